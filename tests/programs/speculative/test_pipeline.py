"""Pipelined speculative decoding (treedec.programs.speculative.verify_table): the same tokens, stats and tree as the
unpipelined loop whatever the acceptance pattern, a stop read one step late rolled back with every page freed,
the masked span itself (DynamicSpans, MaskPatch), and the refusals."""
import collections
import dataclasses

import numpy as np
import pytest
import torch

from treedec.attention import PlanConfig
from treedec.attention.dynamic_span import DynamicSpans, MaskPatch
from treedec.engine import Engine, greedy
from treedec.models import ModelConfig, from_config
from treedec.programs.speculative.acceptance import RejectionSampling, TypicalAcceptance
from treedec.programs.speculative.drafts import PromptLookupDraft, TreeDraft
from treedec.models.medusa import MedusaHeads
from treedec.programs.speculative.medusa import MedusaDraft
from treedec.runtime.scheduler import run_program
from treedec.programs.speculative.program import SpeculativeProgram, speculative_generate
from treedec.sampling.stops import StopRule
from treedec.tree.token_tree import TokenTree
from tests.engines import make_engine, tiny_model
from tests.programs.speculative.test_medusa import OracleHeads
from tests.programs.speculative.test_speculative_program import prompt_with_repeats

NEW = 40


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@pytest.fixture(scope="module")
def greedy_run(tiny):
    """The prompt, its greedy continuation and the hidden state before each continuation token."""
    prompt = prompt_with_repeats()
    engine = make_engine(tiny)
    prefilled = engine.prefill(prompt, return_hidden=True)
    states, out = [prefilled.hidden], [int(greedy(prefilled.logits))]
    while len(out) < NEW + 8:
        engine.tree.extend(prefilled.node, out[-1:])
        step = engine.step(return_hidden=True)
        states.append(step.hidden[0])
        out.append(int(greedy(step.logits[0])))
    return prompt, out, torch.stack(states)


class FlakyOracle(OracleHeads):
    """Right at most positions, wrong at every ``period``-th head output: accepted lengths vary step to step."""

    def __init__(self, states, continuation, period):
        super().__init__(states, continuation)
        self.period = period

    def forward(self, hidden):
        out = super().forward(hidden)
        rows = hidden.reshape(-1, hidden.shape[-1])
        flat = out.reshape(len(rows), self.num_heads, -1)
        for r, state in enumerate(rows):
            k = int((self.states - state).norm(dim=-1).argmin())
            for i in range(self.num_heads):
                if (k + i) % self.period == 0:
                    flat[r, i] = flat[r, i].roll(1)   # a wrong token first
        return out


def both(tiny, prompt, draft, n, page_size=4, rule=None, **kw):
    """(tokens, stats, node sequence) of the unpipelined and the pipelined run (``rule()``: a fresh acceptance rule
    for each); each leaves a clean pool."""
    runs = []
    for pipeline in (False, True):
        engine = make_engine(tiny, page_size=page_size)
        tokens, stats = speculative_generate(engine, prompt, draft, n, None if rule is None else rule(),
                                             pipeline=pipeline, **kw)
        assert stats.pipelined == pipeline
        engine.tree.check_invariants()
        sequence = engine.tree.sequence(stats.node)
        assert engine.tree.num_nodes == 1 and engine.tree.num_pending == 0
        engine.tree.prune(stats.node)
        assert engine.pool.num_free_pages == engine.pool.num_pages
        runs.append((tokens, stats, sequence))
    return runs


def same(runs):
    (t0, s0, q0), (t1, s1, q1) = runs
    assert t1 == t0 and q1 == q0
    assert (s1.steps, s1.accepted, s1.draft_sizes, s1.stop_reason) == (s0.steps, s0.accepted, s0.draft_sizes,
                                                                       s0.stop_reason)


@pytest.mark.parametrize("heads, page_size", [("untrained", 4), ("oracle", 1), ("flaky3", 4), ("flaky2", 16)])
def test_pipelined_equals_unpipelined(tiny, greedy_run, heads, page_size):
    prompt, ref, states = greedy_run
    made = {"untrained": lambda: MedusaHeads.untrained(tiny, num_heads=4),
            "oracle": lambda: OracleHeads(states, ref),
            "flaky3": lambda: FlakyOracle(states, ref, 3), "flaky2": lambda: FlakyOracle(states, ref, 2)}[heads]()
    runs = both(tiny, prompt, MedusaDraft(made), NEW, page_size)
    same(runs)
    tokens, stats, sequence = runs[1]
    assert tokens == ref[:NEW] and sequence[:len(prompt) + NEW - 1] == prompt + tokens[:-1]
    if heads != "untrained":
        assert len(set(stats.accepted)) > 1 or heads == "oracle"
        assert sum(stats.accepted) > NEW // 3


def test_fixed_tree_draft_tokens_pipeline_too(tiny, greedy_run):
    """A TreeDraft of fixed tokens has no row head: its tokens are the same device tensor every step. Here they
    are the greedy continuation's most frequent tokens, so some steps accept."""
    prompt, ref, _ = greedy_run
    common = [t for t, _ in collections.Counter(ref).most_common(3)]
    tree = TokenTree.from_medusa_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])
    draft = TreeDraft(tree, common + [common[1], common[2], common[0]])
    assert draft.fixed_tree is tree
    runs = both(tiny, prompt, draft, NEW)
    same(runs)
    assert runs[1][0] == ref[:NEW] and sum(runs[1][1].accepted) > 0
    with pytest.raises(ValueError, match="no fixed tree"):
        speculative_generate(make_engine(tiny), prompt, TreeDraft(tree, lambda seq: [1] * 6), 4, pipeline=True)


@pytest.mark.parametrize("stop", ["eos_in_path", "eos_as_bonus", "length_in_path", "first_token"])
def test_a_stop_read_one_step_late_is_rolled_back(tiny, greedy_run, stop):
    """The step launched after the one that stops is pruned and the sequence cut to the kept tokens: tokens,
    tree and pages as the unpipelined run's."""
    prompt, ref, states = greedy_run
    draft = MedusaDraft(OracleHeads(states, ref))   # paths of 4 accepted a step: stops fall inside them
    if stop == "eos_in_path":
        kw = dict(n=NEW, eos_token_id=ref[6])
    elif stop == "eos_as_bonus":
        kw = dict(n=NEW, eos_token_id=ref[5])
    elif stop == "length_in_path":
        kw = dict(n=7, eos_token_id=None)
    else:
        kw = dict(n=1, eos_token_id=None)
    n = kw.pop("n")
    runs = both(tiny, prompt, draft, n, **kw)
    same(runs)
    tokens = runs[1][0]
    assert tokens == ref[:len(tokens)] and len(tokens) <= n
    if stop == "first_token":
        assert runs[1][1].steps == 0 and tokens == ref[:1]


@pytest.mark.slow
@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.7, 8)])
def test_pipelined_rejection_sampling_draws_the_unpipelined_tokens(tiny, greedy_run, temperature, top_k):
    """Sampled on the device from the same seeded stream in the same order: the very same tokens and stats."""
    prompt, ref, states = greedy_run
    model, heads, _ = permutation_target("cpu", torch.float32)
    for target, draft in ((tiny, MedusaDraft(FlakyOracle(states, ref, 3))), (model, MedusaDraft(heads))):
        runs = both(target, prompt, draft, 30, rule=lambda: RejectionSampling(temperature, seed=7, top_k=top_k),
                    eos_token_id=None)
        same(runs)
        assert runs[1][0] != ref[:30] or target is model


def test_auto_chooses_and_says_why(tiny, greedy_run):
    prompt, ref, states = greedy_run
    engine = make_engine(tiny)
    _, stats = speculative_generate(engine, prompt, MedusaDraft(OracleHeads(states, ref)), 8)
    assert not stats.pipelined and "CPU" in stats.pipeline_note


@pytest.mark.parametrize("draft, rule, match", [
    (lambda h: PromptLookupDraft(num_draft_tokens=3), None, "no fixed tree"),
    (lambda h: MedusaDraft(h, in_step=False), None, "no fixed tree"),
    (lambda h: MedusaDraft(h), TypicalAcceptance(), "TypicalAcceptance decides on the host"),
])
def test_pipeline_true_refuses_what_cannot_pipeline(tiny, draft, rule, match):
    engine = make_engine(tiny)
    with pytest.raises(ValueError, match=match):
        speculative_generate(engine, [1, 2, 3], draft(MedusaHeads.untrained(tiny)), 4, rule, pipeline=True)
    assert engine.tree.num_nodes == 0
    with pytest.raises(ValueError, match="pipeline must be None, True or False"):
        speculative_generate(engine, [1, 2, 3], MedusaDraft(MedusaHeads.untrained(tiny)), 4, pipeline="yes")
    reference = Engine(tiny, kv_tokens=256, page_size=4, backend="reference")
    with pytest.raises(ValueError, match="reference attention backend"):
        speculative_generate(reference, [1, 2, 3], MedusaDraft(MedusaHeads.untrained(tiny)), 4, pipeline=True)
    windowed = from_config(ModelConfig.from_name("tiny", model_type="mistral", sliding_window=8), dtype=torch.float32,
                           device="cpu")
    with pytest.raises(ValueError, match="the model has sliding-window layers"):
        speculative_generate(make_engine(windowed), [1, 2, 3], MedusaDraft(MedusaHeads.untrained(windowed)), 4,
                             pipeline=True)


def test_a_dynamic_span_step_equals_the_step_without_the_unused_slots(tiny):
    """A node ending in 3 computed slots of which 1 is kept (a device value) gives its child the logits of the
    node without the other 2: masked, and the child's positions moved back by 2."""
    engine = make_engine(tiny)
    prompt = list(range(5, 30))
    node = engine.prefill(prompt).node
    drafted = engine.tree.branch(node, [[7, 8, 9]])[0]
    engine.step()
    computed = torch.as_tensor(engine.tree.slots(drafted)[:3])   # 7 at the position after the prompt
    engine.tree.prune(drafted)
    span_slots = engine.tree.extend_computed(node, [7, 0, 0])
    engine.pool.copy_slots(computed, span_slots)                # 8 and 9 are the unused slots' K/V
    engine.tree.branch(node, [[11, 12]])
    got = engine.step(dynamic=DynamicSpans.one(span_slots, torch.tensor([1]), np.arange(2))).logits
    want_engine = make_engine(tiny)
    want_node = want_engine.prefill(prompt + [7]).node
    want_engine.tree.branch(want_node, [[11, 12]])
    want = want_engine.step().logits
    assert torch.allclose(got, want, atol=1e-5)
    unmasked = make_engine(tiny)       # the test has power: the same step reading the unused slots differs
    unmasked_node = unmasked.prefill(prompt + [7, 8, 9]).node
    unmasked.tree.branch(unmasked_node, [[11, 12]])
    assert not torch.allclose(unmasked.step().logits, want, atol=1e-3)


def test_a_dynamic_span_is_masked_in_every_copy_of_a_batch_invariant_plan():
    """A batch-invariant plan holds a window once per query that reads only a prefix of it (the token tree's three
    queries each copy the window of their own tokens) and a window border may cut the span (positions 45..49 across
    48): the span's unused slots are cleared in every copy, and the step equals the one without them."""
    model = from_config("tiny", seed=0, dtype=torch.float32, device="cpu")   # (the mode switches it in place)
    engines = [Engine(model, kv_tokens=1024, page_size=4, batch_invariant=True, plan_config=PlanConfig("path", 16))
               for _ in range(2)]
    prompt = list(range(5, 50))
    node = engines[0].prefill(prompt).node
    drafted = engines[0].tree.branch(node, [[7, 8, 9, 10, 11]])[0]
    engines[0].step()
    computed = torch.as_tensor(engines[0].tree.slots(drafted)[:5])
    engines[0].tree.prune(drafted)
    span_slots = engines[0].tree.extend_computed(node, [7, 8, 0, 0, 0])
    engines[0].pool.copy_slots(computed, span_slots)              # 9, 10 and 11 are the unused slots' K/V
    engines[0].tree.add_token_tree(node, [11, 12, 13], [-1, 0, 0])
    span = DynamicSpans.one(span_slots, torch.tensor([2]), np.arange(3))
    (plan,), _ = engines[0].attention.plan_host(engines[0].tree.layout(), span)
    unused = np.isin(plan.kv_slots, span_slots[2:])
    # the span's 3 slots before the border once (a window all three read), its 2 after it in each query's copy
    assert np.isin(plan.kv_slots, span_slots[:3]).sum() == 3 and unused.sum() == 1 + 2 * 3
    cleared_exactly(engines[0].attention.plan_host(engines[0].tree.layout())[0][0], plan, set(np.flatnonzero(unused)))
    got = engines[0].step(dynamic=span).logits
    want_node = engines[1].prefill(prompt + [7, 8]).node
    engines[1].tree.add_token_tree(want_node, [11, 12, 13], [-1, 0, 0])
    assert torch.allclose(got, engines[1].step().logits, atol=1e-5)


def test_mask_patch_clears_exactly_the_unused_slots_bits(tiny):
    engine = make_engine(tiny, page_size=4)
    node = engine.prefill(list(range(40))).node
    slots = engine.tree.extend_computed(node, [0] * 5)
    engine.tree.add_token_tree(node, [1, 2, 3], [-1, 0, 0])
    span = DynamicSpans.one(slots, torch.tensor([2]), np.arange(3))
    host = engine.attn.plan_host(engine.tree.layout())
    plan = span.locate(host)
    places = span.places(plan)
    start = int(places.position[0])
    stop = start + 5
    assert places.position.tolist() == list(range(start, stop)) and places.slot.tolist() == list(range(5))
    assert plan.dynamic_kv.tolist() == [[start, stop]]
    assert plan.kv_slots[start:stop].tolist() == slots.tolist()
    others = ((0, 1), (stop, stop + 1))   # a batch's other spans: the span's range joins them, in order
    assert span.locate(dataclasses.replace(host, dynamic_kv=others)).dynamic_kv.tolist() == [
        [0, 1], [start, stop], list(others[1])]
    patched = MaskPatch.of(plan, span, places, plan.mask_words, torch.device("cpu")).apply_host(plan, span.keep)
    cleared_exactly(plan, patched, set(range(start + 2, stop)))
    engine.tree.commit_step()


def cleared_exactly(plan, patched, cleared):
    """``patched``'s mask bits are ``plan``'s with those of the flattened KV positions ``cleared`` cleared."""
    for e in range(plan.num_entries):
        chunk = int(np.searchsorted(plan.chunk_entry_start, e, side="right") - 1)
        for f in range(plan.chunk_kv_start[chunk], plan.chunk_kv_start[chunk + 1]):
            t = f - plan.chunk_kv_start[chunk]
            before = (plan.entry_mask[e, t // 32] >> (t % 32)) & 1
            after = (patched.entry_mask[e, t // 32] >> (t % 32)) & 1
            assert after == (0 if f in cleared else before), (e, f)


@pytest.mark.parametrize("page_size, gap, empty", [(4, 0, False), (16, 1, False), (4, 0, True), (16, 1, True)])
def test_one_mask_patch_clears_several_spans(tiny, page_size, gap, empty):
    """Three requests' spans in one plan, patched by one MaskPatch (gap 1: each node holds only its span, so
    spans may share mask words; ``empty``: an empty span first, a new request's, so that the placed spans are not
    the first ones: each word's width is its own span's): exactly the bits of each span's slots past its keep are
    cleared."""
    engine = make_engine(tiny, page_size=page_size)
    parts, keeps = [], [0, 2, 5]
    if empty:
        parts.append(DynamicSpans.of_rows(np.zeros((1, 0), dtype=np.int64), torch.zeros(1, dtype=torch.int64)))
    nodes = [engine.prefill(list(range(r, r + 3 + 9 * (1 - gap)))).node for r in range(len(keeps))]
    for node, keep in zip(nodes, keeps):
        slots = engine.tree.extend_computed(node, [0] * 5)
        engine.tree.add_token_tree(node, [1, 2], [-1, 0])
        parts.append(DynamicSpans.one(slots, torch.tensor([keep]), np.arange(2)))
    spans = DynamicSpans.concat(parts)
    host = engine.attn.plan_host(engine.tree.layout())
    places = spans.places(host)
    starts = [int(part.places(host).position[0]) for part in parts[empty:]]
    assert places.position.tolist() == sorted(a + i for a in starts for i in range(5))   # (arrays == one by one)
    patch = MaskPatch.of(host, spans, places, host.mask_words, torch.device("cpu"))
    patched = patch.apply_host(host, spans.keep)
    cleared_exactly(host, patched, {f for a, k in zip(starts, keeps) for f in range(a + k, a + 5)})
    engine.tree.commit_step()


def test_unchecked_spans_and_their_rows_are_the_checked_spans():
    """DynamicSpans.unchecked (the verify group's every step, and with_rows') holds what the checked constructor
    does, and with_rows' split of the rows is the checked spans' split."""
    slots, lengths, keep = np.arange(6, dtype=np.int64), np.array([2, 0, 4], dtype=np.int64), torch.tensor([1, 0, 3])
    rows = np.arange(10, 16, dtype=np.int64)
    checked = DynamicSpans(slots, lengths, keep, rows, np.array([0, 0, 1, 1, 2, 2]))
    fields = ("slots", "lengths", "keep", "shift_rows", "shift_span")
    for spans in (DynamicSpans.unchecked(slots, lengths, keep, rows, np.array([0, 0, 1, 1, 2, 2])),
                  DynamicSpans(slots, lengths, keep, rows[:0], rows[:0]).with_rows(rows)):
        assert type(spans) is DynamicSpans
        for name in fields:
            assert np.array_equal(np.asarray(getattr(spans, name)), np.asarray(getattr(checked, name))), name
    with pytest.raises(ValueError, match="split evenly"):
        checked.with_rows(rows[:5])


@pytest.mark.slow
@pytest.mark.triton
def test_pipelined_on_the_triton_backend_masks_on_the_device(triton_device):
    """The triton backend reads the plan from device tensors: the span is masked there (MaskPatch.apply), not on
    the host plan; the tokens are the target's greedy ones, as the unpipelined loop's."""
    model, heads, perm = permutation_target(triton_device, torch.float32)
    prompt = np.random.default_rng(8).integers(0, model.config.vocab_size, 40).tolist()   # accepts 1-4 a step
    expected = [int(perm[prompt[-1]])]
    while len(expected) < 16:
        expected.append(int(perm[expected[-1]]))
    runs = []
    for pipeline in (False, True):
        engine = Engine(model, kv_tokens=1024, page_size=4, backend="triton")
        tokens, stats = speculative_generate(engine, prompt, MedusaDraft(heads), 16, pipeline=pipeline,
                                             eos_token_id=None)
        runs.append((tokens, stats.accepted))
    assert runs[0] == runs[1] and runs[1][0] == expected and len(set(runs[1][1])) > 1


def permutation_target(device, dtype, seed=0):
    """A tiny target whose greedy next token is ``perm[token]`` (attention and MLP outputs zeroed: the final hidden
    state is the token's normed embedding; lm_head row y is the embedding of perm^-1(y)), and Medusa heads with
    one output layer each, head i right (perm^(i+2)) except for a third of the tokens at heads 1 and 2, so
    accepted lengths vary."""
    from treedec.models import from_config
    model = from_config("tiny", seed=seed, dtype=torch.float32, device="cpu")
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=gen)
    with torch.no_grad():
        for layer in model.layers:
            layer.o_proj.weight.zero_()
            layer.down_proj.weight.zero_()
        emb = model.embed_tokens.weight
        model.lm_head.weight.copy_(emb[torch.argsort(perm)])
        heads = MedusaHeads(model.config.hidden_size, vocab, 4, num_layers=0)
        power = perm.clone()
        for i in range(4):
            power = perm[power]                                   # perm^(i + 2)
            rows = emb[torch.argsort(power)].clone()
            if i in (1, 2):
                wrong = torch.randperm(vocab, generator=gen)[:vocab // 3]
                rows[wrong] = emb[torch.randint(0, vocab, (len(wrong),), generator=gen)]
            heads.medusa_head[i][0].weight.copy_(rows)
    return model.to(device=device, dtype=dtype), heads.to(device=device, dtype=dtype), perm


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile_model", [False, True])
def test_pipelined_graphed_loop_equals_the_eager_loop(compile_model):
    """On a GPU with captured (and compiled) steps, the pipelined loop emits the eager unpipelined loop's tokens and
    stats over a 64-token Medusa tree with varying accepted lengths; a stop inside an accepted path is rolled back
    with every page freed; every pipelined verification step is a graph replay."""
    from treedec.workloads.deft import medusa_tree
    model, heads, perm = permutation_target("cuda", torch.bfloat16)
    prompt = np.random.default_rng(3).integers(0, model.config.vocab_size, 600).tolist()
    choices = medusa_tree(64).paths
    expected = [int(perm[prompt[-1]])]
    while len(expected) < 80:
        expected.append(int(perm[expected[-1]]))
    for eos in (None, expected[37]):
        runs = []
        for pipeline, graphs in ((False, False), (True, True)):
            engine = Engine(model, kv_tokens=8192, page_size=16, cuda_graphs=graphs,
                            compile_model=compile_model and graphs)
            tokens, stats = speculative_generate(engine, prompt, MedusaDraft(heads, choices), 60, pipeline=pipeline,
                                                 eos_token_id=eos)
            assert stats.pipelined == pipeline
            sequence = engine.tree.sequence(stats.node)
            engine.tree.check_invariants()
            engine.tree.prune(stats.node)
            assert engine.pool.num_free_pages == engine.pool.num_pages
            if graphs:
                assert not [k for k in engine.graph_stats if k.startswith("eager") and "max_queries" not in k]
                assert engine.graph_stats["replays"] >= stats.steps
            runs.append((tokens, stats.accepted, stats.steps, stats.stop_reason, sequence))
        assert runs[0] == runs[1]
        assert runs[1][0] == expected[:len(runs[1][0])] and len(set(runs[1][1])) > 2
        assert runs[1][3] == ("length" if eos is None else "eos")


def test_fixed_draft_tokens_and_trees_are_checked_before_anything_runs(tiny):
    tree = TokenTree.chain(3)
    for pipeline in (False, True):
        engine = make_engine(tiny)
        with pytest.raises(ValueError, match=r"TreeDraft tokens must be token ids in \[0, 512\), got \[600\]"):
            speculative_generate(engine, [1, 2, 3], TreeDraft(tree, [1, 600, 2]), 4, pipeline=pipeline)
        assert engine.tree.num_nodes == 0
    engine = make_engine(tiny)
    program = SpeculativeProgram([1, 2, 3], TreeDraft(tree, [1, 2, 3]), StopRule(4, ()), max_draft_tokens=3,
                                 pipeline=True)
    with pytest.raises(ValueError, match="fixed tree has 4 tokens; at most max_draft_tokens=3"):
        run_program(engine, program)
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages
