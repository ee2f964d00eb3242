"""The dynamic spans' host work (treedec.attention.dynamic_span): the compiled planner's span_places and mask_patch
give the numpy code's places, located ranges and mask patches exactly, and refuse what it refuses with its words,
in plans that hold a slot once and in batch-invariant ones that hold it once per copy of a window.
(tests/programs/speculative/test_pipeline.py checks what a patch clears, and the pipelined steps it serves.)"""
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.kernels.test_compiled_planner import both, needs_compiled, random_layout, using
from treedec.attention import PlanConfig, make_plan
from treedec.attention.backends.base import SpanMasking
from treedec.attention.dynamic_span import DynamicSpans, MaskPatch, SpanPlaces, located
from treedec.tree import TreeLayout


class HostMasking:   # (a backend that reads the host plan: located patches it there too)
    name, span_masking = "host", SpanMasking.HOST


class DeviceMasking:
    name, span_masking = "device", SpanMasking.DEVICE


def random_spans(rng, layout: TreeLayout, broken: bool) -> DynamicSpans:
    """Spans at the ends of random nodes (some empty, some of nodes no query reads), and with ``broken`` one whose
    slots are not a run of the tree's flattened KV."""
    parts, lengths = [], []
    for node in rng.choice(layout.num_nodes, size=min(layout.num_nodes, rng.integers(1, 9)), replace=False):
        end = int(layout.kv_start[node + 1])
        d = int(rng.integers(0, min(6, end - int(layout.kv_start[node])) + 1))
        parts.append(layout.kv_slots[end - d:end])
        lengths.append(d)
    if broken and sum(lengths):
        i = int(np.flatnonzero(lengths)[0])
        parts[i] = parts[i][::-1] if lengths[i] > 1 else parts[i] + 10**6
    slots = np.concatenate(parts).astype(np.int64)
    keep = torch.as_tensor(rng.integers(0, np.asarray(lengths) + 1))
    return DynamicSpans(slots, np.array(lengths, dtype=np.int64), keep, np.zeros(0, np.int64), np.zeros(0, np.int64))


def outcome(fn):
    """``fn()``'s result, or the ValueError it raised (its words)."""
    try:
        return fn()
    except ValueError as error:
        return ("ValueError", str(error))


def same(a, b) -> bool:
    """Equal results: arrays bitwise (dtype too), tensors equal, plans by their dynamic ranges and masks."""
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, SpanPlaces):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, MaskPatch):
        return all(same(getattr(a, f), getattr(b, f)) for f in ("words", "at", "width", "span", "table")) and \
            (a.merged is None) == (b.merged is None) and (a.merged is None or all(map(same, a.merged, b.merged)))
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(map(same, a, b))
    if hasattr(a, "dynamic_kv"):   # a plan
        return (np.array_equal(np.asarray(a.dynamic_kv).reshape(-1, 2), np.asarray(b.dynamic_kv).reshape(-1, 2))
                and same(a.entry_mask, b.entry_mask))
    return a == b


@needs_compiled
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from([1, 4, 16]), chunk=st.sampled_from([None, 8, 64]),
       invariant=st.booleans(), broken=st.booleans(), stride=st.sampled_from([0, 3]))
def test_compiled_places_and_patches_are_the_numpy_ones(seed, page_size, chunk, invariant, broken, stride):
    rng = np.random.default_rng(seed)
    layout = random_layout(rng, page_size, decode_batch=False)
    config = PlanConfig("path", chunk or 8, 4, batch_invariant=True) if invariant else PlanConfig(chunk_size=chunk,
                                                                                                   query_tile=4)
    plan = make_plan(layout, config, 1)
    spans = random_spans(rng, layout, broken)
    if rng.random() < 0.3:   # ranges set already: the spans' are merged in, sorted
        plan = plan.with_dynamic_kv(np.array([[0, 1]], dtype=np.int64))
    assert same(*both(lambda: outcome(lambda: spans.places(plan))))
    for backend in (HostMasking, DeviceMasking):
        reference, compiled = both(lambda: outcome(lambda: located(plan, spans, backend)))
        assert same(reference, compiled), (reference, compiled)
    if isinstance(reference[0], str):   # (refused)
        return
    places = reference[1]
    width = plan.mask_words + stride   # (a static plan's rows: wider than the plan's)
    assert same(*both(lambda: MaskPatch.of(plan, spans, places, width, torch.device("cpu"))))


@needs_compiled
def test_a_place_outside_the_plan_is_a_value_error_of_the_compiled_patch_not_a_crash():
    plan = make_plan(TreeLayout.from_parents([-1, 0], [30, 1], [(1, 0)]), PlanConfig(chunk_size=8, query_tile=2), 1)
    spans = DynamicSpans(np.arange(3, dtype=np.int64), np.array([3]), torch.tensor([1]), np.zeros(0, np.int64),
                         np.zeros(0, np.int64))
    outside = SpanPlaces(np.array([plan.num_tokens]), np.array([0]), np.array([0]))
    with using("compiled"), pytest.raises(ValueError, match="outside the plan"):
        MaskPatch.of(plan, spans, outside, plan.mask_words, torch.device("cpu"))
