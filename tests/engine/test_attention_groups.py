"""engine/attention_groups.py: a model's layers grouped by their attention variants, one plan per group a step, each
layer run by its variant's kernel; Mistral's sliding window attended as one (== transformers past the window)."""
import numpy as np
import pytest
import torch
from transformers import MistralConfig
from transformers.models.mistral.modeling_mistral import MistralForCausalLM

from treedec.attention import AttentionVariant, TreeAttention
from treedec.attention.dynamic_span import DynamicSpans
from treedec.engine import CudaGraphConfig, Engine
from treedec.models import ModelConfig, from_config, from_hf_model

GROUPED = (AttentionVariant(window=5, logit_softcap=2.0, sm_scale=0.5), AttentionVariant(sm_scale=0.5),
           AttentionVariant(window=5, sm_scale=0.5))


def grouped_model(variants=GROUPED, seed: int = 0):
    """The tiny Llama with one layer per variant and weights large enough that scale, soft-cap and window show."""
    model = from_config(ModelConfig.from_name("tiny", num_layers=len(variants)), seed=seed, dtype=torch.float32,
                        device="cpu", std=0.1)
    model.attention_variants = lambda: variants
    return model


class CausalAttend:
    """``attend`` of one sequence run alone (positions 0..n-1), each layer's variant applied as AttentionVariant
    defines it, densely: independent of the engine's groups, plans and backends."""

    def __init__(self, variants):
        self.variants = variants

    def __call__(self, layer, q, k, v):
        variant, (n, hq, d) = self.variants[layer], q.shape
        k, v = (x.repeat_interleave(hq // x.shape[1], dim=1) for x in (k, v))
        scores = variant.logits(torch.einsum("qhd,khd->hqk", q.float(), k.float()) * variant.scale(d))
        positions = torch.arange(n)
        scores = scores.masked_fill(~variant.visible(positions, positions), float("-inf"))
        return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def alone(model, variants, sequence) -> torch.Tensor:
    """The last token's logits of ``sequence`` run alone through ``model`` with :class:`CausalAttend`."""
    tokens = torch.tensor(sequence)
    return model(tokens, torch.arange(len(sequence)), CausalAttend(variants)).logits[-1]


def check_tree_steps(engine, expected) -> None:
    """Prefill a prompt past the windows, branch it, step twice: every query's logits == ``expected(seq)``."""
    rng = np.random.default_rng(0)
    vocab = engine.model.config.vocab_size
    prompt = rng.integers(0, vocab, 13).tolist()
    root = engine.prefill(prompt)
    torch.testing.assert_close(root.logits, expected(prompt), atol=1e-4, rtol=0)
    leaves = engine.tree.branch(root.node, [rng.integers(0, vocab, 3).tolist() for _ in range(3)])
    for _ in range(2):
        layout = engine.tree.layout()
        rows = [int(np.flatnonzero(layout.node_ids[layout.query_node] == leaf)[-1]) for leaf in leaves]
        logits = engine.step(logits_rows=rows).logits
        for leaf, row in zip(leaves, logits):
            torch.testing.assert_close(row, expected(engine.tree.sequence(leaf)), atol=1e-4, rtol=0)
        for leaf in leaves:
            engine.tree.extend(leaf, rng.integers(0, vocab, 2).tolist())


def test_groups_share_a_plan_per_window_and_a_tree_attention_per_variant():
    engine = Engine(grouped_model(), kv_tokens=256, page_size=4, backend="torch")
    layers = engine.attention
    assert len(layers.planners) == 2 and layers.layer_group == (0, 1, 0) and layers.group_layers == (2, 1)
    assert len({id(a) for a in layers.layer_attn}) == 3
    assert [a.variant for a in layers.layer_attn] == list(GROUPED)
    assert engine.attn is layers.planners[0] and engine.window_cap is None and layers.windowed
    single = Engine(from_config("tiny", dtype=torch.float32, device="cpu"), kv_tokens=256, page_size=4, backend="torch")
    assert len(single.attention.planners) == 1 and not single.attention.windowed
    assert all(a is single.attn for a in single.attention.layer_attn)


def test_grouped_layers_equal_each_path_run_alone():
    """Layers 0 and 2 read windows of 5 keys (layer 0 soft-capped), layer 1 whole paths: each query's logits equal
    its sequence run alone with each layer's variant."""
    model = grouped_model()
    check_tree_steps(Engine(model, kv_tokens=256, page_size=4, backend="torch"), lambda s: alone(model, GROUPED, s))
    seq = list(range(3, 20))
    for other in ((AttentionVariant(sm_scale=0.5),) * 3, (AttentionVariant(window=5, sm_scale=0.5), *GROUPED[1:]),
                  (GROUPED[0], GROUPED[1], GROUPED[1])):   # the variants matter here: scale, soft-cap, window
        assert (alone(model, GROUPED, seq) - alone(model, other, seq)).abs().max() > 1e-2


def test_a_model_must_give_one_variant_a_layer():
    model = grouped_model()
    model.attention_variants = lambda: GROUPED[:2]
    with pytest.raises(TypeError, match="one AttentionVariant for each of its 3 layers, got 2"):
        Engine(model, kv_tokens=64, page_size=4, backend="torch")


def test_a_static_plan_refuses_a_plan_of_another_window():
    from treedec.attention import PlanBounds, StaticPlan, make_plan
    from treedec.attention.backends.cuda_backend import CudaBackend
    from treedec.errors import PlanError
    from treedec.tree import TreeLayout
    layout = TreeLayout.from_parents([-1, 0, 0], [40, 3, 4], [(1, 2), (2, 3)])
    windowed, plain = make_plan(layout, variant=AttentionVariant(window=8)), make_plan(layout)
    static = StaticPlan(PlanBounds.for_plan(plain), CudaBackend.without_kernels(4, 2, 64, torch.float16, 8, 64),
                        torch.device("cpu"))
    static.write(windowed)
    with pytest.raises(PlanError, match="the plan's window None differs from this static plan's 8"):
        static.write(plain)
    assert static.current is windowed


def test_one_plan_per_group_per_step(monkeypatch):
    engine = Engine(grouped_model(), kv_tokens=256, page_size=4, backend="torch")
    plans = []
    original = TreeAttention.plan_host
    monkeypatch.setattr(TreeAttention, "plan_host", lambda self, layout: plans.append(self) or original(self, layout))
    root = engine.prefill(list(range(9))).node
    engine.tree.extend(root, [4])
    engine.step()
    assert plans == list(engine.attention.planners) * 2   # the prefill's step and this one: one plan a group each


def test_mistral_attends_its_sliding_window_as_transformers_does():
    """A Mistral config's sliding_window is attended, not refused: steps past the window == transformers."""
    hf = MistralForCausalLM(MistralConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                          max_position_embeddings=512, sliding_window=6,
                                          attn_implementation="eager"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else 0.3 * torch.randn(p.shape, generator=gen))
    hf.eval()
    model = from_hf_model(hf)
    assert model.attention_variants() == (AttentionVariant(window=6),) * 2
    engine = Engine(model, kv_tokens=256, page_size=4, backend="torch")
    assert engine.window_cap is None

    def expected(sequence):
        with torch.no_grad():
            return hf(torch.tensor([sequence])).logits[0, -1]
    check_tree_steps(engine, expected)
    unwindowed = alone(model, (AttentionVariant(),) * 2, list(range(20)))
    assert (expected(list(range(20))) - unwindowed).abs().max() > 1e-2   # the window matters at 20 positions


def test_windowed_steps_refuse_dynamic_spans_and_change_nothing():
    engine = Engine(grouped_model(), kv_tokens=256, page_size=4, backend="torch")
    root = engine.prefill(list(range(9))).node
    engine.tree.extend(root, [4])
    before = engine.tree.layout()
    span = DynamicSpans.one(engine.tree.slots(root)[-2:], torch.tensor([1]), np.array([0]))
    with pytest.raises(NotImplementedError, match="sliding-window layers: the window's first key would move"):
        engine.step(dynamic=span)
    assert engine.tree.layout() is before and engine.stats["steps"] == 1


@pytest.mark.slow
@pytest.mark.triton
def test_grouped_static_plans_equal_eager_steps(triton_device):
    """Each group's plan in its own static plan of the step's bucket (the buffers a captured graph replays; here run
    uncaptured in the Triton interpreter): the same logits as eager steps."""
    if triton_device.type == "cuda":
        pytest.skip("the uncaptured static path runs the triton kernels in the CPU interpreter")
    model = grouped_model()
    engine = Engine(model, kv_tokens=256, page_size=4, backend="triton", cuda_graphs=CudaGraphConfig(capture=False))
    check_tree_steps(engine, lambda s: alone(model, GROUPED, s))
    assert engine.graph_stats["static_eager"] == 3   # the prefill's step and two more: each in static plans
    entry = next(iter(engine.graph_runner._graphs.values()))
    assert len(entry.statics) == 2 and entry.statics[0].current.window == 5 and entry.statics[1].current.window is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_grouped_plans_inside_captured_graphs_equal_eager_steps(backend):
    model = grouped_model().to(dtype=torch.bfloat16, device="cuda")
    graphed = Engine(model, kv_tokens=1024, page_size=16, backend=backend, cuda_graphs=True)
    eager = Engine(model, kv_tokens=1024, page_size=16, backend=backend)
    outs = []
    for engine in (graphed, eager):
        root = engine.prefill(list(range(40))).node
        leaves = engine.tree.branch(root, [[1, 2], [3], [4, 5, 6]])
        steps = [engine.step().logits.float()]
        for leaf in leaves:
            engine.tree.extend(leaf, [7])
        steps.append(engine.step().logits.float())
        outs.append(steps)
    assert graphed.graph_stats["replays"] >= 2
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=0)
