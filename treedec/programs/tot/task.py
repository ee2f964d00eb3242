"""What a Tree-of-Thought search is given and what it returns.

The text side (the :class:`Tokenizer` protocol and :class:`ByteTokenizer`), the
:class:`ToTTask` a search solves (its prompts, how a value is read, when it is solved), the
searches' configurations (:class:`BFSConfig`, :class:`DFSConfig`) and their results
(:class:`ToTState`, :class:`LevelStats`, :class:`ToTResult`). The searches themselves,
:func:`~treedec.programs.tot.program.tot_bfs` and :func:`~treedec.programs.tot.program.tot_dfs`, are in
:mod:`treedec.programs.tot.program`.
"""
from __future__ import annotations

import abc
import itertools
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Mapping, Protocol, Sequence

from treedec.checks import describe, finite_float, nonnegative_int, positive_int
from treedec.sampling.params import GREEDY, SamplingParams

__all__ = ["SELECTIONS", "BFSConfig", "ByteTokenizer", "DFSConfig", "HFTokenizer", "LevelStats", "ToTResult",
           "ToTState", "ToTTask", "Tokenizer"]

SELECTIONS = ("greedy", "sample")


# ================================================================ text


class Tokenizer(Protocol):
    """Text <-> token ids. ``bos_id``: a token put before the search prompt, or None."""

    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


_BYTES = tuple(bytes((i,)) for i in range(256))
_REPLACEMENT = "\ufffd".encode()   # (an id past the bytes: U+FFFD)


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, for random tiny models; ids >= 256 decode to U+FFFD."""

    bos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        try:
            raw = bytes(ids)   # (the common case in one call: every id a byte; a list, never a buffer)
        except (ValueError, TypeError):
            try:   # ids past the bytes as 0xFF, never UTF-8: one U+FFFD wherever it stands, as its own 3 bytes are
                raw = bytes(map(min, ids, itertools.repeat(255)))
            except (ValueError, TypeError):   # (ids < 0, numpy or float ids)
                raw = b"".join([_BYTES[i] if 0 <= i < 256 else _REPLACEMENT for i in map(int, ids)])
        return raw.decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's transformers tokenizer (:func:`~treedec.models.text.load_tokenizer`) as a :class:`Tokenizer`:
    no special tokens inside the text; ``bos_id`` is the BOS token if the tokenizer puts one before a text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        bos = tokenizer.bos_token_id
        self.bos_id = bos if bos is not None and tokenizer.encode("a")[:1] == [bos] else None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


# ================================================================ task


class ToTTask(abc.ABC):
    """What a search solves: its prompts, how a value is read, when it is solved.

    The hooks get ``thoughts``: the texts of a state's thoughts, the first one first (empty
    for the root). A thought's text keeps the stop string that ended it.

    Attributes
    ----------
    thought_stop : strings that end a thought; () for none.
    thought_max_tokens : most tokens of one thought.
    value_stop, value_max_tokens : the same for one output of an evaluation.
    value_map : word -> value, read by the default :meth:`parse_value`.
    """

    thought_stop: tuple[str, ...] = ("\n",)
    thought_max_tokens: int = 64
    value_stop: tuple[str, ...] = ("\n",)
    value_max_tokens: int = 8
    value_map: Mapping[str, float] = MappingProxyType({"sure": 20.0, "likely": 1.0, "impossible": 0.001})

    @abc.abstractmethod
    def root_prompt(self) -> str:
        """The search's prompt: the root node every thought descends from."""

    def step_prompt(self, thoughts: tuple[str, ...]) -> str:
        """Text put under a state before its thoughts are sampled ('' for none: they follow the last thought)."""
        return ""

    @abc.abstractmethod
    def value_prompt(self, thoughts: tuple[str, ...]) -> str | None:
        """Text put under the last thought's node to have the model judge the state; None to value
        it by :meth:`parse_value` alone (with no outputs)."""

    def parse_value(self, thoughts: tuple[str, ...], outputs: list[str]) -> float:
        """The state's value from its evaluation outputs: the sum over outputs of the value of the
        ``value_map`` word found first in the output's first line (0 for an output with none)."""
        total = 0.0
        for out in outputs:
            line = (out.strip().splitlines() or [""])[0].lower()
            found = [(line.find(word), value) for word, value in self.value_map.items() if word in line]
            total += min(found)[1] if found else 0.0
        return total

    def is_solved(self, thoughts: tuple[str, ...]) -> bool:
        """True if the state ending with these thoughts solves the task (the search stops)."""
        return False


def check_task(task: ToTTask) -> None:
    if not isinstance(task, ToTTask):
        raise TypeError(f"task must be a ToTTask, got {type(task).__name__}")
    name = type(task).__name__
    for attr in ("thought_max_tokens", "value_max_tokens"):
        positive_int(f"{name}.{attr}", getattr(task, attr), numpy=True)
    for attr in ("thought_stop", "value_stop"):
        stops = getattr(task, attr)
        if not isinstance(stops, tuple) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"{name}.{attr} must be a tuple of non-empty strings, got {stops!r}")


# ================================================================ configuration


#: The :class:`~treedec.sampling.params.SamplingParams` fields a ToT search's token draws implement (the thoughts'
#: and the evaluations' lengths and stops are the task's); others are refused, not ignored.
TOT_SAMPLING_FIELDS = frozenset({"temperature", "top_k", "top_p", "min_p"})


@dataclass(frozen=True)
class _SearchConfig:
    k: int = 3
    depth: int = 3
    sampling: SamplingParams = SamplingParams(temperature=0.7)
    value_samples: int = 1
    value_sampling: SamplingParams = GREEDY
    seed: int = 0

    def __post_init__(self):
        owner = type(self).__name__
        for name in ("k", "depth", "value_samples"):
            positive_int(f"{owner}.{name}", getattr(self, name), numpy=True)
        nonnegative_int(f"{owner}.seed", self.seed, numpy=True)
        for name in ("sampling", "value_sampling"):
            params = getattr(self, name)
            if not isinstance(params, SamplingParams):
                raise ValueError(f"{owner}.{name} must be a SamplingParams, got {describe(params)}")
            params.check_supported(TOT_SAMPLING_FIELDS, "a ToT search's token draws", f"{owner}.{name}")


@dataclass(frozen=True)
class BFSConfig(_SearchConfig):
    """Breadth-first ToT.

    Attributes
    ----------
    k : thoughts sampled per kept state.
    n : states kept per level (the breadth limit b of the paper).
    depth : levels (thoughts on a path).
    sampling : how thoughts are drawn (:class:`~treedec.sampling.params.SamplingParams`: temperature, top_k,
        top_p, min_p): temperature 0 takes the top-k first tokens and then argmax; > 0 samples (the first tokens
        without replacement, so the k thoughts differ). Default temperature 0.7.
    value_samples, value_sampling : outputs per evaluation and how they are drawn (default greedy).
    selection : "greedy" (the n best values) or "sample" (n without replacement, in
        proportion to the values).
    seed : of the torch generator (token sampling) and of the selection's numpy generator.
    """

    n: int = 2
    selection: str = "greedy"

    def __post_init__(self):
        super().__post_init__()
        positive_int("BFSConfig.n", self.n, numpy=True)
        if self.selection not in SELECTIONS:
            raise ValueError(f"BFSConfig.selection must be one of {SELECTIONS}, got {self.selection!r}")


@dataclass(frozen=True)
class DFSConfig(_SearchConfig):
    """Depth-first ToT with a value threshold and backtracking.

    Attributes
    ----------
    k, depth, sampling, value_samples, value_sampling, seed : as in :class:`BFSConfig`.
    threshold : thoughts valued below it are pruned at once and never expanded.
    max_expansions : states expanded at most (the search's budget).
    """

    threshold: float = 0.5
    max_expansions: int = 100

    def __post_init__(self):
        super().__post_init__()
        finite_float("DFSConfig.threshold", self.threshold)
        positive_int("DFSConfig.max_expansions", self.max_expansions, numpy=True)


# ================================================================ results


@dataclass
class ToTState:
    """A search state: the prompt and the thoughts below it.

    Attributes
    ----------
    index : each thought's rank among its siblings, root down: ``(2, 0)`` is the first
        thought of the root's third thought; ``()`` is the root.
    thoughts : the thoughts' texts, root down.
    value : of the last thought (None for the root).
    num_tokens : tokens of the last thought (of the prompt, for the root).
    node : its node in ``engine.tree`` while the search ran (pruned by its end).
    """

    index: tuple[int, ...]
    thoughts: tuple[str, ...]
    value: float | None
    num_tokens: int
    node: int


@dataclass
class LevelStats:
    """One BFS level, or one DFS expansion.

    Attributes
    ----------
    depth : depth of the thoughts made (1: children of the prompt).
    states : states expanded.
    thoughts : thoughts made (states x k).
    kept : thoughts kept (BFS: selected; DFS: valued at or above the threshold).
    thought_tokens, value_tokens : tokens of the thoughts, of the evaluations' outputs.
    prompt_tokens : tokens of the step and value prompts.
    steps : engine steps run; queries : tokens those steps computed.
    wall_s : wall time; tokens_per_s : (thought_tokens + value_tokens) / wall_s.
    pages_peak, pages_after : KV pages in use at most, and after the level's pruning.
    best_value : the best value of the thoughts made.
    """

    depth: int
    states: int
    thoughts: int
    kept: int
    thought_tokens: int
    value_tokens: int
    prompt_tokens: int
    steps: int
    queries: int
    wall_s: float
    tokens_per_s: float
    pages_peak: int
    pages_after: int
    best_value: float


@dataclass
class ToTResult:
    """What :func:`tot_bfs` / :func:`tot_dfs` return.

    Attributes
    ----------
    algorithm : "bfs" or "dfs".
    solved : the first state ``task.is_solved`` accepted, or None.
    best : BFS: the states kept at the last level run; DFS: the states that reached
        ``depth`` at or above the threshold; by value, best first.
    levels : per BFS level / DFS expansion.
    expanded : index of each expanded state, in order.
    prompt_tokens : tokens of the search prompt; wall_s : the whole search, prefill included.
    """

    algorithm: str
    solved: ToTState | None = None
    best: list[ToTState] = field(default_factory=list)
    levels: list[LevelStats] = field(default_factory=list)
    expanded: list[tuple[int, ...]] = field(default_factory=list)
    prompt_tokens: int = 0
    wall_s: float = 0.0

    @property
    def tokens_generated(self) -> int:
        return sum(s.thought_tokens + s.value_tokens for s in self.levels)

    def to_json(self) -> dict:
        return {"algorithm": self.algorithm, "solved": None if self.solved is None else asdict(self.solved),
                "best": [asdict(s) for s in self.best], "levels": [asdict(s) for s in self.levels],
                "expanded": [list(i) for i in self.expanded], "prompt_tokens": self.prompt_tokens,
                "tokens_generated": self.tokens_generated, "wall_s": self.wall_s}
