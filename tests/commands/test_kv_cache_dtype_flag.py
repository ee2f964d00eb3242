"""``--kv-cache-dtype`` (vLLM's flag) in the commands that build an engine: the pool stores e4m3, the results files and
the stderr lines say so, speculative decoding still equals plain greedy on the fp8 pool, a bad value is one line."""
import json
import warnings

import pytest

from tests.commands.test_cli import run
from tests.commands.test_serve import _Recorded, tiny_serve
from treedec.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:an fp8 KV cache on the CPU")


@pytest.mark.slow
def test_spec_on_an_fp8_pool_checks_equal_and_says_so(tmp_path, capsys):
    out = tmp_path / "spec.json"
    assert main(["spec", "--speculative", "ngram", "--check", "--kv-cache-dtype", "fp8", "--out", str(out),
                 "--max-tokens", "12", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    assert results["kv_cache_dtype"] == "fp8_e4m3" and results["check"]["equal"]
    assert "tokens of fp8_e4m3" in printed


@pytest.mark.slow
def test_tot_and_generate_on_an_fp8_pool(tmp_path, capsys):
    out = tmp_path / "tot.json"
    assert main(["tot", "--k", "2", "--n", "1", "--depth", "2", "--thought-max-tokens", "3", "--value-max-tokens", "2",
                 "--no-check-steps", "--no-progress", "--kv-tokens", "2048", "--kv-cache-dtype", "fp8_e4m3",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["kv_cache_dtype"] == "fp8_e4m3"
    capsys.readouterr()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [1, 2, 3], "max_tokens": 4}) + "\n")
    assert main(["generate", "--prompts", str(prompts), "--out", str(tmp_path / "r.jsonl"), "--kv-cache-dtype",
                 "fp8", "--backend", "torch"]) == 0
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("KV pool: ")]
    assert "tokens of fp8_e4m3, scales 1.0" in line


@pytest.mark.slow
def test_serve_on_an_fp8_pool_says_so_at_start(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TREEDEC_API_KEY", raising=False)
    recorded = _Recorded(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert tiny_serve(tmp_path, "--kv-cache-dtype", "fp8") == 0
    assert recorded.llm.engine.kv_cache_dtype == "fp8_e4m3"
    assert "KV tokens of fp8_e4m3" in capsys.readouterr().err


def test_a_bad_kv_cache_dtype_is_one_line(capsys):
    code, _, err = run(["generate", "--prompt", "hi", "--kv-cache-dtype", "int8"], capsys)
    assert code == 2 and "argument --kv-cache-dtype: invalid choice: 'int8'" in err
