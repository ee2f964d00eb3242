"""``treedec generate "prompt"``: one prompt streamed to stdout with the sampling flags (SamplingParams), the
same tokens as the library; argument mistakes refused before a model loads. A tiny checkpoint folder with a local
tokenizer on the CPU."""
import json

import pytest
import torch

from tests.models.test_llama import tiny_hf
from tests.tokenizers_local import build_tokenizer
from treedec.cli import main
from treedec.engine import Engine
from treedec.models import from_pretrained
from treedec.models.text import encode_prompt, load_tokenizer
from treedec.search import RequestSpec, SamplingParams, generate_batch


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoint")
    tiny_hf("llama", seed=4, vocab_size=400).save_pretrained(folder)
    build_tokenizer(folder)
    return folder


def library(checkpoint, params, chat=False):
    tokenizer = load_tokenizer(checkpoint)
    engine = Engine(from_pretrained(checkpoint, dtype=torch.float32, device="cpu"), kv_tokens=1024,
                    backend="torch")
    prompt = encode_prompt(tokenizer, "the quick brown fox", chat)
    results, _ = generate_batch(engine, [RequestSpec(0, prompt_ids=tuple(prompt), params=params)], tokenizer)
    return results


BASE = ["generate", "--device", "cpu", "--dtype", "fp32", "--backend", "torch"]


@pytest.mark.parametrize("flags, params", [
    ([], SamplingParams(temperature=0, max_tokens=8)),
    (["--temperature", "0.9", "--top-k", "50", "--min-p", "0.05", "--repetition-penalty", "1.2", "--seed", "3"],
     SamplingParams(temperature=0.9, top_k=50, min_p=0.05, repetition_penalty=1.2, max_tokens=8)),
])
def test_a_prompt_streams_the_library_s_text(checkpoint, flags, params, capsys, tmp_path):
    out = tmp_path / "r.jsonl"
    assert main(BASE + ["--model", str(checkpoint), "the quick brown fox", "--max-new-tokens", "8", "--out", str(out),
                        *flags]) == 0
    printed, err = capsys.readouterr()
    [result] = [json.loads(line) for line in out.read_text().splitlines()]
    if params.temperature == 0:
        [expected] = library(checkpoint, params)
        assert result["output_ids"] == expected.output_ids
    assert printed == result["text"] + "\n" and "tokens/s" in err and "8 tokens" in err


def test_several_outputs_each_under_a_header_and_logprobs_in_the_results(checkpoint, capsys, tmp_path):
    out = tmp_path / "r.jsonl"
    assert main(BASE + ["--model", str(checkpoint), "the quick brown fox", "--max-new-tokens", "5", "--n", "2",
                        "--temperature", "1.0", "--logprobs", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert printed == f"--- output 0 ---\n{results[0]['text']}\n--- output 1 ---\n{results[1]['text']}\n"
    assert all(len(r["logprobs"]) == len(r["output_ids"]) for r in results)


@pytest.mark.parametrize("args, message", [
    (["the prompt"], "a text prompt needs --model with a tokenizer"),
    ([], r"give a prompt \(treedec generate \"...\"\) or --prompts FILE, one of them"),
    (["--prompts", "PROMPTS"], "--prompts needs --out results.jsonl"),
    (["x", "--prompts", "PROMPTS"], "one of them"),
    (["--model", "MODEL", "x", "--min-p", "2"], r"min_p must be a number in \[0, 1\]"),
])
def test_mistakes_are_refused_before_a_model_loads(args, message, checkpoint, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n')
    args = [str(prompts) if a == "PROMPTS" else str(checkpoint) if a == "MODEL" else a for a in args]
    monkeypatch.setattr("treedec.commands.generate.load_model", lambda args: pytest.fail("loaded a model"))
    assert main(BASE + args) == 2
    err = capsys.readouterr().err
    assert err.startswith("treedec generate: error: ") and __import__("re").search(message, err)


def test_vllms_sampling_flags_give_the_librarys_tokens(checkpoint, capsys, tmp_path):
    """The flags of SamplingParams' vLLM fields (#48): the results equal the library's with the same fields."""
    out = tmp_path / "r.jsonl"
    flags = ["--min-tokens", "3", "--logit-bias", "40:5", "--logit-bias", "41:-100", "--allowed-token-ids", "40",
             "--allowed-token-ids", "41", "--allowed-token-ids", "42", "--allowed-token-ids", "2",
             "--truncate-prompt-tokens", "3", "--no-skip-special-tokens"]
    assert main(BASE + ["--model", str(checkpoint), "the quick brown fox", "--max-new-tokens", "6", "--out", str(out),
                        *flags]) == 0
    [result] = [json.loads(line) for line in out.read_text().splitlines()]
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=3, logit_bias={40: 5.0, 41: -100.0},
                            allowed_token_ids=[40, 41, 42, 2], truncate_prompt_tokens=3, skip_special_tokens=False)
    [expected] = library(checkpoint, params)
    assert result["output_ids"] == expected.output_ids and result["text"] == expected.text
    assert len(result["prompt_ids"]) == 3 and set(result["output_ids"]) <= {40, 42, 2}
    capsys.readouterr()
    assert main(BASE + ["--model", str(checkpoint), "the quick brown fox", "--max-new-tokens", "4",
                        "--no-detokenize"]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed) == library(checkpoint, SamplingParams(temperature=0, max_tokens=4))[0].output_ids


@pytest.mark.parametrize("args, message", [
    (["--model", "MODEL", "x", "--logit-bias", "5"], r"argument --logit-bias: must be ID:BIAS"),
    (["--model", "MODEL", "x", "--logit-bias", "5:200"], r"logit_bias\[5\] must be a number in \[-100, 100\]"),
    (["--model", "MODEL", "x", "--min-tokens", "300"], r"min_tokens must be at most max_tokens \(256\)"),
    (["--model", "MODEL", "x", "--truncate-prompt-tokens", "0"], r"truncate_prompt_tokens must be None, -1"),
    (["--model", "MODEL", "x", "--no-detokenize", "--stop", "."], r"need detokenize=True"),
])
def test_bad_sampling_flags_are_refused_before_a_model_loads(args, message, checkpoint, capsys, monkeypatch):
    args = [str(checkpoint) if a == "MODEL" else a for a in args]
    monkeypatch.setattr("treedec.commands.generate.load_model", lambda args: pytest.fail("loaded a model"))
    assert main(BASE + args) == 2
    assert __import__("re").search(message, capsys.readouterr().err)
