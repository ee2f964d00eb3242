"""The treedec decoder against transformers: tree steps == each root-to-leaf path run alone; RoPE scaling."""
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaRotaryEmbedding
from transformers.models.mistral.modeling_mistral import MistralForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM

from treedec.engine import Engine
from treedec.models import RopeScaling, config_from_hf, from_hf_model
from treedec.models.rope import rope_cos_sin, rope_inv_freq

ATOL = 1e-4
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=512, attn_implementation="eager")
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def randomize(hf_model, seed: int):
    """Random weights everywhere (norms near 1, biases non-zero), so that every tensor matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.05 * noise)
    return hf_model.eval()


def tiny_hf(kind: str = "llama", seed: int = 0, **overrides):
    if kind == "llama":
        return randomize(LlamaForCausalLM(LlamaConfig(**{**TINY, "rope_parameters": LLAMA31_ROPE, **overrides})), seed)
    if kind == "qwen2":
        cfg = Qwen2Config(**{**TINY, "tie_word_embeddings": True, "rms_norm_eps": 1e-6, **overrides})
        return randomize(Qwen2ForCausalLM(cfg), seed)
    cfg = MistralConfig(**{**TINY, "sliding_window": None, **overrides})
    return randomize(MistralForCausalLM(cfg), seed)


def hf_logits(hf_model, sequence) -> torch.Tensor:
    """transformers' logits of the last token of ``sequence``, run alone (positions 0..n-1)."""
    with torch.no_grad():
        return hf_model(torch.tensor([sequence])).logits[0, -1]


def check_step(engine: Engine, hf_model, logits_rows=None) -> int:
    """Run a step and compare every query's logits with transformers on its own path."""
    layout = engine.tree.layout()
    nodes, positions = layout.node_ids[layout.query_node], layout.query_position
    rows = np.arange(layout.num_queries) if logits_rows is None else np.asarray(logits_rows)
    sequences = [engine.tree.sequence(int(nodes[r]))[: positions[r] + 1] for r in rows]
    logits = engine.step(logits_rows=logits_rows).logits
    assert logits.shape == (len(rows), hf_model.config.vocab_size)
    for i, seq in enumerate(sequences):
        torch.testing.assert_close(logits[i], hf_logits(hf_model, seq), atol=ATOL, rtol=0)
    return len(rows)


@pytest.mark.parametrize("seed,page_size", [(0, 1), (1, 4), (2, 16)])
def test_tree_steps_match_transformers_per_path(seed, page_size):
    """Prefill of two prompts (a forest), then steps with branching, a token tree, a prompt
    continuation under an inner node, pruning: every query's logits equal transformers' run on
    its root-to-query path alone."""
    rng = np.random.default_rng(seed)
    hf = tiny_hf("llama", seed)
    engine = Engine(from_hf_model(hf), kv_tokens=1024, page_size=page_size, backend="torch", prefill_chunk=16)
    tree, vocab = engine.tree, hf.config.vocab_size

    def toks(n):
        return rng.integers(0, vocab, n).tolist()

    prompts = [toks(int(rng.integers(5, 40))), toks(int(rng.integers(3, 10)))]
    roots = []
    for p in prompts:
        prefilled = engine.prefill(p)
        torch.testing.assert_close(prefilled.logits, hf_logits(hf, p), atol=ATOL, rtol=0)
        roots.append(prefilled.node)

    # step 1: branch the first request, extend the second
    kids = tree.branch(roots[0], [toks(int(rng.integers(1, 4))) for _ in range(3)])
    tree.extend(roots[1], toks(1))
    check_step(engine, hf)

    # step 2: a speculative token tree under one branch, one token on every other live leaf
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, 9)]
    token_tree = tree.add_token_tree(kids[0], toks(len(parents)), parents)
    tree.extend_many({leaf: toks(1) for leaf in tree.live_leaves() if leaf not in token_tree})
    check_step(engine, hf)

    # step 3: a prompt continuation under an inner node, one token on some leaves; only some logits
    tree.branch(kids[1], [toks(7)])
    tree.extend_many({leaf: toks(1) for leaf in tree.live_leaves()[:3]})
    num_q = tree.layout().num_queries
    check_step(engine, hf, logits_rows=rng.choice(num_q, size=4, replace=False))

    # step 4: prune the token tree but its first path, then extend every live leaf
    for child in tree.children(token_tree[0])[1:]:
        tree.prune(child)
    tree.extend_many({leaf: toks(1) for leaf in tree.live_leaves()})
    check_step(engine, hf)
    tree.check_invariants()


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_other_architectures_match_transformers(kind):
    """Qwen2 (q/k/v biases, tied embeddings) and Mistral run as Llama does."""
    hf = tiny_hf(kind, seed=3)
    engine = Engine(from_hf_model(hf), kv_tokens=256, page_size=8, backend="torch")
    prefilled = engine.prefill(list(range(3, 20)))
    torch.testing.assert_close(prefilled.logits, hf_logits(hf, list(range(3, 20))), atol=ATOL, rtol=0)
    engine.tree.branch(prefilled.node, [[5], [6, 7]])
    check_step(engine, hf)


def test_llama_attention_and_mlp_bias():
    hf = tiny_hf("llama", seed=4, attention_bias=True, mlp_bias=True)
    config = config_from_hf(hf.config)
    assert config.qkv_bias and config.o_bias and config.mlp_bias
    engine = Engine(from_hf_model(hf), kv_tokens=256, backend="torch")
    root = engine.prefill([1, 2, 3, 4]).node
    engine.tree.branch(root, [[9], [8]])
    check_step(engine, hf)


def test_reference_backend_agrees():
    hf = tiny_hf("llama", seed=5)
    engine = Engine(from_hf_model(hf), kv_tokens=256, backend="reference")
    root = engine.prefill([1, 2, 3, 4, 5]).node
    engine.tree.add_token_tree(root, [6, 7, 8, 9], [-1, 0, 0, 1])
    check_step(engine, hf)


# ----------------------------------------------------------------------------- RoPE


ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3.1": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "llama3-short": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 16.0, "low_freq_factor": 2.0,
                     "high_freq_factor": 8.0, "original_max_position_embeddings": 1024},
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_matches_transformers(case, head_dim):
    hf_config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                            max_position_embeddings=131072, rope_parameters=dict(ROPE_CASES[case]))
    config = config_from_hf(hf_config)
    inv_freq = rope_inv_freq(config)
    if case == "default":
        expected = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)[0]
    else:
        expected = ROPE_INIT_FUNCTIONS[ROPE_CASES[case]["rope_type"]](hf_config)[0]
    assert torch.equal(inv_freq, expected)
    positions = torch.arange(0, 10001)
    for dtype in (torch.float32, torch.bfloat16):
        cos_ref, sin_ref = LlamaRotaryEmbedding(hf_config)(torch.zeros(1, dtype=dtype), positions[None])
        cos, sin = rope_cos_sin(inv_freq, positions, dtype)
        assert torch.equal(cos, cos_ref[0]) and torch.equal(sin, sin_ref[0])


def test_rope_config_reading():
    c = config_from_hf(LlamaConfig(rope_parameters=dict(ROPE_CASES["llama3.1"]), max_position_embeddings=131072))
    assert c.rope_theta == 500000.0 and c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    with pytest.raises(NotImplementedError, match="yarn"):
        config_from_hf(LlamaConfig(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}))
    assert config_from_hf(Qwen2Config(use_sliding_window=False)).sliding_window is None
    assert config_from_hf(MistralConfig(sliding_window=4096)).sliding_window == 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rms_norm_is_transformers_bit_for_bit(dtype, rows):
    """fp32 takes torch's one-call rms_norm, half precision the composite: both equal LlamaRMSNorm exactly."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from treedec.models.layers import rms_norm

    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    reference = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    with torch.no_grad():
        reference.weight.copy_(1 + 0.1 * torch.randn(576, generator=gen))
        assert torch.equal(rms_norm(x, reference.weight, 1e-5), reference(x))
