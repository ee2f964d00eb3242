"""ScheduleRecorder: writes the shape of any engine run as a replay schedule.

    recorder = ScheduleRecorder(engine, name="my-search")
    ... engine.prefill(...), tree edits, engine.step(), pruning ... (any controller)
    recorder.close().save("my-search.json")      # treedec replay my-search.json

It wraps ``engine.prefill`` and ``engine.step``: at each call it diffs the tree's
structure against the one after the previous call and writes that step's ops, in the
order the schedule format requires (prunes, then growth of existing nodes, then new
nodes in depth-first order as ``branch`` + ``extend``); a prefill becomes a ``prompt``
op. Node ids are the handles (the tree never reuses one). Decoded tokens are recorded as
counts (the shape), prompts as counts too unless ``prompt_ids=True``. A speculative
"keep the accepted path" done by pruning and extending is recorded as exactly that
(``prune`` + ``extend``), which replays the same tree shape.
"""
from __future__ import annotations

import numpy as np

from treedec.engine import Engine
from treedec.workloads.schedule import Branch, Extend, Prompt, Prune, Schedule


class ScheduleRecorder:
    """Records ``engine``'s steps until :meth:`close`, which returns the :class:`Schedule`.

    Parameters
    ----------
    engine : Engine
        The engine to record; its ``prefill`` and ``step`` are wrapped until ``close``.
    name : str
        The schedule's name.
    prompt_ids : bool
        Record prompts by their token ids (default: by their length only).
    """

    def __init__(self, engine: Engine, name: str = "recorded", prompt_ids: bool = False):
        self.engine = engine
        self.name = name
        self.prompt_ids = prompt_ids
        self._steps: list[tuple] = []
        self._in_prefill = False
        self._shape = self._snapshot()
        if self._shape:
            raise ValueError(f"start the recorder on an empty tree; this one has {len(self._shape)} node(s)")
        self._prefill, self._step = engine.prefill, engine.step
        engine.prefill, engine.step = self._recorded_prefill, self._recorded_step

    def close(self) -> Schedule:
        """Stop recording (the engine's methods are restored) and return the validated schedule."""
        if self.engine.prefill == self._recorded_prefill:
            self.engine.prefill, self.engine.step = self._prefill, self._step
            # prunes after the last step (e.g. finishing requests) form a step of their own
            tail = tuple(op for op in self._diff(self._snapshot()) if isinstance(op, Prune))
            if tail:
                self._steps.append(tail)
                self._shape = self._snapshot()
        return Schedule.from_steps(self._steps, name=self.name, source="ScheduleRecorder",
                                   meta={"recorded_steps": len(self._steps)})

    # ================================================================ private

    def _recorded_prefill(self, prompt_ids, parent=None):
        ops = self._diff(self._snapshot())  # prunes since the last step (prefill needs no pending tokens)
        self._in_prefill = True  # prefill runs its chunks through engine.step: not steps of their own
        try:
            node, logits = self._prefill(prompt_ids, parent)
        finally:
            self._in_prefill = False
        tokens = tuple(int(t) for t in prompt_ids) if self.prompt_ids else len(prompt_ids)
        self._steps.append(tuple(ops) + (Prompt(id=node, tokens=tokens, parent=parent),))
        self._shape = self._snapshot()
        return node, logits

    def _recorded_step(self, *args, **kwargs):
        if self._in_prefill:
            return self._step(*args, **kwargs)
        ops = self._diff(self._snapshot())
        logits = self._step(*args, **kwargs)
        self._steps.append(tuple(ops))
        self._shape = self._snapshot()
        return logits

    def _snapshot(self) -> dict[int, tuple[int | None, int]]:
        """node id -> (parent id, length), in depth-first order."""
        layout = self.engine.tree.layout()
        ids = layout.node_ids.tolist()
        lengths = np.diff(layout.kv_start).tolist()
        return {nid: (None if p < 0 else ids[p], n) for nid, p, n in zip(ids, layout.parent.tolist(), lengths)}

    def _diff(self, now: dict[int, tuple[int | None, int]]) -> list:
        before = self._shape
        gone = [nid for nid, (parent, _) in before.items() if nid not in now and (parent is None or parent in now)]
        ops: list = [Prune(node=nid) for nid in gone]
        ops += [Extend(node=nid, tokens=n - before[nid][1]) for nid, (_, n) in now.items()
                if nid in before and n > before[nid][1]]
        for nid, (parent, n) in now.items():  # depth-first: a parent is created before its children
            if nid in before:
                continue
            if parent is None:
                raise AssertionError(f"node {nid} is a new root outside prefill: add prompts with engine.prefill")
            ops.append(Branch(node=parent, ids=(nid,)))
            if n:
                ops.append(Extend(node=nid, tokens=n))
        return ops
