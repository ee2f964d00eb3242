"""The ``torch`` backend: executes any TreePlan with PyTorch ops (chunk by chunk, fp32 math).

It follows the plan exactly like the kernels do (partial (O, LSE) per entry, then the
per-query merge), so it checks planners on any machine and serves CPU runs.
"""
from __future__ import annotations

import numpy as np
import torch

from treedec.attention.merge import merge_states
from treedec.attention.tree_plan import MASK_BITS, TreePlan


def run_plan_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: TreePlan,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree attention by executing ``plan``.

    Parameters
    ----------
    q : [Q, Hq, D]
    k_cache, v_cache : [num_pages, page_size, Hkv, D]
    plan : TreePlan (numpy arrays)

    Returns
    -------
    out : [Q, Hq, D] float32, lse : [Q, Hq] float32 (natural log)
    """
    num_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    k_flat = k_cache.reshape(-1, hkv, d)
    v_flat = v_cache.reshape(-1, hkv, d)
    o_parts = torch.empty(plan.num_entries, hq, d, dtype=torch.float32, device=q.device)
    lse_parts = torch.empty(plan.num_entries, hq, dtype=torch.float32, device=q.device)
    bit = torch.arange(MASK_BITS, device=q.device, dtype=torch.int32)
    for c in range(plan.num_chunks):
        t0, t1 = plan.chunk_kv_start[c], plan.chunk_kv_start[c + 1]
        e0, e1 = plan.chunk_entry_start[c], plan.chunk_entry_start[c + 1]
        if e0 == e1:
            continue
        slots = torch.tensor(plan.kv_slots[t0:t1], device=q.device)   # a copy: plan arrays are read-only
        k = k_flat[slots].float()                                              # [L, Hkv, D]
        v = v_flat[slots].float()
        rows = torch.tensor(plan.entry_query[e0:e1], device=q.device)
        qg = q[rows].float().view(-1, hkv, group, d)                           # [g, Hkv, G, D]
        scores = torch.einsum("gkjd,lkd->gkjl", qg, k) * sm_scale
        words = torch.from_numpy(np.ascontiguousarray(plan.entry_mask[e0:e1])).to(q.device)
        reads = ((words[:, :, None] >> bit) & 1).reshape(len(rows), -1)[:, : t1 - t0].bool()
        scores = scores.masked_fill(~reads[:, None, None, :], float("-inf"))
        m = scores.amax(dim=-1, keepdim=True)
        p = torch.exp(scores - m)
        s = p.sum(dim=-1, keepdim=True)
        o = torch.einsum("gkjl,lkd->gkjd", p, v) / s
        o_parts[e0:e1] = o.reshape(-1, hq, d)
        lse_parts[e0:e1] = (m + torch.log(s)).reshape(-1, hq)
    return merge_states(
        o_parts, lse_parts,
        torch.from_numpy(plan.query_entry_start).to(q.device),
        torch.from_numpy(plan.query_entries).to(q.device),
    )
