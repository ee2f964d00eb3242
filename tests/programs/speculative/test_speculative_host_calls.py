"""A pipelined speculative step's host work (issue #49): the Python calls of a speculative_batch step (a fixed
Medusa-64 TreeDraft, greedy), counted as bench/host_scaling.py counts them (cProfile over 8 decode steps once every
request runs, the forward stubbed, the CUDA-graph path), stay under a fixed bound at one request and grow by at most a
bound per added request. At main 7665195 a step took ~975 calls here (~1020 at 8 requests), whatever the batch (the verify group's tree
edits ~370, its record ~115, the engine step ~330 with ~130 for the dynamic spans' numpy, the scheduler ~100); the
trees kept from step to step (advance_token_trees), the spans compiled and the checks the runtime's own arrays do
not need brought it to ~480 (what is left: the engine step's plan, static write and spans ~200, the verify group's
edits and record ~200, the scheduler ~80)."""
import numpy as np
import torch

from bench.host_scaling import Steps, make_engine
from tests.engines import tiny_model
from treedec.programs.speculative.batch import speculative_batch
from treedec.programs.speculative.drafts import TreeDraft
from treedec.runtime.requests import RequestSpec
from treedec.sampling.params import SamplingParams
from treedec.tree.token_tree import TokenTree
from treedec.workloads.deft import medusa_tree

#: the most Python calls a step of one request may take (measured: ~482 on branch spechost3, ~973 at main 7665195)
CALLS_AT_ONE_REQUEST = 560
#: the most Python calls one more request may add to a step (measured: ~1.3, ~6.7 at main 7665195; the step's work is batch-level)
CALLS_PER_REQUEST_STEP = 5


def python_calls_per_step(requests: int) -> float:
    """Python calls a decode step of a ``requests``-request pipelined speculative batch (steps 4 to 11)."""
    model = tiny_model()
    engine = make_engine(model, torch.device("cpu"), requests * 4096)
    clock = Steps(engine, profile=(3, 11))
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    tree = TokenTree(tuple(medusa_tree(64).parents.tolist()))
    tokens = rng.integers(0, vocab, tree.size - 1).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    specs = [RequestSpec(f"r{i}", prompt_ids=tuple(rng.integers(0, vocab, 64).tolist()), params=params)
             for i in range(requests)]
    speculative_batch(engine, specs, lambda spec: TreeDraft(tree, tokens), pipeline=True)
    assert len(clock.ends) >= 11, f"{len(clock.ends)} steps: too few to count 8"
    return clock.calls()[0] / clock.profiled


def test_a_speculative_step_takes_a_bounded_number_of_python_calls():
    python_calls_per_step(1)   # (what a process does once: made and classified on first use)
    one, eight = python_calls_per_step(1), python_calls_per_step(8)
    assert one <= CALLS_AT_ONE_REQUEST, f"{one:.0f} Python calls a step at one request"
    per_request = (eight - one) / 7
    assert per_request <= CALLS_PER_REQUEST_STEP, f"{per_request:.1f} Python calls per request and step ({one:.0f} / " \
                                                  f"{eight:.0f})"
