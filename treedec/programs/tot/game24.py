"""The Game of 24 as a ToT task (Yao et al., 2023), with an exact checker.

Four numbers must be combined with + - * / (each number used exactly once) into 24. The
search writes one step per thought, ``"a op b = c (left: x y z)\\n"``, three steps and then
the answer line ``"Answer: (a op b) op ... = 24\\n"``. Each step is judged by the model
after ``"Judge:"`` (``sure`` / ``likely`` / ``impossible``, summed over the evaluation's
outputs through the value map); the answer line is judged by the checker. The search
prompt holds both the step-by-step examples and the judging examples once, at the root,
so every thought and every evaluation reads them from the shared prefix.

Arithmetic is exact (:class:`fractions.Fraction`): ``8 / 3`` is 8/3, not 2.666.
"""
from __future__ import annotations

import ast
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from itertools import combinations
from typing import Sequence

from treedec.checks import is_int
from treedec.programs.tot.program import ToTTask

__all__ = ["Game24Error", "Game24Task", "Step", "check_answer", "check_step", "evaluate_answer", "parse_step", "solve"]

TARGET = 24
INSTRUCTION = ("Use the numbers and basic arithmetic operations (+ - * /) to obtain 24. Each step takes two of "
               "the numbers left and replaces them with the result. After three steps, write the answer as one "
               "expression that uses every input number once.\n")
STEP_EXAMPLES = """Input: 1 2 3 4
Steps:
1 + 2 = 3 (left: 3 3 4)
3 + 3 = 6 (left: 4 6)
4 * 6 = 24 (left: 24)
Answer: (1 + 2 + 3) * 4 = 24
Input: 2 5 8 11
Steps:
11 - 5 = 6 (left: 2 6 8)
8 / 2 = 4 (left: 4 6)
4 * 6 = 24 (left: 24)
Answer: (8 / 2) * (11 - 5) = 24
Input: 3 3 8 8
Steps:
8 / 3 = 8/3 (left: 3 8 8/3)
3 - 8/3 = 1/3 (left: 1/3 8)
8 / 1/3 = 24 (left: 24)
Answer: 8 / (3 - 8 / 3) = 24
"""
JUDGE_PROMPT = "Judge:"
JUDGE_EXAMPLES = """Judge whether the numbers left after a step can still reach 24 (sure/likely/impossible):
3 * 8 = 24 (left: 24)
Judge: sure
5 + 5 = 10 (left: 10 14)
Judge: sure
12 / 3 = 4 (left: 4 4 10)
Judge: sure
2 + 3 = 5 (left: 5 7 8)
Judge: likely
1 * 1 = 1 (left: 1 3 3)
Judge: impossible
11 - 1 = 10 (left: 10 10 11)
Judge: impossible
"""
ANSWER = "Answer:"

_NUM = r"-?\d+(?:\.\d+)?(?:/\d+)?"
_STEP = re.compile(rf"^\s*({_NUM})\s*([-+*/×÷])\s*({_NUM})\s*=\s*({_NUM})\s*\(left:\s*((?:{_NUM}\s*)+)\)\s*$")
_OPS = {"+": "+", "-": "-", "*": "*", "×": "*", "/": "/", "÷": "/"}
_MAX_EXPRESSION = 200


class Game24Error(ValueError):
    """A malformed or invalid step or answer; the message says what is wrong."""


@dataclass(frozen=True)
class Step:
    """One step ``a op b = result (left: ...)``; ``op`` is one of ``+ - * /``."""

    a: Fraction
    op: str
    b: Fraction
    result: Fraction
    left: tuple[Fraction, ...]


def parse_step(line: str) -> Step:
    """Parse ``"a op b = c (left: x y ...)"`` (integers, decimals or fractions like ``8/3``; ``×`` and
    ``÷`` accepted). Raises Game24Error if the line does not have that form."""
    m = _STEP.match(line)
    if m is None:
        raise Game24Error(f"not a step of the form 'a op b = c (left: ...)': {line!r:.80}")
    a, op, b, result, left = m.groups()
    return Step(Fraction(a), _OPS[op], Fraction(b), Fraction(result), tuple(Fraction(x) for x in left.split()))


def check_step(before: Sequence[int | Fraction], step: Step) -> bool:
    """True if ``step`` takes two of the numbers ``before``, computes exactly, and lists what is left."""
    pool = Counter(Fraction(x) for x in before)
    pool[step.a] -= 1
    pool[step.b] -= 1
    if pool[step.a] < 0 or pool[step.b] < 0:
        return False
    value = _apply(step.a, step.op, step.b)
    if value is None or value != step.result:
        return False
    pool[value] += 1
    return +pool == Counter(step.left)


def evaluate_answer(numbers: Sequence[int], expression: str) -> Fraction:
    """The exact value of an answer expression, after checking it uses each of ``numbers`` exactly once.

    ``expression`` may start with ``Answer:`` and end with ``= 24``; it may use ``+ - * /``,
    parentheses and non-negative integers only (no unary minus, no other operators).
    Raises Game24Error saying what is wrong (syntax, an operator, the numbers used, a
    division by zero).
    """
    text = expression.strip()
    if text.startswith(ANSWER):
        text = text[len(ANSWER):]
    text = text.split("=", 1)[0].replace("×", "*").replace("÷", "/").strip()
    if not text:
        raise Game24Error(f"empty expression in {expression!r:.80}")
    if len(text) > _MAX_EXPRESSION:
        raise Game24Error(f"expression longer than {_MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise Game24Error(f"malformed expression {text!r:.80}") from None
    used: list[int] = []
    value = _eval(tree.body, used)
    want = sorted(int(n) for n in numbers)
    if sorted(used) != want:
        raise Game24Error(f"{text!r:.80} uses the numbers {sorted(used)}, not each of {want} once")
    return value


def check_answer(numbers: Sequence[int], expression: str) -> bool:
    """True if ``expression`` uses each of ``numbers`` once and equals 24 exactly; False otherwise
    (malformed expressions included)."""
    try:
        return evaluate_answer(numbers, expression) == TARGET
    except Game24Error:
        return False


def solve(numbers: Sequence[int]) -> str | None:
    """An expression of ``numbers`` equal to 24 (exhaustive search), or None if there is none."""
    items = [(Fraction(n), str(n)) for n in numbers]
    return _solve(items)


@dataclass
class Game24Task(ToTTask):
    """Game of 24 for :func:`~treedec.programs.tot.program.tot_bfs` / ``tot_dfs`` (use ``depth=4``: three
    steps and the answer).

    Attributes
    ----------
    numbers : the four input numbers (positive ints).
    check_steps : a step that does not parse or is wrong given the numbers before it gets
        value 0 without asking the model (a random model writes nothing valid: turn it off
        to have every thought judged by the model anyway).
    """

    numbers: tuple[int, ...]
    check_steps: bool = True
    thought_max_tokens: int = 48
    value_max_tokens: int = 12

    def __post_init__(self):
        nums = tuple(self.numbers)
        if len(nums) != 4 or not all(is_int(n) and n > 0 for n in nums):
            raise ValueError(f"Game24Task.numbers must be four positive ints, got {self.numbers!r}")
        self.numbers = tuple(int(n) for n in nums)

    def root_prompt(self) -> str:
        return (INSTRUCTION + STEP_EXAMPLES + JUDGE_EXAMPLES
                + f"Input: {' '.join(map(str, self.numbers))}\nSteps:\n")

    def value_prompt(self, thoughts: tuple[str, ...]) -> str | None:
        if _is_answer(thoughts[-1]) or (self.check_steps and self.numbers_left(thoughts) is None):
            return None
        return JUDGE_PROMPT

    def parse_value(self, thoughts: tuple[str, ...], outputs: list[str]) -> float:
        if _is_answer(thoughts[-1]):
            return self.value_map["sure"] if self.is_solved(thoughts) else 0.0
        if self.check_steps and self.numbers_left(thoughts) is None:
            return 0.0
        return super().parse_value(thoughts, outputs)

    def is_solved(self, thoughts: tuple[str, ...]) -> bool:
        return bool(thoughts) and _is_answer(thoughts[-1]) and check_answer(self.numbers, thoughts[-1])

    def numbers_left(self, thoughts: Sequence[str]) -> tuple[Fraction, ...] | None:
        """The numbers left after the steps ``thoughts``, or None if one of them is malformed or wrong."""
        left = tuple(Fraction(n) for n in self.numbers)
        for line in thoughts:
            try:
                step = parse_step(line)
            except Game24Error:
                return None
            if not check_step(left, step):
                return None
            left = step.left
        return left


# ================================================================ private


def _is_answer(thought: str) -> bool:
    return thought.strip().startswith(ANSWER)


def _apply(a: Fraction, op: str, b: Fraction) -> Fraction | None:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return None if b == 0 else a / b


def _eval(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp):
        op = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}.get(type(node.op))
        if op is None:
            raise Game24Error(f"operator {type(node.op).__name__} is not allowed (only + - * /)")
        a, b = _eval(node.left, used), _eval(node.right, used)
        value = _apply(a, op, b)
        if value is None:
            raise Game24Error("division by zero")
        return value
    raise Game24Error(f"{type(node).__name__} is not allowed in an answer (only integers, + - * / and parentheses)")


def _solve(items: list[tuple[Fraction, str]]) -> str | None:
    if len(items) == 1:
        return items[0][1] if items[0][0] == TARGET else None
    for i, j in combinations(range(len(items)), 2):
        (a, ea), (b, eb) = items[i], items[j]
        rest = [x for k, x in enumerate(items) if k not in (i, j)]
        options = [(a + b, f"({ea} + {eb})"), (a * b, f"({ea} * {eb})"), (a - b, f"({ea} - {eb})"),
                   (b - a, f"({eb} - {ea})")]
        if b:
            options.append((a / b, f"({ea} / {eb})"))
        if a:
            options.append((b / a, f"({eb} / {ea})"))
        for value, expr in options:
            found = _solve(rest + [(value, expr)])
            if found is not None:
                return found
    return None
