"""The scheduler loop's fault isolation (treedec.runtime.scheduler_loop), through the online scheduler without a
tokenizer: one program's bad token ids, or a request whose processed logits have nothing to draw from, fail that
program alone; the others' outputs are those they give alone, and every page is freed (issue #48, item 4)."""
import pytest
import torch

from treedec.programs.generate import GenerateProgram
from treedec.sampling.logits import NonFiniteLogitsError
from treedec.runtime.online import OnlineScheduler
from treedec.runtime.program import Program, StepRequest
from treedec.runtime.requests import RequestSpec
from treedec.sampling.params import SamplingParams
from treedec.runtime.scheduler import run_program
from tests.engines import make_engine, tiny_model
from tests.programs.test_generate_batch import outputs, prompt


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def greedy_streams():
    return [RequestSpec(k, prompt_ids=prompt(k, 6 + k), params=SamplingParams(max_tokens=8, temperature=0.0))
            for k in range(4)]


class PlacesAnIdPastTheVocabulary(Program):
    """A program with a bug: after its prompt it appends the token id ``vocab`` (what the old inverse-CDF draw
    returned for a NaN row) and asks for the step."""

    def __init__(self, vocab):
        self.prompt_ids, self.vocab = list(prompt(9, 5)), vocab

    def run(self, ctx):
        node, _ = yield from ctx.prompt(self.prompt_ids)
        try:
            ctx.engine.tree.extend(node, [self.vocab])
            yield StepRequest([node])
            return "stepped"
        finally:
            ctx.free(node)


def nan_processor(input_ids, scores):
    return torch.full_like(scores, float("nan"))


def run_online(engine, programs, pipeline=None):
    done, errors = {}, {}
    sched = OnlineScheduler(engine, on_done=done.__setitem__, on_error=errors.__setitem__, pipeline=pipeline)
    handles = [sched.submit(p) for p in programs]
    while sched.iterate():
        pass
    sched.cache.clear()
    return handles, done, errors


@pytest.mark.parametrize("pipeline", [False, True])
def test_one_programs_bad_rows_fail_it_alone(tiny, pipeline):
    """4 greedy streams and 4 faulty requests in the same steps: a program placing an id past the vocabulary
    (the engine's step check ended every live request before), a NaN logits processor, a NaN processor with
    penalties on a sampled request; and degenerate but valid values (temperature 1e-45, top_p 1e-300), which are
    greedy now. Only the faulty ones fail, each with its own error."""
    vocab = tiny.config.vocab_size
    alone = [outputs(run_program(make_engine(tiny), GenerateProgram(s, list(s.prompt_ids)))) for s in greedy_streams()]
    nan_greedy = RequestSpec("nan", prompt_ids=prompt(5, 7),
                             params=SamplingParams(max_tokens=6, temperature=0.0, logits_processors=[nan_processor]))
    nan_sampled = RequestSpec("nan-pen", prompt_ids=prompt(6, 4),
                              params=SamplingParams(max_tokens=6, temperature=0.9, seed=2, n=2, presence_penalty=2.0,
                                                    logits_processors=[nan_processor]))
    degenerate = RequestSpec("tiny-t", prompt_ids=prompt(7, 5),
                             params=SamplingParams(max_tokens=6, temperature=1e-45, top_p=1e-300))
    engine = make_engine(tiny)
    programs = [GenerateProgram(s, list(s.prompt_ids)) for s in greedy_streams()[:2]]
    programs += [PlacesAnIdPastTheVocabulary(vocab)] + [GenerateProgram(s, list(s.prompt_ids))
                                                        for s in (nan_greedy, nan_sampled, degenerate)]
    programs += [GenerateProgram(s, list(s.prompt_ids)) for s in greedy_streams()[2:]]
    handles, done, errors = run_online(engine, programs, pipeline)
    assert set(errors) == {handles[2], handles[3], handles[4]}, errors
    assert isinstance(errors[handles[2]], ValueError) and f"must be in [0, {vocab})" in str(errors[handles[2]])
    assert "it alone failed" in str(errors[handles[2]])
    for h, name in ((handles[3], "'nan'"), (handles[4], "'nan-pen'")):
        assert isinstance(errors[h], NonFiniteLogitsError) and name in str(errors[h])
    assert [outputs(done[h]) for h in handles[:2] + handles[6:]] == alone
    [tiny_t] = done[handles[5]]
    greedy_alone = run_program(make_engine(tiny), GenerateProgram(
        RequestSpec("g", prompt_ids=prompt(7, 5), params=SamplingParams(max_tokens=6, temperature=0.0)),
        list(prompt(7, 5))))
    assert tiny_t.output_ids == greedy_alone[0].output_ids and max(tiny_t.output_ids) < vocab
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages


def test_a_bad_id_no_program_owns_still_fails_the_step(tiny, monkeypatch):
    """Only ids a program placed are set aside; any other refusal of the step ends every live program, as before."""
    engine = make_engine(tiny)
    step = engine.step

    def refusing(*args, **kwargs):
        raise ValueError("not a token error")

    monkeypatch.setattr(engine, "step", refusing)
    handles, done, errors = run_online(engine, [GenerateProgram(s, list(s.prompt_ids)) for s in greedy_streams()])
    assert set(errors) == set(handles) and all("not a token error" in str(e) for e in errors.values())
    monkeypatch.setattr(engine, "step", step)
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages
