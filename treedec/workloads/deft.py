"""Loaders for the DeFT workload files shipped in ``workloads/deft/`` (formats: workloads/README.md).

- :func:`medusa_tree`: a Medusa token-tree topology (``speculative/tree_size{N}.json``) as a
  parent array.
- :func:`tot_snapshot`: the state of a recorded ToT-BFS tree (``reasoning/*.json``) at one
  decode iteration: which nodes hold KV, how long they are, which tokens are the queries.

Every record is validated; a malformed one raises :class:`TraceFormatError` naming the file,
the record (tree / node / path) and the field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from treedec.checks import is_int
from treedec.tree.layout import TreeLayout, depth_first_order
from treedec.tree.token_tree import TokenTree

#: ``workloads/deft`` of this repository.
DEFT_DIR = Path(__file__).resolve().parents[2] / "workloads" / "deft"


class TraceFormatError(ValueError):
    """A workload file that does not follow its format (workloads/README.md)."""


# ================================================================ Medusa token trees


@dataclass(frozen=True)
class MedusaTree:
    """A Medusa token tree: the root token (the last accepted token) plus one token per path.

    Attributes
    ----------
    parents : [t] int64
        Parent token index of every token; ``parents[0] == -1`` (the root). Parents come
        before their children (paths sorted by (length, path)).
    depth : [t] int64
        Depth of every token (root 0; the token of path ``p`` has depth ``len(p)``).
    paths : list of tuple of int
        ``paths[i - 1]`` is the Medusa index path of token ``i``.
    tree_id : int
        ``Tree_ID`` of the file.
    source : str
        The file it was read from.
    """

    parents: np.ndarray
    depth: np.ndarray
    paths: list
    tree_id: int
    source: str

    @property
    def size(self) -> int:
        return len(self.parents)


def medusa_tree(path_or_size: str | Path | int) -> MedusaTree:
    """Read ``Tree_Structure`` of a Medusa record file.

    Parameters
    ----------
    path_or_size:
        A path to a ``tree_size{N}.json`` file, or N (reads the shipped
        ``workloads/deft/speculative/tree_size{N}.json``).

    Returns
    -------
    MedusaTree with ``Token_Tree_size`` tokens.
    """
    if is_int(path_or_size):
        path = DEFT_DIR / "speculative" / f"tree_size{int(path_or_size)}.json"
    else:
        path = Path(path_or_size)
    record = load_json(path)
    where = f"{path}"
    if not isinstance(record, dict):
        raise TraceFormatError(f"{where}: the top level must be a JSON object, got {type(record).__name__}")
    structure = _field(record, "Tree_Structure", list, where)
    size = _int_field(record, "Token_Tree_size", where)
    tree_id = _int_field(record, "Tree_ID", where)

    try:
        token_tree = TokenTree.from_medusa_choices(structure)
    except ValueError as e:
        # TokenTree names its argument "choices"; in this file that field is Tree_Structure
        raise TraceFormatError(f"{where}: " + str(e).replace("choices", "Tree_Structure", 1)) from None
    parents = list(token_tree.parents)
    paths = sorted((tuple(p) for p in structure), key=lambda p: (len(p), p))
    if len(parents) != size:
        raise TraceFormatError(f"{where}: Token_Tree_size is {size} but Tree_Structure gives "
                               f"{len(paths)} paths + the root = {len(parents)} tokens")
    return MedusaTree(
        parents=np.asarray(parents, dtype=np.int64),
        depth=np.asarray([0] + [len(p) for p in paths], dtype=np.int64),
        paths=paths,
        tree_id=tree_id,
        source=str(path),
    )


# ================================================================ ToT-BFS traces


@dataclass(frozen=True)
class TotSnapshot:
    """The KV tree of a ToT-BFS trace at one decode iteration.

    Attributes
    ----------
    parents : [N] int64
        Parent index of every kept node (-1 for the prompt); parents come first.
    lengths : [N] int64
        Tokens of every node at this iteration (the prompt: its whole length).
    queries : [Q, 2] int64
        (node index, offset) of the last generated token of every generating node.
    node_ids : [N] int64
        The trace's node ids.
    iteration : int
        The decode iteration (1 is the first decode step after the prompt).
    source : str
        ``"<file>#tree<i>"``.
    """

    parents: np.ndarray
    lengths: np.ndarray
    queries: np.ndarray
    node_ids: np.ndarray
    iteration: int
    source: str

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def layout(self) -> TreeLayout:
        """A TreeLayout with tokens numbered consecutively (a page-size-1 pool)."""
        return TreeLayout.from_parents(self.parents, self.lengths, self.queries, node_ids=self.node_ids)


def load_tot_trees(path: str | Path) -> list[dict]:
    """Read and validate every tree of a ToT-BFS file.

    Returns one ``{node_id: node dict}`` per tree (``incompleted`` trees included; one
    that recorded no node is an empty dict).
    """
    path = Path(path)
    trees = load_json(path)
    if not isinstance(trees, list):
        raise TraceFormatError(f"{path}: the top level must be a JSON list of trees, got {type(trees).__name__}")
    return [_validate_tot_tree(t, f"{path}: tree {i}") for i, t in enumerate(trees)]


def tot_snapshot(path: str | Path, tree_index: int, fraction: float) -> TotSnapshot:
    """State of tree ``tree_index`` of a ToT-BFS file at ``fraction`` of its decode iterations.

    The iteration is ``it = round(fraction * max end)``. A node is *generating* while
    ``start <= it <= end``. The KV holds every started node that is an ancestor-or-self
    of a generating node; a thought's length is the tokens generated so far
    (``min(it, end) - start + 1``), the prompt's its ``value``. The queries are the last
    generated token of every generating node.

    Parameters
    ----------
    path:
        A ``reasoning/*.json`` file.
    tree_index:
        Index of the tree in the file's list.
    fraction:
        In (0, 1].
    """
    path = Path(path)
    trees = load_json(path)
    if not isinstance(trees, list):
        raise TraceFormatError(f"{path}: the top level must be a JSON list of trees, got {type(trees).__name__}")
    if not isinstance(tree_index, (int, np.integer)) or not 0 <= tree_index < len(trees):
        raise IndexError(f"tree_index must be in [0, {len(trees)}) for {path}, got {tree_index!r}")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    where = f"{path}: tree {tree_index}"
    nodes = _validate_tot_tree(trees[tree_index], where)
    if not nodes:
        raise TraceFormatError(f"{where}: the tree has no nodes (an 'incompleted' run)")
    it = int(round(fraction * max(n["end"] for n in nodes.values())))

    generating = {i for i, n in nodes.items() if n["start"] <= it <= n["end"]}
    if not generating:
        raise TraceFormatError(f"{where}: no node is generating at iteration {it} (fraction {fraction})")
    parent_of = {c: i for i, n in nodes.items() for c in n["children"]}
    keep = set()
    for i in generating:
        while i is not None and i not in keep:
            keep.add(i)
            i = parent_of.get(i)
    order = [i for i in trace_preorder(nodes) if i in keep]
    index = {nid: k for k, nid in enumerate(order)}
    lengths = np.array([nodes[i]["value"] if i == 0 else min(it, nodes[i]["end"]) - nodes[i]["start"] + 1
                        for i in order], dtype=np.int64)
    parents = np.array([index[parent_of[i]] if i in parent_of else -1 for i in order], dtype=np.int64)
    queries = np.array([(index[i], lengths[index[i]] - 1) for i in order if i in generating],
                       dtype=np.int64).reshape(-1, 2)
    return TotSnapshot(parents=parents, lengths=lengths, queries=queries,
                       node_ids=np.asarray(order, dtype=np.int64), iteration=it,
                       source=f"{path}#tree{tree_index}")


# ================================================================ files and trace nodes (shared)


def load_json(path: Path):
    """The JSON document of a workload file (a trace, a token tree, a schedule); FileNotFoundError or
    :class:`TraceFormatError` naming ``path`` when it is missing or not JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"workload file not found: {path}") from None
    # ValueError: bad JSON, bad UTF-8, or an int literal past Python's digit limit; RecursionError: deep nesting
    except (ValueError, RecursionError) as e:
        raise TraceFormatError(f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None


def trace_preorder(nodes: dict[int, dict]) -> list[int]:
    """Node ids reachable from the prompt (node 0), depth-first, children in file order."""
    return depth_first_order([0], {i: node["children"] for i, node in nodes.items()})


# ================================================================ private


def _field(record: dict, name: str, kind: type, where: str):
    if name not in record:
        raise TraceFormatError(f"{where}: missing field '{name}'")
    value = record[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TraceFormatError(f"{where}: field '{name}' must be {kind.__name__}, "
                               f"got {type(value).__name__} {value!r:.60}")
    return value


def _int_field(record: dict, name: str, where: str) -> int:
    return _field(record, name, int, where)


def _validate_tot_tree(tree, where: str) -> dict[int, dict]:
    """Check one tree record; returns ``{node id: node}`` with int ids."""
    if not isinstance(tree, dict):
        raise TraceFormatError(f"{where}: a tree must be a JSON object, got {type(tree).__name__}")
    data = _field(tree, "data", dict, where)
    incomplete = tree.get("incompleted", False)
    if not isinstance(incomplete, bool):
        raise TraceFormatError(f"{where}: field 'incompleted' must be true or false, got {incomplete!r:.60}")
    if not data and incomplete:
        return {}  # an incompleted run may have recorded no node at all
    nodes: dict[int, dict] = {}
    for key, node in data.items():
        at = f"{where}, node {key}"
        if not isinstance(node, dict):
            raise TraceFormatError(f"{at}: a node must be a JSON object, got {type(node).__name__}")
        nid = _int_field(node, "id", at)
        if str(nid) != str(key):
            raise TraceFormatError(f"{at}: field 'id' is {nid} but the node is stored under key {key!r}")
        for name in ("value", "start", "end"):
            _int_field(node, name, at)
        children = _field(node, "children", list, at)
        if not all(is_int(c) for c in children):
            raise TraceFormatError(f"{at}: field 'children' must be a list of int node ids, got {children!r:.80}")
        if node["value"] != node["end"] - node["start"] + 1:
            raise TraceFormatError(f"{at}: field 'value' ({node['value']}) must equal end - start + 1 "
                                   f"({node['end']} - {node['start']} + 1)")
        if node["value"] < 0:
            raise TraceFormatError(f"{at}: field 'value' must be >= 0, got {node['value']}")
        nodes[nid] = node
    if 0 not in nodes:
        raise TraceFormatError(f"{where}: missing node 0 (the prompt)")
    if nodes[0]["value"] < 1 or nodes[0]["end"] != 0:
        raise TraceFormatError(f"{where}, node 0: the prompt needs 'value' >= 1 and 'end' == 0, "
                               f"got value={nodes[0]['value']}, end={nodes[0]['end']}")
    parent_of: dict[int, int] = {}
    for nid, node in nodes.items():
        for c in node["children"]:
            at = f"{where}, node {nid}"
            if c not in nodes:
                raise TraceFormatError(f"{at}: field 'children' names node {c}, which is not in the tree")
            if c == 0 or c in parent_of:
                other = "node 0 is the root" if c == 0 else f"node {parent_of[c]} lists it too"
                raise TraceFormatError(f"{at}: field 'children' names node {c} but {other}")
            if nodes[c]["start"] <= node["end"]:
                raise TraceFormatError(f"{where}, node {c}: field 'start' ({nodes[c]['start']}) must be after "
                                       f"its parent node {nid}'s 'end' ({node['end']})")
            parent_of[c] = nid
    unreached = set(nodes) - set(trace_preorder(nodes))
    if unreached:
        raise TraceFormatError(f"{where}: nodes {sorted(unreached)[:10]} are not reachable from node 0 "
                               f"through 'children'")
    return nodes
