"""ScheduleRecorder on every scheduler program but the speculative ones (tiny random model, CPU).

Each run is recorded, its schedule saved and loaded back, then replayed by a :class:`ScheduleDriver` on a fresh
engine (tests/replay/recording.py); after every step the replayed tree must equal the recorded one (each node's
parent and tokens, and the KV pages in use), and once released the replay's pool must be all free. A greedy run
is recorded with ``prompt_ids`` (decoded tokens as counts: the replay's model must choose them again), a sampled
one with ``token_ids``. Speculative programs: test_recorder_speculative.py.
"""
import pytest
import torch

from treedec.replay import ReplayConfig, replay
from treedec.programs import BeamProgram, BranchEvery, ControllerProgram, GenerateProgram, beam_search, generate_batch, greedy_generate, parallel_sample, run_controller
from treedec.runtime import RequestSpec, run_programs
from treedec.sampling import SamplingParams
from treedec.programs.speculative import PromptLookupDraft, SpeculativeProgram
from treedec.sampling.stops import StopRule
from treedec.programs.tot import BFSConfig, ByteTokenizer, DFSConfig, ToTProgram, ToTTask, tot_batch, tot_bfs, tot_dfs
from treedec.workloads import Extend, Prompt, Prune, Truncate
from tests.engines import tiny_model
from tests.replay.recording import (CHUNK, PAGE, make_engine, ops_of, placed, prompt, record, replay_steps)


def batch_requests(temperature):
    shared = prompt(1, 8)   # two whole pages: one prefix node read by requests 0 and 1
    return [RequestSpec(0, prompt_ids=shared + prompt(2, 5), params=SamplingParams(max_tokens=4, temperature=0.0)),
            RequestSpec(1, prompt_ids=shared + prompt(3, 3),
                        params=SamplingParams(max_tokens=3, temperature=temperature, seed=2, n=2)),
            RequestSpec(2, prompt_ids=prompt(4, 20),
                        params=SamplingParams(max_tokens=3, temperature=temperature, seed=5))]


# ================================================================ generation


@pytest.mark.parametrize("temperature, flags", [(0.0, {"prompt_ids": True}), (1.0, {"token_ids": True})])
def test_generate_batch_with_a_shared_prefix_and_a_chunked_prompt(temperature, flags):
    schedule, shots, final, (results, stats) = record(lambda e: generate_batch(e, batch_requests(temperature)),
                                                      **flags)
    # The shared prefix is prefilled; request 2's prompt is the scheduler's (its first chunk, then two extends);
    # the others continue under the prefix's node.
    prefix, chunked = ops_of(schedule, Prompt)
    assert not prefix.pending and chunked.pending and len(chunked.tokens) == CHUNK
    assert [op.tokens for op in ops_of(schedule, Extend) if op.node == chunked.id][:2] == [prompt(4, 20)[8:16],
                                                                                           prompt(4, 20)[16:]]
    assert stats.shared_prefix_tokens == 8
    seen = replay_steps(schedule, shots, final)
    assert all(any(placed(r.output_ids, toks) for toks in seen.values()) for r in results)


def test_pipelined_greedy_generate_truncates_past_the_end():
    text = prompt(11, 10)
    ahead = greedy_generate(make_engine(), text, 6, eos_token_id=None)
    eos = ahead[3]   # the run stops there, one pipelined step past it

    def run(engine):
        return greedy_generate(engine, text, 6, eos_token_id=eos, pipeline=True)

    for flags in ({"token_ids": True}, {"prompt_ids": True}):
        schedule, shots, final, out = record(run, **flags)
        assert out == ahead[:ahead.index(eos) + 1] and ops_of(schedule, Truncate)
        # The tree holds placeholders until the tokens are read back: compare the shapes step by step, the
        # tokens at the end (the prompt and every new token but the last).
        replay_steps(schedule, shots, final, tokens=False)
        assert final[0] == {0: (None, text + tuple(out[:-1]))}


def test_pipelined_generate_batch():
    def run(engine):
        return generate_batch(engine, batch_requests(1.0), pipeline=True)

    schedule, shots, final, (results, _) = record(run, token_ids=True)
    seen = replay_steps(schedule, shots, final, tokens=False)
    assert all(any(placed(r.output_ids, toks) for toks in seen.values()) for r in results)


def test_generate_program_kept_on_its_prompts_node():
    spec = RequestSpec("k", prompt_ids=prompt(5, 6), params=SamplingParams(max_tokens=5, temperature=0.0))
    schedule, shots, final, ((outputs,), _) = record(
        lambda e: run_programs(e, [GenerateProgram(spec, list(spec.prompt_ids), keep=True, on_prompt=True)]),
        prompt_ids=True)
    replay_steps(schedule, shots, final)
    (parent, tokens), = final[0].values()   # the output on the prompt's node, kept
    assert parent is None and tokens[:6 + 4] == prompt(5, 6) + tuple(outputs[0].output_ids[:-1])


def test_parallel_sampling():
    def run(engine):
        return parallel_sample(engine, prompt(8, 9), 3, 4, SamplingParams(temperature=1.0, top_k=20),
                               eos_token_id=None, generator=torch.Generator().manual_seed(1))

    schedule, shots, final, result = record(run, token_ids=True)
    seen = replay_steps(schedule, shots, final)
    assert all(any(placed(s.tokens, toks) for toks in seen.values()) for s in result.samples)


# ================================================================ beams and branches


def test_beam_search():
    schedule, shots, final, result = record(lambda e: beam_search(e, prompt(6, 10), 3, 4, eos_token_id=None),
                                            token_ids=True)
    replay_steps(schedule, shots, final)
    assert len(result.sequences) == 3


@pytest.mark.parametrize("temperature, flags", [(0.0, {"prompt_ids": True}), (0.8, {"token_ids": True})])
def test_run_controller(temperature, flags):
    def run(engine):
        return run_controller(engine, prompt(7, 12), BranchEvery(every=2, k=2, max_leaves=4), max_steps=5,
                              sampling=SamplingParams(temperature=temperature),
                              generator=torch.Generator().manual_seed(3), eos_token_id=None)

    schedule, shots, final, _ = record(run, **flags)
    replay_steps(schedule, shots, final)


# ================================================================ tree of thought


class Task(ToTTask):
    thought_stop, thought_max_tokens, value_max_tokens = (), 3, 2

    def __init__(self, question="Q: 3 5 7?"):
        self.question = question

    def root_prompt(self):
        return self.question

    def step_prompt(self, thoughts):
        return "\nNext:"   # a prompt continued under each state

    def value_prompt(self, thoughts):
        return "\nV:"

    def parse_value(self, thoughts, outputs):
        return (sum(map(ord, "".join(outputs))) % 3) / 2   # 0, 0.5 or 1: DFS prunes some thoughts


@pytest.mark.parametrize("temperature, flags", [(0.0, {"prompt_ids": True}), (1.0, {"token_ids": True})])
def test_tot_bfs(temperature, flags):
    config = BFSConfig(k=2, n=2, depth=2, sampling=SamplingParams(temperature=temperature), seed=4)
    schedule, shots, final, _ = record(lambda e: tot_bfs(e, Task(), ByteTokenizer(), config), **flags)
    replay_steps(schedule, shots, final)


def test_tot_dfs():
    config = DFSConfig(k=3, depth=3, sampling=SamplingParams(temperature=1.0), seed=4, threshold=0.5, max_expansions=4)
    schedule, shots, final, result = record(lambda e: tot_dfs(e, Task(), ByteTokenizer(), config), token_ids=True)
    assert ops_of(schedule, Prune)
    replay_steps(schedule, shots, final)


def test_tot_batch():
    config = BFSConfig(k=2, n=1, depth=2, sampling=SamplingParams(temperature=1.0), seed=4)
    schedule, shots, final, (results, _) = record(
        lambda e: tot_batch(e, [Task(), Task("Q: 1 2?")], ByteTokenizer(), config), token_ids=True)
    assert len(results) == 2
    replay_steps(schedule, shots, final)


# ================================================================ several programs in one run


def every_kind(engine, greedy):
    """Generation, speculative decoding, a ToT search, beam search and a branch controller in one scheduler run."""
    temperature = 0.0 if greedy else 0.9
    spec = RequestSpec("s", prompt_ids=prompt(1, 9),
                       params=SamplingParams(max_tokens=5, temperature=temperature, seed=4, n=1 if greedy else 2))
    return run_programs(engine, [
        GenerateProgram(spec, list(spec.prompt_ids)),
        SpeculativeProgram(prompt(2, 6) * 2, PromptLookupDraft(num_draft_tokens=3), StopRule(6)),
        ToTProgram(engine, Task(), ByteTokenizer(),
                   BFSConfig(k=2, n=1, depth=2, sampling=SamplingParams(temperature=temperature), seed=1)),
        BeamProgram(list(prompt(3, 7)), num_beams=2, max_new_tokens=4, length_penalty=1.0, eos=(),
                    early_stopping=False, keep=4),
        ControllerProgram(engine, prompt(4, 5), BranchEvery(every=2, k=2, max_leaves=4), max_steps=4,
                          sampling=SamplingParams(temperature=temperature),
                          generator=torch.Generator().manual_seed(2), eos_token_id=None)])


@pytest.mark.parametrize("greedy, flags", [(True, {"prompt_ids": True}), (False, {"token_ids": True})])
def test_every_kind_of_program_in_one_run(greedy, flags):
    schedule, shots, final, (results, stats) = record(lambda e: every_kind(e, greedy), **flags)
    assert max(stats.programs_per_step) == 5
    replay_steps(schedule, shots, final)


def test_preempted_programs_run_again():
    """A pool too small for all: programs are preempted (their nodes pruned) and run again from their start."""
    specs = [RequestSpec(k, prompt_ids=prompt(30 + k, 9),
                         params=SamplingParams(max_tokens=12, temperature=0.0)) for k in range(3)]
    kv_tokens = 14 * PAGE
    schedule, shots, final, (results, stats) = record(lambda e: generate_batch(e, specs), kv_tokens=kv_tokens,
                                                      prompt_ids=True)
    assert stats.preemptions > 0
    seen = replay_steps(schedule, shots, final, kv_tokens=kv_tokens)
    assert all(any(placed(r.output_ids, toks) for toks in seen.values()) for r in results)


# ================================================================ the recorded file through replay()


def test_recorded_scheduler_run_replays_from_its_file():
    schedule, *_ = record(lambda e: generate_batch(e, batch_requests(0.0)), prompt_ids=True)
    run = replay(tiny_model(), schedule, ReplayConfig(page_size=PAGE, backend="torch"))
    assert run.summary["pages_free_at_end"] and run.summary["decode_steps"] > 0
    assert {s["kind"] for s in run.steps} >= {"prefill", "decode"}
