"""The request mixes of ``bench/serve.py``, generated locally from a seed (no dataset downloads).

A workload is a list of :class:`Session`: requests sent one after another, each after the previous one's answer
has arrived (a single request for ShareGPT-like prompts and ToT branches, the turns of a conversation for the
multi-turn mix). Sessions of the same ``batch`` arrive together; batches arrive at the client's rate.

- :func:`sharegpt`: single completions whose prompt and output lengths follow lognormal distributions shaped like
  ShareGPT's (a long right tail; medians and spread set by the caller), clipped to the context;
- :func:`multiturn`: ``conversations`` chats of ``turns`` turns; turn ``t`` re-sends the whole conversation so far
  (the system prompt, every earlier user message and the answers the server gave) and a new user message;
- :func:`tot`: ToT-like: per problem, one long shared problem statement and ``branches`` continuations of it, all
  sent at once (a prefix cache across requests finds the statement once per problem).

Prompts are random words of :data:`WORDS` (common English words, mostly one token each in a BPE vocabulary):
lengths are counted in words; the token counts the server reports come back in the results.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["WORDS", "WORKLOADS", "Session", "Turn", "arrival_times", "lognormal_lengths", "multiturn",
           "multiturn_ids", "random_words", "sharegpt", "tot"]


#: The vocabulary of the generated prompts.
WORDS = tuple("""the of and to in is that it was for on are as with his they at be this from have or by one had not
but what all were when we there can an your which their said if do will each about how up out them then she many
some so these would other into has more her two like him see time could no make than first been its who now people
my made over did down only way find use may water long little very after words called just where most know get
through back much before go good new write our used me man too any day same right look think also around another
came come work three word must because does part even place well such here take why things help put years different
away again off went old number great tell men say small every found still between name should home big give air line
set own under read last never us left end along while might next sound below saw something thought both few those
always looked show large often together asked house world going want school important until form food keep children
feet land side without boy once animals life enough took sometimes four head above kind began almost live page got
earth need far hand high year mother light parts country father let night following picture being study second eyes
soon times story boys since white days ever paper hard near sentence better best across during today others sure means
knew tree question answer""".split())

#: The workloads :mod:`bench.serve` runs, by name.
WORKLOADS = ("sharegpt", "multiturn", "multiturn-ids", "tot")


@dataclass(frozen=True)
class Turn:
    """One request of a session: its new text (a completion's whole prompt, or a chat turn's user message) and
    the most tokens it may generate."""

    text: str
    max_tokens: int
    ids: tuple[int, ...] = ()   # (``multiturn-ids``: the message as token ids; text is then "")


@dataclass(frozen=True)
class Session:
    """Requests sent in order, each after the previous answer arrived.

    Attributes
    ----------
    workload : the workload's name.
    index : the session's number within the workload.
    batch : sessions of the same batch arrive together (a ToT problem's branches); batches arrive at the rate.
    turns : its requests.
    chat : ``/v1/chat/completions`` (the conversation as messages) rather than ``/v1/completions``.
    system : a chat session's system message ("" for none).
    system_ids : a token-id conversation's system message (``multiturn-ids``: its turns are token ids, sent to
        ``/v1/completions`` with vLLM's ``return_token_ids``; the answers re-sent are the output's token ids).
    """

    workload: str
    index: int
    batch: int
    turns: tuple[Turn, ...]
    chat: bool = False
    system: str = ""
    system_ids: tuple[int, ...] | None = None

    @property
    def token_ids(self) -> bool:
        return self.system_ids is not None

    def prompt(self, turn: int, answers: list) -> str | list[dict] | list[int]:
        """What turn ``turn`` sends: a completion's prompt text, or a chat's messages (the system message, every
        earlier turn's user message and answer, then this turn's user message). ``answers`` holds the answers of
        the turns before it."""
        if len(answers) < turn:
            raise ValueError(f"turn {turn} needs the answers of the {turn} turns before it, got {len(answers)}")
        if self.token_ids:   # the system message, each earlier turn's message and answer ids, this turn's message
            ids = list(self.system_ids)
            for t in range(turn):
                ids += list(self.turns[t].ids) + list(answers[t])
            return ids + list(self.turns[turn].ids)
        if not self.chat:
            return self.turns[turn].text
        messages = [{"role": "system", "content": self.system}] if self.system else []
        for t in range(turn):
            messages += [{"role": "user", "content": self.turns[t].text},
                         {"role": "assistant", "content": answers[t]}]
        return messages + [{"role": "user", "content": self.turns[turn].text}]


def random_words(rng: np.random.Generator, n: int) -> str:
    """``n`` words drawn uniformly from :data:`WORDS`."""
    return " ".join(rng.choice(WORDS, size=n))


def lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float, low: int,
                      high: int) -> np.ndarray:
    """``n`` integer lengths ~ lognormal(log(median), sigma), rounded and clipped to ``[low, high]``."""
    if not 1 <= low <= high:
        raise ValueError(f"the length bounds must satisfy 1 <= low <= high, got [{low}, {high}]")
    if median <= 0 or sigma < 0:
        raise ValueError(f"lognormal lengths need median > 0 and sigma >= 0, got {median}, {sigma}")
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, size=n)), low, high).astype(int)


def sharegpt(seed: int, num_prompts: int, input_median: float = 256, output_median: float = 128,
             sigma: float = 1.0, context: int = 4096, max_output: int = 512) -> list[Session]:
    """ShareGPT-like single completions: prompt words and output tokens lognormal, each prompt plus its output
    within ``context`` (prompt words at most ``context // 2``, outputs at most ``max_output``)."""
    rng = np.random.default_rng([seed, 0])
    max_output = min(max_output, context // 2)
    words = lognormal_lengths(rng, num_prompts, input_median, sigma, 4, context // 2)
    outputs = lognormal_lengths(rng, num_prompts, output_median, sigma * 0.7, 1, max_output)
    return [Session("sharegpt", i, i, (Turn(random_words(rng, int(w)), int(o)),))
            for i, (w, o) in enumerate(zip(words, outputs))]


def multiturn(seed: int, conversations: int, turns: int, user_median: float = 64, output_median: float = 64,
              sigma: float = 0.5, system_words: int = 128, context: int = 4096) -> list[Session]:
    """Chats of ``turns`` turns, each re-sending the conversation so far: per turn a user message of lognormal
    words and an answer of lognormal tokens, each clipped to ``context // (2 * turns)`` so that a whole
    conversation (with its system message of ``system_words``, at most ``context // 4``) fits the context."""
    rng = np.random.default_rng([seed, 1])
    per_turn = max(1, (context - min(system_words, context // 4)) // (2 * turns))
    sessions = []
    for c in range(conversations):
        users = lognormal_lengths(rng, turns, user_median, sigma, 1, per_turn)
        outputs = lognormal_lengths(rng, turns, output_median, sigma, 1, per_turn)
        system = random_words(rng, min(system_words, context // 4)) if system_words else ""
        sessions.append(Session("multiturn", c, c, tuple(Turn(random_words(rng, int(u)), int(o))
                                                         for u, o in zip(users, outputs)), chat=True, system=system))
    return sessions


def multiturn_ids(seed: int, conversations: int, turns: int, user_median: float = 64, output_median: float = 64,
                  sigma: float = 0.5, system_tokens: int = 128, context: int = 4096,
                  max_token_id: int = 30000) -> list[Session]:
    """:func:`multiturn`'s shape as token ids: each turn re-sends the conversation as the exact ids it was (system,
    messages, and the answers' ids the server returned), as a client holding token ids does (an agent or RL
    framework); what the prefix cache can reuse, without a tokenizer's re-encoding of the answers' text (which
    need not give back the ids the model generated). Message ids are drawn from ``[max_token_id // 30,
    max_token_id)`` (below the vocabulary: 30000 suits SmolLM2's and Llama's tokenizers)."""
    rng = np.random.default_rng([seed, 4])
    per_turn = max(1, (context - min(system_tokens, context // 4)) // (2 * turns))
    draw = lambda n: tuple(int(t) for t in rng.integers(max_token_id // 30, max_token_id, size=int(n)))   # noqa: E731
    sessions = []
    for c in range(conversations):
        users = lognormal_lengths(rng, turns, user_median, sigma, 1, per_turn)
        outputs = lognormal_lengths(rng, turns, output_median, sigma, 1, per_turn)
        system = draw(min(system_tokens, context // 4))
        sessions.append(Session("multiturn-ids", c, c, tuple(Turn("", int(o), draw(u)) for u, o in zip(users, outputs)),
                                system_ids=system))
    return sessions


def tot(seed: int, problems: int, branches: int, problem_words: int = 1024, branch_words: int = 16,
        output_tokens: int = 64, context: int = 4096) -> list[Session]:
    """ToT-like: per problem a shared statement of ``problem_words`` (at most ``context // 2``) and ``branches``
    continuations, each the statement + "Branch k:" + ``branch_words`` words, generating ``output_tokens``; a
    problem's branches arrive together (one batch)."""
    rng = np.random.default_rng([seed, 2])
    sessions = []
    for p in range(problems):
        statement = random_words(rng, min(problem_words, context // 2))
        for b in range(branches):
            text = f"{statement}\nBranch {b + 1}: {random_words(rng, branch_words)}"
            sessions.append(Session("tot", len(sessions), p, (Turn(text, min(output_tokens, context // 4)),)))
    return sessions


def arrival_times(seed: int, batches: int, rate: float) -> np.ndarray:
    """When each of ``batches`` batches is sent, in seconds from the start: a Poisson process of ``rate`` per
    second (exponential gaps, the first at 0), or all at 0 for an infinite rate."""
    if not rate > 0:
        raise ValueError(f"the rate must be > 0 requests per second (inf: all at once), got {rate}")
    if np.isinf(rate) or batches == 0:
        return np.zeros(batches)
    gaps = np.random.default_rng([seed, 3]).exponential(1.0 / rate, size=batches)
    gaps[0] = 0.0
    return np.cumsum(gaps)
