"""The shapes beyond trees of BENCH.md section 2, as workloads of bench/attention.py.

Three families, each a dict of named workloads built like the suite's (bench/suite.py: a
bookkeeping-only pool, every node on fresh pages, pending tokens are the queries):

- ``unshared``: b independent sequences, one query each (its last token), ragged lengths;
  ``unshared_b{b}_{mean}``: b = 1..128, lengths uniform in [mean / 2, 3 mean / 2] (the 96k
  rows: 64k-128k), and ``unshared_b64_mixed``: log-uniform over 1k-128k.
- ``long``: one sequence, one query: ``long_32k``, ``long_64k``, ``long_128k``.
- ``forest``: many requests, each its own tree: a prompt (ragged) with a Medusa-64 token tree
  under it (all its tokens queries), or a ToT frontier (a chain of thoughts, then ``width``
  frontier thoughts, one query each).

Lengths are drawn from a generator seeded by the workload's name, so a name is one shape.
``scale`` shrinks every token count as in the suite (not the number of sequences or the Medusa
topology).
"""
from __future__ import annotations

import zlib
from typing import Callable

import numpy as np

from bench.suite import SUITE, Workload, bookkeeping_pool, build_layout, scaled, token_ids
from treedec import SequenceTree, TreeLayout
from treedec.workloads import medusa_tree

K = 1024


def unshared_batch(name: str, lengths, page_size: int = 16, scale: float = 1.0) -> Workload:
    """``len(lengths)`` independent sequences of the given lengths; one query per sequence (its last token)."""
    lengths = [max(2, scaled(int(n), scale)) for n in lengths]  # a committed token and the query
    layout, num_pages = build_layout([-1] * len(lengths), lengths, range(len(lengths)), page_size)
    return Workload(name, f"{len(lengths)} unshared sequences of {min(lengths)}-{max(lengths)} tokens "
                          f"({sum(lengths)} in all); query = last token of each", layout, num_pages, page_size)


def medusa_forest(name: str, prompts, tree_size: int = 64, page_size: int = 16, scale: float = 1.0) -> Workload:
    """One request per prompt length: the prompt with its own Medusa ``tree_size`` token tree; all tree tokens are queries."""
    medusa = medusa_tree(tree_size)
    prompts = [scaled(int(n), scale) for n in prompts]
    pool = bookkeeping_pool(page_size, [n for prompt in prompts for n in (prompt, medusa.size)])
    tree = SequenceTree(pool)
    roots = [tree.add_prompt(token_ids(prompt)) for prompt in prompts]
    tree.commit_step()
    for root in roots:  # the requests' token trees, pending: every tree token is a query
        tree.add_token_tree(root, token_ids(medusa.size), medusa.parents)
    layout, num_pages = tree.layout(), pool.num_pages
    return Workload(name, f"{len(prompts)} requests, each a {min(prompts)}-{max(prompts)}-token prompt + its own "
                          f"Medusa tree_size{tree_size} token tree (all tree tokens are queries)",
                    layout, num_pages, page_size)


def tot_forest(name: str, prompts, depth: int, thought: int, width: int, frontier: int, page_size: int = 16,
               scale: float = 1.0) -> Workload:
    """One ToT request per prompt length: a chain of ``depth`` thoughts, ``width`` frontier thoughts, a query each."""
    prompts = [scaled(int(n), scale) for n in prompts]
    thought, frontier = scaled(thought, scale), scaled(frontier, scale)
    parents, lengths, queries = [], [], []
    for prompt in prompts:
        base = len(parents)
        parents += [-1] + [base + i for i in range(depth)] + [base + depth] * width
        lengths += [prompt] + [thought] * depth + [frontier] * width
        queries += range(base + depth + 1, base + depth + 1 + width)
    layout, num_pages = build_layout(parents, lengths, queries, page_size)
    return Workload(name, f"{len(prompts)} ToT requests, each a {min(prompts)}-{max(prompts)}-token prompt, "
                          f"{depth} thoughts of {thought} tokens and {width} frontier thoughts of {frontier} "
                          f"(query = last token of each)", layout, num_pages, page_size)


def ragged_lengths(name: str, count: int, low: int, high: int, log: bool = False) -> list[int]:
    """``count`` lengths in [low, high] (uniform, or log-uniform), from a generator seeded by ``name``."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if log:
        return np.exp(rng.uniform(np.log(low), np.log(high), count)).astype(np.int64).tolist()
    return rng.integers(low, high + 1, count).tolist()


def _unshared(b: int, mean: str) -> tuple[str, Callable[..., Workload]]:
    name = f"unshared_b{b}_{mean}"
    if mean == "mixed":
        lengths = ragged_lengths(name, b, 1 * K, 128 * K, log=True)
    else:
        m = int(mean[:-1]) * K
        lengths = ragged_lengths(name, b, m // 2, min(m * 3 // 2, 128 * K)) if m < 96 * K \
            else ragged_lengths(name, b, 64 * K, 128 * K)
    return name, lambda **kw: unshared_batch(name, lengths, **kw)


def _long(tokens: int) -> tuple[str, Callable[..., Workload]]:
    name = f"long_{tokens // K}k"
    return name, lambda **kw: unshared_batch(name, [tokens], **kw)


def _medusa_forest(requests: int, mean: int) -> tuple[str, Callable[..., Workload]]:
    name = f"forest_medusa64_r{requests}_p{mean // K}k"
    prompts = ragged_lengths(name, requests, mean // 2, mean * 3 // 2)
    return name, lambda **kw: medusa_forest(name, prompts, **kw)


def _tot_forest(requests: int) -> tuple[str, Callable[..., Workload]]:
    name = f"forest_tot_r{requests}"
    prompts = ragged_lengths(name, requests, 500, 1500)
    return name, lambda **kw: tot_forest(name, prompts, depth=3, thought=200, width=5, frontier=100, **kw)


#: family -> {workload name -> builder(page_size=16, scale=1.0)}
FAMILIES: dict[str, dict[str, Callable[..., Workload]]] = {
    "unshared": dict([_unshared(b, m) for m in ("2k", "16k") for b in (1, 8, 32, 128)]
                     + [_unshared(b, "96k") for b in (1, 4, 16)] + [_unshared(64, "mixed")]),
    "long": dict(_long(n) for n in (32 * K, 64 * K, 128 * K)),
    "forest": dict([_medusa_forest(r, 2 * K) for r in (8, 32)] + [_medusa_forest(8, 8 * K)]
                   + [_tot_forest(r) for r in (16, 64)]),
}

#: the peers each family runs unless --peers names others (the suite: every peer)
FAMILY_PEERS: dict[str, tuple[str, ...]] = {
    "unshared": ("flashinfer_batch_decode",),
    "long": ("flashinfer_batch_decode",),
    "forest": ("flashinfer_custom_mask", "flashinfer_per_path_decode"),
}

#: every workload bench/attention.py can run: the suite's, then the families'
WORKLOADS: dict[str, Callable[..., Workload]] = {**SUITE, **{n: b for f in FAMILIES.values() for n, b in f.items()}}


def family_of(name: str) -> str:
    """``"suite"`` or the family of workload ``name``."""
    if name in SUITE:
        return "suite"
    for family, workloads in FAMILIES.items():
        if name in workloads:
            return family
    raise ValueError(f"unknown workload {name!r}; the suite: {list(SUITE)}, the families: "
                     f"{ {f: list(w) for f, w in FAMILIES.items()} }")


def tokens_read(layout: TreeLayout) -> int:
    """Sum over queries of the tokens each reads (its path's tokens): the ones of ``dense_tree_mask``."""
    return int((layout.query_position + 1).sum())
