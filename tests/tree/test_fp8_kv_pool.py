"""An fp8 (e4m3) KV pool (tree/paged_kv_pool.py, tree/kv_cache_dtype.py): stored K/V read back as the de-quantized
values within e4m3's round-trip bound, per-layer and per-head scales, saturation, the one store path (the pool's and
the custom op's), slot copies and the tree's page moves of the stored bytes, and twice the tokens in the same bytes."""
import numpy as np
import pytest
import torch

from treedec.attention import store_kv  # noqa: F401  (registers torch.ops.treedec.store_kv)
from treedec.tree import PagedKVPool, SequenceTree
from treedec.tree.kv_cache_dtype import (FP8_E4M3, FP8_E4M3_MAX, dequantize_kv, fp8_round_trip_bound, kv_storage_dtype,
                                         quantize_kv)


def fp8_pool(num_pages=16, page_size=4, layers=2, heads=2, head_dim=64, **kwargs):
    return PagedKVPool(num_pages, page_size, layers, heads, head_dim, dtype=torch.float32, kv_dtype="fp8", **kwargs)


def test_kv_cache_dtype_names_are_vllm_s():
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype(None, torch.float16) == torch.float16
    assert kv_storage_dtype("fp8", torch.bfloat16) == FP8_E4M3 == kv_storage_dtype("fp8_e4m3", torch.float32)
    for bad in ("fp8_e5m2", "int8", 8):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of \\['auto', 'fp8', 'fp8_e4m3'\\]"):
            kv_storage_dtype(bad, torch.float32)


@pytest.mark.parametrize("scale", [1.0, 0.01, 3.0])
def test_round_trip_within_e4m3_bound_and_saturates(scale):
    x = torch.randn(200, 2, 64, generator=torch.Generator().manual_seed(0)) * 4
    s = torch.full((2,), scale)
    back = dequantize_kv(quantize_kv(x, s), s)
    inside = (x / scale).abs() <= FP8_E4M3_MAX
    err = (back - x).abs()
    assert (err[inside] <= fp8_round_trip_bound(x, s)[inside]).all(), f"{(err - fp8_round_trip_bound(x, s)).max()=}"
    assert (back[~inside].abs() == FP8_E4M3_MAX * scale).all()   # saturated, never inf or NaN
    assert torch.isfinite(dequantize_kv(quantize_kv(x * 1e6, s), s)).all()


def test_stored_kv_read_back_as_the_dequantized_values_with_per_head_scales():
    pool = fp8_pool()
    assert pool.k.dtype == FP8_E4M3 and pool.kv_dtype == FP8_E4M3 and pool.kv_scale.shape == (2, 2, 2)
    pool.set_kv_scales(torch.tensor([[0.5, 2.0], [1.0, 0.25]]), [0.1, 3.0])   # K per head, V per layer
    assert pool.layer_scale(1).tolist() == [[1.0, 0.25], [3.0, 3.0]]
    slots = pool.allocate_slots(7)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(7, 2, 64, generator=g) * 3, torch.randn(7, 2, 64, generator=g)
    for layer in range(2):
        pool.write(layer, slots, k * (layer + 1), v)
    gk, gv = pool.gather(slots)
    assert gk.dtype == torch.float32 and gk.shape == (2, 7, 2, 64)
    for layer in range(2):
        ks, vs = pool.layer_scale(layer)
        assert torch.equal(gk[layer], dequantize_kv(quantize_kv(k * (layer + 1), ks), ks))
        assert torch.equal(gv[layer], dequantize_kv(quantize_kv(v, vs), vs))
        assert ((gk[layer] - k * (layer + 1)).abs() <= fp8_round_trip_bound(k * (layer + 1), ks)).all()


def test_the_pool_s_store_and_the_custom_op_store_the_same_bytes():
    a, b = fp8_pool(), fp8_pool()
    for pool in (a, b):
        pool.set_kv_scales(0.5, 0.25)
    slots = torch.tensor([3, 9, 4], dtype=torch.int64)
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    a.store(1, slots, k, v)
    torch.ops.treedec.store_kv(b.k_slots[1], b.v_slots[1], slots, k, v, b.layer_scale(1))
    assert torch.equal(a.k.view(torch.uint8), b.k.view(torch.uint8))
    assert torch.equal(a.v.view(torch.uint8), b.v.view(torch.uint8))
    assert a.k.view(torch.uint8)[0].count_nonzero() == 0   # layer 0 untouched


def test_copy_slots_moves_the_stored_bytes():
    pool = fp8_pool(num_pages=32)
    slots = pool.allocate_slots(10)
    for layer in range(2):
        pool.write(layer, slots, torch.randn(10, 2, 64), torch.randn(10, 2, 64))
    before = [t.view(torch.uint8)[:, slots // 4, slots % 4].clone() for t in (pool.k, pool.v)]
    dst = pool.allocate_slots(10)
    pool.copy_slots(slots, dst)
    for t, old in zip((pool.k, pool.v), before):
        assert torch.equal(t.view(torch.uint8)[:, dst // 4, dst % 4], old)


def test_an_accepted_draft_path_keeps_its_fp8_kv():
    pool = fp8_pool(num_pages=32)
    pool.set_kv_scales(0.5, 2.0)
    tree = SequenceTree(pool)
    root = tree.add_prompt(list(range(10)))
    tree.commit_step()
    nodes = tree.add_token_tree(root, [11, 12, 13], [-1, 0, 1])
    tree.commit_step()
    drafted = np.concatenate([tree.slots(n) for n in nodes])
    for layer in range(2):
        pool.write(layer, drafted, torch.randn(3, 2, 64), torch.randn(3, 2, 64))
    expected = pool.gather(drafted)
    tree.accept(root, nodes)
    tree.check_invariants()
    after = pool.gather(tree.slots(root)[-3:])
    assert all(torch.equal(x, y) for x, y in zip(after, expected))


def test_twice_the_tokens_in_the_same_bytes():
    bf16 = PagedKVPool(8, 16, 4, 8, 128, dtype=torch.bfloat16, allocate_storage=False)
    fp8 = PagedKVPool(8, 16, 4, 8, 128, dtype=torch.bfloat16, kv_dtype="fp8", allocate_storage=False)
    assert bf16.bytes_per_token / fp8.bytes_per_token == 2.0
    pool = fp8_pool(num_pages=4)
    assert sum(t.numel() * t.element_size() for t in pool._storage) == (4 + 0) * 4 * pool.bytes_per_token


def test_bad_scales_are_refused_and_change_nothing():
    pool = fp8_pool()
    for k_scale, message in [(torch.ones(3), "k_scale must be a number, \\[2\\] or \\[2, 2\\]"),
                             (torch.ones(2, 3), "k_scale must be a number"), (0.0, "k_scale must be finite and > 0"),
                             (float("nan"), "finite"), (-1.0, "finite")]:
        with pytest.raises(ValueError, match=message):
            pool.set_kv_scales(k_scale, 1.0)
    assert (pool.kv_scale == 1).all()
    with pytest.raises(ValueError, match="takes no scales"):
        PagedKVPool(4, 4, dtype=torch.float32).set_kv_scales(1.0, 1.0)
    assert PagedKVPool(4, 4, dtype=torch.float32).layer_scale(0) is None
