"""The real Gemma 3 270M (the known model ``gemma3-270m``: its GGUF file in four chunk packages of the package
index, Q4_K_M, assembled and converted once; both sides read the same de-quantized float32 tensors): greedy
decoding on the engine equals transformers' ``generate`` on the CPU, and the front doors take the name
(``LLM("gemma3-270m")``, ``treedec spec --model gemma3-270m``). Slow: the first run fetches ~240 MB and converts
(minutes); later runs read the cache."""
import json

import pytest
import torch

from treedec.errors import ModelUnavailableError

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoint():
    from treedec.models import resolve_model
    try:
        return resolve_model("gemma3-270m").checkpoint
    except (ModelUnavailableError, ImportError) as e:   # no package index here; gguf not installed
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from treedec.models import load_tokenizer
    return load_tokenizer(checkpoint)


@pytest.mark.slow
def test_gemma3_270m_is_what_its_config_says(checkpoint, tokenizer):
    from treedec.models import from_pretrained
    model = from_pretrained(checkpoint, dtype=torch.float32, device="cpu")
    c = model.config
    assert (c.model_type, c.num_layers, c.hidden_size, c.head_dim, c.num_kv_heads) == ("gemma3_text", 18, 640, 256, 1)
    assert c.layer_types.count("full") == 3 and (c.sliding_window, c.local_rope_theta, c.rope_theta) == (512, 1e4, 1e6)
    assert [v.window for v in model.attention_variants()][:6] == [512] * 5 + [None]
    assert model.eos_token_ids == (1,) and tokenizer.bos_token_id == 2


@pytest.mark.slow
def test_gemma3_270m_greedy_equals_transformers(checkpoint, tokenizer):
    from transformers import AutoModelForCausalLM

    from treedec.engine import Engine
    from treedec.models import from_pretrained
    from treedec.programs.greedy import greedy_generate

    model = from_pretrained(checkpoint, dtype=torch.float32, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        ours = greedy_generate(Engine(model, kv_tokens=512, backend="torch"), ids, NEW_TOKENS)
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 min_new_tokens=NEW_TOKENS)[0, len(ids):].tolist()
        assert ours == theirs, (prompt, tokenizer.decode(ours), tokenizer.decode(theirs))


@pytest.mark.slow
def test_the_front_doors_take_the_name(checkpoint, tmp_path, capsys):
    from treedec import LLM, SamplingParams
    from treedec.cli import main

    llm = LLM("gemma3-270m", device="cpu", kv_tokens=2048)
    [out] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0))
    assert out.outputs[0].text.startswith(" the capital of")
    results = tmp_path / "spec.json"
    assert main(["spec", "--model", "gemma3-270m", "--device", "cpu", "--dtype", "fp32", "--backend", "torch",
                 "--prompt", PROMPTS[1], "--speculative", "ngram", "--check", "--max-tokens", "12", "--no-progress",
                 "--out", str(results)]) == 0
    assert "check: equal to plain greedy decoding" in capsys.readouterr().out
    assert json.loads(results.read_text())["check"]["equal"]
