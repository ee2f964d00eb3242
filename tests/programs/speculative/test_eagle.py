"""EAGLE drafters (treedec.models.eagle_drafter, treedec.programs.speculative.eagle) on tiny CPU models.

- The engine returns the inputs of chosen layers (``aux``) equal to transformers' hidden states.
- Drafters in the EAGLE reference layouts: saved with the reference names, loaded back equal, equal
  to an independent dense implementation of the reference network, and bad checkpoints rejected
  with the tensor named.
- Greedy speculative decoding with EAGLE-1 and EAGLE-3 drafters (random ones, and "bigram"
  drafters built to predict a bigram target exactly, so that long paths are accepted) emits
  plain greedy's tokens, alone and batched; the drafter's K/V of its sequence equal one pass of
  the drafter over the target's states (the accepted tokens are recomputed from the target's states).
- Sampled EAGLE drafts with rejection sampling emit the target's distribution (chi-square).
"""
import collections
import dataclasses
import json

import numpy as np
import pytest
import torch

from treedec.engine import CudaGraphConfig, Engine
from treedec.models import ModelConfig, from_config, to_hf_config, to_hf_state_dict
from treedec.models.eagle_drafter import EagleDrafter, default_aux_layers, load_eagle, save_eagle
from treedec.models.loading import CheckpointError, read_state_dict
from treedec.programs.speculative.acceptance import RejectionSampling
from treedec.programs.speculative.eagle import EagleDraft
from treedec.programs.speculative.drafter_batch import DrafterGroup
from treedec.runtime.requests import RequestSpec
from treedec.sampling.params import SamplingParams, sampling_probs
from treedec.programs.greedy import greedy_generate
from treedec.programs.speculative.program import speculative_generate
from treedec.programs.speculative.batch import speculative_batch
from tests.programs.speculative.test_acceptance import passes_chi_square

SIX_LAYERS = dataclasses.replace(ModelConfig.from_name("tiny"), num_layers=6)
PROMPT = [5, 9, 2, 7, 5, 9, 2, 7, 5, 9, 2, 30, 31, 32]


@pytest.fixture(scope="module")
def target():
    return from_config(SIX_LAYERS, seed=3, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def bigram():
    """A target whose next token depends on the current token only: every layer's attention and
    MLP outputs are zeroed, so the residual stream is the token's embedding throughout."""
    model = from_config(SIX_LAYERS, seed=4, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for layer in model.layers:
            layer.o_proj.weight.zero_()
            layer.down_proj.weight.zero_()
    return model


def engine(model, page_size=4, **kw):
    return Engine(model, kv_tokens=2048, page_size=page_size, backend="torch", **kw)


def bigram_eagle(target):
    """EAGLE-1 drafter exact for :func:`bigram`: fc passes the next token's embedding through, the
    layer adds nothing, and the target's lm_head of it is the target's logits after that token."""
    d = EagleDrafter.random(target, "eagle", seed=5)
    H = target.config.hidden_size
    with torch.no_grad():
        d.fc.weight.copy_(torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1))
        d.fc.bias.zero_()
        d.layer.o_proj.weight.zero_()
        d.layer.down_proj.weight.zero_()
    return d


def bigram_eagle3(target, drop=0.1):
    """EAGLE-3 drafter for :func:`bigram`, exact at the first tree layer wherever the answer is in its
    draft vocabulary (all tokens but a random ``drop`` share): fc gives 0, attention copies each
    query's own normed token embedding (q = 4 k: a query's own key wins the softmax), the MLP adds
    nothing, lm_head is the target's rows of the draft vocabulary. (Deeper layers add the parent's
    output in the residual, so they guess worse.)"""
    c = target.config
    keep = torch.sort(torch.randperm(c.vocab_size, generator=torch.Generator().manual_seed(6))
                      [:int(c.vocab_size * (1 - drop))]).values
    d = EagleDrafter.random(target, "eagle3", seed=5, draft_vocab_size=len(keep))
    H, hd, hq, hkv = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
    qkv = torch.zeros(c.qkv_size, 2 * H)
    for g in range(hkv):                                  # kv head g reads embedding dims [g hd, (g + 1) hd)
        block = slice(g * hd, (g + 1) * hd)
        qkv[(hq + g) * hd:(hq + g + 1) * hd, block] = torch.eye(hd)             # k
        qkv[(hq + hkv + g) * hd:(hq + hkv + g + 1) * hd, block] = torch.eye(hd)  # v
        for h in range(g * hq // hkv, (g + 1) * hq // hkv):
            qkv[h * hd:(h + 1) * hd, block] = 4 * torch.eye(hd)                  # q
    o = torch.zeros(H, hq * hd)
    for g in range(hkv):                                  # one query head per group writes its block back
        h = g * hq // hkv
        o[g * hd:(g + 1) * hd, h * hd:(h + 1) * hd] = torch.eye(hd)
    with torch.no_grad():
        d.fc.weight.zero_()
        d.layer.qkv_proj.weight.copy_(qkv)
        d.layer.o_proj.weight.copy_(o)
        d.layer.down_proj.weight.zero_()
        d.lm_head.weight.copy_(target.lm_head.weight[keep])
        d.d2t.copy_(keep - torch.arange(len(keep)))
    return d


# ================================================================ the engine's inner-layer states


def test_aux_states_are_transformers_hidden_states(target):
    """``aux[:, j]`` is the input of layer ``hidden_layers[j]``: transformers' ``hidden_states[i]``;
    rows chosen by ``hidden_rows``, logits by ``logits_rows``."""
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM(to_hf_config(target.config))
    hf.load_state_dict(to_hf_state_dict(target), strict=False)
    ids = list(range(3, 23))
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    e = engine(target)
    assert e.capture_hidden_layers([4, 1]) == (1, 4) and e.capture_hidden_layers([4]) == (1, 4)
    e.tree.add_prompt(ids)
    out = e.step(logits_rows=[19], hidden_rows=list(range(20)), return_hidden=True, return_aux=True)
    assert out.logits.shape == (1, 512) and out.aux.shape == (20, 2, 128) and out.heads is None
    for j, layer in enumerate((1, 4)):
        torch.testing.assert_close(out.aux[:, j], states[layer][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.hidden[-1], states[-1][0, -1], atol=1e-5, rtol=1e-5)   # (normed, in transformers)


@pytest.mark.slow
def test_aux_and_features_in_static_graph_steps(target, triton_device):
    """The padded static (CUDA-graph) steps return the same aux states, and a drafter's graph steps
    read their features from the graph's buffer: equal to eager steps."""
    if triton_device.type == "cuda":
        pytest.skip("the GPU tests capture real graphs")
    d = EagleDrafter.random(target, "eagle3", seed=2, draft_vocab_size=100)
    graphs = CudaGraphConfig(max_queries=32, max_graphs=4, capture=False)
    results = []
    for kw in ({}, {"backend": "triton", "cuda_graphs": graphs}):
        t_engine = Engine(target, kv_tokens=512, page_size=4, **kw)
        d_engine = Engine(d, kv_tokens=512, page_size=4, **kw)
        t_engine.capture_hidden_layers(d.aux_layers)
        root = t_engine.tree.add_prompt(list(range(40, 60)))
        aux = t_engine.step(logits_rows=[19], return_aux=True, hidden_rows=list(range(20))).aux
        node = d_engine.tree.add_prompt(list(range(41, 61)))
        steps = [d_engine.step(logits_rows=[19], return_hidden=True, features=d.fuse(aux))]
        kids = d_engine.tree.add_token_tree(node, [1, 2, 3], [-1, -1, 0])
        rows = d_engine.pending_rows(kids)
        steps.append(d_engine.step(logits_rows=rows, return_hidden=True, features=torch.randn(
            3, 128, generator=torch.Generator().manual_seed(0))))
        t_engine.tree.extend(root, [7])
        last = t_engine.step(return_aux=True)
        results.append([aux] + [t for s in steps for t in (s.logits, s.hidden)] + [last.logits, last.aux])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


def test_step_input_errors(target):
    e = engine(target)
    e.tree.add_prompt([1, 2, 3])
    with pytest.raises(ValueError, match="capture_hidden_layers"):
        e.step(return_aux=True)
    with pytest.raises(ValueError, match="reads token ids only"):
        e.step(features=torch.zeros(3, 128))
    with pytest.raises(ValueError, match="hidden_rows must be query indices"):
        e.step(hidden_rows=[3])
    with pytest.raises(ValueError, match="distinct layer indices in \\[0, 6\\)"):
        e.capture_hidden_layers([6])
    d_engine = engine(EagleDrafter.random(target, "eagle"))
    d_engine.tree.add_prompt([1, 2, 3])
    with pytest.raises(ValueError, match="needs features \\[3, 128\\]"):
        d_engine.step()
    with pytest.raises(ValueError, match="shape \\[3, 128\\]"):
        d_engine.step(features=torch.zeros(2, 128))
    with pytest.raises(ValueError, match="1-D of one length"):
        e.pool.copy_slots(torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
    assert e.tree.num_pending == 3 and d_engine.tree.num_pending == 3   # nothing ran


# ================================================================ reference layouts


EAGLE1_KEYS = {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
               "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight",
               "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
               "layers.0.post_attention_layernorm.weight"}
EAGLE3_KEYS = {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
               "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
               "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
               "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
               "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_reference_layout_round_trip(target, tmp_path, kind):
    d = EagleDrafter.random(target, kind, seed=1, draft_vocab_size=200 if kind == "eagle3" else None)
    folder = save_eagle(d, tmp_path / kind)
    file = folder / ("pytorch_model.bin" if kind == "eagle" else "model.safetensors")
    state = read_state_dict(file)
    assert set(state) == (EAGLE1_KEYS if kind == "eagle" else EAGLE3_KEYS)
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    if kind == "eagle3":
        assert config["draft_vocab_size"] == 200 and state["t2d"].sum() == 200 and state["d2t"].dtype == torch.int64
        assert state["fc.weight"].shape == (128, 3 * 128) and state["midlayer.self_attn.q_proj.weight"].shape[1] == 256
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in d.aux_layers]
    loaded = load_eagle(folder, target, kind)
    assert loaded.kind == kind and loaded.aux_layers == d.aux_layers and loaded.embed_tokens is target.embed_tokens
    for a, b in zip(d.state_dict().values(), loaded.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def dense_reference(state, kind, config, target, tokens, states):
    """The EAGLE reference network written out from the reference tensors: causal attention over
    ``len(tokens)`` queries at positions 0, 1, ...; ``states`` the target's (EAGLE-3: [n, 3, H])."""
    c, eagle3 = config, kind == "eagle3"
    p = "midlayer." if eagle3 else "layers.0."
    w = {k: v.float() for k, v in state.items()}

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps))

    n, d = len(tokens), c.head_dim
    emb = target.embed_tokens.weight[torch.tensor(tokens)].float()
    if eagle3:
        x = states.reshape(n, -1) @ w["fc.weight"].T
        h = torch.cat([rms(emb, w[p + "input_layernorm.weight"]), rms(x, w[p + "hidden_norm.weight"])], -1)
    else:
        x = torch.cat([emb, states], -1) @ w["fc.weight"].T + w["fc.bias"]
        h = x
    q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, c.num_heads, d)
    k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, c.num_kv_heads, d)
    v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, c.num_kv_heads, d)
    inv = 1.0 / c.rope_theta ** (torch.arange(0, d, 2).float() / d)
    ang = torch.arange(n).float()[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

    def rope(t):
        return t * cos + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * sin

    q, k = rope(q), rope(k)
    group = c.num_heads // c.num_kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    x = x + o @ w[p + "self_attn.o_proj.weight"].T
    m = rms(x, w[p + "post_attention_layernorm.weight"])
    g, u = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
    x = x + (torch.nn.functional.silu(g) * u) @ w[p + "mlp.down_proj.weight"].T
    head = w["lm_head.weight"] if eagle3 else target.lm_head.weight
    return (rms(x, w["norm.weight"]) if eagle3 else x) @ head.T, x


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_drafter_equals_the_dense_reference_network(target, tmp_path, kind):
    d = EagleDrafter.random(target, kind, seed=2, draft_vocab_size=300 if kind == "eagle3" else None)
    state = read_state_dict(save_eagle(d, tmp_path, "model.safetensors") / "model.safetensors")
    ids = list(range(50, 75))
    t = engine(target)
    if kind == "eagle3":
        t.capture_hidden_layers(d.aux_layers)
    t.tree.add_prompt(ids)
    target_out = t.step(return_hidden=True, return_aux=kind == "eagle3")
    states = target_out.aux if kind == "eagle3" else target_out.hidden
    de = engine(load_eagle(tmp_path, target))
    de.tree.add_prompt(ids[1:])
    out = de.step(return_hidden=True, features=de.model.fuse(states[:-1]))
    ref_logits, ref_out = dense_reference(state, kind, d.config, target, ids[1:], states[:-1])
    torch.testing.assert_close(out.logits, ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.hidden, ref_out, atol=1e-4, rtol=1e-4)


def test_bad_checkpoints_name_the_problem(target, tmp_path):
    d = EagleDrafter.random(target, "eagle3", seed=1, draft_vocab_size=100)
    folder = save_eagle(d, tmp_path / "e3")
    file = folder / "model.safetensors"
    from safetensors.torch import save_file
    good = read_state_dict(file)
    with pytest.raises(CheckpointError, match="EAGLE-3 drafter, not EAGLE-1/2"):
        load_eagle(folder, target, "eagle")
    save_file({k: v for k, v in good.items() if k != "norm.weight"}, str(file))
    with pytest.raises(CheckpointError, match="missing \\['norm.weight'\\]"):
        load_eagle(folder, target)
    save_file({**good, "midlayer.mlp.up_proj.weight": torch.zeros(256, 64)}, str(file))
    with pytest.raises(CheckpointError, match="'midlayer.mlp.up_proj.weight' has shape \\[256, 64\\], expected "
                                              "\\[256, 128\\]"):
        load_eagle(folder, target)
    save_file({**good, "d2t": good["d2t"] + 1}, str(file))
    with pytest.raises(CheckpointError, match="'d2t' and 't2d' disagree"):
        load_eagle(folder, target)
    other = from_config(dataclasses.replace(SIX_LAYERS, vocab_size=600), dtype=torch.float32, device="cpu")
    save_file(good, str(file))
    with pytest.raises(CheckpointError, match="600 tokens"):
        load_eagle(folder, other)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_eagle(tmp_path, target)
    (tmp_path / "e1").mkdir()
    (tmp_path / "e1" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no EAGLE weights"):
        load_eagle(tmp_path / "e1", target)
    assert default_aux_layers(32) == (2, 16, 29)


# ================================================================ speculative decoding


DRAFTERS = {
    "eagle-random": lambda t: EagleDrafter.random(t, "eagle", seed=1),
    "eagle3-random": lambda t: EagleDrafter.random(t, "eagle3", seed=1, draft_vocab_size=300),
    "eagle-bigram": bigram_eagle,
    "eagle3-bigram": bigram_eagle3,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_eagle_equals_greedy(target, bigram, name, page_size):
    model = bigram if "bigram" in name else target
    want = greedy_generate(engine(model, page_size), PROMPT, 30, eos_token_id=None)
    # 2 + 4 + 4 + 4 nodes: all kept, so the drafter's best path is in the tree
    draft = EagleDraft(engine(DRAFTERS[name](model), page_size), depth=4, top_k=2, total_tokens=14)
    tokens, stats = speculative_generate(engine(model, page_size), PROMPT, draft, 30, eos_token_id=None)
    assert tokens == want
    if name == "eagle-bigram":                     # every draft right; the tree's 2 best per layer may miss
        assert stats.tokens_per_step >= 4.0 and max(stats.accepted) == 4
    elif name == "eagle3-bigram":                  # right at depth 1 unless the answer is not a draft token
        assert stats.tokens_per_step >= 2.0


@pytest.mark.parametrize("kind,depth", [("eagle", 4), ("eagle3", 5), ("eagle3", 1)])
def test_chained_drafting_grows_the_tree_layer_by_layer_drafting_grows(target, kind, depth):
    """The chained drafter steps (launched without a wait, frontier chosen on the device, chains'
    K/V regathered) propose the tree that expand_by_logprob grows one read-back layer at a time."""
    from treedec.programs.speculative.drafts import TargetOutput
    from treedec.programs.speculative.tree_drafting import EngineTreeDraft

    d = EagleDrafter.random(target, kind, seed=3, draft_vocab_size=300 if kind == "eagle3" else None, std=0.2)
    t = engine(target)
    if kind == "eagle3":
        t.capture_hidden_layers(d.aux_layers)
    t.tree.add_prompt(PROMPT)
    target_out = t.step(logits_rows=[0], hidden_rows=list(range(len(PROMPT))), return_hidden=True,
                        return_aux=kind == "eagle3")
    seq = PROMPT + [17]
    proposals = []
    for propose in (EagleDraft.propose, EngineTreeDraft.propose):
        draft = EagleDraft(engine(d), depth=depth, top_k=3, total_tokens=10)
        draft.start(t)
        draft.observe(TargetOutput(seq, None, None, target_out.aux if kind == "eagle3" else target_out.hidden))
        tree, tokens = propose(draft, seq)
        proposals.append((tree.parents, tokens))
        assert draft.engine.tree.num_pending == 0
    assert proposals[0] == proposals[1] and len(proposals[0][1]) == (4 if depth == 1 else 11)


def test_drafter_kv_equals_one_pass_over_the_target_states(bigram):
    """After a run with long accepted paths, the drafter's K/V of its sequence are those of one drafter
    pass over the target's states at every token: accepted tokens were recomputed from the target's
    states, paired with the right next tokens at the right positions."""
    d = bigram_eagle3(bigram)
    draft = EagleDraft(engine(d), depth=4, top_k=2, total_tokens=14)
    t = engine(bigram)
    tokens, stats = speculative_generate(t, PROMPT, draft, 25, eos_token_id=None)
    assert max(stats.accepted) >= 2 and sum(stats.accepted) >= 8
    de = draft.engine
    seq = PROMPT + tokens
    mine = de.tree.sequence(draft.node)
    assert mine == seq[1:len(mine) + 1]
    fresh_t = engine(bigram)
    fresh_t.capture_hidden_layers(d.aux_layers)
    fresh_t.tree.add_prompt(seq[:len(mine)])
    aux = fresh_t.step(logits_rows=[0], hidden_rows=list(range(len(mine))), return_aux=True).aux
    fresh = engine(d)
    node = fresh.tree.add_prompt(mine)
    fresh.step(logits_rows=[0], features=d.fuse(aux))
    for a, b in ((de.pool.k, fresh.pool.k), (de.pool.v, fresh.pool.v)):
        a = a.reshape(1, -1, *a.shape[3:])[:, torch.as_tensor(de.tree.slots(draft.node))]
        b = b.reshape(1, -1, *b.shape[3:])[:, torch.as_tensor(fresh.tree.slots(node))]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_batched_eagle_requests_equal_one_at_a_time(bigram):
    """Five requests (two share a long system prompt: EAGLE requests compute their prompts alone)
    with EAGLE-1 and EAGLE-3 drafts in one scheduler run, the drafts of each kind sharing one drafter
    engine: each equals its greedy decoding."""
    system = list(range(100, 140))
    prompts = [system + [1, 2, 3], system + [4, 5], [7, 8, 9, 10], PROMPT, [3, 3, 3]]
    specs = [RequestSpec(id=str(i), prompt_ids=tuple(p), params=SamplingParams(max_tokens=12 + i, temperature=0.0))
             for i, p in enumerate(prompts)]
    e1, e3 = engine(bigram_eagle(bigram)), engine(bigram_eagle3(bigram))

    def draft(spec):
        return EagleDraft(e1 if int(spec.id) % 2 else e3, depth=3, top_k=2, total_tokens=10)
    results, stats = speculative_batch(engine(bigram), specs, draft)
    for spec, result in zip(specs, results):
        assert result.output_ids == greedy_generate(engine(bigram), spec.prompt_ids, spec.params.max_tokens,
                                                              eos_token_id=None)
    assert stats.shared_prefix_tokens == 0 and max(stats.programs_per_step) == 5
    # drafted together: one drafter step per tree layer for the requests of a pass (fewer drafts than requests)
    for e in (e1, e3):
        group = DrafterGroup.of(e)
        assert group.stats["requests"] > group.stats["flushes"] > 0, group.stats
    # each request's drafter pages (its sequence, its chains' scratch slots) freed at its end
    assert all(e.tree.num_nodes == 0 and e.pool.num_free_pages == e.pool.num_pages for e in (e1, e3))


@pytest.mark.slow
def test_sampled_eagle_speculation_emits_the_target_distribution(bigram):
    """The bigram EAGLE-3 drafter samples its trees at temperature 1.3 (its distributions differ from
    the target's, and are zero outside its draft vocabulary); rejection sampling at temperature 0.8,
    top-k 3 given those distributions: the first two emitted tokens follow the target's."""
    params = SamplingParams(temperature=0.8, top_k=3)
    draft = EagleDraft(engine(bigram_eagle3(bigram)), depth=2, top_k=2, total_tokens=4,
                       sample=SamplingParams(temperature=1.3, top_k=4))
    t = engine(bigram)
    runs, accepted = [], 0
    for seed in range(500):
        tokens, stats = speculative_generate(t, PROMPT, draft, 2, RejectionSampling(0.8, top_k=3, seed=seed),
                                             eos_token_id=None)
        t.tree.prune(stats.node)
        runs.append(tokens)
        accepted += sum(stats.accepted)
    assert accepted > 200 and draft.draft_probs.shape[1] == 512
    logits = t.prefill(PROMPT).logits
    first = np.bincount([r[0] for r in runs], minlength=512).astype(float)
    assert passes_chi_square(first, sampling_probs(logits, params).double().numpy())
    a, count = collections.Counter(r[0] for r in runs).most_common(1)[0]
    logits = t.prefill(PROMPT + [a]).logits
    second = np.bincount([r[1] for r in runs if r[0] == a], minlength=512).astype(float)
    assert count > 100 and passes_chi_square(second, sampling_probs(logits, params).double().numpy())


def test_eagle_draft_errors(target):
    d = EagleDrafter.random(target, "eagle")
    with pytest.raises(TypeError, match="must run an EagleDrafter"):
        EagleDraft(engine(target))
    draft = EagleDraft(engine(d))
    with pytest.raises(ValueError, match="target's states"):
        draft.propose([1, 2, 3])
    t = engine(target)
    with pytest.raises(ValueError, match="its own Engine"):
        speculative_generate(draft.engine, [1, 2], draft, 3)
    other = from_config(dataclasses.replace(SIX_LAYERS, hidden_size=64, num_heads=2, num_kv_heads=1),
                        dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="hidden size 128, this target has 512 and 64"):
        speculative_generate(engine(other), [1, 2], draft, 3)
    assert t.tree.num_pending == 0 and t.tree.num_nodes == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("compile_model", [False, True])
def test_eagle_in_captured_graphs_equals_eager(kind, compile_model):
    """Target and drafter both in CUDA graphs (the target's aux states and the drafter's features
    through the graphs' buffers, optionally torch.compile'd): the same tokens and accepted lengths as
    eager engines, greedy == plain greedy, and every verification and drafter step a graph replay."""
    model = from_config(SIX_LAYERS, seed=4, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():   # a bigram target (see the fixture) so that drafts are accepted
        for layer in model.layers:
            layer.o_proj.weight.zero_()
            layer.down_proj.weight.zero_()
    drafter = (bigram_eagle if kind == "eagle" else bigram_eagle3)(model)   # (logits depend on the last token only)
    prompt = np.random.default_rng(3).integers(0, 512, 600).tolist()
    want = greedy_generate(Engine(model, kv_tokens=4096, page_size=16), prompt, 40, eos_token_id=None)
    runs = []
    for graphs in (False, True):
        kw = {"kv_tokens": 4096, "page_size": 16, "cuda_graphs": graphs,
              "compile_model": compile_model and graphs}
        target, draft_engine = Engine(model, **kw), Engine(drafter, **kw)
        tokens, stats = speculative_generate(target, prompt, EagleDraft(draft_engine, depth=4, top_k=2,
                                                                        total_tokens=14), 40, eos_token_id=None)
        if graphs:
            for e in (target, draft_engine):
                assert not [k for k in e.graph_stats if k.startswith("eager") and "max_queries" not in k], \
                    e.graph_stats
            assert target.graph_stats["replays"] >= stats.steps
            # per proposal: the sync step (a replay) and the drafting chain (one graph of depth - 1 steps)
            assert draft_engine.graph_stats["replays"] >= stats.steps - 1   # (the first sync: the prompt, eager)
            assert draft_engine.graph_stats["chain_replays"] == stats.steps
        runs.append((tokens, stats.accepted))
    assert runs[0][0] == runs[1][0] == want
    assert sum(runs[1][1]) > 20
