"""treedec.sampling.stops: EOS ids, stop strings and token budgets on one output.

Stop strings are matched on real detokenized text: the tokenizers of tests/tokenizers_local.py
(byte-level BPE and SentencePiece-style with byte fallback) and treedec's ByteTokenizer.
"""
import dataclasses
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treedec.models.text import IncrementalDetokenizer, load_tokenizer
from treedec.sampling.stops import (MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, STOP_REASONS, StopChecker, StopDecision,
                                  StopRule)
from treedec.programs.tot import ByteTokenizer
from tests.tokenizers_local import KINDS, build_tokenizer

EOS = 2
REPLACEMENT = "\ufffd"
TEXT = "Hello world! Stop here, then go on."


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {kind: load_tokenizer(build_tokenizer(root / kind, kind)) for kind in KINDS}


def checker(tokenizer, max_new_tokens=100, eos=(), stop=(), include=False, prompt_ids=()):
    rule = StopRule(max_new_tokens, eos, stop, include)
    return StopChecker(rule, IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer is not None else None)


def output_ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def first_token_completing(tokenizer, ids, stop):
    """The shortest prefix of ``ids`` whose (one-shot) text holds ``stop``: how many tokens a stop keeps."""
    return next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))


# ================================================================ StopRule


def test_rule_normalizes_ids_and_strings():
    rule = StopRule(8, eos_token_ids=[2, 7, 2], stop_strings=["\n", "###", "\n"])
    assert rule.eos_token_ids == (2, 7) and rule.stop_strings == ("\n", "###")
    assert StopRule(8, 2, "###") == StopRule(8, (2,), ("###",))       # one id, one string
    assert StopRule(4).eos_token_ids == () and StopRule(4).include_stop_str is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.max_new_tokens = 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
    (dict(max_new_tokens=True), "max_new_tokens must be an int >= 1, got True"),
    (dict(max_new_tokens=2.0), "max_new_tokens must be an int >= 1, got 2.0"),
    (dict(max_new_tokens=4, eos_token_ids=-1), r"eos_token_ids must be token ids \(ints >= 0\), got int -1"),
    (dict(max_new_tokens=4, eos_token_ids=[1, "2"]), r"eos_token_ids must be token ids .*got str '2'"),
    (dict(max_new_tokens=4, eos_token_ids=[True]), r"eos_token_ids must be token ids .*got bool True"),
    (dict(max_new_tokens=4, eos_token_ids="2"), "eos_token_ids must be a token id or a sequence of token ids"),
    (dict(max_new_tokens=4, eos_token_ids=None), "eos_token_ids must be a token id or a sequence"),
    (dict(max_new_tokens=4, stop_strings=""), "stop_strings must be non-empty strings, got str ''"),
    (dict(max_new_tokens=4, stop_strings=["ok", ""]), "stop_strings must be non-empty strings"),
    (dict(max_new_tokens=4, stop_strings=[3]), "stop_strings must be non-empty strings, got int 3"),
    (dict(max_new_tokens=4, stop_strings=b"\n"), "stop_strings must be a string or a sequence of strings"),
    (dict(max_new_tokens=4, stop_strings=None), "stop_strings must be a string or a sequence of strings"),
    (dict(max_new_tokens=4, include_stop_str=1), "include_stop_str must be a bool, got int 1"),
])
def test_rule_rejects_bad_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StopRule(**kwargs)


def test_checker_construction_errors(tokenizers):
    tok = tokenizers["byte_bpe"]
    with pytest.raises(TypeError, match="rule must be a StopRule, got dict"):
        StopChecker({"max_new_tokens": 4})
    with pytest.raises(TypeError, match="detokenizer must be an IncrementalDetokenizer"):
        StopChecker(StopRule(4), tok)
    with pytest.raises(ValueError, match="need a detokenizer"):
        StopChecker(StopRule(4, stop_strings=["\n"]))
    used = IncrementalDetokenizer(tok)
    used.feed(5)
    with pytest.raises(ValueError, match="detokenizer must be fresh.*1 output ids"):
        StopChecker(StopRule(4), used)
    done = IncrementalDetokenizer(tok)
    done.finish()
    with pytest.raises(ValueError, match="is finished"):
        StopChecker(StopRule(4), done)


# ================================================================ EOS and length


def test_eos_inside_an_accepted_path_truncates_after_it():
    """A speculative step accepts [5, 6, EOS, 7] + bonus 8: the output keeps 5, 6, EOS."""
    stops = checker(None, eos=[EOS, 9])
    assert stops.accept([3, 4]) == StopDecision(2, None)
    assert stops.accept([5, 6, EOS, 7, 8]) == StopDecision(3, "eos")
    assert stops.token_ids == [3, 4, 5, 6, EOS] and stops.stop_reason == "eos" and stops.stopped
    assert stops.text is None and stops.remaining == 0
    with pytest.raises(RuntimeError, match="already ended \\('eos'\\)"):
        stops.accept([1])


def test_eos_as_first_token_and_on_the_last_allowed_token():
    assert checker(None, eos=EOS).accept([EOS, 5]) == (1, "eos")
    last = checker(None, max_new_tokens=3, eos=EOS)
    assert last.accept([4, 5, EOS, 6]) == (3, "eos")                  # EOS is checked before the budget


def test_max_new_tokens_caps_a_path():
    stops = checker(None, max_new_tokens=5, eos=EOS)
    assert stops.accept([]) == (0, None) and stops.remaining == 5
    assert stops.accept([1, 3]) == (2, None) and stops.remaining == 3
    assert stops.accept([4, 5, 6, 7, 8]) == (3, "length")
    assert stops.token_ids == [1, 3, 4, 5, 6] and stops.stop_reason == "length"


def test_eos_text_is_skipped_and_held_bytes_are_flushed(tokenizers):
    tok = tokenizers["byte_bpe"]
    stops = checker(tok, eos=tok.eos_token_id)
    ids = output_ids(tok, "done 日本")
    assert stops.accept(ids + [tok.eos_token_id, 7]) == (len(ids) + 1, "eos")
    assert stops.text == "done 日本"
    cut = checker(ByteTokenizer(), max_new_tokens=3)
    assert cut.accept(list("aé".encode()) + [0x61]) == (3, "length")
    assert cut.text == "aé"
    half = checker(ByteTokenizer(), max_new_tokens=2)
    half.accept(list("a日".encode()))
    assert half.text == "a\ufffd"                           # as a one-shot decode of the kept bytes shows them


def test_accept_checks_ids_first():
    stops = checker(ByteTokenizer(), stop=["x"])
    with pytest.raises(TypeError, match="token_ids"):
        stops.accept("ab")
    with pytest.raises(ValueError, match=r"token_ids must be >= 0"):
        stops.accept([97, -1])
    assert stops.token_ids == [] and stops.text == "" and not stops.stopped


def test_accept_checks_ids_against_the_vocabulary(tokenizers):
    tok = tokenizers["byte_bpe"]
    stops = checker(tok, stop=["x"])
    with pytest.raises(ValueError, match=r"token_ids must be in \[0, 399\]"):
        stops.accept([5, 400])
    assert stops.token_ids == []


# ================================================================ stop strings


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_stop_string_spanning_tokens(tokenizers, kind, chunk):
    tok = tokenizers[kind]
    ids = output_ids(tok, TEXT)
    stop = "Stop here"
    keep = first_token_completing(tok, ids, stop)
    assert not any(stop in tok.decode([i]) for i in ids) and keep > 1      # it spans several tokens
    stops = checker(tok, stop=[stop])
    decisions = [stops.accept(ids[i:i + chunk]) for i in range(0, keep + chunk - 1, chunk) if not stops.stopped]
    assert sum(d.keep for d in decisions) == keep and decisions[-1].reason == "stop_string"
    assert all(d.reason is None and d.keep == chunk for d in decisions[:-1])
    assert stops.token_ids == ids[:keep] and stops.stop_string == stop
    assert stops.text == "Hello world! "


@pytest.mark.parametrize("kind", KINDS)
def test_include_stop_str_ends_the_text_with_it(tokenizers, kind):
    tok = tokenizers[kind]
    ids = output_ids(tok, TEXT)
    stops = checker(tok, stop=["Stop here"], include=True)
    keep, reason = stops.accept(ids)
    assert reason == "stop_string" and keep == first_token_completing(tok, ids, "Stop here")
    assert stops.text == "Hello world! Stop here"


@pytest.mark.parametrize("include, text", [(False, "Hello world! Stop "), (True, "Hello world! Stop he")])
def test_stop_string_ending_inside_a_token_drops_the_rest_of_it(tokenizers, include, text):
    tok = tokenizers["byte_bpe"]
    ids = output_ids(tok, TEXT)
    keep = first_token_completing(tok, ids, "he")
    assert tok.decode(ids[keep - 1:keep]) == " here"             # the token " here" completes "he"
    stops = checker(tok, stop=["he"], include=include)
    assert stops.accept(ids) == (keep, "stop_string") and stops.text == text


@pytest.mark.parametrize("kind", KINDS)
def test_stop_string_of_multibyte_characters_stops_at_the_byte_completing_it(tokenizers, kind):
    """日本 is several tokens ending inside characters: the output stops at the token that
    completes 日's last byte, not at a later one that happens to end on a character boundary."""
    tok = tokenizers[kind]
    ids = output_ids(tok, "go 日本語 🎉 now")
    keep = first_token_completing(tok, ids, "日")
    stops = checker(tok, stop=["日"])
    assert stops.accept(ids) == (keep, "stop_string") and stops.text == "go "
    emoji = checker(tok, stop="🎉", include=True)
    assert emoji.accept(ids).keep == first_token_completing(tok, ids, "🎉")
    assert emoji.text == "go 日本語 🎉"


def test_several_stop_strings_completed_by_one_token():
    """At 'b' "b", "ab" and "xab" complete at the same character: the longest (starting first) wins, so no stop
    string shows."""
    stops = checker(ByteTokenizer(), stop=["b", "ab", "xab"])
    assert stops.accept(list(b"xxabc")) == (4, "stop_string")
    assert stops.stop_string == "xab" and stops.text == "x"
    tie = checker(ByteTokenizer(), stop=["abc", "ab"], include=True)
    assert tie.accept(list(b"zabc")) == (3, "stop_string") and tie.text == "zab"


class ChunkTokenizer(ByteTokenizer):
    """Bytes, and one token (id 256 + k) per text of ``chunks``: a token that writes several characters at once."""

    def __init__(self, *chunks: str):
        super().__init__()
        self.chunks = chunks
        self.vocab_size = 256 + len(chunks)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = b"".join(self.chunks[t - 256].encode() if t >= 256 else bytes([t]) for t in ids)
        return out.decode("utf-8", errors="replace")


def test_the_stop_string_that_completes_first_wins_within_one_token():
    """vLLM's rule: text "abc" from one token with stop strings ["abc", "b"] gives "a", stopped by "b" (the one
    completed first), whatever the stop strings' order; as one character a token would."""
    for stops in (["abc", "b"], ["b", "abc"]):
        whole = StopChecker(StopRule(10, (), stops), IncrementalDetokenizer(ChunkTokenizer("abc")))
        assert whole.accept([256]) == (1, "stop_string") and (whole.text, whole.stop_string) == ("a", "b")
        bytewise = checker(ByteTokenizer(), stop=stops)
        assert bytewise.accept(list(b"abc")) == (2, "stop_string") and bytewise.text == "a"
    included = StopChecker(StopRule(10, (), ["abc", "b"], include_stop_str=True),
                           IncrementalDetokenizer(ChunkTokenizer("zabcd")))
    assert included.accept([256]) == (1, "stop_string") and included.text == "zab"


def test_a_stop_token_text_is_left_out_unless_include_stop_str():
    """vLLM's rule for a request's stop_token_ids: the token ends the output (kept as its last token, reason
    "eos") but its text is not the output's; with include_stop_str it is. An EOS id's text stays (treedec's)."""
    bang = ord("!")
    rule = dict(max_new_tokens=10, eos_token_ids=[bang], stop_token_ids=[bang])
    left_out = StopChecker(StopRule(**rule), IncrementalDetokenizer(ByteTokenizer()))
    assert left_out.accept(list(b"hi!x")) == (3, "eos")
    assert left_out.token_ids == list(b"hi!") and left_out.text == "hi" and left_out.streamable_text == "hi"
    kept = StopChecker(StopRule(**rule, include_stop_str=True), IncrementalDetokenizer(ByteTokenizer()))
    assert kept.accept(list(b"hi!x")) == (3, "eos") and kept.text == "hi!"
    eos = StopChecker(StopRule(10, [bang]), IncrementalDetokenizer(ByteTokenizer()))
    assert eos.accept(list(b"hi!x")) == (3, "eos") and eos.text == "hi!"
    early = StopChecker(StopRule(**rule, min_tokens=2), IncrementalDetokenizer(ByteTokenizer()))
    assert early.accept(list(b"!!")) == (2, None) and early.text == "!!"   # (within min_tokens: an ordinary token)
    assert early.accept(list(b"!")) == (1, "eos") and early.text == "!!"
    # a stop token that completes a multi-byte character's bytes: the bytes before it are shown as a decode shows
    held = StopChecker(StopRule(10, [bang], stop_token_ids=[bang]), IncrementalDetokenizer(ByteTokenizer()))
    assert held.accept(list("é".encode())[:1] + [bang]) == (2, "eos") and held.text == "\ufffd"
    with pytest.raises(ValueError, match=r"stop_token_ids must be among eos_token_ids .*got 5 not in \[2\]"):
        StopRule(4, [2], stop_token_ids=[5])


def test_sampling_params_stop_rule_marks_the_stop_token_ids():
    from treedec.sampling import SamplingParams
    rule = SamplingParams(max_tokens=5, stop_token_ids=[7, 9]).stop_rule([2])
    assert rule.eos_token_ids == (2, 7, 9) and rule.stop_token_ids == (7, 9)
    assert SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=[7]).stop_rule([2]).eos_token_ids == (7,)


def test_stop_string_in_the_prompt_does_not_stop(tokenizers):
    tok = tokenizers["byte_bpe"]
    prompt = tok.encode("Stop here, then")
    stops = checker(tok, max_new_tokens=4, stop=["Stop", "then"], prompt_ids=prompt)
    ids = output_ids(tok, " go on.")
    assert stops.accept(ids) == (len(ids), None) and stops.text == " go on." and len(ids) < 4


def test_stop_string_found_as_eos_stops_with_eos():
    """The EOS check comes first: an EOS whose text completes a stop string stops as "eos",
    and the text is still cut before the stop string."""
    stops = checker(ByteTokenizer(), eos=ord("!"), stop=["!"])
    assert stops.accept(list(b"hi!!")) == (3, "eos")
    assert stops.text == "hi" and stops.stop_string == "!"


def test_stop_reasons_are_the_documented_ones():
    assert STOP_REASONS == ("eos", "stop_string", "length")


# ================================================================ properties

ALPHABET = "ab 日本é\n🎉"


def reference(tok, ids, eos, stops, max_new_tokens, include):
    """(keep, reason, text) by brute force: one-shot decodes of every prefix."""
    decode = tok.decode if isinstance(tok, ByteTokenizer) else lambda x: tok.decode(x, skip_special_tokens=True)
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        whole = text.rstrip(REPLACEMENT)                      # characters not yet complete do not count
        if ids[k - 1] in eos:
            reason = "eos"
        elif any(s in whole for s in stops):
            reason = "stop_string"
        elif k == max_new_tokens:
            reason = "length"
        else:
            continue
        # the stop string that completes first in the text wins (the longer of those ending at one character)
        found = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
        if found:
            end, length = min(found)
            text = text[:end] if include else text[:end + length]
        return k, reason, text
    return len(ids), None, decode(ids).rstrip(REPLACEMENT)


@given(text=st.text(alphabet=ALPHABET, max_size=30), data=st.data())
@settings(max_examples=150, deadline=None)
@pytest.mark.parametrize("kind", KINDS + ("bytes",))
def test_any_chunking_matches_the_brute_force_reference(tokenizers, kind, text, data):
    """Random text, stop strings, EOS and budget; the output's tokens fed in random chunks:
    the checker keeps what the shortest stopping prefix holds, and its text is that prefix's
    one-shot decode cut at the stop string completed first."""
    tok = ByteTokenizer() if kind == "bytes" else tokenizers[kind]
    ids = tok.encode(text) if kind == "bytes" else output_ids(tok, text)
    stops = data.draw(st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=3), max_size=3))
    eos = data.draw(st.lists(st.sampled_from(sorted(set(ids)) or [0]), max_size=1))
    max_new_tokens = data.draw(st.integers(1, 40))
    include = data.draw(st.booleans())
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=5)))
    rule = StopRule(max_new_tokens, eos, stops, include)
    check = StopChecker(rule, IncrementalDetokenizer(tok))
    kept = 0
    reason = None
    for a, b in zip([0] + cuts, cuts + [len(ids)]):
        if reason is None and a < b:
            decision = check.accept(ids[a:b])
            kept, reason = kept + decision.keep, decision.reason
            assert reason is not None or decision.keep == b - a
    keep, want_reason, want_text = reference(tok, ids, set(eos), rule.stop_strings, max_new_tokens, include)
    assert (kept, reason) == (keep, want_reason)
    assert check.token_ids == ids[:keep] and check.stop_reason == want_reason
    if kind == "sentencepiece" and want_text.endswith(REPLACEMENT):
        # Byte fallback shows an unfinished byte run, whole characters before it included, as one
        # U+FFFD per byte; the stream had shown those characters already (see IncrementalDetokenizer).
        whole = keep
        while tok.decode(ids[:whole]).endswith(REPLACEMENT):
            whole -= 1
        assert check.text.rstrip(REPLACEMENT) == tok.decode(ids[:whole]) and check.text.endswith(REPLACEMENT)
    else:
        assert check.text == want_text
    if not include:
        assert not any(s in check.text for s in rule.stop_strings)


@given(text=st.text(alphabet=ALPHABET, max_size=30), data=st.data())
@settings(max_examples=150, deadline=None)
@pytest.mark.parametrize("kind", KINDS + ("bytes",))
def test_tokens_taken_together_end_as_one_at_a_time(tokenizers, kind, text, data):
    """A chunk of tokens is taken in one pass (its text made at once, a stop string then found at the token that
    completed it): with min_tokens, stop token ids, EOS ids, ids past the text's and a prompt, any chunking keeps
    the tokens, the reason, the stop string and the text that feeding them one at a time does."""
    tok = ByteTokenizer() if kind == "bytes" else tokenizers[kind]
    vocab = 512 if kind == "bytes" else len(tok)
    ids = tok.encode(text) if kind == "bytes" else output_ids(tok, text)
    ids += data.draw(st.lists(st.integers(0, vocab - 1), max_size=4))
    ids = data.draw(st.permutations(ids))
    stops = data.draw(st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=3), max_size=3))
    eos = data.draw(st.lists(st.sampled_from(sorted(set(ids)) or [0]), max_size=2, unique=True))
    max_new_tokens = data.draw(st.integers(1, 40))
    rule = StopRule(max_new_tokens, eos, stops, data.draw(st.booleans()), data.draw(st.integers(0, max_new_tokens)),
                    stop_token_ids=[e for e in eos if data.draw(st.booleans())])
    prompt = ids[:data.draw(st.integers(0, 3))]

    def fed(sizes):
        check, at = StopChecker(rule, IncrementalDetokenizer(tok, prompt)), 0
        decisions = []
        for size in sizes:
            if check.stopped or at >= len(ids):
                break
            decisions.append(check.accept(ids[at:at + size]))
            at += size
        return check, sum(d.keep for d in decisions)

    sizes = data.draw(st.lists(st.integers(1, 8), min_size=len(ids), max_size=len(ids))) if ids else []
    one, kept_one = fed([1] * len(ids))
    many, kept_many = fed(sizes)
    assert kept_many == kept_one and many.token_ids == one.token_ids == ids[:kept_one]
    assert (many.stop_reason, many.stop_string, many.text) == (one.stop_reason, one.stop_string, one.text)
    assert many.streamable_text == one.streamable_text


# ================================================================ bounds and cost (issue #48 item 3)


def test_stop_strings_are_bounded_before_any_work():
    """A client-controlled size: a 1 MB stop string (which took 57 s for 8 tokens on the engine thread) and one
    stop string too many are refused at once, naming the field and the bound."""
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"stop_strings\[1\] must be at most {MAX_STOP_STRING_CHARS} characters, "
                                         rf"got 1000000"):
        StopRule(8, stop_strings=["ok", "a" * 10**6])
    with pytest.raises(ValueError, match=rf"stop_strings must hold at most {MAX_STOP_STRINGS} strings, got "
                                         rf"{MAX_STOP_STRINGS + 1}"):
        StopRule(8, stop_strings=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    assert time.perf_counter() - start < 0.5
    longest = "a" * MAX_STOP_STRING_CHARS
    assert len(StopRule(8, stop_strings=[longest] + [f"s{i}" for i in range(MAX_STOP_STRINGS - 1)]).stop_strings) \
        == MAX_STOP_STRINGS


def test_a_longest_stop_string_costs_each_token_its_own_characters():
    """The worst case for a hold-back (the text always ends with a long prefix of the stop strings): the old
    per-token ``endswith`` of every prefix was O(len(stop)^2) a token (3.1 s for these 6000 tokens on the CI
    machine, 57.7 s for 8 tokens of a 1 MB stop string); the matchers are O(new characters): 0.08 s."""
    stop = "a" * (MAX_STOP_STRING_CHARS - 1) + "b"
    stops = checker(ByteTokenizer(), max_new_tokens=20000, stop=[stop, "a" * 1000 + "c"])
    start = time.perf_counter()
    for _ in range(6000):
        assert stops.accept(ord("a")) == (1, None)
        stops.streamable_length
    elapsed = time.perf_counter() - start
    assert stops.streamable_text == "a" * (6000 - len(stop) + 1)     # the last 1023 a's may still become the stop
    assert stops.text_from(4000) == "a" * (6000 - len(stop) + 1 - 4000)
    assert stops.accept(ord("b")) == (1, "stop_string") and stops.text == "a" * (6000 - len(stop) + 1)
    assert elapsed < 1.0, f"{elapsed:.2f} s for 6000 tokens"


def brute_force_hold(text, stop_strings):
    return max((k for s in stop_strings for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@given(text=st.text(alphabet="ab日", max_size=40), data=st.data())
@settings(max_examples=200, deadline=None)
def test_streamable_text_holds_back_exactly_the_brute_force_tail(text, data):
    """After every chunk of tokens: the stream shows the text but its longest tail that is the start of a stop
    string (the old brute force), and the deltas join to the final text."""
    tok = ByteTokenizer()
    ids = tok.encode(text)
    stop_strings = data.draw(st.lists(st.text(alphabet="ab日", min_size=1, max_size=6), min_size=1, max_size=3))
    min_tokens = data.draw(st.integers(0, 6))
    stops = StopChecker(StopRule(60, (), stop_strings, data.draw(st.booleans()), min(min_tokens, 60)),
                        IncrementalDetokenizer(tok))
    shown = ""
    for a in range(0, len(ids), 3):
        if stops.stopped:
            break
        stops.accept(ids[a:a + 3])
        full = stops.text
        want = full if stops.stopped else full[:len(full) - brute_force_hold(full, stop_strings)]
        assert stops.streamable_text == want and stops.streamable_length == len(want)
        shown += stops.text_from(len(shown))
        assert shown == want


def test_min_tokens_lets_no_eos_or_stop_string_end_the_output_before_it():
    """vLLM's rule: an EOS or a stop string ends an output only once it has more than min_tokens tokens; a stop
    string counts when it ends in a later token's text (it may start earlier)."""
    early = StopChecker(StopRule(10, [ord("!")], ["x"], min_tokens=3), IncrementalDetokenizer(ByteTokenizer()))
    assert early.accept(list(b"x!x")) == (3, None) and early.text == "x!x"
    assert early.accept(list(b"y!z")) == (2, "eos") and early.text == "x!xy!"
    spanning = StopChecker(StopRule(10, (), ["abc"], min_tokens=2), IncrementalDetokenizer(ByteTokenizer()))
    assert spanning.accept(list(b"abcd")) == (3, "stop_string") and spanning.text == ""
    assert StopChecker(StopRule(3, (), ["a"], min_tokens=3), IncrementalDetokenizer(ByteTokenizer())) \
        .accept(list(b"aaaa")) == (3, "length")
    with pytest.raises(ValueError, match=r"min_tokens must be an int in \[0, 4\] \(max_new_tokens\), got 5"):
        StopRule(4, min_tokens=5)
