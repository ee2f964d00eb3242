"""Replay schedules: the JSON format, validation that names file/step/field, builders on the shipped files."""
import json

import numpy as np
import pytest

from treedec.replay import ScheduleDriver, dry_run
from treedec.tree import PagedKVPool, SequenceTree
from treedec.workloads import (DEFT_DIR, WORKLOADS, Accept, Extend, Prompt, Prune, Schedule, ScheduleError,
                               TokenTree, TraceFormatError, fewshot_schedule, load_schedule, medusa_schedule,
                               medusa_tree, tot_schedule, tot_snapshot, workload_schedule)

KEYWORD = DEFT_DIR / "reasoning" / "keywordToT.json"


def doc(*steps):
    return {"format": "treedec-schedule", "version": 1, "name": "t", "steps": list(steps)}


GOOD = doc(
    [{"op": "prompt", "id": "p", "tokens": 10}],
    [{"op": "branch", "node": "p", "ids": ["a", "b"]}, {"op": "extend", "node": "a", "tokens": 1},
     {"op": "extend", "node": "b", "tokens": [5, 6]}],
    [{"op": "prune", "node": "b"}, {"op": "token_tree", "node": "a", "parents": [-1, 0, 0], "ids": ["t0", "t1", "t2"]}],
    [{"op": "accept", "ids": ["t0", "t2"]}, {"op": "extend", "node": "a", "tokens": 1}],
    [{"op": "prune", "node": "p"}],
)


def test_round_trip_and_stats(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(GOOD))
    s = load_schedule(path)
    assert len(s) == 5 and s.stats.forward_steps == 3 and s.stats.live_roots == ()
    assert s.stats.max_token_id == 6
    assert s.stats.max_position == 10 + 1 + 2 + 1 - 1   # prompt, a's token, accepted t0 t2, one more
    assert s.stats.peak_tree_tokens == 10 + 1 + 3   # b pruned, then the 3-token tree
    assert Schedule.from_json(s.to_json()).steps == s.steps
    assert dry_run(s, page_size=4) == {"peak_pages": 5, "peak_tokens": 14, "final_free": True}


@pytest.mark.parametrize("step, op, field, bad, message", [
    (1, 1, "node", "zz", r"names unknown node 'zz' \(never created\)"),
    (1, 1, "tokens", -3, "field 'tokens' must be a count >= 1"),
    (1, 2, "tokens", [5, -1], r"field 'tokens\[1\]' must be an int >= 0"),
    (2, 1, "parents", [-1, 2, 1], r"field 'parents\[1\]' = 2: parents must come before their children \(a cycle\)"),
    (2, 1, "parents", [-1, 0], "field 'ids' must have one handle per token"),
    (1, 0, "ids", "ab", "field 'ids' must be a non-empty list of node handles"),
    (1, 0, "node", 1.5, "field 'node' must be a node handle"),
    (0, 0, "tokens", True, r"field 'tokens' must be a list of ints"),
    (1, 0, "op", "fork", "field 'op' must be one of"),
    (3, 0, "ids", ["t0", "t1", "t2"], r"field 'ids\[2\]': node 't2' is not a child of ids\[1\]"),
    (3, 0, "ids", ["t0", "b"], "names node 'b', which was pruned"),
])
def test_malformed_ops_name_file_step_op_field(tmp_path, step, op, field, bad, message):
    data = json.loads(json.dumps(GOOD))
    data["steps"][step][op][field] = bad
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ScheduleError, match=message) as e:
        load_schedule(path)
    assert str(e.value).startswith(f"{path}: step {step}, op {op}")


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["steps"].__setitem__(1, {"op": "extend"}), "step 1: a step must be a list of ops"),
    (lambda d: d.__setitem__("version", 2), "field 'version' must be 1"),
    (lambda d: d.__setitem__("steps", "x"), "field 'steps' must be a list"),
    (lambda d: d["steps"][2].reverse(), r"step 2, op 1 \(prune\): field 'op': a 'prune' op must come before"),
    (lambda d: d["steps"][1][0].pop("ids"), r"step 1, op 0 \(branch\): missing field 'ids'"),
    (lambda d: d["steps"][1][0].__setitem__("idz", 1), "unknown field 'idz'"),
    (lambda d: d["steps"][4].append({"op": "prompt", "id": "a", "tokens": 3}), "reuses node handle 'a'"),
    (lambda d: d["steps"][1].append({"op": "extend", "node": "p", "tokens": 1}), "node 'p' has children"),
])
def test_malformed_documents(tmp_path, mutate, message):
    data = json.loads(json.dumps(GOOD))
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ScheduleError, match=message):
        load_schedule(path)


def test_truncated_file_and_missing_file(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text(json.dumps(GOOD)[:60])
    with pytest.raises(TraceFormatError, match=f"{path}: not valid JSON"):
        load_schedule(path)
    with pytest.raises(FileNotFoundError, match="workload file not found"):
        load_schedule(tmp_path / "nope.json")


def test_builders_on_every_shipped_workload():
    for name in WORKLOADS:
        s = workload_schedule(name, iterations=5)
        assert len(s) == 7 and s.stats.live_roots == ()   # prompt + 5 iterations + the release step
        assert isinstance(s.steps[0][0], Prompt)
        assert dry_run(s, 16)["final_free"]


def test_fewshot_schedule_shape():
    s = fewshot_schedule(prompt_tokens=100, branches=3, iterations=4)
    assert s.stats.forward_steps == 4 and s.stats.peak_tree_tokens == 100 + 3 * 4
    assert s.stats.max_position == 100 + 4 - 1
    with pytest.raises(ValueError, match="branches must be a positive int"):
        fewshot_schedule(branches=0)


@pytest.mark.parametrize("fraction", [0.05, 0.3, 0.6, 1.0])
def test_tot_schedule_matches_tot_snapshot(fraction):
    """After iteration it, the replayed tree is tot_snapshot's tree at it: nodes, lengths, order."""
    snap = tot_snapshot(KEYWORD, 0, fraction)
    schedule = tot_schedule(KEYWORD, 0)
    pool = PagedKVPool(20_000, 16, allocate_storage=False)
    driver = ScheduleDriver(tree=SequenceTree(pool))
    for step in schedule.steps[:snap.iteration + 1]:
        for op in step:
            driver.apply(op)
        driver.forward()
    layout = driver.tree.layout()
    handle_of = {nid: h for h, nid in driver.nodes.items()}
    assert [handle_of[n] for n in layout.node_ids.tolist()] == snap.node_ids.tolist()
    np.testing.assert_array_equal(layout.parent, snap.parents)
    np.testing.assert_array_equal(layout.node_len, snap.lengths)
    driver.tree.check_invariants()


def test_medusa_schedule_accepts_the_recorded_lengths():
    s = medusa_schedule(64, record=0, prompt_tokens=50)
    tree = medusa_tree(64)
    accepts = json.loads((DEFT_DIR / "speculative" / "tree_size64.json").read_text())["Records"][0]["Accept_length"]
    depth = int(tree.depth.max())
    for k in range(1, 20):
        op = s.steps[k + 1][0]
        assert isinstance(op, Accept) and len(op.ids) == min(accepts[k - 1], depth) + 1
        assert isinstance(s.steps[k][-1], TokenTree) and s.steps[k][-1].parents == tuple(tree.parents.tolist())
    assert s.meta["accept_lengths_clamped_to_depth"] == sum(a > depth for a in accepts)
    # the sequence only grows: the deepest token is the last token tree's, over all earlier accepted paths
    assert s.stats.max_position == 50 + sum(min(a, depth) + 1 for a in accepts[:-1]) + depth


def test_medusa_bad_record(tmp_path):
    data = json.loads((DEFT_DIR / "speculative" / "tree_size32.json").read_text())
    data["Records"][3]["Accept_length"][7] = -1
    path = tmp_path / "tree_size32.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TraceFormatError, match=r"record 3: field 'Accept_length\[7\]' must be an int >= 0"):
        medusa_schedule(path, record=3)


def test_truncated_appends_release_and_builders_validate():
    s = Schedule.from_steps([[Prompt("p", 4)], [Extend("p", 1)], [Extend("p", 1)]])
    t = s.truncated(2)
    assert t.steps[-1] == (Prune("p"),) and t.stats.live_roots == ()
    with pytest.raises(ScheduleError, match=r"step 1, op 0 \(extend\): field 'node' names unknown node 'q'"):
        Schedule.from_steps([[Prompt("p", 4)], [Extend("q", 1)]])
