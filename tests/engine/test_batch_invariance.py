"""engine/batch_invariance.py and models/batch_invariant.py: in the batch-invariant mode a request's logits are
the same bits decoded alone or beside other requests of other lengths (and a branching tree); what cannot be
invariant is refused by name. On the CPU the mode runs F.linear row by row (fp32: the default mode's logits differ
by rounding between the two runs); the Triton kernels' path runs here in the interpreter (marked ``triton``); the
GPU tests (bf16, the Triton kernels compiled, through ``LLM.generate`` too) are marked ``gpu``."""
import os
import types

import numpy as np
import pytest
import torch

from treedec import LLM, SamplingParams
from treedec.attention import PlanConfig
from treedec.errors import BackendUnavailableError
from treedec.engine import Engine
from treedec.models import from_config
from treedec.models.batch_invariant import make_batch_invariant

PROMPTS = ((7, 3, 99, 12, 5), tuple(range(40, 77)), (1,), tuple(range(100, 190)), tuple(range(300, 312)))


def decode_logits(model, prompts, steps=3, branch=False, **options):
    """Logits of the first request (prefill, then ``steps`` greedy steps) with ``prompts[1:]`` decoding beside it
    (``branch``: the last one as a tree of two leaves)."""
    engine = Engine(model, kv_tokens=2048, page_size=4, batch_invariant=True, **options)
    outs = [engine.prefill(p) for p in prompts]
    leaves = [o.node for o in outs]
    tokens = [int(o.logits.argmax()) for o in outs]
    if branch and len(prompts) > 1:
        leaves[-1:] = engine.tree.branch(leaves[-1], [[tokens[-1]], [(tokens[-1] + 1) % 512]])
        tokens.append(tokens[-1])
        engine.step()
    seen = [outs[0].logits]
    for _ in range(steps):
        for leaf, token in zip(leaves, tokens):
            engine.tree.extend(leaf, [token])
        logits = engine.step().logits
        seen.append(logits[0].clone())
        tokens = logits.argmax(-1).tolist()
    return engine, seen


def tiny(dtype=torch.float32, device="cpu", **kwargs):
    return from_config("tiny", seed=0, dtype=dtype, device=device, **kwargs)


def assert_bitwise(alone, batched):
    for step, (a, b) in enumerate(zip(alone, batched)):
        assert torch.equal(a, b), f"step {step}: max |diff| {float((a.float() - b.float()).abs().max())}"


def test_logits_alone_equal_logits_in_a_batch_on_the_cpu():
    engine, alone = decode_logits(tiny(), PROMPTS[:1])
    _, batched = decode_logits(tiny(), PROMPTS, branch=True)
    assert_bitwise(alone, batched)
    # what ran, as reported
    assert engine.batch_invariance.kernel == "rows"
    assert engine.model.linear_paths() == {"F.linear row by row": 9}
    assert engine.attn.plan_config.planner == "path" and engine.attn.plan_config.batch_invariant
    assert engine.attn.backend == "torch" and engine.attn.backend_impl.form == "rows"


def test_a_prompt_in_chunks_gives_the_same_logits():
    """Prefill in 16-token chunks (steps of their own) == in one chunk, as a prefix-cache hit needs."""
    prompt = PROMPTS[3]
    one = Engine(tiny(), kv_tokens=512, page_size=4, batch_invariant=True).prefill(prompt).logits
    chunked = Engine(tiny(), kv_tokens=512, page_size=4, batch_invariant=True, prefill_chunk=16).prefill(prompt).logits
    assert torch.equal(one, chunked)


@pytest.mark.triton
def test_the_triton_kernels_path_is_batch_invariant(triton_device):
    """The CUDA path (Triton matmul, RMSNorm, attention), asked for explicitly: interpreted on the CPU."""
    if triton_device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    runs = []
    for prompts in (PROMPTS[:1], PROMPTS[:3]):
        model = tiny(device=triton_device)
        assert make_batch_invariant(model, "triton-kernels").kernel == "triton-kernels"
        engine, seen = decode_logits(model, [p[:12] for p in prompts], steps=2, backend="triton")
        assert engine.batch_invariance.kernel == "triton-kernels"   # kept: the model was switched already
        assert engine.model.linear_paths() == {"batch-invariant matmul": 9}
        runs.append(seen)
    assert_bitwise(*runs)


def siblings_logits(model, prompt, firsts, steps=3, **options):
    """Logits of the first of ``len(firsts)`` leaves branched under one prompt (siblings sharing its K/V, as requests
    on a prefix-cache hit do), over ``steps`` greedy steps with the others decoding beside it; and the engine."""
    engine = Engine(model, kv_tokens=2048, page_size=4, batch_invariant=True, **options)
    leaves = engine.tree.branch(engine.prefill(prompt).node, [[t] for t in firsts])
    seen = []
    for _ in range(steps):
        logits = engine.step().logits
        seen.append(logits[0].clone())
        for leaf, token in zip(leaves, logits.argmax(-1).tolist()):
            engine.tree.extend(leaf, [token])
    return engine, seen


def test_siblings_read_their_prompts_windows_once_and_change_no_bit():
    """16-token chunks under a 40-token prompt: its two whole windows are one chunk each for all four leaves (read
    once a step, not once a leaf), and the first leaf's logits are the same bits alone or beside the other three."""
    prompt, config = list(range(100, 140)), PlanConfig("path", 16)
    _, alone = siblings_logits(tiny(), prompt, [5], plan_config=config)
    engine, beside = siblings_logits(tiny(), prompt, [5, 6, 7, 8], plan_config=config)
    assert_bitwise(alone, beside)
    (plan,), _ = engine.attention.plan_host(engine.tree.layout())   # the next step's
    assert np.diff(plan.chunk_entry_start).tolist() == [4, 4, 1, 1, 1, 1]
    assert plan.kv_tokens_read() == 2 * 16 + 4 * (40 + 4 - 32)


@pytest.mark.triton
def test_siblings_on_the_triton_kernels_change_no_bit(triton_device):
    if triton_device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    runs = []
    for firsts in ([5], [5, 6, 7]):
        model = tiny(device=triton_device)
        make_batch_invariant(model, "triton-kernels")
        runs.append(siblings_logits(model, list(range(100, 120)), firsts, steps=2, backend="triton",
                                    plan_config=PlanConfig("path", 8))[1])
    assert_bitwise(*runs)


def test_what_cannot_be_invariant_is_refused_by_name():
    model = tiny()
    with pytest.raises(ValueError, match="planner='path' and a fixed chunk_size"):
        Engine(model, kv_tokens=64, batch_invariant=True, plan_config=PlanConfig("flatten", 64))
    with pytest.raises(BackendUnavailableError, match="reference backend attends every query in one dense"):
        Engine(model, kv_tokens=64, batch_invariant=True, backend="reference")
    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        Engine(model, kv_tokens=64, batch_invariant="yes")
    assert model.linear_paths() == {"F.linear": 9}   # nothing switched by a refused engine
    with pytest.raises(ValueError, match=r"needs unquantized projections, this model has \['fp8"):
        Engine(tiny(quantization="fp8"), kv_tokens=64, batch_invariant=True)
    with pytest.raises(ValueError, match="quantization='fp8': leave it None"):
        LLM("no-such-model", quantization="fp8", batch_invariant=True)
    fused = tiny()
    fused.compile_pointwise()
    with pytest.raises(ValueError, match="cannot keep compile_pointwise's fused ops"):
        Engine(fused, kv_tokens=64, batch_invariant=True)
    split = tiny()
    split.tensor_parallel = types.SimpleNamespace(size=2)   # (the check reads the group's size only)
    with pytest.raises(ValueError, match="split over 2 ranks .* the all-reduce"):
        make_batch_invariant(split)
    with pytest.raises(NotImplementedError, match="has no batch-invariant mode"):
        make_batch_invariant(torch.nn.Linear(2, 2))


def test_a_switched_model_is_refused_outside_the_mode():
    """Engine(batch_invariant=True) switches the model in place: a default-mode engine on it would run the
    invariant kernels while reporting the default mode, so it is refused, naming why."""
    model = from_config("tiny", dtype=torch.float32, device="cpu")
    Engine(model, kv_tokens=256, batch_invariant=True)
    with pytest.raises(ValueError, match="switched to batch-invariant GEMMs"):
        Engine(model, kv_tokens=256)
    assert Engine(model, kv_tokens=256, batch_invariant=True).batch_invariance is not None
    assert Engine(from_config("tiny", dtype=torch.float32, device="cpu"), kv_tokens=256).batch_invariance is None


def test_auto_on_an_h200_is_triton_in_the_mode(monkeypatch):
    """auto's fast cuda choice is passed over, saying why (the GPU faked: no device needed)."""
    from treedec.attention.backends import get_backend, resolve_backend
    for name in ("cuda", "triton"):
        monkeypatch.setattr(get_backend(name), "why_unavailable", classmethod(lambda cls, device: None))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gpu = torch.device("cuda", 0)
    assert resolve_backend("auto", gpu, dtype=torch.bfloat16)[0] == "cuda"
    backend, reason = resolve_backend("auto", gpu, dtype=torch.bfloat16, batch_invariant=True)
    assert backend == "triton" and "cuda: the cuda backend's KV tile follows the longest chunk" in reason
    with pytest.raises(BackendUnavailableError, match="backend 'cuda' cannot run: the cuda backend's KV tile"):
        resolve_backend("cuda", gpu, dtype=torch.bfloat16, batch_invariant=True)


def test_llm_takes_the_mode():
    llm = LLM(tiny(), batch_invariant=True, kv_tokens=1024)
    assert llm.engine.batch_invariance.kernel == "rows"
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2)
    alone = llm.generate([{"prompt_token_ids": list(PROMPTS[0])}], params, use_tqdm=False)[0].outputs[0]
    batched = llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], params, use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == batched.token_ids and alone.logprobs == batched.logprobs


# ---------------------------------------------------------------- GPU (bf16, the Triton kernels compiled)

def _gpu_prompts(n):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 512, (int(k),), generator=g).tolist()
            for k in torch.randint(1, 300, (n,), generator=g)]


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_gpu_bf16_logits_alone_equal_logits_in_a_batch(cuda_graphs):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    prompts = _gpu_prompts(8)
    runs = [decode_logits(tiny(torch.bfloat16, "cuda"), ps, steps=6, branch=True, cuda_graphs=cuda_graphs)
            for ps in (prompts[:1], prompts)]
    assert runs[0][0].batch_invariance.kernel == "triton-kernels" and runs[0][0].attn.backend == "triton"
    assert_bitwise(runs[0][1], runs[1][1])


@pytest.mark.gpu
def test_gpu_bf16_generate_one_equals_eight():
    """Greedy tokens and their logprobs of each request: generated alone == among 8 (the default CUDA graphs)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    llm = LLM(tiny(torch.bfloat16, "cuda"), batch_invariant=True)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3)
    prompts = [{"prompt_token_ids": p} for p in _gpu_prompts(8)]
    together = llm.generate(prompts, params, use_tqdm=False)
    for prompt, batched in zip(prompts, together):
        alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == batched.outputs[0].token_ids
        assert alone.logprobs == batched.outputs[0].logprobs
