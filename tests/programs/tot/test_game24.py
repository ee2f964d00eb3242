"""The Game of 24: step parsing and checking, the exact answer checker, the solver, the task's values,
and a BFS on the tiny random model."""
from fractions import Fraction

import pytest

from treedec.sampling.params import GREEDY
from treedec.engine import Engine
from treedec.programs.tot.game24 import (JUDGE_EXAMPLES, JUDGE_PROMPT, STEP_EXAMPLES, Game24Error, Game24Task, Step,
                                   check_answer, check_step, evaluate_answer, parse_step, solve)
from treedec.programs.tot import BFSConfig, ByteTokenizer, tot_bfs
from tests.engines import tiny_model


@pytest.mark.parametrize("numbers", [(4, 9, 10, 13), (1, 2, 3, 4), (3, 3, 8, 8), (1, 5, 5, 5), (4, 4, 6, 8),
                                     (2, 9, 10, 12), (1, 1, 4, 6)])
def test_solver_finds_answers_the_checker_accepts(numbers):
    answer = solve(numbers)
    assert answer is not None and check_answer(numbers, answer)
    assert evaluate_answer(numbers, f"Answer: {answer} = 24") == 24


@pytest.mark.parametrize("numbers", [(1, 1, 1, 1), (1, 1, 1, 2), (1, 1, 2, 2), (13, 13, 13, 13)])
def test_unsolvable(numbers):
    assert solve(numbers) is None


@pytest.mark.parametrize("numbers, expression", [
    ((4, 4, 6, 8), "(6 - 4) * (4 + 8)"),
    ((3, 3, 8, 8), "Answer: 8 / (3 - 8 / 3) = 24"),      # exact: 8/3 is not rounded
    ((1, 5, 5, 5), "(5 - 1 / 5) * 5 = 24\n"),
    ((2, 9, 10, 12), "12 × 2 × (10 - 9)"),
    ((1, 2, 3, 4), "1*2*3*4"),
])
def test_check_answer_accepts(numbers, expression):
    assert check_answer(numbers, expression)


@pytest.mark.parametrize("numbers, expression, match", [
    ((4, 4, 6, 8), "4 + 4 + 6 + 8", None),                               # 22
    ((3, 3, 8, 8), "8 / (3 - 8 // 3)", "FloorDiv is not allowed"),
    ((4, 4, 6, 8), "4 * 6", r"uses the numbers \[4, 6\], not each of \[4, 4, 6, 8\] once"),
    ((4, 4, 6, 8), "(6 - 4) * (4 + 8) + 0", r"uses the numbers \[0, 4, 4, 6, 8\]"),
    ((4, 4, 6, 8), "(8 - 4) * 6 * 4 / 4", r"uses the numbers \[4, 4, 4, 6, 8\]"),
    ((4, 4, 6, 8), "(6 - 4) * (4 + 8", "malformed expression"),
    ((4, 4, 6, 8), "", "empty expression"),
    ((4, 4, 6, 8), "Answer: = 24", "empty expression"),
    ((2, 2, 6, 3), "2 ** 3 * 6 / 2", "Pow is not allowed"),
    ((4, 4, 6, 8), "-4 + 4 * 6 + 8 / 8", "UnaryOp is not allowed"),
    ((4, 4, 6, 8), "4.0 * 6 + 4 - 8 / 2", "Constant is not allowed"),
    ((4, 4, 6, 8), "__import__('os')", "Call is not allowed"),
    ((4, 4, 6, 8), "x * 6 + 4 - 4", "Name is not allowed"),
    ((4, 4, 6, 8), "8 / (4 - 4) + 6", "division by zero"),
    ((4, 4, 6, 8), "(" * 150 + "4" + ")" * 150, "longer than 200 characters"),
])
def test_check_answer_rejects(numbers, expression, match):
    assert not check_answer(numbers, expression)
    if match is None:
        assert evaluate_answer(numbers, expression) != 24
    else:
        with pytest.raises(Game24Error, match=match):
            evaluate_answer(numbers, expression)


def test_parse_step():
    assert parse_step("4 + 8 = 12 (left: 4 6 12)\n") == Step(Fraction(4), "+", Fraction(8), Fraction(12),
                                                               (Fraction(4), Fraction(6), Fraction(12)))
    step = parse_step("  8 ÷ 3 = 8/3 (left: 3 8 8/3)")
    assert step.op == "/" and step.result == Fraction(8, 3) and step.left[-1] == Fraction(8, 3)
    assert parse_step("4 - 10 = -6 (left: -6 9 13)").result == -6
    assert parse_step("2.5 * 4 = 10 (left: 10)").a == Fraction(5, 2)


@pytest.mark.parametrize("line", ["4 + 8 = 12", "4 plus 8 = 12 (left: 12)", "(left: 4 6)", "", "Answer: 4 * 6 = 24",
                                  "4 + 8 = 12 (left: )", "4 + 8 = 12 (left: 4 6 12) and more"])
def test_parse_step_rejects_malformed_lines(line):
    with pytest.raises(Game24Error, match="not a step of the form"):
        parse_step(line)


@pytest.mark.parametrize("before, line, ok", [
    ((4, 4, 6, 8), "4 + 8 = 12 (left: 4 6 12)", True),
    ((4, 4, 6, 8), "4 + 4 = 8 (left: 6 8 8)", True),       # both 4s
    ((4, 6, 8, 9), "4 + 4 = 8 (left: 6 8 8)", False),      # only one 4
    ((4, 4, 6, 8), "4 + 8 = 13 (left: 4 6 13)", False),    # wrong arithmetic
    ((4, 4, 6, 8), "5 + 8 = 13 (left: 4 6 13)", False),    # 5 is not there
    ((4, 4, 6, 8), "4 + 8 = 12 (left: 4 12)", False),      # 6 lost
    ((4, 4, 6, 8), "4 + 8 = 12 (left: 4 6 12 12)", False),  # 12 twice
    ((4, 4, 6, 8), "4 - 4 = 0 (left: 0 6 8)", True),
    ((0, 6, 8), "6 / 0 = 0 (left: 0 8)", False),           # division by zero
    ((Fraction(8, 3), 3, 8), "3 - 8/3 = 1/3 (left: 1/3 8)", True),
])
def test_check_step(before, line, ok):
    assert check_step(before, parse_step(line)) is ok


def test_prompt_examples_are_correct():
    """Every worked example of the prompt checks out, and every judged step parses."""
    blocks = [b for b in STEP_EXAMPLES.split("Input: ") if b]
    assert len(blocks) == 3
    for block in blocks:
        lines = block.strip().splitlines()
        numbers = tuple(int(x) for x in lines[0].split())
        task = Game24Task(numbers)
        assert lines[1] == "Steps:" and task.numbers_left(lines[2:5]) == (24,)
        assert task.is_solved(tuple(lines[2:6]))
    judged = JUDGE_EXAMPLES.strip().splitlines()[1:]
    for step_line, verdict in zip(judged[::2], judged[1::2]):
        parse_step(step_line)
        assert verdict.split(":")[0] + ":" == JUDGE_PROMPT and verdict.split()[-1] in Game24Task.value_map


def test_task_values_and_prompts():
    task = Game24Task((4, 9, 10, 13))
    good = ("13 - 10 = 3 (left: 3 4 9)\n", "9 - 3 = 6 (left: 4 6)\n")
    assert task.root_prompt().endswith("Input: 4 9 10 13\nSteps:\n") and STEP_EXAMPLES in task.root_prompt()
    assert task.value_prompt(good) == JUDGE_PROMPT
    assert task.parse_value(good, [" sure\n", " likely"]) == 21.0
    assert task.parse_value(good, [" no idea"]) == 0.0
    bad = ("13 - 10 = 4 (left: 4 4 9)\n",)                 # wrong arithmetic
    assert task.value_prompt(bad) is None and task.parse_value(bad, []) == 0.0
    assert task.value_prompt(good + ("4 * 6 = 24 (left: 24)\n", "Answer: 4 * (9 - (13 - 10)) = 24\n")) is None
    answer = good + ("4 * 6 = 24 (left: 24)\n", "Answer: 4 * (9 - (13 - 10)) = 24\n")
    assert task.is_solved(answer) and task.parse_value(answer, []) == 20.0
    wrong = good + ("4 * 6 = 24 (left: 24)\n", "Answer: 4 * 6 = 24\n")
    assert not task.is_solved(wrong) and task.parse_value(wrong, []) == 0.0
    lenient = Game24Task((4, 9, 10, 13), check_steps=False)
    assert lenient.value_prompt(bad) == JUDGE_PROMPT and lenient.parse_value(bad, ["impossible"]) == 0.001


@pytest.mark.parametrize("numbers", [(1, 2, 3), (1, 2, 3, 4, 5), (0, 2, 3, 4), (1, 2, 3, 4.0), (1, 2, True, 4)])
def test_task_rejects_bad_numbers(numbers):
    with pytest.raises(ValueError, match="Game24Task.numbers must be four positive ints"):
        Game24Task(numbers)


@pytest.mark.parametrize("check_steps", [True, False])
def test_bfs_on_the_tiny_model(check_steps):
    """Random weights write no valid step: checked steps are valued 0 without the model; unchecked, every
    thought's value prompt runs (and its outputs are decoded), and the search still frees everything."""
    engine = Engine(tiny_model(), kv_tokens=4096, page_size=16, backend="torch")
    task = Game24Task((4, 9, 10, 13), check_steps=check_steps, thought_max_tokens=4, value_max_tokens=2)
    result = tot_bfs(engine, task, ByteTokenizer(), BFSConfig(k=2, n=2, depth=2, sampling=GREEDY))
    assert result.solved is None and len(result.levels) == 2
    assert result.prompt_tokens == len(task.root_prompt().encode())
    evaluations = [level.value_tokens for level in result.levels]
    assert evaluations == ([0, 0] if check_steps else [2 * 2, 4 * 2])
    assert engine.pool.num_free_pages == engine.pool.num_pages and engine.tree.num_nodes == 0
