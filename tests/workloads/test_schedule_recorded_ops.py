"""The schedule ops a recorded run needs: pending prompts, ``children``, ``truncate``, and prunes / accepts
anywhere in a step that leave its pending tokens alone. Each bad document names step, op and field."""
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.workloads.test_schedule_fuzz import _check, good_counts, handles, plausible_ops, tree_handles
from treedec.replay import dry_run
from treedec.workloads import Children, Prompt, Prune, Schedule, ScheduleError, Truncate, load_schedule


def doc(*steps):
    return {"format": "treedec-schedule", "version": 1, "name": "t", "steps": list(steps)}


GOOD = doc(
    [{"op": "prompt", "id": "p", "tokens": [1, 2, 3, 4, 5], "pending": True}],                    # 5 tokens
    [{"op": "extend", "node": "p", "tokens": 3},
     {"op": "children", "nodes": ["p", "p"], "ids": ["c0", "c1"], "tokens": [7, 8]}],
    [{"op": "children", "nodes": ["c0"], "ids": ["d0"]}, {"op": "prompt", "id": "q", "tokens": 4, "pending": True}],
    [{"op": "accept", "ids": ["c0", "d0"]}, {"op": "truncate", "node": "p", "length": 6}],
    [{"op": "extend", "node": "q", "tokens": 1}, {"op": "prune", "node": "p"}],    # a prune after q's token
    [{"op": "prune", "node": "q"}],
)


def test_new_ops_load_size_and_dry_run(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(GOOD))
    s = load_schedule(path)
    assert s.steps[0][0] == Prompt("p", (1, 2, 3, 4, 5), None, True)
    assert s.steps[1][1] == Children(("p", "p"), ("c0", "c1"), (7, 8)) and s.steps[3][1] == Truncate("p", 6)
    assert s.stats.forward_steps == 4   # the pending prompt's step, two decode steps, q's extend
    assert s.stats.peak_tree_tokens == 5 + 3 + 2 + 1 + 4
    assert s.stats.max_position == 5 + 3 + 2 - 1   # p's 8 tokens and the accepted c0, d0
    assert s.stats.live_roots == ()
    assert Schedule.from_json(s.to_json()).steps == s.steps
    assert "pending" not in json.dumps(Schedule.from_steps([[Prompt("x", 3)], [Prune("x")]]).to_json())   # as before
    assert dry_run(s, page_size=2)["final_free"]


@pytest.mark.parametrize("step, op, field, bad, message", [
    (0, 0, "pending", 1, r"step 0, op 0 \(prompt\): field 'pending' must be true or false, got 1"),
    (1, 1, "ids", ["c0"], r"step 1, op 1 \(children\): field 'ids' must have one handle per node: 1 ids for 2"),
    (1, 1, "tokens", [7], r"step 1, op 1 \(children\): field 'tokens' must have one id per node: 1 for 2 nodes"),
    (1, 1, "nodes", ["p", "zz"], r"step 1, op 1 \(children\): field 'nodes\[1\]' names unknown node 'zz'"),
    (1, 1, "ids", ["c0", "c0"], r"step 1, op 1 \(children\): field 'ids' lists a handle twice"),
    (1, 1, "tokens", [7, -8], r"step 1, op 1 \(children\): field 'tokens\[1\]' must be an int >= 0, got -8"),
    (2, 0, "ids", ["p"], r"step 2, op 0 \(children\): field 'ids\[0\]' reuses node handle 'p'"),
    (3, 1, "length", 0, r"step 3, op 1 \(truncate\): field 'length' must be an int >= 1 .*, got 0"),
    (3, 1, "length", "6", r"step 3, op 1 \(truncate\): field 'length' must be an int >= 1 .*, got '6'"),
    (3, 1, "length", 11, r"step 3, op 1 \(truncate\): field 'length' = 11: node 'p' holds 10 token\(s\)"),
    (3, 1, "node", "c1", r"step 3, op 1 \(truncate\): field 'node' names node 'c1', which was pruned"),
])
def test_bad_fields_name_step_op_and_field(step, op, field, bad, message):
    data = json.loads(json.dumps(GOOD))
    data["steps"][step][op][field] = bad
    with pytest.raises(ScheduleError, match=message):
        Schedule.from_json(data, source="s.json")


@pytest.mark.parametrize("edit, message", [
    # a prefilled prompt needs a tree without pending tokens
    (lambda d: d["steps"][2].append({"op": "prompt", "id": "r", "tokens": 2}),
     r"step 2, op 2 \(prompt\): field 'op': a prefilled 'prompt' op must come before"),
    # a prune, accept or truncate of this step's pending tokens
    (lambda d: d["steps"][2].append({"op": "prune", "node": "q"}),
     r"step 2, op 2 \(prune\): field 'node': pruning 'q' would remove node\(s\) \['q'\]"),
    (lambda d: d["steps"][2].append({"op": "accept", "ids": ["c0", "d0"]}),
     r"step 2, op 2 \(accept\): field 'ids': the accept would change node\(s\) \['d0'\]"),
    (lambda d: d["steps"][4].append({"op": "truncate", "node": "q", "length": 1}),
     r"step 4, op 2 \(truncate\): field 'node': truncate would drop tokens of node\(s\) \['q'\]"),
    (lambda d: d["steps"][3].insert(0, {"op": "truncate", "node": "p", "length": 2}),
     r"step 3, op 0 \(truncate\): field 'node': node 'p' has children \['c0', 'c1'\]; only leaves are truncated"),
    (lambda d: d["steps"][1].append({"op": "children", "nodes": ["gone"], "ids": ["e"]}),
     r"step 1, op 2 \(children\): field 'nodes\[0\]' names unknown node 'gone'"),
])
def test_ops_out_of_order(edit, message):
    data = json.loads(json.dumps(GOOD))
    edit(data)
    with pytest.raises(ScheduleError, match=message):
        Schedule.from_json(data, source="s.json")


# ================================================================ fuzzing: the new ops among the old


recorded_ops = st.one_of(
    plausible_ops,
    st.builds(lambda h, t, parent: {"op": "prompt", "id": h, "tokens": t, "pending": True,
                                    **({} if parent is None else {"parent": parent})},
              handles | tree_handles, good_counts, st.none() | handles),
    st.builds(lambda nodes, ids: {"op": "children", "nodes": nodes, "ids": ids[:len(nodes)]},
              st.lists(handles | tree_handles, min_size=1, max_size=3),
              st.lists(tree_handles | handles, min_size=3, max_size=3, unique=True)),
    st.builds(lambda n, k: {"op": "truncate", "node": n, "length": k}, handles | tree_handles, st.integers(1, 12)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(recorded_ops, max_size=5), max_size=8))
def test_recorded_op_sequences_load_or_refuse_and_dry_run_as_predicted(steps):
    """Those that load must dry-run as the loader predicted (the tree refuses nothing it accepted)."""
    _check({"format": "treedec-schedule", "version": 1, "steps": steps})


@st.composite
def grown_recorded_docs(draw):
    """Schedules grown op by op on a model of the tree, every op kind anywhere in a step (so some prune,
    accept or truncate this step's pending tokens, or prefill after them: the loader must refuse those)."""
    parent: dict = {}
    drafts: set = set()
    fresh = iter(range(10**6))

    def kids(h):
        return [c for c, p in parent.items() if p == h]

    def remove(h):
        for c in kids(h):
            remove(c)
        del parent[h]
        drafts.discard(h)

    steps = []
    for _ in range(draw(st.integers(1, 8))):
        step = []
        for _ in range(draw(st.integers(0, 6))):
            live = sorted(parent, key=str)
            leaves = [h for h in live if not kids(h)]
            starts = [h for h in live if h in drafts and parent[h] not in drafts]
            kind = draw(st.sampled_from(["prompt"] + (["extend", "children", "prune", "truncate", "branch"] if live
                                                      else []) + (["accept"] if starts else [])))
            if kind == "prompt":
                op = {"op": "prompt", "id": next(fresh), "tokens": draw(good_counts), "pending": draw(st.booleans())}
                parent[op["id"]] = draw(st.sampled_from(live)) if live and draw(st.booleans()) else None
                if parent[op["id"]] is not None:
                    op["parent"] = parent[op["id"]]
            elif kind == "branch":
                op = {"op": "branch", "node": draw(st.sampled_from(live)), "ids": [next(fresh)]}
                parent[op["ids"][0]] = op["node"]
            elif kind == "extend":
                op = {"op": "extend", "node": draw(st.sampled_from(leaves)), "tokens": draw(good_counts)}
            elif kind == "children":
                nodes = draw(st.lists(st.sampled_from(live), min_size=1, max_size=3))
                op = {"op": "children", "nodes": nodes, "ids": [next(fresh) for _ in nodes]}
                parent.update(zip(op["ids"], nodes))
                drafts.update(op["ids"])
            elif kind == "truncate":
                op = {"op": "truncate", "node": draw(st.sampled_from(leaves)), "length": draw(st.integers(1, 3))}
            elif kind == "prune":
                op = {"op": "prune", "node": draw(st.sampled_from(live))}
                remove(op["node"])
            else:
                chain = [draw(st.sampled_from(starts))]
                while draw(st.booleans()) and [c for c in kids(chain[-1]) if c in drafts]:
                    chain.append(draw(st.sampled_from([c for c in kids(chain[-1]) if c in drafts])))
                op = {"op": "accept", "ids": chain}
                for c in kids(parent[chain[0]]):
                    remove(c)
            step.append(op)
        steps.append(step)
    return {"format": "treedec-schedule", "version": 1, "steps": steps}


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grown_recorded_docs())
def test_grown_recorded_schedules(doc):
    _check(doc)
