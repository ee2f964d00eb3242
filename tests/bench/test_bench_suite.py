"""The benchmark suite (bench/suite.py), the peers' index arithmetic (bench/peers.py) and a CPU
smoke run of bench/attention.py."""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.peers import PEERS, PeerUnavailable, cascade_levels, path_slots
from bench.report import TABLE_END, TABLE_START, render_table, write_readme_table
from bench.suite import SUITE, build_workload, windowed_kv_layout
from treedec.attention import AttentionVariant, PlanConfig, dense_tree_mask, make_plan, reference_tree_attention

REPO = Path(__file__).resolve().parents[2]

# name -> (tree tokens, queries), from BENCH.md's table
EXPECTED = {
    "spec_medusa64_p4k": (4000 + 64, 64),
    "spec_medusa256_p4k": (4000 + 256, 256),
    "spec_medusa64_p32k": (32000 + 64, 64),
    "fewshot_b30_p4k": (4000 + 30 * 200, 30),
    "fewshot_b50_p16k": (16000 + 50 * 400, 50),
    "tot_d5w10": (1000 + 5 * 300 + 10 * 150, 10),
    "tot_sorting1": (4956, 9),
    "tot_docmerge0": (6627, 10),
}


def test_suite_is_bench_md_table():
    assert list(SUITE) == list(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
@pytest.mark.parametrize("page_size", [16, 1, 7])
def test_workload_sizes(name, page_size):
    w = build_workload(name, page_size=page_size)
    layout = w.layout
    assert (layout.num_tokens, layout.num_queries) == EXPECTED[name]
    assert w.page_size == page_size
    # real paged slots: unique, inside a pool of exactly the pages the nodes need
    assert len(np.unique(layout.kv_slots)) == layout.num_tokens
    assert layout.kv_slots.max() < w.num_pages * page_size
    assert len(np.unique(layout.kv_slots // page_size)) == w.num_pages, "the pool has unused pages"


@pytest.mark.parametrize("name", ["spec_medusa64_p4k", "spec_medusa256_p4k"])
def test_medusa_workload_reads(name):
    layout = build_workload(name).layout
    reads = dense_tree_mask(layout).sum(axis=1)
    depth = layout.node_prefix_len[layout.query_node] - 4000   # tokens of the token tree above each query
    assert np.array_equal(reads, 4000 + depth + 1)
    assert reads.min() == 4001  # the root token reads the prompt and itself


def test_branching_workload_reads():
    assert np.all(dense_tree_mask(build_workload("fewshot_b30_p4k").layout).sum(axis=1) == 4200)
    assert np.all(dense_tree_mask(build_workload("tot_d5w10").layout).sum(axis=1) == 1000 + 1500 + 150)


def test_smoke_scale_shrinks_token_counts():
    w = build_workload("fewshot_b50_p16k", scale=0.05)
    assert (w.layout.num_tokens, w.layout.num_queries) == (800 + 50 * 20, 50)
    assert build_workload("spec_medusa256_p4k", scale=0.05).layout.num_queries == 256


def test_unknown_workload():
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        build_workload("nope")


def _attend(q, k_flat, v_flat, slots, sm_scale):
    """fp32 attention of q [Hq, D] over the tokens at ``slots`` of k_flat/v_flat [N, Hkv, D]."""
    group = q.shape[0] // k_flat.shape[1]
    k = k_flat[slots].float().repeat_interleave(group, 1)
    v = v_flat[slots].float().repeat_interleave(group, 1)
    s = torch.einsum("hd,thd->ht", q.float(), k) * sm_scale
    return torch.einsum("ht,thd->hd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


@pytest.mark.parametrize("name", ["spec_medusa64_p4k", "fewshot_b30_p4k", "tot_sorting1"])
def test_path_and_cascade_slots_give_reference(name):
    """The per-path and cascade peers' KV index lists, attended in fp32, equal the reference."""
    w = build_workload(name, page_size=16, scale=0.05)
    layout = w.layout
    torch.manual_seed(0)
    q = torch.randn(layout.num_queries, 32, 128)
    k = torch.randn(w.num_pages, 16, 8, 128)
    v = torch.randn_like(k)
    kf, vf = k.view(-1, 8, 128), v.view(-1, 8, 128)
    scale = 1 / math.sqrt(128)
    ref, _ = reference_tree_attention(q, k, v, layout, AttentionVariant(sm_scale=scale))
    indptr, slots = path_slots(layout)
    shared, rest_indptr, rest = cascade_levels(layout)
    assert len(shared) > 0
    for i in range(layout.num_queries):
        out, _ = _attend(q[i], kf, vf, torch.from_numpy(slots[indptr[i]:indptr[i + 1]]), scale)
        torch.testing.assert_close(out, ref[i], atol=1e-5, rtol=1e-5)
        o1, l1 = _attend(q[i], kf, vf, torch.from_numpy(shared), scale)
        o2, l2 = _attend(q[i], kf, vf, torch.from_numpy(rest[rest_indptr[i]:rest_indptr[i + 1]]), scale)
        lse = torch.logaddexp(l1, l2)
        merged = o1 * torch.exp(l1 - lse)[:, None] + o2 * torch.exp(l2 - lse)[:, None]
        torch.testing.assert_close(merged, ref[i], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [AttentionVariant(), AttentionVariant(window=20, logit_softcap=3.0)],
                         ids=["plain", "window-softcap"])
@pytest.mark.parametrize("peer", ["sdpa_dense_mask", "flex_attention"])
def test_torch_peers_on_cpu(peer, variant):
    """The peers compute the layer's variant (a window in their masks, flex's soft-cap as its score_mod); SDPA has
    no soft-cap and says so."""
    w = build_workload("tot_d5w10", scale=0.05)
    torch.manual_seed(0)
    q = torch.randn(w.layout.num_queries, 32, 128, dtype=torch.float16)
    k = torch.randn(w.num_pages, 16, 8, 128, dtype=torch.float16)
    v = torch.randn_like(k)
    ref, _ = reference_tree_attention(q, k, v, w.layout, variant)
    if peer == "sdpa_dense_mask" and variant.logit_softcap is not None:
        with pytest.raises(PeerUnavailable, match="n/a: SDPA has no logit soft-cap"):
            PEERS[peer].make(w.layout, q, k, v, variant)
        return
    out = PEERS[peer].make(w.layout, q, k, v, variant)()
    assert out.shape == ref.shape
    assert float((out.float() - ref).norm() / ref.norm()) < 2e-3


@pytest.mark.parametrize("name", ["fewshot_b30_p4k", "tot_d5w10", "spec_medusa64_p4k"])
def test_windowed_kv_layout_reads_what_the_windowed_plan_reads(name):
    """The yardstick's layout: its plain plan reads the tokens of the windowed plan, and the variant's attention over
    it is the same."""
    w = build_workload(name, scale=0.05)
    windowed = windowed_kv_layout(w.layout, 30)
    wide = make_plan(w.layout, PlanConfig(chunk_size=64), variant=AttentionVariant(window=30))
    assert np.array_equal(make_plan(windowed, PlanConfig(chunk_size=64)).kv_slots, wide.kv_slots)
    q, k, v = w.random_inputs("cpu", torch.float32)
    a, _ = reference_tree_attention(q, k, v, w.layout, AttentionVariant(window=30))
    b, _ = reference_tree_attention(q, k, v, windowed, AttentionVariant(window=30))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_flashinfer_peers_say_why_on_cpu():
    for name in ("flashinfer_custom_mask", "flashinfer_per_path_decode", "flashinfer_cascade", "deft_triton"):
        assert PEERS[name].unavailable(torch.device("cpu"))


def smoke_tot_d5w10(tmp_path, option: str, values) -> dict:
    """``bench/attention.py --smoke`` on tot_d5w10 (torch backend, the sdpa peer) once per value of ``option``:
    each run's results JSON by value; the README table must be left alone."""
    readme = REPO / "bench" / "README.md"
    before = readme.read_text()
    results = {}
    for value in values:
        out = tmp_path / str(value)
        cmd = [sys.executable, str(REPO / "bench" / "attention.py"), "--smoke", "--backends", "torch", "--peers",
               "sdpa_dense_mask", "--workloads", "tot_d5w10", option, str(value), "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        [path] = out.glob("*-smoke.json")
        results[value] = json.loads(path.read_text())
    assert readme.read_text() == before
    return results


@pytest.mark.slow
def test_attention_head_dim_option(tmp_path):
    """`--head-dim 64` runs q, k, v of that dim, its floors halve, and the README table is left alone."""
    results = smoke_tot_d5w10(tmp_path, "--head-dim", (64, 128))
    small, full = results[64], results[128]
    assert small["head_dim"] == 64 and full["head_dim"] == 128
    w64, w128 = small["workloads"]["tot_d5w10"], full["workloads"]["tot_d5w10"]
    assert w64["tensor_core_floor_us"] == pytest.approx(w128["tensor_core_floor_us"] / 2)
    assert w64["hbm_bytes"] == w128["hbm_bytes"] // 2
    for r in w64["methods"].values():
        assert r["status"] == "ok" and r["rel_err"] < 2e-3, r
    assert "head dim 64" in render_table(small)


@pytest.mark.slow
def test_attention_kv_heads_option(tmp_path):
    """`--kv-heads 32` (no GQA) gives K/V caches of 32 heads: its K/V bytes are 4x the default 8 heads', treedec
    and the peer check against the reference, the results name it, and the README table is left alone."""
    results = smoke_tot_d5w10(tmp_path, "--kv-heads", (8, 32))
    w8, w32 = results[8]["workloads"]["tot_d5w10"], results[32]["workloads"]["tot_d5w10"]
    q_bytes = 2 * w8["queries"] * 32 * 128 * 2
    assert w32["hbm_bytes"] - q_bytes == 4 * (w8["hbm_bytes"] - q_bytes)
    assert results[32]["kv_heads"] == 32 and "32 KV heads" in render_table(results[32])
    for r in w32["methods"].values():
        assert r["status"] == "ok" and r["rel_err"] < 2e-3, r


@pytest.mark.slow
def test_attention_variant_options(tmp_path):
    """`--window` (scaled with --smoke's token counts) and `--softcap` make every method compute that variant, checked
    against the variant's reference: the windowed plan reads fewer tokens, its yardstick (the plain kernel over the
    same windowed KV) runs, SDPA says it has no soft-cap; the README table is left alone."""
    windowed = smoke_tot_d5w10(tmp_path, "--window", (200,))[200]
    w = windowed["workloads"]["tot_d5w10"]
    assert windowed["variant"] == {"window": 10, "logit_softcap": None, "kv_dtype": None}
    assert all(r["status"] == "ok" and r["rel_err"] < 2e-3 for r in w["methods"].values()), w["methods"]
    assert w["methods"]["treedec_torch_flatten"]["plan"]["tree_tokens"] < w["tree_tokens"]
    assert w["yardstick"]["status"] == "ok" and w["yardstick"]["kv_tokens"] == \
        w["methods"]["treedec_torch_flatten"]["plan"]["tree_tokens"] and w["yardstick"]["yardstick_ratio"] > 0
    capped = smoke_tot_d5w10(tmp_path, "--softcap", (30.0,))[30.0]["workloads"]["tot_d5w10"]["methods"]
    assert capped["treedec_torch_flatten"]["status"] == "ok" and capped["treedec_torch_flatten"]["rel_err"] < 2e-3
    assert capped["sdpa_dense_mask"] == {"status": "unavailable", "reason": "n/a: SDPA has no logit soft-cap"}


@pytest.mark.slow
def test_attention_smoke_run(tmp_path):
    """`bench/attention.py --smoke` runs the whole suite on the CPU and every result passes the check."""
    readme = REPO / "bench" / "README.md"
    before = readme.read_text()
    cmd = [sys.executable, str(REPO / "bench" / "attention.py"), "--smoke", "--backends", "torch",
           "--peers", "sdpa_dense_mask", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert readme.read_text() == before, "a --smoke run must not rewrite bench/README.md"
    [path] = tmp_path.glob("*-smoke.json")
    results = json.loads(path.read_text())
    assert results["smoke"] and results["device"] and results["versions"]["torch"] == torch.__version__
    assert list(results["workloads"]) == list(SUITE)
    for name, w in results["workloads"].items():
        assert set(w["methods"]) == {"treedec_torch_flatten", "sdpa_dense_mask"}
        assert w["floor_us"] > 0
        for method, r in w["methods"].items():
            assert r["status"] == "ok", (name, method, r)
            assert r["rel_err"] < 2e-3 and r["us"] > 0 and r["x_floor"] > 0
    assert "spec_medusa64_p4k" in proc.stdout  # the summary table is printed

    table = tmp_path / "README.md"
    table.write_text(f"# x\n\nbefore\n{TABLE_START}\nold\n{TABLE_END}\nafter\n")
    write_readme_table(results, table)
    text = table.read_text()
    assert "old" not in text and text.startswith("# x\n\nbefore\n") and text.endswith(f"{TABLE_END}\nafter\n")
    assert "| tot_docmerge0 |" in text
