"""Replay of decoding-tree schedules through the engine, with per-step measurements."""
from treedec.replay.driver import ScheduleDriver, dry_run
from treedec.replay.runner import AttentionTimer, ReplayConfig, ReplayRun, replay, replay_results, timed_attention

__all__ = ["ScheduleRecorder", "AttentionTimer", "ReplayConfig", "ReplayRun", "ScheduleDriver", "dry_run", "replay",
           "replay_results", "timed_attention"]
from treedec.replay.recorder import ScheduleRecorder  # noqa: E402
