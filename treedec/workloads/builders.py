"""Replay schedules from the shipped workloads (workloads/README.md) and the few-shot setting.

Every builder puts the prompt's prefill in step 0 and one decode iteration in each later
step, and ends with a step that prunes everything (so a replay frees every KV page).

- :func:`tot_schedule`: a ToT-BFS trace (``reasoning/*.json``). At iteration ``it`` the
  nodes that start generating (``start == it``) are created under their parents
  (``branch``), every live node (``start <= it <= end``) grows by one token (``extend``),
  and nodes that are no longer an ancestor-or-self of a live or yet-to-start node are
  evicted (``prune``). Nodes with no tokens (``value == 0``) are created only where a
  live descendant needs them.
- :func:`medusa_schedule`: a Medusa record (``speculative/tree_size{N}.json``). Each step
  hangs the full token tree (``Tree_Structure``) under the sequence, verifies it in one
  forward, and the next step keeps ``Accept_length + 1`` tokens on the accepted path
  (``accept``: the rest is freed, the path's K/V moved onto the sequence). The record has
  only the lengths, so the accepted path of length a is the smallest index path of depth
  a and its prefixes (the first-candidate chain ``[0], [0, 0], ...`` where the tree has it).
  The shipped records were made with a deeper tree than the shipped ``Tree_Structure``
  (accept lengths up to 5, trees of depth 4): a length past the tree's depth is clamped
  to it, and the count of clamped steps is in the schedule's ``meta``.
- :func:`fewshot_schedule`: a prompt of P tokens, b branches, n iterations of one token
  per branch (the DeFT paper's few-shot setting: P = 4000, b = 20/30/50, n = 400).
"""
from __future__ import annotations

from pathlib import Path

from treedec.checks import nonnegative_int, positive_int
from treedec.workloads.deft import DEFT_DIR, TraceFormatError, load_json, load_tot_trees, medusa_tree, trace_preorder
from treedec.workloads.schedule import (DEFAULT_MAX_TREE_TOKENS, Accept, Branch, Extend, Prompt, Prune, Schedule,
                                        TokenTree, load_schedule)

#: ``treedec replay`` workload names -> what they build.
TOT_FILES = {"tot-docmerge": "docmergeToT.json", "tot-keyword": "keywordToT.json",
             "tot-sorting": "sorting128ToT.json"}
MEDUSA_SIZES = (32, 64, 96, 128, 256)
WORKLOADS = (*TOT_FILES, *(f"medusa-{n}" for n in MEDUSA_SIZES), "fewshot")

#: Characters per token used to size a Medusa record's prompt (the records hold text, no tokenizer here).
CHARS_PER_TOKEN = 4


def tot_schedule(path: str | Path, tree_index: int | None = None) -> Schedule:
    """The schedule of one tree of a ToT-BFS file.

    Parameters
    ----------
    path:
        A ``reasoning/*.json`` file.
    tree_index:
        Index of the tree in the file; default the first tree not marked ``incompleted``.
        Node handles are the trace's node ids (ints).
    """
    path = Path(path)
    trees = load_tot_trees(path)
    if tree_index is None:
        raw = load_json(path)
        tree_index = next((i for i, t in enumerate(raw) if trees[i] and not t.get("incompleted", False)), None)
        if tree_index is None:
            raise TraceFormatError(f"{path}: no tree is complete; pass tree_index")
    if not isinstance(tree_index, int) or not 0 <= tree_index < len(trees):
        raise IndexError(f"tree_index must be in [0, {len(trees)}) for {path}, got {tree_index!r}")
    nodes = trees[tree_index]
    if not nodes:
        raise TraceFormatError(f"{path}: tree {tree_index} has no nodes (an 'incompleted' run)")
    parent_of = {c: i for i, n in nodes.items() for c in n["children"]}
    lineage = {}  # node -> itself and its ancestors, the node first
    for nid in nodes:
        chain, x = [], nid
        while x is not None:
            chain.append(x)
            x = parent_of.get(x)
        lineage[nid] = chain
    order = {nid: k for k, nid in enumerate(trace_preorder(nodes))}
    thoughts = [i for i, n in nodes.items() if i != 0 and n["value"] > 0]
    last = max((nodes[i]["end"] for i in thoughts), default=0)

    steps = [(Prompt(0, nodes[0]["value"]),)]
    exists = {0}
    for it in range(1, last + 1):
        live = sorted((i for i in thoughts if nodes[i]["start"] <= it <= nodes[i]["end"]), key=order.get)
        keep = {a for i in thoughts if nodes[i]["end"] >= it for a in lineage[i]}
        ops = [Prune(i) for i in sorted(exists - keep, key=order.get) if parent_of.get(i) in keep]
        exists &= keep
        new: dict[int, list[int]] = {}
        for i in sorted({a for i in live for a in lineage[i]} - exists, key=order.get):
            new.setdefault(parent_of[i], []).append(i)
        ops += [Branch(p, tuple(ids)) for p, ids in new.items()]
        exists |= {i for ids in new.values() for i in ids}
        ops += [Extend(i, 1) for i in live]
        steps.append(tuple(ops))
    steps.append((Prune(0),))
    return Schedule.from_steps(steps, name=f"tot-{path.stem}-tree{tree_index}", source=f"{path}#tree{tree_index}",
                               meta={"kind": "tot", "file": str(path), "tree_index": tree_index,
                                     "prompt_tokens": nodes[0]["value"], "iterations": last})


def medusa_schedule(path_or_size: str | Path | int, record: int = 0, prompt_tokens: int | None = None) -> Schedule:
    """The schedule of one record of a Medusa file.

    Parameters
    ----------
    path_or_size:
        A ``tree_size{N}.json`` path, or N for the shipped file.
    record:
        Index into ``Records``.
    prompt_tokens:
        Prompt length; default the record's prompt text length / :data:`CHARS_PER_TOKEN`.
    """
    tree = medusa_tree(path_or_size)
    data = load_json(Path(tree.source))
    records = data.get("Records")
    if not isinstance(records, list) or not records:
        raise TraceFormatError(f"{tree.source}: field 'Records' must be a non-empty list")
    if not isinstance(record, int) or not 0 <= record < len(records):
        raise IndexError(f"record must be in [0, {len(records)}) for {tree.source}, got {record!r}")
    where = f"{tree.source}: record {record}"
    rec = records[record]
    if not isinstance(rec, dict):
        raise TraceFormatError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    accepts = rec.get("Accept_length")
    if not isinstance(accepts, list) or not accepts:
        raise TraceFormatError(f"{where}: field 'Accept_length' must be a non-empty list of ints, got {accepts!r:.60}")
    index = {p: k + 1 for k, p in enumerate(tree.paths)}
    first_of_depth = {}  # depth -> the smallest path of that depth (paths are sorted by (len, path))
    for p in tree.paths:
        first_of_depth.setdefault(len(p), p)
    for k, a in enumerate(accepts):
        nonnegative_int(f"{where}: field 'Accept_length[{k}]'", a, error=TraceFormatError)
    depth = max(first_of_depth)
    clamped = sum(a > depth for a in accepts)
    accepts = [min(a, depth) for a in accepts]
    if prompt_tokens is None:
        turns = rec.get("prompt")
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise TraceFormatError(f"{where}: field 'prompt' must be a list of strings, got {turns!r:.60}")
        prompt_tokens = max(1, sum(map(len, turns)) // CHARS_PER_TOKEN)
    parents = tuple(int(p) for p in tree.parents)
    steps = [(Prompt("seq", prompt_tokens),)]
    accepted = None
    for k, a in enumerate(accepts):
        ids = tuple(f"t{k}.{i}" for i in range(tree.size))
        steps.append(((Accept(accepted),) if accepted else ()) + (TokenTree("seq", parents, ids),))
        path = first_of_depth.get(a, ())
        accepted = tuple(ids[0 if d == 0 else index[path[:d]]] for d in range(a + 1))
    steps.append((Accept(accepted), Prune("seq")))
    return Schedule.from_steps(steps, name=f"medusa-{tree.size}-record{record}", source=f"{tree.source}#record{record}",
                               meta={"kind": "medusa", "file": tree.source, "record": record,
                                     "token_tree_size": tree.size, "prompt_tokens": prompt_tokens,
                                     "iterations": len(accepts), "accepted_tokens": sum(accepts) + len(accepts),
                                     "accept_lengths_clamped_to_depth": clamped})


def fewshot_schedule(prompt_tokens: int = 4000, branches: int = 20, iterations: int = 400,
                     max_tree_tokens: int = DEFAULT_MAX_TREE_TOKENS) -> Schedule:
    """A prompt of ``prompt_tokens`` tokens, ``branches`` branches, ``iterations`` tokens per branch.

    The schedule holds ``prompt_tokens + branches * iterations`` tokens at its peak; more
    than ``max_tree_tokens`` raises ValueError before any op is built.
    """
    for name, value in (("prompt_tokens", prompt_tokens), ("branches", branches), ("iterations", iterations),
                        ("max_tree_tokens", max_tree_tokens)):
        positive_int(name, value)
    peak = prompt_tokens + branches * iterations
    if peak > max_tree_tokens:
        raise ValueError(f"a few-shot schedule of prompt_tokens={prompt_tokens}, branches={branches}, "
                         f"iterations={iterations} holds {peak} tokens, more than max_tree_tokens={max_tree_tokens}")
    ids = tuple(f"b{i}" for i in range(branches))
    grow = tuple(Extend(b, 1) for b in ids)
    steps = [(Prompt("prompt", prompt_tokens),), (Branch("prompt", ids),) + grow]
    steps += [grow] * (iterations - 1)
    steps.append((Prune("prompt"),))
    return Schedule.from_steps(steps, name=f"fewshot-p{prompt_tokens}-b{branches}", source="fewshot",
                               meta={"kind": "fewshot", "prompt_tokens": prompt_tokens, "branches": branches,
                                     "iterations": iterations})


def workload_schedule(workload: str, iterations: int | None = None, tree_index: int | None = None, record: int = 0,
                      prompt_tokens: int | None = None, branches: int = 20) -> Schedule:
    """A schedule by ``treedec replay`` name (:data:`WORKLOADS`) or from a schedule JSON file.

    ``iterations`` keeps step 0 (the prompt) and the ``iterations`` steps after it, then
    prunes what is left. The other arguments go to the builder of that family.
    """
    if iterations is not None:
        positive_int("iterations", iterations)
    if workload in TOT_FILES:
        schedule = tot_schedule(DEFT_DIR / "reasoning" / TOT_FILES[workload], tree_index)
    elif workload.startswith("medusa-") and workload.removeprefix("medusa-").isdigit():
        schedule = medusa_schedule(int(workload.removeprefix("medusa-")), record, prompt_tokens)
    elif workload == "fewshot":
        return fewshot_schedule(prompt_tokens or 4000, branches, iterations or 400)
    elif Path(workload).is_file():
        schedule = load_schedule(workload)
    else:
        raise ValueError(f"workload must be one of {list(WORKLOADS)} or a schedule JSON file, got {workload!r}")
    return schedule if iterations is None else schedule.truncated(iterations + 1)

