"""Loaders of the shipped DeFT workload files (treedec/workloads/deft.py)."""
import json

import numpy as np
import pytest

from treedec.workloads import DEFT_DIR, TraceFormatError, load_tot_trees, medusa_tree, tot_snapshot

MEDUSA_SIZES = (32, 64, 96, 128, 256)
TOT_FILES = ("sorting128ToT.json", "docmergeToT.json", "keywordToT.json")


# ================================================================ Medusa


@pytest.mark.parametrize("size", MEDUSA_SIZES)
def test_medusa_tree_shipped(size):
    tree = medusa_tree(size)
    record = json.loads((DEFT_DIR / "speculative" / f"tree_size{size}.json").read_text())
    assert tree.size == record["Token_Tree_size"] == size
    assert tree.parents[0] == -1 and tree.depth[0] == 0
    idx = np.arange(1, size)
    assert np.all((tree.parents[1:] >= 0) & (tree.parents[1:] < idx)), "parents must precede children"
    assert np.array_equal(tree.depth[1:], tree.depth[tree.parents[1:]] + 1)
    assert tree.paths == sorted(tree.paths, key=lambda p: (len(p), p))
    # a path's parent token is the token of the path without its last index
    for i, p in enumerate(tree.paths, start=1):
        parent = tree.parents[i]
        assert (tree.paths[parent - 1] if parent > 0 else ()) == p[:-1]


def test_medusa_tree_by_path_equals_by_size():
    a = medusa_tree(64)
    b = medusa_tree(DEFT_DIR / "speculative" / "tree_size64.json")
    assert np.array_equal(a.parents, b.parents) and a.tree_id == b.tree_id


def _medusa_file(tmp_path, **record):
    base = {"Tree_ID": 1, "Tree_Structure": [[0], [1], [0, 0]], "Token_Tree_size": 4, "Records": []}
    base.update(record)
    path = tmp_path / "tree_bad.json"
    path.write_text(json.dumps(base))
    return path


def test_medusa_tree_small_file(tmp_path):
    tree = medusa_tree(_medusa_file(tmp_path))
    assert tree.parents.tolist() == [-1, 0, 0, 1]
    assert tree.depth.tolist() == [0, 1, 1, 2]


@pytest.mark.parametrize("record, words", [
    ({"Tree_Structure": None}, ["Tree_Structure", "list"]),
    ({"Token_Tree_size": "4"}, ["Token_Tree_size", "int"]),
    ({"Tree_Structure": [[0], [0, 1, 2]]}, ["Tree_Structure", "[0, 1, 2]", "parent path"]),
    ({"Tree_Structure": [[0], [0]], "Token_Tree_size": 3}, ["[0]", "twice"]),
    ({"Tree_Structure": [[0], ["a"]]}, ["Tree_Structure[1]", "ints"]),
    ({"Tree_Structure": [[0], []]}, ["Tree_Structure[1]", "non-empty"]),
    ({"Token_Tree_size": 5}, ["Token_Tree_size", "5"]),
])
def test_medusa_tree_malformed(tmp_path, record, words):
    path = _medusa_file(tmp_path, **record)
    with pytest.raises(TraceFormatError) as info:
        medusa_tree(path)
    message = str(info.value)
    assert str(path) in message
    for word in words:
        assert word in message


def test_medusa_tree_missing_field(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"Tree_ID": 1, "Token_Tree_size": 1}))
    with pytest.raises(TraceFormatError, match="missing field 'Tree_Structure'"):
        medusa_tree(path)


def test_medusa_tree_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tree_size7"):
        medusa_tree(7)


# ================================================================ ToT-BFS


@pytest.mark.parametrize("name", TOT_FILES)
def test_shipped_tot_files_validate(name):
    trees = load_tot_trees(DEFT_DIR / "reasoning" / name)
    assert len(trees) >= 50
    assert sum(1 for t in trees if t) >= 48


@pytest.mark.parametrize("name, tree, fraction", [
    ("sorting128ToT.json", 1, 0.8), ("docmergeToT.json", 0, 0.8), ("keywordToT.json", 0, 0.5),
    ("sorting128ToT.json", 3, 0.3), ("docmergeToT.json", 5, 1.0),
])
def test_tot_snapshot_shapes(name, tree, fraction):
    snap = tot_snapshot(DEFT_DIR / "reasoning" / name, tree, fraction)
    n = len(snap.parents)
    assert snap.parents[0] == -1 and snap.node_ids[0] == 0
    assert np.all(snap.parents[1:] < np.arange(1, n)) and np.all(snap.parents[1:] >= 0)
    assert np.all(snap.lengths >= 1)
    assert len(snap.queries) >= 1
    # each query is the last token of a leaf of the kept tree
    leaves = set(range(n)) - set(snap.parents.tolist())
    assert set(snap.queries[:, 0].tolist()) <= leaves
    assert np.array_equal(snap.queries[:, 1], snap.lengths[snap.queries[:, 0]] - 1)
    # every kept leaf is generating (finished branches are evicted)
    assert leaves == set(snap.queries[:, 0].tolist())
    layout = snap.layout()
    assert layout.num_tokens == snap.num_tokens and layout.num_queries == len(snap.queries)


def test_tot_snapshot_bench_trees():
    """The two traces of BENCH.md's suite (their floors there match these token counts)."""
    sorting = tot_snapshot(DEFT_DIR / "reasoning" / "sorting128ToT.json", 1, 0.8)
    assert (sorting.iteration, sorting.num_tokens, len(sorting.queries)) == (2966, 4956, 9)
    docmerge = tot_snapshot(DEFT_DIR / "reasoning" / "docmergeToT.json", 0, 0.8)
    assert (docmerge.iteration, docmerge.num_tokens, len(docmerge.queries)) == (1900, 6627, 10)


def _node(i, value, start, children=()):
    return {"id": i, "value": value, "start": start, "end": start + value - 1, "children": list(children)}


def _tot_file(tmp_path, nodes, extra_trees=()):
    """One tree whose node ``i`` of ``nodes`` is stored under key ``str(i)``."""
    trees = [{"incompleted": False, "prompt": "p", "data": {str(i): n for i, n in enumerate(nodes)}}, *extra_trees]
    path = tmp_path / "tot.json"
    path.write_text(json.dumps(trees))
    return path


def _small_tree():
    # prompt 5 tokens; A: iterations 1-3; B: 1-6; C under B: 7-9
    return [_node(0, 5, -4, [1, 2]), _node(1, 3, 1), _node(2, 6, 1, [3]), _node(3, 3, 7)]


def test_tot_snapshot_rule(tmp_path):
    path = _tot_file(tmp_path, _small_tree())
    # it = round(0.5 * 9) = 4: B generating (4 tokens so far), A finished and evicted
    snap = tot_snapshot(path, 0, 0.5)
    assert snap.iteration == 4
    assert snap.node_ids.tolist() == [0, 2]
    assert snap.lengths.tolist() == [5, 4]
    assert snap.queries.tolist() == [[1, 3]]
    # it = 2: A and B both generating, 2 tokens each
    snap = tot_snapshot(path, 0, 2 / 9)
    assert snap.node_ids.tolist() == [0, 1, 2] and snap.lengths.tolist() == [5, 2, 2]
    assert snap.queries.tolist() == [[1, 1], [2, 1]]
    # it = 8: C generating (2 tokens) under the finished B (6 tokens)
    snap = tot_snapshot(path, 0, 8 / 9)
    assert snap.node_ids.tolist() == [0, 2, 3] and snap.lengths.tolist() == [5, 6, 2]
    assert snap.parents.tolist() == [-1, 0, 1] and snap.queries.tolist() == [[2, 1]]


@pytest.mark.parametrize("mutate, words", [
    (lambda n: n[1].pop("start"), ["node 1", "'start'"]),
    (lambda n: n[2].update(value="6"), ["node 2", "'value'", "int"]),
    (lambda n: n[2].update(children=[7]), ["node 2", "'children'", "7"]),
    (lambda n: n[2].update(children=["3"]), ["node 2", "'children'"]),
    (lambda n: n[3].update(end=20), ["node 3", "'value'", "end - start + 1"]),
    (lambda n: n[3].update(id=4), ["node 3", "'id'"]),
    (lambda n: n[3].update(start=5, end=7), ["node 3", "'start'", "parent node 2"]),
    (lambda n: n[0].update(children=[1, 2, 3]), ["'children'", "node 3", "lists it too"]),
    (lambda n: n[2].update(children=[]), ["[3]", "not reachable"]),
])
def test_tot_malformed_node(tmp_path, mutate, words):
    nodes = _small_tree()
    mutate(nodes)
    path = _tot_file(tmp_path, nodes)
    for load in (lambda: tot_snapshot(path, 0, 0.5), lambda: load_tot_trees(path)):
        with pytest.raises(TraceFormatError) as info:
            load()
        message = str(info.value)
        assert str(path) in message and "tree 0" in message
        for word in words:
            assert word in message


def test_tot_malformed_file(tmp_path):
    path = tmp_path / "tot.json"
    path.write_text(json.dumps({"data": {}}))
    with pytest.raises(TraceFormatError, match="JSON list of trees"):
        tot_snapshot(path, 0, 0.5)
    path.write_text("[{")
    with pytest.raises(TraceFormatError, match="not valid JSON"):
        load_tot_trees(path)
    path.write_text(json.dumps([{"incompleted": False, "data": {"1": _node(1, 3, 1)}}]))
    with pytest.raises(TraceFormatError, match="tree 0: missing node 0"):
        tot_snapshot(path, 0, 0.5)
    path.write_text(json.dumps([{"prompt": "p"}]))
    with pytest.raises(TraceFormatError, match="tree 0: missing field 'data'"):
        tot_snapshot(path, 0, 0.5)


def test_tot_snapshot_bad_arguments(tmp_path):
    path = _tot_file(tmp_path, _small_tree(), extra_trees=[{"incompleted": True, "prompt": "p", "data": {}}])
    with pytest.raises(IndexError, match="tree_index"):
        tot_snapshot(path, 2, 0.5)
    with pytest.raises(ValueError, match="fraction"):
        tot_snapshot(path, 0, 0.0)
    with pytest.raises(TraceFormatError, match="tree 1: the tree has no nodes"):
        tot_snapshot(path, 1, 0.5)
    assert load_tot_trees(path)[1] == {}
