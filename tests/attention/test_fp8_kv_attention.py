"""Tree attention over fp8 (e4m3) K/V caches (AttentionVariant.kv_dtype): every backend reading the stored e4m3 values
with the layer's per-head scales equals the fp32 reference over the de-quantized K/V (the torch and reference backends
exactly up to rounding; the triton kernel, under the interpreter on the CPU, within its bf16/fp16 tolerance), soft-cap
included; fp8 caches without scales, or scales beside caches of q's dtype, are refused."""
import dataclasses

import numpy as np
import pytest
import torch

from tests.trees import random_forest, rel_error
from treedec import PlanConfig, TreeAttention
from treedec.attention import AttentionVariant, make_plan, reference_tree_attention
from treedec.attention.torch_executor import run_plan_torch
from treedec.tree import PagedKVPool
from treedec.tree.kv_cache_dtype import dequantize_kv, quantize_kv

FP8 = AttentionVariant(kv_dtype="fp8")


def fp8_caches(tree, scale):
    """The tree's layer-0 caches (fp32) stored as e4m3 with ``scale`` [2, Hkv], and the de-quantized fp32 caches."""
    k, v = tree.pool.layer(0)
    shape = k.shape
    stored = [quantize_kv(c.reshape(-1, *shape[2:]), scale[i]).view(shape) for i, c in enumerate((k, v))]
    back = [dequantize_kv(c.reshape(-1, *shape[2:]), scale[i]).view(shape) for i, c in enumerate(stored)]
    return stored, back


def case(seed, page_size=4, hkv=2, head_dim=64, max_nodes=6):
    rng = np.random.default_rng(seed)
    tree = random_forest(rng, page_size, num_kv_heads=hkv, head_dim=head_dim, max_nodes=max_nodes)
    scale = torch.tensor([[0.02, 0.5][:hkv], [1.0, 0.01][:hkv]], dtype=torch.float32)   # per head, K and V
    return tree, scale


def test_variant_kv_dtype_names_and_kernel_key():
    assert FP8.kv_dtype == "fp8_e4m3" and FP8.fp8_kv and FP8.cache_dtype(torch.bfloat16) == torch.float8_e4m3fn
    assert FP8.kernel_key() == ("kv_fp8",) and FP8.mask_key() == AttentionVariant().mask_key()
    assert AttentionVariant(logit_softcap=30.0, kv_dtype="fp8_e4m3").kernel_key() == ("softcap", "kv_fp8")
    assert AttentionVariant.from_op_values(FP8.op_values()) == FP8
    with pytest.raises(ValueError, match="kv_dtype must be None"):
        AttentionVariant(kv_dtype="fp8_e5m2")


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("variant", [FP8, AttentionVariant(logit_softcap=5.0, kv_dtype="fp8")],
                         ids=["plain", "softcap"])
def test_torch_and_reference_read_fp8_as_the_dequantized_values(seed, variant):
    tree, scale = case(seed)
    (k8, v8), (kd, vd) = fp8_caches(tree, scale)
    plan = make_plan(tree.layout(), PlanConfig("flatten", 16, 4))
    q = torch.randn(plan.num_queries, 4, 64, generator=torch.Generator().manual_seed(seed))
    plain = dataclasses.replace(variant, kv_dtype=None)
    want, want_lse = reference_tree_attention(q, kd, vd, plan.layout, plain)
    got, got_lse = reference_tree_attention(q, k8, v8, plan.layout, variant, scale)
    assert torch.allclose(got, want, atol=1e-6) and torch.allclose(got_lse, want_lse, atol=1e-5)
    for form in ("chunks", "dense"):
        out, lse = run_plan_torch(q, k8, v8, plan, variant, form, kv_scale=scale)
        assert rel_error(out, want) < 1e-5 and torch.allclose(lse, want_lse, atol=1e-4), form


def test_tree_attention_checks_fp8_caches_and_scales():
    tree, scale = case(3)
    (k8, v8), _ = fp8_caches(tree, scale)
    attn = TreeAttention(4, 2, 64, backend="torch", variant=FP8, device="cpu", dtype=torch.float32)
    plan = attn.plan(tree)
    q = torch.randn(plan.plan.num_queries, 4, 64)
    out = attn.run(q, k8, v8, plan, kv_scale=scale)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    with pytest.raises(TypeError, match="an fp8 KV cache needs kv_scale"):
        attn.run(q, k8, v8, plan)
    with pytest.raises(ValueError, match="kv_scale must be a contiguous float32 tensor of shape \\[2, 2\\]"):
        attn.run(q, k8, v8, plan, kv_scale=scale[:, :1])
    k, v = tree.pool.layer(0)
    with pytest.raises(TypeError, match="differs from the variant's kv_dtype 'fp8_e4m3'"):
        attn.run(q, k, v, plan, kv_scale=scale)
    plain = TreeAttention(4, 2, 64, backend="torch", device="cpu", dtype=torch.float32)
    with pytest.raises(TypeError, match="an fp8 cache needs a TreeAttention whose variant has kv_dtype"):
        plain.run(q, k8, v8, plain.plan(tree))
    with pytest.raises(ValueError, match="kv_scale is for fp8 K/V caches"):
        plain.run(q, k, v, plain.plan(tree), kv_scale=scale)


def test_auto_never_picks_a_backend_without_fp8_kernels():
    from treedec.attention.backends import get_backend
    assert get_backend("cuda").why_not_variant(FP8) is None or "fp8" in get_backend("cuda").why_not_variant(FP8)
    assert get_backend("torch").why_not_variant(FP8) is None and get_backend("triton").why_not_variant(FP8) is None


TRITON_TOLERANCE = {torch.float16: 3e-3, torch.bfloat16: 1.2e-2}


@pytest.mark.triton
@pytest.mark.parametrize("seed,dtype,head_dim,variant", [
    (0, torch.bfloat16, 64, FP8), (1, torch.float16, 64, FP8),
    (2, torch.bfloat16, 128, AttentionVariant(logit_softcap=5.0, kv_dtype="fp8")),
])
def test_triton_reads_fp8_within_tolerance_of_the_fp32_reference(triton_device, seed, dtype, head_dim, variant):
    """The triton kernel over e4m3 caches (converted in registers after the tile load, the scales folded in) against
    the fp32 reference over the de-quantized caches."""
    from treedec.attention.backends.triton_backend import run_plan_triton
    tree, scale = case(seed, hkv=1 if head_dim == 128 else 2, head_dim=head_dim, max_nodes=4)
    (k8, v8), (kd, vd) = fp8_caches(tree, scale[:, :tree.pool.num_kv_heads])
    scale = scale[:, :tree.pool.num_kv_heads].contiguous()
    plan = make_plan(tree.layout(), PlanConfig("flatten", 32, 4))
    group = 4 // tree.pool.num_kv_heads
    q = torch.randn(plan.num_queries, tree.pool.num_kv_heads * group, head_dim,
                    generator=torch.Generator().manual_seed(seed)).to(dtype)
    dev = triton_device
    out, lse = run_plan_triton(q.to(dev), k8.to(dev), v8.to(dev), plan.to(dev), variant, kv_scale=scale.to(dev))
    plain = dataclasses.replace(variant, kv_dtype=None)
    want, want_lse = reference_tree_attention(q.float(), kd, vd, plan.layout, plain)
    assert out.dtype == dtype and rel_error(out.cpu(), want) < TRITON_TOLERANCE[dtype], f"{rel_error(out.cpu(), want)=}"
    assert torch.allclose(lse.cpu(), want_lse, atol=2e-2), f"{(lse.cpu() - want_lse).abs().max()=}"


def test_pool_layer_scale_is_what_the_backends_take():
    pool = PagedKVPool(8, 4, 1, 2, 64, dtype=torch.float32, kv_dtype="fp8")
    scale = pool.layer_scale(0)
    assert scale.shape == (2, 2) and scale.dtype == torch.float32 and scale.is_contiguous()


# ----------------------------------------------------------------------------- GPU

def _long_tree(prompt: int, hkv: int, d: int, seed: int = 0):
    """A long prompt with a 64-token Medusa tree under it and a few branches (fp32 K/V of scale ~1)."""
    from treedec.tree import SequenceTree
    from treedec.workloads.deft import medusa_tree
    gen = np.random.default_rng(seed)
    pool = PagedKVPool(-(-(prompt + 1024) // 16), 16, 1, hkv, d, dtype=torch.float32)
    tree = SequenceTree(pool)
    root = tree.add_prompt(gen.integers(0, 512, prompt).tolist())
    kids = tree.branch(root, [gen.integers(0, 512, int(gen.integers(50, 300))).tolist() for _ in range(3)])
    tree.commit_step()
    tree.add_token_tree(kids[0], gen.integers(0, 512, 64).tolist(), medusa_tree(64).parents)
    for kid in kids[1:]:
        tree.extend(kid, [int(gen.integers(0, 512))])
    pool.k.normal_(generator=torch.Generator().manual_seed(seed))
    pool.v.normal_(generator=torch.Generator().manual_seed(seed + 1))
    return tree


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype,head_dim,hkv", [(torch.bfloat16, 128, 8), (torch.float16, 64, 2),
                                                (torch.bfloat16, 64, 4)])
def test_gpu_kernels_read_fp8_within_tolerance_of_the_fp32_reference(backend, dtype, head_dim, hkv):
    """The triton and cuda kernels over e4m3 caches on long trees (4k-token prompt, a 64-token token tree, branches)
    against the fp32 reference over the de-quantized caches; per-head scales."""
    from treedec.attention.backends import get_backend
    why = get_backend(backend).why_not_variant(FP8, head_dim)
    if why is not None:
        pytest.skip(why)
    tree = _long_tree(4000, hkv, head_dim)
    scale = torch.stack([torch.linspace(0.005, 0.05, hkv), torch.linspace(0.01, 0.03, hkv)]).float()
    (k8, v8), (kd, vd) = fp8_caches(tree, scale)
    attn = TreeAttention(4 * hkv, hkv, head_dim, backend=backend, variant=FP8, device="cuda", dtype=dtype)
    plan = attn.plan(tree)
    q = torch.randn(plan.plan.num_queries, 4 * hkv, head_dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    out, lse = attn.run(q.cuda(), k8.cuda(), v8.cuda(), plan, return_lse=True, kv_scale=scale.cuda())
    want, want_lse = reference_tree_attention(q.float(), kd, vd, plan.plan.layout, AttentionVariant())
    assert rel_error(out.cpu(), want) < TRITON_TOLERANCE[dtype], f"{rel_error(out.cpu(), want)=}"
    assert torch.allclose(lse.cpu(), want_lse, atol=2e-2), f"{(lse.cpu() - want_lse).abs().max()=}"
    again = attn.run(q.cuda(), k8.cuda(), v8.cuda(), plan, kv_scale=scale.cuda())
    assert torch.equal(again, out)   # deterministic
