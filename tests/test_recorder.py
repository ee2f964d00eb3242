import numpy as np
import pytest
import torch

from treedec.engine import Engine, from_config
from treedec.replay.driver import ScheduleDriver
from treedec.replay.recorder import ScheduleRecorder
from treedec.tree import PagedKVPool, SequenceTree
from treedec.workloads.schedule import Schedule


def shape_of(tree, handle_of=lambda nid: nid):
    """The tree as {handle: (parent handle, length)}."""
    layout = tree.layout()
    ids = layout.node_ids.tolist()
    lens = np.diff(layout.kv_start).tolist()
    return {handle_of(n): (None if p < 0 else handle_of(ids[p]), ln)
            for n, p, ln in zip(ids, layout.parent.tolist(), lens)}


@pytest.fixture(scope="module")
def tiny():
    return from_config("tiny", seed=0, dtype=torch.float32, device="cpu")


def test_recorded_run_replays_to_the_same_tree_after_every_step(tiny):
    engine = Engine(tiny, kv_tokens=1024, page_size=4, backend="torch")
    recorder = ScheduleRecorder(engine, name="search")
    shapes = []

    def step():
        engine.step()
        shapes.append(shape_of(engine.tree))

    root, logits = engine.prefill(range(12))
    shapes.append(shape_of(engine.tree))
    a, b, c = engine.tree.branch(root, [[int(logits.argmax())]] * 3)   # branch into 3
    step()
    for _ in range(2):                                                  # decode all leaves
        engine.tree.extend_many({leaf: [1] for leaf in engine.tree.live_leaves()})
        step()
    engine.tree.prune(b)                                                # keep two
    engine.tree.add_token_tree(a, [5, 6, 7], [-1, 0, -1])               # verify a token tree
    engine.tree.extend(c, [2, 3])
    step()
    ids = engine.tree.children(a)
    engine.tree.prune(ids[0])                                           # accept: keep nothing of it,
    engine.tree.prune(ids[1])                                           # continue a by one token
    engine.tree.extend(a, [4])
    step()
    engine.tree.prune(root)                                             # the request is done
    schedule = recorder.close()

    assert isinstance(schedule, Schedule) and len(schedule) == len(shapes) + 1
    assert engine.step.__func__ is Engine.step  # methods restored
    # replay the schedule on a bookkeeping-only tree: same shape after every step
    driver = ScheduleDriver(tree=SequenceTree(PagedKVPool(256, 4, allocate_storage=False)))
    for i, ops in enumerate(schedule.steps):
        for op in ops:
            driver.apply(op)
        driver.forward()
        handle_of = {nid: h for h, nid in driver.nodes.items()}
        replayed = shape_of(driver.tree, handle_of.__getitem__)
        if i < len(shapes):
            assert replayed == shapes[i], f"step {i}"
    assert driver.tree.num_nodes == 0


def test_round_trip_through_json(tiny, tmp_path):
    engine = Engine(tiny, kv_tokens=256, page_size=4, backend="torch")
    recorder = ScheduleRecorder(engine, prompt_ids=True)
    root, _ = engine.prefill([3, 1, 4, 1, 5])
    engine.tree.branch(root, [[9], [2]])
    engine.step()
    path = tmp_path / "run.json"
    recorder.close().save(path)
    from treedec.workloads.schedule import load_schedule
    loaded = load_schedule(path)
    assert loaded.steps[0][0].tokens == (3, 1, 4, 1, 5)
    assert len(loaded) == 2


def test_recorder_needs_an_empty_tree(tiny):
    engine = Engine(tiny, kv_tokens=256, page_size=4, backend="torch")
    engine.prefill([1, 2, 3])
    with pytest.raises(ValueError, match="empty tree"):
        ScheduleRecorder(engine)
