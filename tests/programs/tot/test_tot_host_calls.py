"""A ToT batch's host work per request and step (issue #49): the Python calls of a tot_batch search, counted as
bench/host_scaling.py counts them (cProfile over every step of the search after the first two, the forward stubbed),
grow by at most a bound per task and step. At base 780ea43 one more task cost ~240 calls a step here (its thoughts'
text fed token by token through per-token method calls, its prompts branched, its evaluations and dropped thoughts
pruned, its new lanes placed, one at a time); one pass over a thought's text and one edit for each kind of tree edit
brought it to ~80 (what is left: the text at ~6 calls a token, a Decode's and an evaluation's fixed work)."""
import torch

from bench.host_scaling import Steps, make_engine
from tests.engines import tiny_model
from treedec.programs.tot import BFSConfig, ByteTokenizer, tot_batch
from treedec.programs.tot.game24 import Game24Task

PUZZLES = ([1, 1, 4, 6], [2, 3, 5, 12], [4, 9, 10, 13], [3, 3, 8, 8])
#: the most Python calls one more task may add to a step (measured: 83 on branch tot-host, 241 at base 780ea43)
CALLS_PER_TASK_STEP = 95


def python_calls_per_step(tasks: int) -> tuple[float, int]:
    """(Python calls a step over the search after its first two steps, steps) of a ``tasks``-task tot_batch."""
    engine = make_engine(tiny_model(), torch.device("cpu"), 64 * 1024)
    clock = Steps(engine, profile=(2, None))
    games = [Game24Task(PUZZLES[i % len(PUZZLES)], check_steps=False, thought_max_tokens=24, value_max_tokens=8)
             for i in range(tasks)]
    tot_batch(engine, games, ByteTokenizer(), BFSConfig(k=3, n=2, depth=2))
    clock.stop()
    return clock.calls()[0] / clock.profiled, clock.profiled


def test_a_tot_task_adds_a_bounded_number_of_python_calls_to_a_step():
    python_calls_per_step(1)   # (what a process does once: made and classified on first use)
    (few, steps_few), (many, steps_many) = python_calls_per_step(2), python_calls_per_step(12)
    assert abs(steps_many - steps_few) <= 2, (steps_few, steps_many)   # (the searches run side by side)
    per_task = (many - few) / 10
    assert per_task <= CALLS_PER_TASK_STEP, f"{per_task:.1f} Python calls per task and step ({few:.0f} / {many:.0f})"
