"""CPU smoke runs of the benchmarks' fp8 KV options (issue #52): bench/attention.py --kv-dtype fp8 times treedec's
kernel over e4m3 caches beside its twin over the de-quantized 16-bit K/V, both checked against the fp32 reference;
bench/programs.py --kv-cache-dtype fp8 (with --quantization fp8) runs on an fp8 pool and counts its bytes."""
import json

import pytest

from bench import attention, programs


@pytest.mark.slow
def test_attention_bench_fp8_kv_smoke(tmp_path):
    assert attention.main(["--smoke", "--backends", "torch", "--kv-dtype", "fp8", "--workloads", "tot_d5w10",
                           "--peers", "sdpa_dense_mask", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*-smoke.json")
    results = json.loads(path.read_text())
    assert results["variant"]["kv_dtype"] == "fp8_e4m3"
    entry = results["workloads"]["tot_d5w10"]
    methods = entry["methods"]
    assert methods["treedec_torch_flatten"]["status"] == "ok" == methods["treedec_torch_flatten_kv16"]["status"]
    assert methods["sdpa_dense_mask"]["status"] == "unavailable" and "fp8" in methods["sdpa_dense_mask"]["reason"]
    assert entry["fp8_kv"]["us"]["speedup"] > 0
    assert entry["hbm_bytes"] < 2 * entry["tree_tokens"] * 8 * 128 * 2   # e4m3 K/V: one byte a value


@pytest.mark.slow
def test_programs_bench_fp8_weights_and_kv_smoke(tmp_path):
    assert programs.main(["--smoke", "--programs", "greedy", "--methods", "eager", "--quantization", "fp8",
                          "--kv-cache-dtype", "fp8", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*-programs-smoke.json")
    results = json.loads(path.read_text())
    assert results["kv_cache_dtype"] == "fp8" and results["quantization"] == "fp8"
    assert results["kv_bytes_per_token"] == 2 * 2 * 2 * 64   # tiny: 2 layers, 2 KV heads, head dim 64, 1 byte
    assert not results.get("errors") and results["runs"][0]["ms"] > 0
