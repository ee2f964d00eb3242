"""Requests longer than the model's positions (tiny random model, CPU): every program refuses, before
anything runs, a request whose prompt and token budget pass the model's ``max_position`` (or its
sliding window), naming the request; what a program only learns as it runs (a draft tree, a
controller's or a task's tokens) is refused before it is computed, with every page freed."""
import functools

import pytest
import torch

from treedec.sampling.params import GREEDY, SamplingParams
from treedec.engine import Engine
from treedec.models import ModelConfig, from_config
from treedec.programs.generate import GenerateProgram, generate_batch
from treedec.programs.beam import BeamProgram, beam_search
from treedec.programs.controller import BranchEvery, ControllerError, ControllerProgram, Extend, run_controller
from treedec.programs.speculative.drafts import DraftSource, PromptLookupDraft, TreeDraft
from treedec.runtime.request import position_limit
from treedec.runtime.requests import RequestSpec
from treedec.runtime.scheduler import run_programs
from treedec.programs.speculative.program import speculative_generate
from treedec.programs.speculative.batch import speculative_batch
from treedec.programs.tot import BFSConfig, ToTTask, tot_bfs
from treedec.tree.token_tree import TokenTree
from tests.programs.tot.test_tot_search import CharTokenizer

POSITIONS = 64


@functools.lru_cache(maxsize=None)
def short_model(**overrides):
    """The tiny Llama with 64 positions (or other overrides)."""
    config = ModelConfig.from_name("tiny", **{"max_position": POSITIONS, **overrides})
    return from_config(config, seed=0, dtype=torch.float32, device="cpu")


def fresh_engine(model=None):
    return Engine(model or short_model(), kv_tokens=512, page_size=4, backend="torch")


def ids(n, k=0):
    return tuple((13 * k + 7 * i + 1) % 512 for i in range(n))


def untouched(engine):
    """Nothing ran: no step, no node, every page free."""
    return engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages \
        and engine.stats["steps"] == 0


def test_a_batch_refuses_a_request_past_the_positions_before_anything_runs():
    """The issue's case at a small scale: a request whose prompt and max_new_tokens pass max_position
    (here the third; the one before it ends exactly at the limit) stops the batch before any step, and
    the error names it by id and line."""
    engine, done = fresh_engine(), []
    specs = [RequestSpec(0, prompt_ids=ids(10), params=SamplingParams(max_tokens=5, temperature=0.0)),
             RequestSpec("edge", prompt_ids=ids(60, 1), params=SamplingParams(max_tokens=4, temperature=0.0)),
             RequestSpec("long", prompt_ids=ids(60, 2), line=7, params=SamplingParams(max_tokens=5, temperature=0.0))]
    with pytest.raises(ValueError, match=r"request 'long' \(line 7\) may reach 65 positions \(a 60-token prompt "
                                         r"\+ max_tokens 5\), more than the model's max_position 64 .*nothing was "
                                         r"run"):
        generate_batch(engine, specs, on_request_done=done.append)
    assert untouched(engine) and done == []
    results, _ = generate_batch(engine, specs[:2])   # exactly max_position: runs
    assert [len(r.output_ids) for r in results] == [5, 4] and engine.pool.num_free_pages == engine.pool.num_pages


def test_the_default_model_refuses_the_issue_s_5000_token_request():
    engine = Engine(from_config("tiny", seed=0, dtype=torch.float32, device="cpu"), kv_tokens=16384, page_size=16,
                    backend="torch")
    spec = RequestSpec("r", prompt_ids=ids(5000), params=SamplingParams(max_tokens=5000))
    with pytest.raises(ValueError, match=r"request 'r' may reach 10000 positions .* max_position 4096"):
        generate_batch(engine, [spec])
    assert untouched(engine)


def test_a_sliding_window_bounds_the_positions():
    """A config's window its layers' variants do not attend (a model that does not declare it stands in: every
    family's layers declare theirs) bounds the positions."""
    from treedec.attention.variant import AttentionVariant

    model = short_model(sliding_window=16)
    model.attention_variants = lambda: (AttentionVariant(),) * model.config.num_layers
    engine = fresh_engine(model)
    with pytest.raises(ValueError, match=r"request 1 may reach 17 positions .* its sliding window of 16 tokens"):
        generate_batch(engine, [RequestSpec(1, prompt_ids=ids(10), params=SamplingParams(max_tokens=7))])
    assert untouched(engine)


def test_a_window_the_model_attends_bounds_nothing():
    """Mistral's sliding window is attended as a window (the engine's tree attention clips each query's reads to
    it): its positions run to max_position, past the window."""
    model = short_model(sliding_window=16, model_type="mistral")
    assert position_limit(model) == POSITIONS
    results, _ = generate_batch(fresh_engine(model), [RequestSpec(1, prompt_ids=ids(10), params=SamplingParams(
        max_tokens=30, temperature=0.0, ignore_eos=True))])
    assert len(results[0].output_ids) == 30


@pytest.mark.parametrize("make, match", [
    (lambda: BeamProgram(list(ids(50)), 2, 15, 1.0, (), False, 4),
     r"a 50-token prompt \+ max_new_tokens 15"),
    (lambda: ControllerProgram(fresh_engine(), list(ids(50)), BranchEvery(), max_steps=15),
     r"a 50-token prompt \+ max_steps 15"),
], ids=["beam", "controller"])
def test_run_programs_refuses_every_program_before_the_first_runs(make, match):
    """The first program is fine; the second would pass the positions: nothing runs, and the error names
    it by its index in the run."""
    engine = fresh_engine()
    spec = RequestSpec(0, prompt_ids=ids(8), params=SamplingParams(max_tokens=3, temperature=0.0))
    with pytest.raises(ValueError, match=rf"programs\[1\] \(\w+Program\) may reach 65 positions \({match}\)"):
        run_programs(engine, [GenerateProgram(spec, list(spec.prompt_ids)), make()])
    assert untouched(engine)


def test_the_one_request_functions_refuse_too():
    engine = fresh_engine()
    with pytest.raises(ValueError, match="may reach 66 positions"):
        beam_search(engine, ids(60), num_beams=2, max_new_tokens=6, eos_token_id=None)
    with pytest.raises(ValueError, match="may reach 65 positions"):
        run_controller(engine, ids(60), BranchEvery(), max_steps=5)
    assert untouched(engine)


def test_speculative_decoding_counts_the_draft_s_depth():
    """A tree hangs up to its draft's ``max_depth`` tokens past the sequence: prompt + max_new_tokens +
    max_depth - 1 positions."""
    engine = fresh_engine()
    with pytest.raises(ValueError, match=r"may reach 65 positions \(a 50-token prompt \+ max_new_tokens 12 \+ the "
                                         r"draft's max_depth 4 - 1\)"):
        speculative_generate(engine, ids(50), PromptLookupDraft(num_draft_tokens=4), 12)
    specs = [RequestSpec("s", prompt_ids=ids(50), line=2, params=SamplingParams(max_tokens=12, temperature=0.0))]
    with pytest.raises(ValueError, match=r"request 's' \(line 2\) may reach 65 positions"):
        speculative_batch(engine, specs, lambda spec: PromptLookupDraft(num_draft_tokens=4))
    assert untouched(engine)
    tokens, _ = speculative_generate(engine, ids(50), PromptLookupDraft(num_draft_tokens=3), 12, eos_token_id=None)
    assert len(tokens) == 12


class DeepDraft(DraftSource):
    """A chain draft ``depth`` tokens deep that declares ``max_depth`` (or nothing)."""

    def __init__(self, depth, max_depth=None):
        self.draft = TreeDraft(TokenTree.chain(depth), [1] * depth)
        if max_depth is not None:
            self.max_depth = max_depth

    def propose(self, sequence_tokens):
        return self.draft.propose(sequence_tokens)


@pytest.mark.parametrize("draft, match", [
    (DeepDraft(6, max_depth=2), "the draft proposed a tree 6 tokens deep, past its max_depth 2"),
    (DeepDraft(20), r"programs\[0\] \(SpeculativeProgram\) may reach 70 positions \(50 tokens so far \+ a draft "
                    r"tree 20 deep\)"),
], ids=["past-its-max-depth", "undeclared-depth"])
def test_a_draft_tree_past_its_bound_is_refused_before_it_is_computed(draft, match):
    engine = fresh_engine()
    with pytest.raises(ValueError, match=match):
        speculative_generate(engine, ids(49), draft, 8, eos_token_id=None)
    # the prompt was prefilled and then freed with the request (speculative_generate keeps it only on success)
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages


def test_a_controller_extend_past_the_positions_is_refused():
    class Long:
        def decide(self, view):
            return [Extend(leaf, tuple(ids(30))) for leaf in view.leaves]

    engine = fresh_engine()
    with pytest.raises(ControllerError, match=r"ops\[0\] = Extend\(.*: 40 \+ 30 tokens would run past the model's 64 "
                                              r"positions"):
        run_controller(engine, ids(40), Long(), max_steps=3)


class ShortTask(ToTTask):
    """A task whose prompts are as long as asked (``step`` characters of step prompt)."""

    thought_max_tokens, value_max_tokens = 4, 2

    def __init__(self, root=10, step=0):
        self.root, self.step = root, step

    def root_prompt(self):
        return "r" * self.root

    def step_prompt(self, thoughts):
        return "s" * self.step

    def value_prompt(self, thoughts):
        return "v"

    def parse_value(self, thoughts, outputs):
        return float(len(thoughts))



def test_tot_counts_its_depth_and_refuses_a_task_prompt_past_the_positions():
    engine = fresh_engine()
    config = BFSConfig(k=2, n=1, depth=3, sampling=GREEDY)
    with pytest.raises(ValueError, match=r"may reach 65 positions \(a 51-token root prompt \+ depth 3 x "
                                         r"thought_max_tokens 4 \+ value_max_tokens 2\)"):
        tot_bfs(engine, ShortTask(root=51), CharTokenizer(), config, eos_token_id=None)
    assert untouched(engine)
    # The step prompts are the task's, made as the search goes: the second level's would pass the positions.
    with pytest.raises(ValueError, match=r"may reach 73 positions \(39 tokens \+ a 34-token prompt of ShortTask\)"):
        tot_bfs(engine, ShortTask(root=1, step=34), CharTokenizer(), config, eos_token_id=None)
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages
