import torch

from treedec.attention import merge_states


def partial_state(q, k, v):
    """(O, LSE) of q [H, D] over keys k, v [T, H, D]."""
    s = torch.einsum("hd,thd->ht", q, k)
    return torch.einsum("ht,thd->hd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


def test_merging_partials_equals_attention_over_the_union():
    torch.manual_seed(0)
    q = torch.randn(2, 3, 16)
    k, v = torch.randn(30, 3, 16), torch.randn(30, 3, 16)
    # query 0 reads keys 0:30 in three partials, query 1 reads 10:20 in one
    parts = [partial_state(q[0], k[a:b], v[a:b]) for a, b in [(0, 7), (7, 25), (25, 30)]]
    parts.insert(1, partial_state(q[1], k[10:20], v[10:20]))
    o = torch.stack([p[0] for p in parts])
    lse = torch.stack([p[1] for p in parts])
    out, out_lse = merge_states(o, lse, torch.tensor([0, 3, 4]), torch.tensor([0, 2, 3, 1]))
    for i, (a, b) in enumerate([(0, 30), (10, 20)]):
        ref, ref_lse = partial_state(q[i], k[a:b], v[a:b])
        assert torch.allclose(out[i], ref, atol=1e-6) and torch.allclose(out_lse[i], ref_lse, atol=1e-6)
