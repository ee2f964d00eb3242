"""A full pool never crashes a run (tiny random model, CPU): whenever each program runs alone in the
pool, the batch runs too, sharing prompt prefixes or not, gives each program's result alone, and frees
every page; a program that fails mid-run frees every page and loses no result already delivered."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treedec.sampling.params import GREEDY, SamplingParams
from treedec.engine import Engine
from treedec.errors import PoolExhaustedError
from treedec.programs.generate import GenerateProgram, generate_batch
from treedec.programs.beam import BeamProgram
from treedec.programs.controller import BranchEvery, ControllerProgram
from treedec.programs.speculative.drafts import PromptLookupDraft, TreeDraft
from treedec.runtime.program import Program, StepRequest
from treedec.runtime.requests import RequestSpec
from treedec.runtime.scheduler import run_program, run_programs
from treedec.programs.speculative.program import SpeculativeProgram
from treedec.sampling.stops import StopRule
from treedec.programs.tot import BFSConfig, ToTProgram, ToTTask
from treedec.tree.token_tree import TokenTree
from tests.engines import make_engine, tiny_model

BASE = [(29 * i + 11) % 512 for i in range(40)]   # the prefix prompts may share


def tokens(n, k):
    return [(37 * k + 13 * i + 5) % 512 for i in range(n)]


def outputs(results):
    return [(r.id, r.index, r.output_ids, r.stop_reason) for r in results]


def engine_of(pages, page_size=4):
    return Engine(tiny_model(), kv_tokens=pages * page_size, page_size=page_size, backend="torch")


def all_free(engine):
    return engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages


# ================================================================ the cases


@pytest.mark.parametrize("sharing", [None, 0])
def test_requests_sharing_a_prefix_run_where_each_runs_alone(sharing):
    """The issue's case (smaller): three requests whose prompts share 13 tokens each run alone on a 48-token
    pool (page size 4). Shared, a prefix ending mid-page cost each member a page more than alone, and the
    batch raised PoolExhaustedError; a prefix holds whole pages now, so the batch runs, sharing or not."""
    specs = [RequestSpec(k, prompt_ids=tuple(BASE[:13] + tokens(3, k)),
                         params=SamplingParams(max_tokens=32, temperature=0.0))
             for k in range(3)]
    alone = [r for spec in specs for r in generate_batch(engine_of(12), [spec])[0]]
    engine = engine_of(12)
    batched, stats = generate_batch(engine, specs, min_shared_prefix=sharing)
    assert outputs(batched) == outputs(alone) and all_free(engine)
    assert stats.preemptions > 0 and stats.peak_pages <= 12
    assert stats.shared_prefix_tokens == (12 * 2 if sharing is None else 0)


def test_an_idle_prefix_gives_its_pages_back():
    """Group a's first member retires while its second waits for admission: the prefix stays (idle) for
    the second, but when request b, which alone takes the whole pool, needs its pages they are taken back
    (and the prefix prefilled again for the second member). Before, b raised PoolExhaustedError."""
    specs = [RequestSpec("a1", prompt_ids=tuple(BASE[:16] + tokens(2, 1)),
                         params=SamplingParams(max_tokens=2, temperature=0.0)),
             RequestSpec("b", prompt_ids=tuple(tokens(8, 2)), params=SamplingParams(max_tokens=76, temperature=0.0)),
             RequestSpec("a2", prompt_ids=tuple(BASE[:16] + tokens(48, 3)),
                         params=SamplingParams(max_tokens=2, temperature=0.0))]
    alone = [r for spec in specs for r in generate_batch(engine_of(21), [spec])[0]]
    engine = engine_of(21)
    batched, stats = generate_batch(engine, specs)
    assert outputs(batched) == outputs(alone) and all_free(engine)
    assert stats.shared_prefix_tokens == 16 and stats.peak_pages <= 21


# ================================================================ every kind of program, random batches


class EchoTask(ToTTask):
    """A short ToT task whose values depend on the outputs only (a preempted search runs again the same)."""

    thought_max_tokens, value_max_tokens = 2, 1

    def root_prompt(self):
        return "Q?"

    def step_prompt(self, thoughts):
        return ""

    def value_prompt(self, thoughts):
        return "V"

    def parse_value(self, thoughts, outputs):
        return float(sum(map(len, "".join(outputs).split())) % 3)


class Chars:
    bos_id = None

    def encode(self, text):
        return [ord(c) % 512 for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


def make_program(kind, prompt, budget, k):
    """A fresh program of ``kind`` (a preempted program runs again: each run gets its own)."""
    if kind == "greedy":
        spec = RequestSpec(k, prompt_ids=tuple(prompt), params=SamplingParams(max_tokens=budget, temperature=0.0))
    elif kind == "sampled":   # parallel sampling, seeded: the same outputs batched as alone
        spec = RequestSpec(k, prompt_ids=tuple(prompt),
                           params=SamplingParams(max_tokens=budget, temperature=0.8, seed=k, n=2))
    elif kind == "lookup":
        return SpeculativeProgram(prompt, PromptLookupDraft(num_draft_tokens=3), StopRule(budget))
    elif kind == "tree":
        draft = TreeDraft(TokenTree.from_medusa_choices([[0], [1], [0, 0]]), lambda seq: [seq[-1], 7, seq[-1]])
        return SpeculativeProgram(prompt, draft, StopRule(budget), max_draft_tokens=4)
    elif kind == "beam":
        return BeamProgram(prompt, 2, budget, 1.0, (), False, 4)
    elif kind == "controller":
        return ControllerProgram(tiny_engine(), prompt, BranchEvery(every=2, k=2, max_leaves=4), max_steps=budget,
                                 eos_token_id=None)
    else:
        return ToTProgram(tiny_engine(), EchoTask(), Chars(), BFSConfig(k=2, n=1, depth=2, sampling=GREEDY),
                          eos_token_id=None)
    return GenerateProgram(spec, list(spec.prompt_ids))


def tiny_engine():
    return make_engine(tiny_model())


KINDS = ["greedy", "sampled", "lookup", "tree", "beam", "controller", "tot"]


def view(result):
    """A program's result as ``(plain values, scores)`` (its seconds and node ids left out): beam scores sum
    float32 log-probs, whose last bits depend on the step's other rows."""
    if isinstance(result, list):   # GenerateProgram
        return [(r.output_ids, r.stop_reason) for r in result], []
    if isinstance(result, tuple):   # SpeculativeProgram
        return result[0].token_ids, []
    if hasattr(result, "sequences"):
        return result.sequences, result.scores
    if hasattr(result, "queries_per_step"):   # ControllerRun
        return (result.steps, result.queries_per_step), []
    return ([(s.index, s.thoughts, s.value) for s in result.best], [lv.thoughts for lv in result.levels]), []


requests = st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from([0, 4, 9, 16]), st.integers(1, 6),
                              st.integers(1, 8)), min_size=2, max_size=4)


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(requests=requests, page_size=st.sampled_from([1, 2, 4, 8]), slack=st.integers(0, 3),
       sharing=st.sampled_from([None, 0, 1]))
@pytest.mark.slow
def test_a_batch_runs_wherever_each_program_runs_alone(requests, page_size, slack, sharing):
    """Random batches of every program kind (prompts with and without a common prefix), the smallest pool
    (plus ``slack`` pages) in which each program runs alone: the batch runs, each result is the program's
    alone, and every page is free again."""
    def programs():
        return [make_program(kind, BASE[:shared] + tokens(own, k), budget, k)
                for k, (kind, shared, own, budget) in enumerate(requests)]

    need = []   # the fewest pages each program runs alone in
    for program in programs():
        pages = 1
        while True:
            try:
                result = run_program(engine_of(pages, page_size), program)
                break
            except PoolExhaustedError:
                pages += 1
        need.append((pages, view(result)))
    pool = max(p for p, _ in need) + slack
    engine = engine_of(pool, page_size)
    free = engine.pool.num_free_pages
    results, stats = run_programs(engine, programs(), min_shared_prefix=sharing)
    together, alone = [view(r) for r in results], [v for _, v in need]
    assert [v for v, _ in together] == [v for v, _ in alone]
    assert [x for _, s in together for x in s] == pytest.approx([x for _, s in alone for x in s], rel=1e-5)
    assert engine.pool.num_free_pages == free and engine.tree.num_nodes == 0 and stats.peak_pages <= pool


# ================================================================ a failure mid-run


class FailsAfter(Program):
    """Prefills its prompt (sharing its prefix), takes ``steps`` steps, then raises."""

    def __init__(self, prompt, steps):
        self.prompt_ids, self.steps = list(prompt), steps

    def run(self, ctx):
        node = None
        try:
            node, _ = yield from ctx.prompt(self.prompt_ids)
            for _ in range(self.steps):
                yield from ctx.reserve(ctx.engine.tree.pages_to_extend(node, 1))
                ctx.engine.tree.extend(node, [3])
                yield StepRequest([node])
            raise RuntimeError("the program failed")
        finally:
            ctx.free(node)


@pytest.mark.parametrize("pages", [64, 14])
def test_a_program_failing_mid_run_frees_every_page_and_keeps_delivered_results(pages):
    """Requests sharing a prefix, one short (it finishes first), one failing mid-run: the error ends the run,
    every page is free (the prefix's too), and the result given to ``on_done`` stays given."""
    engine = engine_of(pages)
    free, done = engine.pool.num_free_pages, []
    specs = [RequestSpec(k, prompt_ids=tuple(BASE[:16] + tokens(3, k)),
                         params=SamplingParams(max_tokens=2 + 10 * k, temperature=0.0))
             for k in range(2)]
    programs = [GenerateProgram(specs[0], list(specs[0].prompt_ids)), FailsAfter(BASE[:16] + tokens(5, 9), 6),
                GenerateProgram(specs[1], list(specs[1].prompt_ids))]
    with pytest.raises(RuntimeError, match="the program failed"):
        run_programs(engine, programs, on_done=lambda index, result: done.append((index, result)))
    assert engine.pool.num_free_pages == free and engine.tree.num_nodes == 0
    assert [(index, outputs(result)) for index, result in done] == \
        [(0, outputs(generate_batch(engine_of(64), specs[:1])[0]))]
