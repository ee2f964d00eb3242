"""Step chains (treedec.engine.step_chain): several steps planned at once and run as one graph.

On the CPU the graphed chain runs its static plans eagerly (``CudaGraphConfig(capture=False)``, the
triton kernels under ``TRITON_INTERPRET``): the same buffers and padding a captured graph replays.
Both the graphed and the step-by-step chain must equal each other (greedy decoding chained on the
device; EAGLE's drafting chains, whose K/V are regathered between steps), and bad chains are refused.
"""
import dataclasses

import numpy as np
import pytest
import torch

from treedec.sampling.params import SamplingParams
from treedec.engine import CudaGraphConfig, Engine
from treedec.models import from_config, ModelConfig
from treedec.engine.step_chain import ChainStep, StepChain
from treedec.tree.layout import TreeLayout
from treedec.programs.speculative.eagle import EagleDraft
from treedec.programs.speculative.drafter_batch import DrafterGroup
from treedec.runtime.requests import RequestSpec
from treedec.programs.speculative.batch import speculative_batch
from treedec.programs.greedy import greedy_generate
from treedec.programs.speculative.program import speculative_generate
from tests.programs.speculative.test_eagle import bigram_eagle, bigram_eagle3

STATIC = CudaGraphConfig(max_queries=32, max_graphs=4, capture=False)


@pytest.fixture(scope="module")
def bigram():
    model = from_config(dataclasses.replace(ModelConfig.from_name("tiny"), num_layers=3), seed=4, dtype=torch.float32, device="cpu")
    with torch.no_grad():   # the next token depends on the current token only (see tests/programs/speculative/test_eagle.py)
        for layer in model.layers:
            layer.o_proj.weight.zero_()
            layer.down_proj.weight.zero_()
    return model


def engines(model, graphed: bool):
    kw = {"backend": "triton", "cuda_graphs": STATIC} if graphed else {"backend": "torch"}
    return Engine(model, kv_tokens=1024, page_size=4, **kw)


class GreedyChain:
    """``length`` greedy steps of ``prompts`` (one node each, computed) chained on the device in scratch
    slots: each step's argmax is the next step's token; every step's logits are returned."""

    def __init__(self, engine, nodes, length):
        self.engine, self.nodes = engine, nodes
        self.scratch = engine.pool.allocate_slots(len(nodes) * length).reshape(len(nodes), length)
        self.chain = StepChain(engine, length, self.layout, self.body, {"first": ((len(nodes),), torch.long)})

    def layout(self, i):
        t, n = self.engine.tree, len(self.nodes)
        lengths = [len(t.slots(x)) for x in self.nodes]
        parents = [-1] * n + list(range(n))          # each prompt, then its continuation of i + 1 tokens
        slots = [t.slots(x) for x in self.nodes] + [self.scratch[j, :i + 1] for j in range(n)]
        layout = TreeLayout.from_parents(parents, lengths + [i + 1] * n, [(n + j, i) for j in range(n)], slots)
        return ChainStep(layout, np.arange(n))

    def body(self, ctx, inputs):
        tokens, out = inputs["first"], []
        for i in range(self.chain.length):
            logits = ctx.forward(i, tokens).logits
            out.append(logits.float())
            tokens = logits.argmax(-1)
        return (torch.stack(out),)


@pytest.mark.slow
@pytest.mark.triton
def test_graphed_chain_equals_steps_one_by_one(bigram, triton_device):
    """Three prompts decoded greedily for four steps as chains, twice in a row (the second run rewrites
    the static plans): the graphed chain's logits equal the step-by-step chain's, whose tokens are plain
    greedy decoding's; the tree is not changed."""
    if triton_device.type == "cuda":
        pytest.skip("the GPU tests capture real graphs")
    prompts = [[5, 9, 2, 7], [1, 2, 3], [8, 8]]
    runs = []
    for graphed in (False, True):
        e = engines(bigram, graphed)
        nodes = [e.prefill(p[:-1]).node for p in prompts]
        chain = GreedyChain(e, nodes, 4)
        first = torch.tensor([p[-1] for p in prompts])
        runs.append([chain.chain.run({"first": first})[0].clone() for _ in range(2)])
        assert [e.tree.sequence(x) for x in nodes] == [p[:-1] for p in prompts] and e.tree.num_pending == 0
        if not graphed:
            chained = [runs[-1][0][:, j].argmax(-1).tolist() for j in range(len(prompts))]
            assert chained == [greedy_generate(engines(bigram, False), p, 4, eos_token_id=None) for p in prompts]
        else:
            assert e.graph_stats["chain_static_eager"] == 2
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_graphed_eagle_drafting_equals_eager(bigram, triton_device, kind):
    """Greedy EAGLE speculation with the drafter's chains as one graphed chain (static plans, K/V regathered
    inside) emits plain greedy decoding's tokens, with the step-by-step chain's accepted lengths."""
    if triton_device.type == "cuda":
        pytest.skip("the GPU tests capture real graphs")
    drafter = (bigram_eagle if kind == "eagle" else bigram_eagle3)(bigram)
    prompt = [5, 9, 2, 7, 5, 9, 2, 7, 30, 31, 32]
    want = greedy_generate(engines(bigram, False), prompt, 8, eos_token_id=None)
    runs = []
    for graphed in (False, True):
        d_engine = engines(drafter, graphed)
        draft = EagleDraft(d_engine, depth=3, top_k=3, total_tokens=8)
        tokens, stats = speculative_generate(engines(bigram, graphed), prompt, draft, 8, eos_token_id=None)
        runs.append((tokens, stats.accepted))
        if graphed:
            assert d_engine.graph_stats["chain_static_eager"] == stats.steps
    assert runs[0] == runs[1] and runs[0][0] == want


def test_chain_errors(bigram):
    """Bad chains raise naming the problem, changing nothing."""
    e = engines(bigram, False)
    node = e.prefill([1, 2, 3]).node
    with pytest.raises(ValueError, match="length must be an int >= 1"):
        StepChain(e, 0, lambda i: None, lambda ctx, x: (), {})
    chain = GreedyChain(e, [node], 2)
    with pytest.raises(ValueError, match=r"needs inputs \['first'\], got \['other'\]"):
        chain.chain.run({"other": torch.zeros(1, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"'first' must be a tensor of shape \[1\]"):
        chain.chain.run({"first": torch.zeros(2, dtype=torch.long)})
    bad = StepChain(e, 1, lambda i: (0,), lambda ctx, x: (), {})
    with pytest.raises(TypeError, match="must return a ChainStep of a TreeLayout, got"):
        bad.run({})
    good = chain.layout(0).layout
    out_of_range = StepChain(e, 1, lambda i: ChainStep(good, np.array([3])), lambda ctx, x: (), {})
    with pytest.raises(ValueError, match=r"rows in \[0, 1\), got \[3\]"):
        out_of_range.run({})
    assert e.tree.num_pending == 0 and e.tree.sequence(node) == [1, 2, 3] and e.stats["steps"] == 1


@pytest.mark.slow
@pytest.mark.triton
def test_graphed_batched_eagle_drafting_equals_alone(bigram, triton_device):
    """Three EAGLE-3 requests in one speculative batch, their drafts sharing one graphed drafter engine:
    drafted together (the chains of all three in one chain of 3 * top_k queries a layer, smaller ones as
    requests finish), each emits its plain greedy tokens."""
    if triton_device.type == "cuda":
        pytest.skip("the GPU tests capture real graphs")
    drafter = bigram_eagle3(bigram)
    prompts = [[5, 9, 2, 7, 30], [1, 2, 3, 4], [8, 8, 9]]
    specs = [RequestSpec(id=str(i), prompt_ids=tuple(p), params=SamplingParams(max_tokens=4 + 2 * i, temperature=0.0))
             for i, p in enumerate(prompts)]
    d_engine = engines(drafter, True)
    results, _ = speculative_batch(engines(bigram, True), specs,
                                   lambda spec: EagleDraft(d_engine, depth=3, top_k=2, total_tokens=6))
    for spec, result in zip(specs, results):
        assert result.output_ids == greedy_generate(engines(bigram, False), spec.prompt_ids, spec.params.max_tokens,
                                                    eos_token_id=None)
    group = DrafterGroup.of(d_engine)
    assert group.stats["requests"] > group.stats["flushes"] and (3, 3, 2) in group._chains
    assert d_engine.pool.num_free_pages == d_engine.pool.num_pages and d_engine.tree.num_nodes == 0
