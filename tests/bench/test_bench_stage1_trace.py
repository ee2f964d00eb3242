"""bench/stage1_trace.py: the per-slot summary of %globaltimer stamps (the GPU part needs sm_90a)."""
import numpy as np

from bench.stage1_trace import SLOTS, summarize


def test_summary_is_relative_to_each_calls_first_cta_and_skips_unstamped_slots():
    stamps = np.zeros((2, 3, len(SLOTS)), dtype=np.int64)
    for call, base in enumerate((10_000_000, 50_000_000)):  # two calls at different absolute times
        stamps[call, :, SLOTS.index("start")] = base + np.array([0, 1000, 2000])
        stamps[call, :, SLOTS.index("stored")] = base + np.array([5000, 9000, 7000])
        stamps[call, 1, SLOTS.index("item0")] = base + 3000       # one CTA stamped it, the others not
    summary = summarize(stamps)
    assert summary["start"] == {"median_cta_us": 1.0, "slowest_cta_us": 2.0}
    assert summary["stored"] == {"median_cta_us": 7.0, "slowest_cta_us": 9.0}
    assert summary["item0"] == {"median_cta_us": 3.0, "slowest_cta_us": 3.0}
    assert "item1" not in summary and "record" not in summary
