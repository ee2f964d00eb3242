import numpy as np
import pytest
import torch

from treedec.engine import Engine
from treedec.models import from_config
from treedec.errors import PoolExhaustedError, RecordingError, TreeError
from treedec.replay.driver import ScheduleDriver
from treedec.replay.recorder import TREE_EDITS, ScheduleRecorder
from treedec.tree import PagedKVPool, SequenceTree
from treedec.workloads.schedule import Accept, Children, Schedule, Truncate
from tests.replay.recording import ops_of, prompt, record, replay_steps


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


def test_an_unrecorded_engine_runs_its_own_methods():
    """No recorder, no cost: the methods are the classes' own (nothing wraps them) before and after a recording."""
    engine = Engine(from_config("tiny", seed=0, dtype=torch.float32, device="cpu"), kv_tokens=64, page_size=4,
                    backend="torch")
    wrapped = ("prefill", "step", *TREE_EDITS, "copy_slots")

    def instance_methods():
        return [name for obj in (engine, engine.tree, engine.pool) for name in wrapped if name in vars(obj)]

    assert not instance_methods()
    recorder = ScheduleRecorder(engine)
    assert len(instance_methods()) == len(wrapped)
    recorder.close()
    assert not instance_methods()


# ================================================================ tree edits no program makes (yet)


def test_children_accept_truncate_pause_and_an_accept_of_plain_nodes():
    def run(engine):
        tree = engine.tree
        root = engine.prefill(prompt(12, 9)).node
        a, b = tree.branch(root, [[5], [6, 7]])
        engine.step()
        tree.pause(b)
        first = tree.add_children([a, a, b], [1, 2, 3])           # one layer of a draft, over two parents
        second = tree.add_children([first[0]], [4])
        engine.step()
        tree.accept(a, iter([first[0], second[0]]))              # a generator path: read once by each
        tree.prune(b)
        tree.extend(a, [8, 9])
        engine.step()
        tree.truncate(a, 2)                                       # drop a's last 3 tokens
        c, d = tree.branch(a, [[10], [11]])
        engine.step()
        tree.accept(a, [c])                                       # plain nodes: pruned, their tokens extended
        tree.extend(a, [12])
        engine.step()

    schedule, shots, final, _ = record(run, token_ids=True)
    assert ops_of(schedule, Children) and ops_of(schedule, Truncate) and len(ops_of(schedule, Accept)) == 1
    replay_steps(schedule, shots[:4], final)


def test_a_prune_after_the_steps_tokens_is_recorded_in_place():
    def run(engine):
        tree = engine.tree
        root = engine.prefill(prompt(13, 6)).node
        a, b = tree.branch(root, [[1], [2]])
        engine.step()
        tree.extend(a, [3])
        tree.prune(b)            # after a's pending token, as a scheduler's retiring program does
        engine.step()

    schedule, shots, final, _ = record(run)
    assert [op.op for op in schedule.steps[2]] == ["extend", "prune"]
    replay_steps(schedule, shots, final, tokens=False)


# ================================================================ a pipelined speculative step by hand


def verified_tree(engine):
    """A prompt and a verified token tree under it: (root, the tree's nodes, their slots)."""
    tree = engine.tree
    root = engine.prefill(prompt(14, 6)).node
    ids = tree.add_token_tree(root, [5, 6, 7], [-1, 0, 0])
    engine.step()
    return root, ids, tree.first_slots(ids)


def test_reserved_slots_filled_by_a_copy_are_an_accept():
    """extend_computed reserves the root and a path of depth 2; the path accepted is one token long, so one slot
    stays unused (the root's K/V copied again) and is cut a step later: the schedule has the accept only."""
    def run(engine):
        tree = engine.tree
        root, ids, slots = verified_tree(engine)
        tree.prune(ids[0])
        reserved = tree.extend_computed(root, [0, 0, 0])
        engine.pool.copy_slots(torch.as_tensor(slots[[0, 2, 0]]), reserved)
        tree.set_tokens(root, 6, [5, 7])
        following = tree.add_token_tree(root, [8], [-1])
        engine.step()
        tree.prune(following[0])
        tree.truncate(root, 9 - 1)   # the unused slot: nothing in the schedule
        tree.truncate(root, 7)       # a cut into the accepted tokens is recorded

    schedule, shots, final, _ = record(run, token_ids=True)
    assert [[op.op for op in step] for step in schedule.steps] == [["prompt"], ["token_tree"],
                                                                   ["accept", "token_tree"], ["prune", "truncate"]]
    assert ops_of(schedule, Accept)[0].ids == (1, 3) and ops_of(schedule, Truncate)[0].length == 7
    replayed = replay_steps(schedule, [], final)
    assert replayed[0] == prompt(14, 6) + (5, 7) and final[0][0] == (None, prompt(14, 6) + (5,))


# ================================================================ bad use


def test_a_second_recorder_and_a_wrapper_left_at_close_are_refused():
    engine = Engine(from_config("tiny", seed=0, dtype=torch.float32, device="cpu"), kv_tokens=64, page_size=4,
                    backend="torch")
    first = ScheduleRecorder(engine)
    with pytest.raises(RecordingError, match="already recorded by another ScheduleRecorder"):
        ScheduleRecorder(engine)
    step = engine.step
    engine.step = lambda *args, **kwargs: step(*args, **kwargs)   # wrapped again after the recorder started
    with pytest.raises(RecordingError, match="engine.step was replaced after the recorder started"):
        first.close()
    engine.step = step
    engine.prefill([1, 2, 3])
    assert [op.op for step in first.close().steps for op in step] == ["prompt"]
    assert "step" not in vars(engine) and "prune" not in vars(engine.tree)


def test_what_no_op_can_say_is_refused_before_it_runs():
    engine = Engine(from_config("tiny", seed=0, dtype=torch.float32, device="cpu"), kv_tokens=256, page_size=4,
                    backend="torch")
    recorder = ScheduleRecorder(engine, token_ids=True)
    tree, pool = engine.tree, engine.pool
    root, ids, slots = verified_tree(engine)
    k = pool.k.clone()
    with pytest.raises(RecordingError, match="copy_slots outside a tree edit"):
        pool.copy_slots(slots[:1], slots[1:2])
    tree.prune(ids[0])
    reserved = tree.extend_computed(root, [0, 0, 0])
    nodes = tree.num_nodes
    with pytest.raises(RecordingError, match="tree.add_token_tree called between tree.extend_computed"):
        tree.add_token_tree(root, [1], [-1])
    with pytest.raises(RecordingError, match="only into the 3 slot"):
        pool.copy_slots(slots, reserved[::-1].copy())
    with pytest.raises(RecordingError, match="slot .* is node 3, a child of 1"):
        pool.copy_slots(slots[[2, 0, 0]], reserved)   # not a path from the root down
    with pytest.raises(RecordingError, match="must repeat the root's slot"):
        pool.copy_slots(slots[[0, 0, 1]], reserved)
    assert tree.num_nodes == nodes and torch.equal(pool.k, k)   # nothing changed
    pool.copy_slots(slots[[0, 1, 0]], reserved)   # the root and one token accepted: one reserved slot left
    with pytest.raises(RecordingError, match="grows node 0, which holds 1 reserved slot"):
        tree.extend(root, [4])
    tree.truncate(root, tree.node_length(root) - 1)
    tree.extend(root, [4])
    engine.step()
    tree.prune(root)
    assert [[op.op for op in s] for s in recorder.close().steps] == [["prompt"], ["token_tree"], ["accept", "extend"],
                                                                   ["prune"]]


def test_a_run_ending_inside_a_reservation_is_refused_at_close():
    engine = Engine(from_config("tiny", seed=0, dtype=torch.float32, device="cpu"), kv_tokens=256, page_size=4,
                    backend="torch")
    recorder = ScheduleRecorder(engine)
    root, ids, _ = verified_tree(engine)
    engine.tree.prune(ids[0])
    engine.tree.extend_computed(root, [0])
    with pytest.raises(RecordingError, match="before engine.pool.copy_slots filled them"):
        recorder.close()
    assert "step" not in vars(engine) and "extend_computed" not in vars(engine.tree)   # restored all the same
