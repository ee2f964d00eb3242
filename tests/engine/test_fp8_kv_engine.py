"""Engines and programs on an fp8 (e4m3) KV pool (Engine(kv_cache_dtype="fp8"), engine/kv_cache.py).

The tiny random model's next-token distributions are nearly flat (its logits' spread is ~0.25 and the median gap
between the first two tokens ~0.06), so fp8 K/V (about 2**-4 relative error a value) flip some argmaxes: the budget
on it, teacher-forced over 92 steps against the fp32 pool, is a top-1 agreement >= 85%, logits within 0.1 and a mean
KL(fp32 || fp8) <= 1e-3 (measured: 94%, 0.032, 2e-5). Every program is exact against itself on the same fp8 pool:
speculative decoding (each draft source) equals plain greedy, beams and ToT equal their runs alone, the prefix cache
changes nothing, the server returns the offline outputs."""
import warnings

import numpy as np
import pytest
import torch

from tests.engines import tiny_model
from treedec import LLM, BeamSearchParams, SamplingParams
from treedec.engine import Engine
from treedec.engine.pool_sizing import cpu_pool_tokens, kv_bytes_per_token
from treedec.models import from_config
from treedec.programs import beam_search
from treedec.programs.tot import BFSConfig, ByteTokenizer, tot_bfs
from treedec.programs.tot.game24 import Game24Task
from treedec.tree.kv_cache_dtype import FP8_E4M3, FP8_E4M3_MAX

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], [5, 6, 7, 8, 1, 2]]
TEXT = [int(t) for t in torch.randint(1, 500, (100,), generator=torch.Generator().manual_seed(0))]


def engine(kv_cache_dtype="fp8", model=None, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # (the CPU's de-quantization warning: its own test)
        return Engine(model or tiny_model(), kv_tokens=2048, page_size=4, backend="torch",
                      kv_cache_dtype=kv_cache_dtype, **kwargs)


def teacher_forced_logits(e: Engine, text=TEXT, first=8) -> torch.Tensor:
    root = e.prefill(text[:first])
    out = [root.logits.reshape(-1, root.logits.shape[-1])[-1]]
    for t in text[first:]:
        e.tree.extend(root.node, [t])
        out.append(e.step().logits[0])
    return torch.stack(out).float()


def within_budget(reference: torch.Tensor, fp8: torch.Tensor) -> None:
    agree = (reference.argmax(-1) == fp8.argmax(-1)).float().mean()
    logp, logq = reference.log_softmax(-1), fp8.log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean()
    assert agree >= 0.85 and (reference - fp8).abs().max() <= 0.1 and kl <= 1e-3, f"{agree=}, {kl=}"


def llm(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(tiny_model(), kv_tokens=2048, page_size=4, backend="torch", kv_cache_dtype="fp8", **kwargs)


def test_an_fp8_engine_says_what_it_stores_and_warns_once_on_the_cpu():
    with pytest.warns(UserWarning, match="an fp8 KV cache on the CPU .* de-quantizes"):
        e = Engine(tiny_model(), kv_tokens=512, page_size=4, backend="torch", kv_cache_dtype="fp8_e4m3")
    assert e.pool.k.dtype == FP8_E4M3 and e.kv_cache_dtype == "fp8_e4m3"
    assert e.kv_scale_source.startswith("1.0") and all(a.variant.fp8_kv for a in e.attention.layer_attn)
    plain = engine("auto")
    assert plain.kv_cache_dtype == "auto (float32)" and plain.kv_scale_source is None and plain.pool.kv_scale is None
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        engine("int8")


def test_teacher_forced_logits_within_the_budget_of_the_fp32_pool():
    within_budget(teacher_forced_logits(engine("auto")), teacher_forced_logits(engine()))


def test_calibrated_scales_are_each_head_s_amax_over_448():
    e = engine()
    scales = e.calibrate_kv_scales([TEXT[:40], TEXT[40:60]])
    assert scales.shape == (2, 2, 2) and torch.equal(e.pool.kv_scale, scales) and e.kv_scale_source.startswith("calib")
    amax = torch.zeros(2, 2, 2)

    def record(layer, q, k, v):   # layer 0's K/V of the first prompt (its output is not attention: layer 1's differ)
        amax[layer, 0] = k.abs().amax(dim=(0, 2))
        amax[layer, 1] = v.abs().amax(dim=(0, 2))
        return q
    tokens = torch.tensor(TEXT[:40])
    tiny_model()(tokens, torch.arange(40), record, tokens.new_zeros(1))
    assert (scales[0] * FP8_E4M3_MAX >= amax[0] * (1 - 1e-6)).all()   # at least the first prompt's (the second's too)
    within_budget(teacher_forced_logits(engine("auto")), teacher_forced_logits(e))
    with pytest.raises(ValueError, match="the KV pool holds tokens already"):
        e.calibrate_kv_scales([TEXT[:5]])
    with pytest.raises(ValueError, match="token ids must be ints"):
        engine().calibrate_kv_scales([[10**6]])
    with pytest.raises(ValueError, match="takes no scales"):
        engine("auto").calibrate_kv_scales([TEXT[:5]])


def test_the_same_memory_holds_twice_the_tokens():
    bf16 = from_config("tiny", seed=0, dtype=torch.bfloat16)
    assert kv_bytes_per_token(bf16, "auto") == 2 * kv_bytes_per_token(bf16, "fp8")
    budget = 64 * kv_bytes_per_token(bf16, "auto") * 1000   # a memory cap that cuts both pools
    sizes = {kv: cpu_pool_tokens(bf16, 16, 4096, [40_000] * 4, kv_cache_dtype=kv).tokens for kv in ("auto", "fp8")}
    assert sizes["fp8"] >= 1.9 * sizes["auto"] or sizes["auto"] * kv_bytes_per_token(bf16) < budget
    pools = {kv: engine(kv, bf16).pool for kv in ("auto", "fp8")}
    assert pools["auto"].bytes_per_token / pools["fp8"].bytes_per_token == 2.0
    assert pools["fp8"].k.numel() * pools["fp8"].k.element_size() * 2 == \
        pools["auto"].k.numel() * pools["auto"].k.element_size()


@pytest.mark.slow
@pytest.mark.parametrize("config", [{"method": "ngram", "num_speculative_tokens": 4},
                                    {"method": "eagle", "model": "random", "num_speculative_tokens": 3},
                                    {"method": "medusa", "model": "random", "medusa_choices": [[0], [0, 0], [1]]}],
                         ids=["ngram", "eagle", "medusa"])
def test_speculative_decoding_on_an_fp8_pool_equals_its_plain_greedy(config):
    params = SamplingParams(temperature=0, max_tokens=10)
    plain = llm().generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    spec = llm(speculative_config=config)
    out = spec.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert spec.engine.pool.num_free_pages == spec.engine.pool.num_pages


@pytest.mark.slow
def test_a_draft_model_and_a_fixed_tree_on_an_fp8_pool():
    from treedec.programs.speculative import DraftModelDraft, GreedyAcceptance, TreeDraft, speculative_generate
    from treedec.tree.token_tree import TokenTree
    target = engine()
    root = target.prefill(PROMPTS[0])
    greedy = [int(root.logits.argmax())]
    while len(greedy) < 12:
        target.tree.extend(root.node, greedy[-1:])
        greedy.append(int(target.step().logits[0].argmax()))
    draft_model = DraftModelDraft(engine(model=from_config("tiny", seed=1, dtype=torch.float32)), depth=3, top_k=2)
    tree = TreeDraft(TokenTree.from_medusa_choices([[0], [0, 0], [0, 0, 0]]), lambda context: greedy[:3])
    for draft in (draft_model, tree):
        tokens, _ = speculative_generate(engine(), PROMPTS[0], draft, 12, GreedyAcceptance(), eos_token_id=None)
        assert tokens == greedy


@pytest.mark.slow
def test_beams_and_tot_on_an_fp8_pool_equal_their_runs_alone():
    model = llm()
    first, second = model.beam_search(PROMPTS[1:], BeamSearchParams(beam_width=3, max_tokens=5))
    for result, prompt in zip((first, second), PROMPTS[1:]):
        alone = beam_search(engine(), prompt, 3, 5)
        assert [s.tokens for s in result.sequences] == [prompt + seq for seq in alone.sequences]
    task = Game24Task([4, 9, 10, 13], check_steps=False, thought_max_tokens=3, value_max_tokens=2)
    config = BFSConfig(k=2, n=1, depth=2, sampling=SamplingParams(temperature=0.5), seed=1)
    a, b = (tot_bfs(engine(), task, ByteTokenizer(), config) for _ in range(2))
    assert [s.thoughts for s in a.best] == [s.thoughts for s in b.best]


def test_the_prefix_cache_on_fp8_pages_changes_no_output():
    params = SamplingParams(temperature=0, max_tokens=6)
    prompts = [{"prompt_token_ids": PROMPTS[0] + [3, 4]}, {"prompt_token_ids": PROMPTS[0] + [9]}]
    cached, plain = llm(enable_prefix_caching=True), llm()
    cached.generate(prompts[:1], params, use_tqdm=False)
    again = cached.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids
                                                        for o in plain.generate(prompts, params, use_tqdm=False)]
    assert all(o.stats["cached_tokens"] > 0 for o in again)


def test_pipelined_speculative_steps_move_fp8_kv_on_the_device_as_eager_ones():
    """copy_slots of accepted drafts inside the speculative loop (the pipelined path moves them on the device)."""
    a = llm(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    out = a.generate({"prompt_token_ids": PROMPTS[0] * 3}, SamplingParams(temperature=0, max_tokens=16),
                     use_tqdm=False)
    plain = llm().generate({"prompt_token_ids": PROMPTS[0] * 3}, SamplingParams(temperature=0, max_tokens=16),
                           use_tqdm=False)
    assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert sum(out[0].stats["accepted"]) > 0


# ----------------------------------------------------------------------------- GPU


def _gpu_tree_steps(e: Engine, seed=1) -> list[torch.Tensor]:
    from treedec.workloads.deft import medusa_tree
    gen = np.random.default_rng(seed)
    medusa = medusa_tree(64)
    out = []
    root = e.prefill(gen.integers(0, 512, 3000).tolist()).node
    for _ in range(6):
        ids = e.tree.add_token_tree(root, gen.integers(0, 512, 64).tolist(), medusa.parents)
        out.append(e.step().logits)
        e.tree.prune(ids[0])
        e.tree.extend(root, gen.integers(0, 512, int(gen.integers(1, 300))).tolist())
        out.append(e.step(logits_rows=[0]).logits)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_graphed_fp8_steps_equal_eager_and_stay_near_bf16(backend):
    """On the GPU: captured steps over an fp8 pool equal its eager steps (the kernels read e4m3 tiles), and both stay
    within the fp8 budget of a bf16 pool's logits."""
    from treedec.attention.backends import get_backend
    from treedec.attention.variant import FP8_KV, AttentionVariant
    if get_backend(backend).why_not_variant(AttentionVariant(kv_dtype=FP8_KV)) is not None:
        pytest.skip(get_backend(backend).why_not_variant(AttentionVariant(kv_dtype=FP8_KV)))
    model = from_config("tiny", seed=0, dtype=torch.bfloat16, device="cuda")
    bf16 = Engine(model, kv_tokens=8192, page_size=16, backend=backend)
    eager = Engine(model, kv_tokens=8192, page_size=16, backend=backend, kv_cache_dtype="fp8")
    graphed = Engine(model, kv_tokens=8192, page_size=16, backend=backend, kv_cache_dtype="fp8", cuda_graphs=True)
    ref, a, b = (_gpu_tree_steps(e) for e in (bf16, eager, graphed))
    for x, y in zip(a, b):
        torch.testing.assert_close(x.float(), y.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(eager.pool.k.view(torch.uint8), graphed.pool.k.view(torch.uint8)) or \
        (eager.pool.k.float() - graphed.pool.k.float()).abs().max() <= 2 ** -3
    assert graphed.graph_stats["replays"] > 0
    for x, y in zip(ref, a):
        assert (x.float() - y.float()).abs().max() <= 0.25, (x.float() - y.float()).abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_fp8_pool_sized_from_free_gpu_memory_holds_twice_the_tokens():
    model = from_config("tiny", dtype=torch.bfloat16, device="cuda")
    sizes = {}
    for kv in ("auto", "fp8"):
        e = Engine(model, memory_fraction=0.3, kv_cache_dtype=kv)
        sizes[kv] = e.kv_capacity_tokens
        del e
        torch.cuda.empty_cache()
    assert sizes["fp8"] >= 1.9 * sizes["auto"], sizes
