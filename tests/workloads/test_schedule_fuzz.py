"""Fuzzing the schedule loader: any input loads, with sound stats, or raises ScheduleError; nothing huge is allocated.

A loaded schedule is then checked against a small token capacity and, when it fits, dry-run
(the tree operations on a bookkeeping pool): the run must peak at the tokens the loader
predicted and free every page, and the whole example must stay under a memory cap.
"""
import copy
import json
import tracemalloc

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from treedec.replay import dry_run
from treedec.workloads import Schedule, ScheduleError, load_schedule
from treedec.workloads.schedule import TOKEN_ID_LIMIT

CAPACITY = 2_000          # tokens a fuzzed schedule may hold in its dry run
MEMORY_CAP = 32 << 20     # bytes one example may allocate (tracemalloc peak), far below a 10^9-token run
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

GOOD = {"format": "treedec-schedule", "version": 1, "name": "t", "steps": [
    [{"op": "prompt", "id": "p", "tokens": 10}],
    [{"op": "branch", "node": "p", "ids": ["a", "b"]}, {"op": "extend", "node": "a", "tokens": 1},
     {"op": "extend", "node": "b", "tokens": [5, 6]}],
    [{"op": "prune", "node": "b"}, {"op": "token_tree", "node": "a", "parents": [-1, 0, 0], "ids": ["t0", "t1", "t2"]}],
    [{"op": "accept", "ids": ["t0", "t2"]}, {"op": "extend", "node": "a", "tokens": 1}],
    [{"op": "prompt", "id": 7, "tokens": [1, 2], "parent": "a"}, {"op": "prune", "node": "p"}],
]}

# ================================================================ strategies

NASTY = [0, -1, 1, 2, 10**9, 10**18, 2**31, 2**63, -(10**9), 10**40, None, "", "p", "a", "t0", 7, [], {}, [[]], [-1],
         [0, 0], [1, -1], [10**9], 1.5, float("nan"), True, False, "prompt", "branch", "token_tree", "accept",
         {"op": "prune", "node": "p"}, [{"op": "extend", "node": "a", "tokens": 10**9}]]
scalars = (st.none() | st.booleans() | st.integers() | st.integers(-(2**70), 2**70) | st.floats()
           | st.text(max_size=6) | st.sampled_from(NASTY))
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
    st.sampled_from(["op", "id", "node", "ids", "tokens", "parent", "parents", "steps", "format", "version", "x"])
    | st.text(max_size=5), kids, max_size=5), max_leaves=24)

handles = st.sampled_from(["p", "q", "a", "b", "c", "d", 0, 1, 2, 3])
tree_handles = st.sampled_from([f"t{i}" for i in range(8)] + ["a", "b", 4, 5])
good_counts = st.integers(1, 60) | st.lists(st.integers(0, 100), min_size=1, max_size=4)
counts = good_counts | st.sampled_from([10**9, 0, -3])


@st.composite
def token_tree_ops(draw):
    m = draw(st.integers(1, 4))
    parents = [draw(st.integers(-1, i - 1)) for i in range(m)]
    op = {"op": "token_tree", "node": draw(handles), "parents": parents,
          "ids": draw(st.lists(tree_handles, min_size=m, max_size=m, unique=True))}
    if draw(st.booleans()):
        op["tokens"] = draw(st.lists(st.integers(0, 100), min_size=m, max_size=m))
    return op


def _prompt(h, tokens, parent):
    return {"op": "prompt", "id": h, "tokens": tokens, **({} if parent is None else {"parent": parent})}


plausible_ops = st.one_of(
    st.builds(_prompt, handles, counts, st.none() | st.none() | handles),
    st.builds(lambda n, ids: {"op": "branch", "node": n, "ids": ids}, handles,
              st.lists(handles, min_size=1, max_size=3, unique=True)),
    st.builds(lambda n, t: {"op": "extend", "node": n, "tokens": t}, handles | tree_handles, counts),
    token_tree_ops(),
    st.builds(lambda ids: {"op": "accept", "ids": ids}, st.lists(tree_handles, min_size=1, max_size=3, unique=True)),
    st.builds(lambda n: {"op": "prune", "node": n}, handles | tree_handles),
)
plausible_docs = st.builds(lambda steps: {"format": "treedec-schedule", "version": 1, "steps": steps},
                           st.lists(st.lists(plausible_ops, max_size=5), max_size=8))


@st.composite
def grown_docs(draw):
    """Schedules grown op by op on a model of the tree: mostly valid, with a few corrupted fields."""
    parent: dict = {}                 # live handle -> parent handle (None: a root)
    in_token_tree: set = set()
    fresh = iter(range(10**6))

    def new_handle():
        k = next(fresh)
        return k if draw(st.booleans()) else f"n{k}"

    def children(h):
        return [c for c, p in parent.items() if p == h]

    def remove(h):
        for c in children(h):
            remove(c)
        del parent[h]
        in_token_tree.discard(h)

    steps = []
    for _ in range(draw(st.integers(1, 8))):
        step, adding = [], False
        for _ in range(draw(st.integers(0, 5))):
            live = list(parent)
            starts = sorted((h for h in in_token_tree if parent[h] not in in_token_tree), key=str)
            kinds = ["branch", "extend", "token_tree"] if live else []
            kinds += [] if adding else ["prompt"] + (["prune"] if live else []) + (["accept"] * 2 if starts else [])
            kind = draw(st.sampled_from(kinds))
            if kind == "prompt":
                op = {"op": "prompt", "id": new_handle(), "tokens": draw(good_counts)}
                if live and draw(st.sampled_from(range(5))) == 3:
                    op["parent"] = draw(st.sampled_from(live))
                parent[op["id"]] = op.get("parent")
            elif kind == "branch":
                op = {"op": "branch", "node": draw(st.sampled_from(live)),
                      "ids": [new_handle() for _ in range(draw(st.integers(1, 3)))]}
                parent.update(dict.fromkeys(op["ids"], op["node"]))
            elif kind == "extend":
                leaves = [h for h in live if not children(h)]
                op = {"op": "extend", "node": draw(st.sampled_from(leaves)), "tokens": draw(good_counts)}
            elif kind == "token_tree":
                op = draw(token_tree_ops())
                op["node"], op["ids"] = draw(st.sampled_from(live)), [new_handle() for _ in op["parents"]]
                for h, i in zip(op["ids"], op["parents"]):
                    parent[h] = op["node"] if i < 0 else op["ids"][i]
                in_token_tree.update(op["ids"])
            elif kind == "prune":
                op = {"op": "prune", "node": draw(st.sampled_from(live))}
                remove(op["node"])
            else:
                chain = [draw(st.sampled_from(starts))]
                while draw(st.booleans()) and [c for c in children(chain[-1]) if c in in_token_tree]:
                    chain.append(draw(st.sampled_from([c for c in children(chain[-1]) if c in in_token_tree])))
                op = {"op": "accept", "ids": chain}
                anchor = parent.get(chain[0])
                if anchor is not None:
                    for c in children(anchor):
                        remove(c)
            if draw(st.sampled_from(range(20))) == 13:   # corrupt one field, now and then
                op[draw(st.sampled_from(sorted(op)))] = draw(st.sampled_from(NASTY))
            adding = adding or kind in ("extend", "token_tree")
            step.append(op)
        steps.append(step)
    return {"format": "treedec-schedule", "version": 1, "steps": steps}


def _locations(value):
    """Every (container, key) of a JSON value, depth-first."""
    if isinstance(value, dict):
        for k in list(value):
            yield value, k
            yield from _locations(value[k])
    elif isinstance(value, list):
        for i in range(len(value)):
            yield value, i
            yield from _locations(value[i])


@st.composite
def mutated_docs(draw, base=GOOD):
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        locations = list(_locations(doc))
        if not locations:
            break
        container, key = draw(st.sampled_from(locations))
        action = draw(st.sampled_from(["replace", "replace", "delete", "duplicate"]))
        if action == "delete":
            del container[key]
        elif action == "duplicate" and isinstance(container, list):
            container.insert(key, copy.deepcopy(container[key]))
        else:
            # A copy: a later mutation edits the doc in place, and must not edit a value Hypothesis
            # may hand out again (its data generation then differs between runs: FlakyStrategyDefinition).
            container[key] = copy.deepcopy(draw(json_values))
    return doc


# ================================================================ the property


def _check(doc) -> Schedule | None:
    """Load ``doc``; if it loads, its stats must be sound and a dry run within CAPACITY must match them."""
    tracemalloc.start()
    try:
        try:
            schedule = Schedule.from_json(doc, source="fuzz.json")
        except ScheduleError as e:
            assert str(e).startswith("fuzz.json: ")
            event("refused by the loader")
            return None
        _check_loaded(schedule)
        assert tracemalloc.get_traced_memory()[1] < MEMORY_CAP
        return schedule
    finally:
        tracemalloc.stop()


def _check_loaded(schedule: Schedule) -> None:
    s = schedule.stats
    assert 0 <= s.forward_steps <= len(schedule.steps)
    assert -1 <= s.max_position < max(s.peak_tree_tokens, 1)   # a position is a token held by the tree
    assert -1 <= s.max_token_id < TOKEN_ID_LIMIT
    again = Schedule.from_json(json.loads(json.dumps(schedule.to_json())))
    assert again.steps == schedule.steps and again.stats == s
    try:
        schedule.check_fits(max_tree_tokens=CAPACITY)
    except ScheduleError as e:
        assert s.peak_tree_tokens > CAPACITY, e
        with pytest.raises(ScheduleError):
            dry_run(schedule, page_size=4, max_tree_tokens=CAPACITY)
        event("loaded, refused by check_fits")
        return
    event("loaded and dry-run")
    for page_size in (1, 16):
        sizing = dry_run(schedule, page_size=page_size, max_tree_tokens=CAPACITY)
        assert sizing["peak_tokens"] == s.peak_tree_tokens and sizing["final_free"]


@FUZZ
@given(json_values)
def test_arbitrary_json_values(doc):
    assert _check(doc) is None or isinstance(doc, dict)


@FUZZ
@given(st.builds(lambda steps: {"format": "treedec-schedule", "version": 1, "steps": steps},
                 st.lists(st.lists(json_values, max_size=3) | json_values, max_size=4)))
def test_arbitrary_steps(doc):
    _check(doc)


@FUZZ
@given(mutated_docs())
def test_mutated_valid_schedule(doc):
    _check(doc)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grown_docs())
def test_grown_schedules(doc):
    """Mostly valid schedules: those that load must dry-run as the loader predicted."""
    _check(doc)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plausible_docs)
def test_plausible_op_sequences(doc):
    """Ops of the right shape on a few handles: many load, and those must dry-run as predicted."""
    _check(doc)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz_schedule")


@FUZZ
@given(data=st.data())
def test_mutated_files(fuzz_dir, data):
    """Bytes cut from, flipped in or appended to a valid file: load_schedule gives a Schedule or a ScheduleError."""
    raw = bytearray(json.dumps(GOOD).encode())
    for _ in range(data.draw(st.integers(1, 4))):
        where = data.draw(st.integers(0, len(raw)))
        kind = data.draw(st.sampled_from(["cut", "flip", "insert"]))
        if kind == "cut":
            del raw[where:where + data.draw(st.integers(1, 20))]
        elif kind == "flip" and where < len(raw):
            raw[where] = data.draw(st.integers(0, 255))
        else:
            raw[where:where] = data.draw(st.sampled_from([b"[", b"]", b"{", b"-", b"9" * 30, b'"', b"\xff", b",",
                                                          b"null", b"1e400", b"NaN"]))
    path = fuzz_dir / "s.json"
    path.write_bytes(bytes(raw))
    try:
        schedule = load_schedule(path)
    except ScheduleError as e:
        assert str(e).startswith(str(path))
        return
    _check_loaded(schedule)
