import numpy as np
import pytest
import torch

from treedec.engine import Engine
from treedec.models import from_config
from treedec.errors import PoolExhaustedError, TreeError
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

    prefilled = engine.prefill(range(12))
    root = prefilled.node
    shapes.append(shape_of(engine.tree))
    a, b, c = engine.tree.branch(root, [[int(prefilled.logits.argmax())]] * 3)   # branch into 3
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
    root = engine.prefill([3, 1, 4, 1, 5]).node
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


@pytest.mark.parametrize("kwargs, error, message", [
    ({"engine": "engine"}, TypeError, "engine must be an Engine, got str"),
    ({"name": 3}, TypeError, "name must be a string, got int"),
    ({"prompt_ids": "yes"}, TypeError, "prompt_ids must be a bool, got 'yes'"),
    ({"token_ids": 1}, TypeError, "token_ids must be a bool, got 1"),
])
def test_bad_arguments(tiny, kwargs, error, message):
    engine = Engine(tiny, kv_tokens=256, page_size=4, backend="torch")
    with pytest.raises(error, match=message):
        ScheduleRecorder(**{"engine": engine, **kwargs})
    assert "step" not in vars(engine) and "prune" not in vars(engine.tree)   # nothing wrapped


def test_a_failed_call_raises_its_own_error_and_records_nothing(tiny):
    engine = Engine(tiny, kv_tokens=64, page_size=4, backend="torch")
    recorder = ScheduleRecorder(engine, token_ids=True)
    root = engine.prefill([1, 2, 3]).node
    tree = engine.tree
    failing = [
        (lambda: tree.extend(99, [1]), TreeError, "unknown node id 99"),
        (lambda: tree.prune("x"), TypeError, "node id must be an int"),
        (lambda: tree.extend(root, [1] * 100), PoolExhaustedError, "KV pool exhausted"),
        (lambda: tree.accept(root, [5]), TreeError, "unknown node id 5"),
        (lambda: tree.branch(root, 0), TreeError, "branch needs 1 <= k"),
        (lambda: tree.add_token_tree(root, [1, 2], [-1, 1]), TreeError, "parents must come before children"),
        (lambda: tree.truncate(root, 9), TreeError, "cannot truncate node 0 of 3 tokens to 9"),
        (lambda: tree.extend(root, node_id=root), TypeError, "multiple values for argument 'node_id'"),
        (lambda: engine.step(), TreeError, "step\\(\\) needs pending tokens"),
        (lambda: engine.prefill([]), TreeError, "prefill needs at least one prompt token"),
    ]
    for call, error, message in failing:
        with pytest.raises(error, match=message):
            call()
    tree.extend(root, [0])   # a placeholder: the step reads the token on the device
    for tokens, error, message in (([4], TypeError, "tokens must be an int64 or int32 tensor"),
                                   (torch.tensor([4, 5]), ValueError, r"tokens must have shape \[1\]")):
        with pytest.raises(error, match=message):
            engine.step(tokens=tokens)
    engine.step(tokens=torch.tensor([4]))
    schedule = recorder.close()
    assert [[op.op for op in step] for step in schedule.steps] == [["prompt"], ["extend"]]
    assert schedule.steps[1][0].tokens == (4,)
    assert recorder.close().steps == schedule.steps   # closing again changes nothing
    assert "step" not in vars(engine) and "extend" not in vars(tree)
