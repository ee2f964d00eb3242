"""``treedec generate "prompt"``: one prompt streamed to stdout with the sampling flags (SamplingParams), the
same tokens as the library; argument mistakes refused before a model loads. A tiny checkpoint folder with a local
tokenizer on the CPU."""
import json
import re

import pytest
import torch

from tests.models.test_llama import tiny_hf
from tests.tokenizers_local import build_tokenizer
from treedec.cli import main
from treedec.engine import Engine
from treedec.models import from_pretrained
from treedec.models.text import encode_prompt, load_tokenizer
from treedec.programs import generate_batch
from treedec.runtime import RequestSpec
from treedec.sampling import SamplingParams


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
    assert main(BASE + ["--model", str(checkpoint), "--prompt", "the quick brown fox", "--no-chat-template",
                        "--max-tokens", "8", "--out", str(out), *flags]) == 0
    printed, err = capsys.readouterr()
    [result] = [json.loads(line) for line in out.read_text().splitlines()]
    if params.temperature == 0:
        [expected] = library(checkpoint, params)
        assert result["output_ids"] == expected.output_ids
    assert printed == result["text"] + "\n" and "tokens/s" in err and "8 tokens" in err


def test_several_outputs_each_under_a_header_and_logprobs_in_the_results(checkpoint, capsys, tmp_path):
    out = tmp_path / "r.jsonl"
    assert main(BASE + ["--model", str(checkpoint), "--prompt", "the quick brown fox", "--max-tokens", "5", "--n",
                        "2", "--temperature", "1.0", "--logprobs", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert printed == f"--- output 0 ---\n{results[0]['text']}\n--- output 1 ---\n{results[1]['text']}\n"
    assert all(len(r["logprobs"]) == len(r["output_ids"]) for r in results)


@pytest.mark.parametrize("args, message", [
    (["--prompt", "the prompt"], "a text prompt needs --model with a tokenizer"),
    ([], r"give --prompt TEXT or --prompts FILE, one of them"),
    (["--prompts", "PROMPTS"], "--prompts needs --out results.jsonl"),
    (["--prompt", "x", "--prompts", "PROMPTS"], "one of them"),
    (["--model", "MODEL", "--prompt", "x", "--min-p", "2"], r"min_p must be a number in \[0, 1\]"),
    (["--model", "MODEL", "x"], "unexpected argument 'x'; give it as --prompt x"),
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
    assert main(BASE + ["--model", str(checkpoint), "--prompt", "the quick brown fox", "--no-chat-template",
                        "--max-tokens", "6", "--out", str(out), *flags]) == 0
    [result] = [json.loads(line) for line in out.read_text().splitlines()]
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=3, logit_bias={40: 5.0, 41: -100.0},
                            allowed_token_ids=[40, 41, 42, 2], truncate_prompt_tokens=3, skip_special_tokens=False)
    [expected] = library(checkpoint, params)
    assert result["output_ids"] == expected.output_ids and result["text"] == expected.text
    assert len(result["prompt_ids"]) == 3 and set(result["output_ids"]) <= {40, 42, 2}
    capsys.readouterr()
    assert main(BASE + ["--model", str(checkpoint), "--prompt", "the quick brown fox", "--no-chat-template",
                        "--max-tokens", "4", "--no-detokenize"]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed) == library(checkpoint, SamplingParams(temperature=0, max_tokens=4))[0].output_ids


@pytest.mark.parametrize("args, message", [
    (["--model", "MODEL", "--prompt", "x", "--logit-bias", "5"], r"argument --logit-bias: must be ID:BIAS"),
    (["--model", "MODEL", "--prompt", "x", "--logit-bias", "5:200"], r"logit_bias\[5\] must be a number in \[-100, 100\]"),
    (["--model", "MODEL", "--prompt", "x", "--min-tokens", "300"], r"min_tokens must be at most max_tokens \(256\)"),
    (["--model", "MODEL", "--prompt", "x", "--truncate-prompt-tokens", "0"], r"truncate_prompt_tokens must be None, -1"),
    (["--model", "MODEL", "--prompt", "x", "--no-detokenize", "--stop", "."], r"need detokenize=True"),
])
def test_bad_sampling_flags_are_refused_before_a_model_loads(args, message, checkpoint, capsys, monkeypatch):
    args = [str(checkpoint) if a == "MODEL" else a for a in args]
    monkeypatch.setattr("treedec.commands.generate.load_model", lambda args: pytest.fail("loaded a model"))
    assert main(BASE + args) == 2
    assert __import__("re").search(message, capsys.readouterr().err)


def test_a_chat_model_gets_the_prompt_through_its_chat_template_by_default(checkpoint, capsys, tmp_path):
    """Was: the raw text (SmolLM2 answered it with one token, then EOS, and nothing said why): a model with a chat
    template gets the prompt as a user message, as LLM.chat does, and stderr says so (--no-chat-template: raw)."""
    out = tmp_path / "r.jsonl"
    params = SamplingParams(temperature=0, max_tokens=6)
    assert main(BASE + ["--model", str(checkpoint), "--prompt", "the quick brown fox", "--max-tokens", "6",
                        "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "prompt: sent as a user message through the model's chat template (--no-chat-template" in err
    [result] = [json.loads(line) for line in out.read_text().splitlines()]
    [chat] = library(checkpoint, params, chat=True)
    assert result["prompt_ids"] == list(chat.prompt_ids) and result["output_ids"] == chat.output_ids
    assert main(BASE + ["--model", str(checkpoint), "--prompt", "the quick brown fox", "--max-tokens", "6",
                        "--no-chat-template", "--out", str(out)]) == 0
    [raw] = library(checkpoint, params)
    assert json.loads(out.read_text())["prompt_ids"] == list(raw.prompt_ids) != result["prompt_ids"]
    assert "chat template" not in capsys.readouterr().err


def test_a_tokenizer_without_a_chat_template_gets_the_text_and_says_so(tmp_path, capsys):
    folder = tmp_path / "plain"
    tiny_hf("llama", seed=4, vocab_size=400).save_pretrained(folder)
    build_tokenizer(folder, chat_template=False)
    assert main(BASE + ["--model", str(folder), "--prompt", "the quick brown fox", "--max-tokens", "2"]) == 0
    assert "prompt: the text as it is (the tokenizer has no chat template)" in capsys.readouterr().err


def test_logprobs_are_printed_without_out(checkpoint, capsys):
    """Was: --logprobs went to the results file only, so without --out they were computed and never shown."""
    assert main(BASE + ["--model", str(checkpoint), "--prompt", "the quick brown fox", "--max-tokens", "3",
                        "--logprobs", "2"]) == 0
    printed, err = capsys.readouterr()
    lines = err.splitlines()
    start = lines.index("logprobs of output 0 (token: log-probability, rank; the most likely):")
    rows = lines[start + 1:start + 4]
    assert len(rows) == 3 and all(re.match(r"^ +\d+ '.*': -?\d+\.\d{4}, rank \d+; ", row) for row in rows), rows
    assert "logprobs" not in printed


def test_the_cpu_pool_is_sized_from_the_request_and_said(checkpoint, capsys):
    """Was: 32768 tokens whatever the request (2.48 GB and 4 s of start-up for SmolLM2): a prompt of a few tokens
    and 8 new ones get a pool of a few pages, and one stderr line says so; --kv-tokens still sets it."""
    assert main(BASE + ["--model", str(checkpoint), "--prompt", "the quick brown fox", "--max-tokens", "8",
                        "--no-chat-template", "--page-size", "4"]) == 0
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("KV pool: ")]
    tokens = int(line.split()[2])
    assert tokens <= 64 and "the request's worst case" in line and "--kv-tokens N sets it" in line
    assert main(BASE + ["--model", str(checkpoint), "--prompt", "the quick brown fox", "--max-tokens", "8",
                        "--kv-tokens", "1024"]) == 0
    assert "KV pool" not in capsys.readouterr().err   # (what the user set is not said again)


def test_quantization_fp8_gives_the_library_s_fp8_tokens(checkpoint, caplog, tmp_path):
    """``--quantization fp8`` loads the model as ``from_pretrained(..., quantization="fp8")`` does (the same greedy
    tokens); the CPU's de-quantized path is said (a warning of logger treedec)."""
    out = tmp_path / "r.jsonl"
    assert main(BASE + ["--model", str(checkpoint), "--prompt", "the quick brown fox", "--no-chat-template",
                        "--max-tokens", "6", "--out", str(out), "--quantization", "fp8"]) == 0
    [result] = [json.loads(line) for line in out.read_text().splitlines()]
    tokenizer = load_tokenizer(checkpoint)
    model = from_pretrained(checkpoint, dtype=torch.float32, device="cpu", quantization="fp8")
    prompt = encode_prompt(tokenizer, "the quick brown fox", False)
    [expected], _ = generate_batch(Engine(model, kv_tokens=1024, backend="torch"),
                                   [RequestSpec(0, prompt_ids=tuple(prompt),
                                                params=SamplingParams(temperature=0, max_tokens=6))], tokenizer)
    assert result["output_ids"] == expected.output_ids
    assert any(r.levelname == "WARNING" and "8 projection(s) by de-quantize + F.linear" in r.getMessage()
               for r in caplog.records)
