"""The scheduler (tiny random Llama, CPU): the step budget, reads, waits, failures, and programs of
every kind in one run giving what each gives alone."""
import pytest

from treedec.sampling.params import SamplingParams
from treedec.engine import Engine
from treedec.errors import PoolExhaustedError
from treedec.programs.generate import GenerateProgram, generate_batch
from treedec.programs.beam import BeamProgram
from treedec.programs.controller import BranchEvery, ControllerProgram
from treedec.programs.speculative.drafts import PromptLookupDraft
from treedec.programs.tot.game24 import Game24Task
from treedec.runtime.requests import RequestSpec
from treedec.runtime.program import Program, Read, StepRequest, Wait
from treedec.runtime.scheduler import run_program, run_programs
from treedec.programs.speculative.program import SpeculativeProgram
from treedec.sampling.stops import StopRule
from treedec.programs.tot import BFSConfig, ByteTokenizer, ToTProgram
from tests.engines import make_engine, plain_greedy, tiny_model


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


class Greedy(Program):
    """``steps`` greedy tokens after ``prompt``; reads each token back through the scheduler."""

    def __init__(self, prompt, steps, read_shape=None):
        self.prompt_ids, self.steps, self.read_shape = list(prompt), steps, read_shape

    def run(self, ctx):
        node = None
        try:
            node, out = yield from ctx.prompt(self.prompt_ids)
            tokens = []
            for _ in range(self.steps):
                drawn = out.logits.argmax(dim=-1)
                if self.read_shape is not None:   # a 2-D read comes back as nested lists
                    value = yield Read(drawn.repeat(self.read_shape).reshape(self.read_shape[0], -1))
                    assert value == [value[0]] * self.read_shape[0]
                    value = value[0]
                else:
                    value = yield Read(drawn)
                tokens.append(value[0])
                yield from ctx.reserve(ctx.engine.tree.pages_to_extend(node, 1))
                ctx.engine.tree.extend(node, value)
                out = yield StepRequest([node])
            return tokens
        finally:
            ctx.free(node)


def prompt(k, length=6):
    return [(31 * k + 7 * i + 3) % 512 for i in range(length)]


def test_programs_share_steps_and_the_budget_defers_the_rest(tiny):
    engine = make_engine(tiny)
    programs = [Greedy(prompt(k), 4, read_shape=(2, 1) if k == 1 else None) for k in range(3)]
    results, stats = run_programs(engine, programs, max_step_tokens=6, min_shared_prefix=0)
    assert results == [plain_greedy(tiny, prompt(k), 5)[:4] for k in range(3)]
    # 6 prompt tokens fill the budget: one prompt a step, then the decode steps of all three together.
    assert stats.queries_per_step[:3] == [6, 7, 8] and stats.programs_per_step[:3] == [1, 2, 3]
    assert stats.prompt_steps == 3 and max(stats.programs_per_step) == 3
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages


def test_a_program_alone_that_waits_for_pages_raises_and_frees_them(tiny):
    engine = Engine(tiny, kv_tokens=32, page_size=4, backend="torch")
    with pytest.raises(PoolExhaustedError, match="a program needs 1 free pages of 4 tokens, 0 of 8 are free"):
        run_program(engine, Greedy(prompt(0, 20), 30))
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == 8


def test_a_step_bigger_than_the_pool_raises(tiny):
    engine = Engine(tiny, kv_tokens=32, page_size=4, backend="torch")
    with pytest.raises(PoolExhaustedError, match="a step needs 10 pages of 4 tokens, the pool has 8 in all"):
        run_program(engine, Greedy(prompt(0, 40), 1))
    assert engine.tree.num_nodes == 0


class Failing(Program):
    def __init__(self, at, what):
        self.prompt_ids, self.at, self.what = prompt(9), at, what

    def run(self, ctx):
        node, _ = yield from ctx.prompt(self.prompt_ids)
        try:
            for i in range(self.at):
                ctx.engine.tree.extend(node, [5])
                yield StepRequest([node])
            ctx.engine.tree.extend(node, [5])   # pending when it fails: freed with the rest
            if self.what == "raise":
                raise RuntimeError("the program failed")
            yield "not a request"
        finally:
            ctx.free(node)


@pytest.mark.parametrize("what,error,match", [("raise", RuntimeError, "the program failed"),
                                              ("yield", TypeError, "Failing.run yielded str, not a StepRequest")])
def test_a_failing_program_ends_the_run_and_frees_every_program(tiny, what, error, match):
    engine = make_engine(tiny)
    other = engine.prefill([1, 2, 3]).node   # not the run's: left alone
    free = engine.pool.num_free_pages
    with pytest.raises(error, match=match):
        run_programs(engine, [Greedy(prompt(0), 8), Failing(2, what), Greedy(prompt(1), 8)])
    assert engine.tree.roots == [other] and engine.pool.num_free_pages == free


def test_run_programs_checks_its_arguments(tiny):
    engine = make_engine(tiny)
    with pytest.raises(TypeError, match="programs must be Program instances, got list"):
        run_programs(engine, [[1, 2]])
    with pytest.raises(ValueError, match="max_step_tokens must be an int >= 1, got 0"):
        run_programs(engine, [], max_step_tokens=0)
    root = engine.prefill([1, 2]).node
    engine.tree.extend(root, [3])
    with pytest.raises(ValueError, match="the engine's tree has 1 pending token"):
        run_programs(engine, [Greedy(prompt(0), 1)])


def test_a_wait_is_retried_once_pages_are_free(tiny):
    class Patient(Program):
        prompt_ids = None

        def run(self, ctx):
            waited = 0
            while ctx.engine.pool.num_free_pages < 7:
                waited += 1
                yield Wait(7)
            return waited

    engine = Engine(tiny, kv_tokens=32, page_size=4, backend="torch")
    results, stats = run_programs(engine, [Greedy(prompt(0, 8), 3), Patient()])
    assert results[1] >= 1 and stats.waits >= 1 and stats.preemptions == 0


def test_every_kind_of_program_in_one_run_gives_what_it_gives_alone(tiny):
    """Sampled generation, greedy speculative decoding, a ToT search, beam search and a branch
    controller share the engine's steps; each result is the program's alone (fp32, the CPU; the beam scores to
    1e-4: the torch backend computes one request's step as one masked attention and a forest's chunk by chunk,
    which round differently in the last bits)."""
    def programs():
        spec = RequestSpec("s", prompt_ids=tuple(prompt(1, 9)),
                           params=SamplingParams(max_tokens=9, temperature=0.9, seed=4, n=2))
        model_engine = Engine(tiny, kv_tokens=64, page_size=4, backend="torch")   # for construction-time checks
        return [GenerateProgram(spec, list(spec.prompt_ids)),
                SpeculativeProgram(prompt(2, 12) * 2, PromptLookupDraft(num_draft_tokens=4), StopRule(10)),
                ToTProgram(model_engine, Game24Task([4, 9, 10, 13], check_steps=False, thought_max_tokens=3,
                                                    value_max_tokens=2),
                           ByteTokenizer(),
                           BFSConfig(k=2, n=1, depth=2, sampling=SamplingParams(temperature=0.5), seed=1)),
                BeamProgram(prompt(3, 7), num_beams=3, max_new_tokens=6, length_penalty=1.0, eos=(), early_stopping=False,
                            keep=6),
                ControllerProgram(model_engine, prompt(4, 5), BranchEvery(every=2, k=2, max_leaves=4), max_steps=6)]

    def view(results):
        sampled, (checker, _), tot, beams, run = results
        return ([r.output_ids for r in sampled], checker.token_ids,
                [(s.index, s.thoughts, s.value) for s in tot.best], [lv.thoughts for lv in tot.levels],
                beams.sequences, [round(x, 4) for x in beams.scores], run.steps, run.queries_per_step)

    engine = Engine(tiny, kv_tokens=1 << 14, page_size=4, backend="torch")
    together, stats = run_programs(engine, programs())
    alone = [run_program(Engine(tiny, kv_tokens=1 << 14, page_size=4, backend="torch"), p) for p in programs()]
    assert view(together) == view(alone)
    assert together[1][0].token_ids == plain_greedy(tiny, prompt(2, 12) * 2, 10)
    assert max(stats.programs_per_step) == 5
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages



def test_on_step_sees_every_engine_step(tiny):
    seen = []
    specs = [RequestSpec(k, prompt_ids=(1 + k, 2, 3), params=SamplingParams(temperature=0, max_tokens=4)) for k in
             range(3)]
    _, stats = generate_batch(make_engine(tiny), specs, on_step=lambda s: seen.append(s.steps))
    assert seen == list(range(1, stats.steps + 1))
