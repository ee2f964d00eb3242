"""What the recorder tests share: record a run on a fresh engine (its schedule saved to a file and loaded back),
replay a schedule through the engine step by step, and compare the trees.

A run is recorded under a :class:`ScheduleRecorder`, with the tree taken after every engine step and prefill
(:class:`Snapshots`); its schedule is saved and loaded (the file format's checker accepts it); a
:class:`ScheduleDriver` replays it on a fresh engine and the replayed tree is compared after every step.
``token_ids`` records every token; ``prompt_ids`` leaves decoded tokens to the replay's greedy choices, so a
greedy program must choose the same tokens again.
"""
import collections
import tempfile
from pathlib import Path

import numpy as np

from treedec.engine import Engine
from treedec.replay import ScheduleDriver, ScheduleRecorder
from treedec.workloads import load_schedule
from tests.engines import tiny_model

PAGE = 4
CHUNK = 8   # prefill_chunk: a longer prompt is computed in several steps


def make_engine(page_size=PAGE, kv_tokens=1024, model=None):
    return Engine(tiny_model() if model is None else model, kv_tokens=kv_tokens, page_size=page_size,
                  backend="torch", prefill_chunk=CHUNK)


def prompt(seed, n):
    return tuple(np.random.default_rng(seed).integers(0, 256, n).tolist())


def snapshot(engine, name=None):
    """The tree as {node: (parent, tokens)} (nodes named by ``name(node)``: a replay's handles, or a recording's,
    :meth:`ScheduleRecorder.handle`) and the KV pages in use."""
    tree, name = engine.tree, (lambda n: n) if name is None else name
    nodes = {name(n): (None if tree.parent(n) is None else name(tree.parent(n)), tuple(tree.tokens(n)))
             for r in tree.roots for n in tree.subtree(r)}
    return nodes, engine.pool.num_pages - engine.pool.num_free_pages


class Snapshots:
    """The tree after each engine step and prefill (a prefill's own steps not counted), as the recorder
    ends its steps, its nodes named by ``name`` (the recorder's handles). Installed before the recorder, which wraps
    these wrappers and restores them."""

    def __init__(self, engine):
        self.engine, self.taken, self._inside, self.name = engine, [], False, None
        prefill, step = engine.prefill, engine.step

        def snapped_prefill(*args, **kwargs):
            self._inside = True
            try:
                out = prefill(*args, **kwargs)
            finally:
                self._inside = False
            self.taken.append(snapshot(engine, self.name))
            return out

        def snapped_step(*args, **kwargs):
            out = step(*args, **kwargs)
            if not self._inside:
                self.taken.append(snapshot(engine, self.name))
            return out

        engine.prefill, engine.step = snapped_prefill, snapped_step

    def remove(self):
        del self.engine.prefill, self.engine.step


def record(run, page_size=PAGE, kv_tokens=1024, model=None, **flags):
    """Run ``run(engine)`` on a fresh engine under a recorder; returns the schedule (saved to a file and loaded
    back: the loaded one), the snapshots, the tree as the run left it and the run's result."""
    engine = make_engine(page_size, kv_tokens, model)
    shots = Snapshots(engine)
    recorder = ScheduleRecorder(engine, name="test", **flags)
    shots.name = recorder.handle
    result = run(engine)
    schedule = recorder.close()
    shots.remove()
    assert engine.step.__func__ is Engine.step and not {"extend", "extend_computed"} & set(vars(engine.tree))
    assert "copy_slots" not in vars(engine.pool)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "recorded.json"
        schedule.save(path)
        loaded = load_schedule(path)
    assert loaded.steps == schedule.steps and loaded.to_json()["steps"] == schedule.to_json()["steps"]
    return loaded, shots.taken, snapshot(engine, recorder.handle), result


def replay(schedule, page_size=PAGE, kv_tokens=1024, model=None):
    """Replay ``schedule`` on a fresh engine: yields after each step the tree by handle (:func:`snapshot`); at the
    end checks that every page is freed once the driver releases the tree."""
    engine = make_engine(page_size, kv_tokens, model)
    driver = ScheduleDriver(engine)
    for ops in schedule.steps:
        for op in ops:
            driver.apply(op)
        driver.forward()
        yield snapshot(engine, {nid: h for h, nid in driver.nodes.items()}.__getitem__)
    driver.release()
    engine.tree.check_invariants()
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages


def replay_steps(schedule, shots, final, page_size=PAGE, tokens=True, **engine):
    """Replay ``schedule``: the tree after each step equals ``shots`` (with ``tokens=False``, their shape
    and pages only), and ``final`` after the last; then every page is freed. Returns each replayed
    node's longest tokens, by handle."""
    seen: dict = {}
    now = None
    for i, now in enumerate(replay(schedule, page_size, **engine)):
        for h, (_, toks) in now[0].items():
            seen[h] = max(seen.get(h, ()), toks, key=len)
        want = shots[i] if i < len(shots) else None
        if want is not None:
            assert (now if tokens else _shape(now)) == (want if tokens else _shape(want)), f"step {i}"
    assert now == final if tokens else _shape(now) == _shape(final)
    return seen


def _shape(shot):
    nodes, pages = shot
    return {n: (p, len(t)) for n, (p, t) in nodes.items()}, pages


def leaf_sequences(shot):
    """The tree's root-to-leaf token sequences, sorted (what its queries read, whatever the node cuts)."""
    nodes, _ = shot
    inner = {p for p, _ in nodes.values()}

    def sequence(n):
        out = ()
        while n is not None:
            parent, tokens = nodes[n]
            out, n = tokens + out, parent
        return out
    return sorted(sequence(n) for n in nodes if n not in inner)


def sequences_seen(schedule, **engine):
    """Every node's full sequence at any step of the replay of ``schedule``, and the replay's trees."""
    seen, trees = set(), []
    for tree in replay(schedule, **engine):
        seen.update(leaf_sequences(tree))
        trees.append(tree)
    return seen, trees


def placed(output, tokens):
    """Whether a node's ``tokens`` hold an output's tokens (its last token, drawn last, is never placed)."""
    return len(output) > 1 and tokens[:len(output) - 1] == tuple(output[:-1])


def continued(sequences, prompt_ids, output):
    """Whether a sequence continues ``prompt_ids`` with ``output`` (but its last token, never placed)."""
    want = tuple(prompt_ids) + tuple(output[:-1])
    return any(s[:len(want)] == want for s in sequences)


def ops_of(schedule, kind):
    return [op for step in schedule.steps for op in step if isinstance(op, kind)]


def op_counts(schedule):
    return collections.Counter(op.op for step in schedule.steps for op in step)
