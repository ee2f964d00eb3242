"""Random trees for tests: built through SequenceTree so slots are really paged."""
from __future__ import annotations

import numpy as np
import torch

from hypothesis.stateful import RuleBasedStateMachine, invariant

from treedec.attention import AttentionVariant, reference_tree_attention
from treedec.attention.torch_executor import run_plan_torch
from treedec.tree import PagedKVPool, SequenceTree


def random_forest(rng: np.random.Generator, page_size: int, num_kv_heads: int = 2, head_dim: int = 64,
                  dtype=torch.float32, max_requests: int = 3, max_nodes: int = 12) -> SequenceTree:
    """A forest of 1..max_requests trees with one pending step.

    Node lengths are random (1..40, prompts up to 90); some leaves get a pending decode
    token, some requests a pending speculative token tree, some branches stay paused
    (no query below them). Pool K/V are random normal.
    """
    pool = PagedKVPool(num_pages=4096 // page_size + 64, page_size=page_size, num_layers=1,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    tree = SequenceTree(pool)
    roots = [tree.add_prompt(rng.integers(0, 1000, rng.integers(1, 90))) for _ in range(rng.integers(1, max_requests + 1))]
    nodes = list(roots)
    for _ in range(rng.integers(0, max_nodes)):
        parent = nodes[rng.integers(len(nodes))]
        if rng.random() < 0.3 and not tree.children(parent):
            tree.extend(parent, rng.integers(0, 1000, rng.integers(1, 30)))
        else:
            nodes += tree.branch(parent, [rng.integers(0, 1000, rng.integers(1, 40))])
    tree.commit_step()
    leaves = [n for n in nodes if not tree.children(n)]
    for leaf in leaves:
        kind = rng.random()
        if kind < 0.5:
            tree.extend(leaf, [int(rng.integers(1000))])
        elif kind < 0.75:
            m = int(rng.integers(1, 12))
            tree.add_token_tree(leaf, rng.integers(0, 1000, m), [int(rng.integers(-1, i)) for i in range(m)])
        else:
            tree.pause(leaf)
    if not len(tree.pending_tokens()):
        tree.extend(leaves[0], [7])
    pool.k.normal_(generator=torch.Generator().manual_seed(int(rng.integers(2**31))))
    pool.v.normal_(generator=torch.Generator().manual_seed(int(rng.integers(2**31))))
    return tree


def poison_free_slots(tree: SequenceTree) -> None:
    """NaN in every pool slot that no tree token owns: reading one would show in the output."""
    used = torch.tensor(tree.layout().kv_slots)   # a copy: layout arrays are read-only
    for cache in (tree.pool.k, tree.pool.v):
        flat = cache.view(-1, cache.shape[-2], cache.shape[-1])
        keep = flat[used].clone()
        flat.fill_(float("nan"))
        flat[used] = keep


def check_against_references(out, lse, plan, q, k_cache, v_cache, tol, variant=AttentionVariant()):
    ref, ref_lse = reference_tree_attention(q, k_cache, v_cache, plan.layout, variant)
    via_plan, _ = run_plan_torch(q, k_cache, v_cache, plan, variant)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:2] and lse.dtype == torch.float32
    assert torch.isfinite(out.float()).all()
    assert rel_error(out, ref) < tol, f"{rel_error(out, ref)=}"
    assert rel_error(out, via_plan) < tol, f"{rel_error(out, via_plan)=}"
    assert torch.allclose(lse, ref_lse, atol=2e-3, rtol=1e-4), f"{(lse - ref_lse).abs().max()=}"


def path_slots(tree: SequenceTree, node: int, offset: int) -> np.ndarray:
    """Slots a query token reads, from the tree's own path API (independent of layouts)."""
    path = tree.path(node)
    parts = [tree.slots(n) for n in path[:-1]] + [tree.slots(node)[: offset + 1]]
    return np.concatenate(parts)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.linalg.norm((out.float() - ref.float()).flatten()) / torch.linalg.norm(ref.float().flatten()))


def run_on_random_q(runner, tree: SequenceTree, plan, group: int, dtype, device, seed: int = 0,
                    variant=AttentionVariant(), **kwargs):
    """``runner`` (run_plan_triton / run_plan_cuda) on seeded random q for ``plan`` over ``tree``'s layer 0, with
    ``variant``.

    Returns ``(out, lse, plan, q, k_cache, v_cache)``, what :func:`check_against_references` takes.
    """
    k_cache, v_cache = (c.to(device) for c in tree.pool.layer(0))
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    q = torch.randn(plan.num_queries, hkv * group, d, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)
    out, lse = runner(q, k_cache, v_cache, plan.to(device), variant, **kwargs)
    return out, lse, plan, q, k_cache, v_cache


class ConsistentTreeMachine(RuleBasedStateMachine):
    """A hypothesis state machine over ``self.tree``: its invariants hold after every step, and
    pruning every request at the end frees every page."""

    tree: SequenceTree

    @invariant()
    def consistent(self):
        self.tree.check_invariants()

    def teardown(self):
        self.tree.commit_step()
        for root in self.tree.roots:
            self.tree.prune(root)
        assert self.tree.pool.num_free_pages == self.tree.pool.num_pages, "pages leaked"
        assert not self.tree.pool.refcount.any()
