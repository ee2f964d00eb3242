"""bench/families.py (BENCH.md section 2: unshared batches, long sequences, forests), the index
arithmetic of the peers that run them (bench/peers.py) and a CPU smoke run of bench/attention.py
over them. FlashInfer runs on the GPU machine only: here its peers must say why they cannot run."""
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.families import FAMILIES, FAMILY_PEERS, WORKLOADS, family_of, ragged_lengths, tokens_read
from bench.peers import PEERS, PeerUnavailable, path_pages, path_slots, request_masks, split_by_root
from bench.suite import SUITE
from treedec.attention import AttentionVariant, dense_tree_mask, reference_tree_attention

REPO = Path(__file__).resolve().parents[2]
ALL = [(family, name) for family, workloads in FAMILIES.items() for name in workloads]


def _inputs(w, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(w.layout.num_queries, 32, 128)
    k = torch.randn(w.num_pages, w.page_size, 8, 128)
    return q, k, torch.randn_like(k)


@pytest.mark.parametrize("family,name", ALL)
def test_family_workloads_build(family, name):
    w = WORKLOADS[name](scale=0.01)
    layout = w.layout
    assert family_of(name) == family
    assert tokens_read(layout) == int(dense_tree_mask(layout).sum())  # the floors' token count
    trees = int((layout.parent < 0).sum())
    if family in ("unshared", "long"):
        b = 1 if family == "long" else int(re.match(r"unshared_b(\d+)_", name).group(1))
        assert trees == layout.num_queries == b and layout.num_nodes == b
    else:
        requests = int(re.match(r"forest_\w+_r(\d+)", name).group(1))
        assert trees == requests
        assert layout.num_queries == requests * (64 if "medusa" in name else 5)


def test_full_scale_lengths():
    """Unshared lengths are ragged inside 1k-128k tokens, fixed by the name; long sequences are 32k-128k."""
    for name in FAMILIES["unshared"]:
        b = int(re.match(r"unshared_b(\d+)_", name).group(1))
        assert len(FAMILIES["unshared"][name](scale=0.001).layout.query_node) == b
    lengths = ragged_lengths("unshared_b64_mixed", 64, 1024, 128 * 1024, log=True)
    assert lengths == ragged_lengths("unshared_b64_mixed", 64, 1024, 128 * 1024, log=True)
    assert min(lengths) >= 1024 and max(lengths) <= 128 * 1024 and len(set(lengths)) > 32
    assert list(FAMILIES["long"]) == ["long_32k", "long_64k", "long_128k"]
    assert set(FAMILY_PEERS) == set(FAMILIES) and all(p in PEERS for ps in FAMILY_PEERS.values() for p in ps)
    assert not set(SUITE) & {n for f in FAMILIES.values() for n in f}
    with pytest.raises(ValueError, match="unknown workload"):
        family_of("unshared_b3_2k")


def _attend(q, k_flat, v_flat, slots, sm_scale):
    """fp32 attention of q [Hq, D] over the tokens at ``slots`` of k_flat/v_flat [N, Hkv, D]."""
    k = k_flat[slots].float().repeat_interleave(q.shape[0] // k_flat.shape[1], 1)
    v = v_flat[slots].float().repeat_interleave(q.shape[0] // k_flat.shape[1], 1)
    s = torch.einsum("hd,thd->ht", q.float(), k) * sm_scale
    return torch.einsum("ht,thd->hd", torch.softmax(s, -1), v)


@pytest.mark.parametrize("name", ["unshared_b8_2k", "long_32k"])
def test_batch_decode_pages_give_reference(name):
    """flashinfer_batch_decode's page lists (the pool's pages, last_page_len), attended, equal the reference."""
    w = WORKLOADS[name](scale=0.02)
    q, k, v = _inputs(w)
    scale = 1 / math.sqrt(128)
    ref, _ = reference_tree_attention(q, k, v, w.layout, AttentionVariant(sm_scale=scale))
    indptr, pages, last = path_pages(w.layout, w.page_size)
    for i in range(w.layout.num_queries):
        own = pages[indptr[i]:indptr[i + 1]]
        slots = (own[:, None] * w.page_size + np.arange(w.page_size)).reshape(-1)[:(len(own) - 1) * w.page_size + last[i]]
        out = _attend(q[i], k.view(-1, 8, 128), v.view(-1, 8, 128), torch.from_numpy(slots), scale)
        torch.testing.assert_close(out, ref[i], atol=1e-5, rtol=1e-5)


def test_batch_decode_pages_refuse_trees():
    with pytest.raises(PeerUnavailable, match="not whole pages"):
        path_pages(WORKLOADS["forest_tot_r16"](scale=0.05).layout, 16)


@pytest.mark.parametrize("name", ["forest_medusa64_r8_p2k", "forest_tot_r16", "unshared_b8_2k", "spec_medusa64_p4k"])
def test_request_masks_and_split_by_root(name):
    """Per-tree requests of the custom-mask peer and the reference tree by tree equal the whole-forest reference."""
    w = WORKLOADS[name](scale=0.02)
    layout = w.layout
    q, k, v = _inputs(w)
    scale = 1 / math.sqrt(128)
    ref, _ = reference_tree_attention(q, k, v, layout, AttentionVariant(sm_scale=scale))
    qo_indptr, kv_indptr, masks = request_masks(layout)
    assert len(qo_indptr) - 1 == int((layout.parent < 0).sum()) and qo_indptr[-1] == layout.num_queries
    assert kv_indptr[-1] == layout.num_tokens and masks.sum() == tokens_read(layout)
    kf, vf = k.view(-1, 8, 128), v.view(-1, 8, 128)
    at = 0
    for r in range(len(qo_indptr) - 1):
        rows, cols = qo_indptr[r + 1] - qo_indptr[r], kv_indptr[r + 1] - kv_indptr[r]
        mask = masks[at:at + rows * cols].reshape(rows, cols)
        at += rows * cols
        for j in range(rows):
            slots = layout.kv_slots[kv_indptr[r]:kv_indptr[r + 1]][mask[j]]
            out = _attend(q[qo_indptr[r] + j], kf, vf, torch.from_numpy(slots), scale)
            torch.testing.assert_close(out, ref[qo_indptr[r] + j], atol=1e-5, rtol=1e-5)
    assert at == len(masks)
    by_root = torch.empty_like(ref)
    for queries, sub in split_by_root(layout):
        by_root[torch.from_numpy(queries)] = reference_tree_attention(q[torch.from_numpy(queries)], k, v, sub, AttentionVariant(sm_scale=scale))[0]
    torch.testing.assert_close(by_root, ref, atol=1e-5, rtol=1e-5)
    _, slots = path_slots(layout)
    assert np.array_equal(slots, layout.kv_slots[np.nonzero(dense_tree_mask(layout))[1]])


def test_flashinfer_batch_decode_says_why_on_cpu():
    assert PEERS["flashinfer_batch_decode"].unavailable(torch.device("cpu"))


@pytest.mark.slow
def test_attention_families_smoke_run(tmp_path):
    """`bench/attention.py --smoke --families long ...` runs the families' workloads on the CPU: floors,
    treedec checked against the tree-by-tree reference, the families' FlashInfer peers saying why not,
    and the README table left alone (it is the suite's)."""
    readme = REPO / "bench" / "README.md"
    before = readme.read_text()
    cmd = [sys.executable, str(REPO / "bench" / "attention.py"), "--smoke", "--backends", "torch",
           "--families", "long", "--workloads", "unshared_b8_2k,forest_tot_r16", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert readme.read_text() == before
    [path] = tmp_path.glob("*-smoke.json")
    results = json.loads(path.read_text())
    assert list(results["workloads"]) == ["unshared_b8_2k", "forest_tot_r16", "long_32k", "long_64k", "long_128k"]
    for name, w in results["workloads"].items():
        assert w["family"] == family_of(name) and w["floor_us"] > 0
        assert w["floor_us"] == max(w["hbm_floor_us"], w["tensor_core_floor_us"])
        assert set(w["methods"]) == {"treedec_torch_flatten", *FAMILY_PEERS[w["family"]]}
        r = w["methods"]["treedec_torch_flatten"]
        assert r["status"] == "ok" and r["rel_err"] < 2e-3, (name, r)
        for peer in FAMILY_PEERS[w["family"]]:
            assert w["methods"][peer]["status"] == "unavailable" and w["methods"][peer]["reason"]
    assert results["workloads"]["forest_tot_r16"]["trees"] == 16


def test_attention_rejects_unknown_family(tmp_path):
    cmd = [sys.executable, str(REPO / "bench" / "attention.py"), "--smoke", "--families", "batches"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0 and "unknown family 'batches'" in proc.stderr
