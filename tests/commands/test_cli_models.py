"""Every command that loads a checkpoint takes every model form in ``--model`` (and ``spec --draft-model``): a
``.gguf`` file (converted once into the cache), a hub repo id in the local hub cache, a folder; what it resolved
to is said on stderr; what names nothing is refused when the arguments are parsed, in one line that lists the
known names and the accepted forms. Tiny local fixtures on the CPU (the real ``smollm2``: tests/models)."""
import json

import pytest

gguf = pytest.importorskip("gguf")

from tests.gguf_files import write_gguf  # noqa: E402
from tests.models.test_catalog import hub_layout  # noqa: E402
from tests.models.test_llama import tiny_hf  # noqa: E402
from tests.tokenizers_local import build_tokenizer  # noqa: E402
from treedec.cli import main  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TREEDEC_PLANNER", "numpy")   # not a build of the compiled planner into the empty cache
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", heads=(1, 1))   # head dim 64


@pytest.fixture
def hub_repo(tmp_path, monkeypatch):
    """``org/tiny`` in a local hub cache layout: a tiny Llama with a tokenizer."""
    from huggingface_hub import constants

    folder = tmp_path / "checkpoint"
    tiny_hf("llama", seed=4, vocab_size=400).save_pretrained(folder)   # (the tokenizer's 400 tokens)
    build_tokenizer(folder)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_layout(tmp_path / "hub", "org/tiny", folder)


def test_spec_takes_a_gguf_file_as_the_model_and_the_draft_model(gguf_file, cache, tmp_path, capsys):
    out = tmp_path / "spec.json"
    assert main(["spec", "--model", str(gguf_file), "--device", "cpu", "--dtype", "fp32", "--prompt", "ab ab ab",
                 "--speculative", "draft_model", "--draft-model", str(gguf_file), "--check", "--max-tokens", "6",
                 "--backend", "torch", "--no-progress", "--out", str(out)]) == 0
    printed, err = capsys.readouterr()
    [checkpoint] = (cache / "gguf").iterdir()
    assert f"model: {gguf_file} -> {checkpoint} (converted from the GGUF file {gguf_file})" in err
    assert err.count("converting tiny.gguf") == 1   # once: the draft model reads the cached conversion
    assert "check: equal to plain greedy decoding" in printed
    assert json.loads(out.read_text())["check"]["equal"]


def test_generate_takes_a_hub_repo_id_and_its_tokenizer(hub_repo, cache, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "the quick brown fox", "max_tokens": 4, "temperature": 0}) + "\n")
    out = tmp_path / "results.jsonl"
    assert main(["generate", "--model", "org/tiny", "--device", "cpu", "--backend", "torch", "--prompts", str(prompts),
                 "--out", str(out)]) == 0
    assert f"model: org/tiny -> {hub_repo} (the local Hugging Face hub cache's snapshot)" in capsys.readouterr().err
    [result] = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(result["output_ids"]) == 4 and isinstance(result["text"], str)
    assert not cache.exists()


@pytest.mark.parametrize("command", [["generate", "--prompts", "PROMPTS", "--out", "OUT"], ["spec"], ["tot"],
                                     ["replay", "fewshot"]])
@pytest.mark.parametrize("model, fragment", [("nosuchmodel", "'nosuchmodel' is not a known name"),
                                             ("org/nosuch", "`hf download org/nosuch`")])
def test_a_model_that_names_nothing_is_refused_when_parsed(command, model, fragment, tmp_path, capsys, monkeypatch):
    for module in ("treedec.commands.args", "treedec.commands.generate", "treedec.commands.replay",
                   "treedec.commands.spec", "treedec.commands.tot"):
        monkeypatch.setattr(f"{module}.load_model", lambda args: pytest.fail("loaded a model"))
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2]}\n')
    argv = [{"PROMPTS": str(tmp_path / "p.jsonl"), "OUT": str(tmp_path / "o.jsonl")}.get(a, a) for a in command]
    assert main([*argv, "--model", model]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"treedec {command[0]}: error: argument --model: ")
    assert fragment in err and "known name (smollm2, gemma3-270m)" in err and "a .gguf file" in err


@pytest.mark.parametrize("kind", ["gpt2", "awq"])
def test_a_checkpoint_treedec_does_not_run_is_one_line(kind, tmp_path, cache, capsys):
    """Issue 48's front door: an unsupported family or a quantized checkpoint is a documented limit, said in one
    line (exit 2), not an unexpected error."""
    folder = tmp_path / kind
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=100)).save_pretrained(folder)
    else:
        tiny_hf("llama", seed=4).save_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2]}\n')
    assert main(["generate", "--model", str(folder), "--device", "cpu", "--prompts", str(tmp_path / "p.jsonl"),
                 "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("treedec generate: error: ") and "unexpected" not in err[-1]
    assert ("is not supported; treedec runs Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5: LlamaForCausalLM" if kind == "gpt2" else
            "quantized with 'awq': a quantized (AWQ, GPTQ") in err[-1]
