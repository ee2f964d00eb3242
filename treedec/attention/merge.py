"""merge_states: combine partial attention states (O, LSE) per query, in a fixed order."""
from __future__ import annotations

import torch


def merge_states(
    o_parts: torch.Tensor,
    lse_parts: torch.Tensor,
    query_entry_start: torch.Tensor,
    query_entries: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge each query's partials (natural-log LSE), in CSR order, with fp32 math.

    Parameters
    ----------
    o_parts : [E, H, D] float32
        Partial outputs, each normalised over its own keys.
    lse_parts : [E, H] float32
        Their log-sum-exp of scaled scores.
    query_entry_start : [Q + 1] int, query_entries : [E] int
        Query q's partials are ``query_entries[query_entry_start[q]:query_entry_start[q + 1]]``.

    Returns
    -------
    out : [Q, H, D] float32, lse : [Q, H] float32
    """
    start = query_entry_start.long()
    counts = start[1:] - start[:-1]
    width = int(counts.max())
    cols = torch.arange(width, device=start.device)
    valid = cols[None, :] < counts[:, None]                                   # [Q, P]
    gather = torch.where(valid, start[:-1, None] + cols[None, :], start[:-1, None])
    idx = query_entries.long()[gather]                                        # [Q, P]
    lse = torch.where(valid[..., None], lse_parts.float()[idx], float("-inf"))  # [Q, P, H]
    m = lse.max(dim=1).values
    w = torch.exp(lse - m[:, None, :])
    s = w.sum(dim=1)
    out = (w[..., None] * o_parts.float()[idx]).sum(dim=1) / s[..., None]
    return out, m + torch.log(s)
