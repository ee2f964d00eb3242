"""Replay schedules: the JSON format, validation that names file/step/field, builders on the shipped files."""
import json

import numpy as np
import pytest

from treedec.replay import ScheduleDriver, dry_run
from treedec.tree import PagedKVPool, SequenceTree
from treedec.workloads import (DEFT_DIR, WORKLOADS, Accept, Extend, Prompt, Prune, Schedule, ScheduleError,
                               TokenTree, TraceFormatError, fewshot_schedule, load_schedule, medusa_schedule,
                               medusa_tree, tot_schedule, tot_snapshot, workload_schedule)
from treedec.workloads.schedule import DEFAULT_MAX_TREE_TOKENS

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
    (lambda d: d["steps"][1].append({"op": "prune", "node": "b"}),
     r"step 1, op 3 \(prune\): field 'node': pruning 'b' would remove node\(s\) \['b'\], whose tokens an earlier op"),
    (lambda d: d["steps"][3].append({"op": "prompt", "id": "q", "tokens": 2}),
     r"step 3, op 2 \(prompt\): field 'op': a prefilled 'prompt' op must come before the step's ops that add"),
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


@pytest.mark.slow
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
    with pytest.raises(ValueError, match="branches must be an int >= 1"):
        fewshot_schedule(branches=0)


def test_fewshot_schedule_is_sized_before_it_is_built(monkeypatch):
    monkeypatch.setattr("treedec.workloads.builders.Extend", lambda *a: pytest.fail("built an op"))
    with pytest.raises(ValueError, match=r"prompt_tokens=4000, branches=2000, iterations=1000 holds "
                                         r"2004000 tokens, more than max_tree_tokens=1048576"):
        fewshot_schedule(branches=2000, iterations=1000)
    with pytest.raises(ValueError, match="holds 4010 tokens, more than max_tree_tokens=4009"):
        fewshot_schedule(4000, 10, 1, max_tree_tokens=4009)


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


def test_what_is_no_op_is_refused_by_the_checker_and_the_driver():
    with pytest.raises(ScheduleError, match=r"step 1, op 0: dict is not a schedule op \(one of Prompt, Branch"):
        Schedule.from_steps([[Prompt("p", 4)], [{"op": "extend", "node": "p", "tokens": 1}]])
    driver = ScheduleDriver(tree=SequenceTree(PagedKVPool(16, 4, allocate_storage=False)))
    with pytest.raises(TypeError, match="op must be a schedule op .*, got str"):
        driver.apply("prune")


# ================================================================ sizes and hostile input


@pytest.mark.parametrize("content, message", [
    ("[" * 100_000 + "]" * 100_000, r"not valid JSON \(RecursionError"),
    ('{"format": "treedec-schedule", "version": 1, "steps": [[{"op": "prompt", "id": "p", "tokens": 1'
     + "0" * 5000 + "}]]}", r"not valid JSON \(ValueError: Exceeds the limit"),
    (b'{"format": "treedec-schedule", "name": "\xff\xfe"}', r"not valid JSON \(UnicodeDecodeError"),
    (json.dumps(doc([{"op": ["prompt"], "id": "p", "tokens": 3}])), r"step 0, op 0: field 'op' must be one of"),
    (json.dumps(doc([{"op": {"x": 1}, "id": "p", "tokens": 3}])), r"step 0, op 0: field 'op' must be one of"),
    (json.dumps(doc([{"op": "prompt", "id": "p", "tokens": [1, 2**63]}])),
     r"step 0, op 0 \(prompt\): field 'tokens\[1\]' must be an int < 2147483648, got 9223372036854775808"),
    (json.dumps(doc([{"op": "prompt", "id": "p", "tokens": 3}],
                    [{"op": "token_tree", "node": "p", "parents": [-1], "ids": ["t"], "tokens": [2**31]}])),
     r"step 1, op 0 \(token_tree\): field 'tokens\[0\]' must be an int < 2147483648"),
    (json.dumps(doc([{"op": "prompt", "id": "p", "tokens": -10**30}])), "field 'tokens' must be a count >= 1"),
    (json.dumps(doc([{"op": "prompt", "id": "p", "tokens": 3, "parent": "p"}])),
     r"field 'parent' names unknown node 'p'"),
    (json.dumps(doc([{"op": "prompt", "id": "p", "tokens": 3}],
                    [{"op": "token_tree", "node": "p", "parents": [-1, -2], "ids": ["a", "b"]}])),
     r"field 'parents\[1\]' must be an int >= -1, got -2"),
    (json.dumps(doc([{"op": "prompt", "id": "p", "tokens": 3}],
                    [{"op": "token_tree", "node": "p", "parents": [1, 0], "ids": ["a", "b"]}])),
     r"field 'parents\[0\]' = 1: parents must come before their children \(a cycle\)"),
    (json.dumps(doc([{"op": "prompt", "id": "p", "tokens": 3}], [{"op": "branch", "node": "p", "ids": ["a", "a"]}])),
     "field 'ids' lists a handle twice"),
    (json.dumps(doc([{"op": "prompt", "id": "p", "tokens": 3}], [{"op": "accept", "ids": ["p"]}])),
     r"field 'ids\[0\]': node 'p' is not a token-tree node"),
    (json.dumps({"format": "treedec-schedule", "version": 1}), "field 'steps' must be a list of steps, got NoneType"),
    (json.dumps([1, 2]), "the top level must be a JSON object"),
    (json.dumps(doc([{"op": "prompt", "id": None, "tokens": 3}])), "field 'id' must be a node handle"),
    (json.dumps(doc([{"op": "prompt", "id": "p", "tokens": 3.0}])), "field 'tokens' must be a list of ints"),
    (json.dumps(doc([{"op": "prune", "node": "p"}])), "field 'node' names unknown node 'p'"),
    (json.dumps({**doc(), "name": 5}), "field 'name' must be a string, got int"),
    (json.dumps({**doc(), "meta": []}), "field 'meta' must be an object, got list"),
])
def test_hostile_files_raise_schedule_errors(tmp_path, content, message):
    path = tmp_path / "bad.json"
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    with pytest.raises(ScheduleError, match=message) as e:
        load_schedule(path)
    assert str(e.value).startswith(str(path))


def test_unknown_non_string_field_in_memory():
    with pytest.raises(ScheduleError, match=r"step 0, op 0 \(prune\): unknown field '3'"):
        Schedule.from_json(doc([{"op": "prune", "node": "p", 3: 1}]))


def test_huge_counts_are_refused_before_anything_is_allocated(tmp_path, monkeypatch):
    """A 177-byte file asking for 10^9 tokens loads (a count is a number) but never reaches an allocation."""
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(doc([{"op": "prompt", "id": "p", "tokens": 10**9}],
                                   [{"op": "extend", "node": "p", "tokens": 1}], [{"op": "prune", "node": "p"}]),
                               separators=(",", ":")))
    assert path.stat().st_size < 200
    s = load_schedule(path)
    assert s.stats.peak_tree_tokens == 10**9 + 1
    monkeypatch.setattr("treedec.replay.driver.PagedKVPool", lambda *a, **k: pytest.fail("allocated a pool"))
    with pytest.raises(ScheduleError, match=rf"{path}: step 0, op 0 \(prompt\): node 'p' grows the tree to "
                                            rf"1000000000 tokens, more than max_tree_tokens = "
                                            rf"{DEFAULT_MAX_TREE_TOKENS}"):
        dry_run(s, page_size=16)
    with pytest.raises(ScheduleError, match="more than max_tree_tokens = 10$"):
        dry_run(Schedule.from_json(doc([{"op": "prompt", "id": "p", "tokens": 11}])), 16, max_tree_tokens=10)


@pytest.mark.parametrize("limits, message", [
    (dict(max_tree_tokens=13), r"step 2, op 1 \(token_tree\): node 't2' grows the tree to 14 tokens, more than "
                               r"max_tree_tokens = 13"),
    (dict(max_tree_tokens=12, tokens_limit="kv_tokens"), r"step 1, op 2 \(extend\): node 'b' grows the tree to 13 "
                                                         r"tokens, more than kv_tokens = 12"),
    (dict(max_position=12), r"step 2, op 1 \(token_tree\): node 't1' reaches position 12 \(sequence length 13\), "
                            r"past max_position = 12"),
    (dict(max_position=10, position_limit="the model's sliding window"),
     r"step 1, op 1 \(extend\): node 'a' reaches position 10 \(sequence length 11\), past the model's sliding "
     r"window = 10"),
    (dict(vocab_size=6), r"step 1, op 2 \(extend\): field 'tokens\[1\]' = 6 is outside the model's vocabulary of 6"),
])
def test_check_fits_names_the_first_op_past_a_limit(limits, message):
    s = Schedule.from_json(GOOD, source="good.json")
    s.check_fits(max_tree_tokens=14, max_position=14, vocab_size=7)   # exactly the schedule's needs
    with pytest.raises(ScheduleError, match=f"good.json: {message}"):
        s.check_fits(**limits)


@pytest.mark.parametrize("name, value", [("max_tree_tokens", 0), ("max_position", -1), ("vocab_size", 2.5),
                                         ("max_tree_tokens", True)])
def test_check_fits_validates_its_limits(name, value):
    with pytest.raises(ValueError, match=f"{name} must be an int >= 1 or None, got {value!r}"):
        Schedule.from_json(GOOD).check_fits(**{name: value})


def test_wide_branch_of_empty_children_is_sized():
    """A branch of k empty children needs k pages in a pool (the tree's rule), tokens or not."""
    s = Schedule.from_json(doc([{"op": "prompt", "id": "p", "tokens": 1}],
                               [{"op": "branch", "node": "p", "ids": list("abcde")}], [{"op": "prune", "node": "p"}]))
    assert s.stats.widest_branch == 5 and s.stats.peak_tree_tokens == 1
    assert dry_run(s, page_size=16) == {"peak_pages": 1, "peak_tokens": 1, "final_free": True}


def test_accepting_extended_token_tree_nodes_counts_all_their_tokens():
    """The loader's sizing of an accept counts every token of the accepted nodes (a token-tree node
    may have been extended since), as the tree's accept keeps them (found by the schedule fuzzer)."""
    doc = {"format": "treedec-schedule", "version": 1, "steps": [
        [{"op": "prompt", "id": "n0", "tokens": 1},
         {"op": "token_tree", "node": "n0", "parents": [-1, 0, -1, 0], "ids": ["n1", "n2", 3, "n4"]},
         {"op": "extend", "node": "n2", "tokens": 1},
         {"op": "branch", "node": "n1", "ids": ["n5"]}],
        [{"op": "extend", "node": "n2", "tokens": 1}],
        [{"op": "accept", "ids": ["n1", "n2"]}],
        [{"op": "extend", "node": "n0", "tokens": 4}]]}
    schedule = Schedule.from_json(doc)
    assert schedule.stats.peak_tree_tokens == 9 and schedule.stats.max_position == 8   # 1 + (1 + 3) + 4
    for page_size in (1, 16):
        assert dry_run(schedule, page_size=page_size)["peak_tokens"] == 9
