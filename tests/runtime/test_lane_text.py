"""Text lanes checked at their events only (treedec/runtime/lane_text.py): which tokens are events
(IncrementalDetokenizer.may_write), a stop string across tokens ends where a token-by-token check ends it, the checker
is fed at events only, and a tokenizer whose text depends on its neighbours is refused."""
import numpy as np
import pytest
import torch

from tests.engines import make_engine, tiny_model
from tests.programs.test_generate_batch import LetterTokenizer
from treedec.models.text import IncrementalDetokenizer
from treedec.programs.generate import generate_batch
from treedec.programs.tot import ByteTokenizer
from treedec.runtime.decode import Decode
from treedec.runtime.lane_group import LaneGroup
from treedec.runtime.lane_text import KEPT_KEYS, TextEvents
from treedec.runtime.requests import RequestSpec
from treedec.sampling.params import SamplingParams
from treedec.sampling.stops import StopRule


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def test_may_write_is_true_where_a_stop_strings_last_character_may_appear():
    detok = IncrementalDetokenizer(ByteTokenizer())
    newline = frozenset("\n")
    assert detok.may_write(10, newline) and not detok.may_write(65, newline)
    # a byte of a multi-byte character (its own text U+FFFD) completes a non-ASCII character only
    assert not detok.may_write(0xC3, newline) and detok.may_write(0xC3, frozenset("é"))
    assert detok.may_write(65, frozenset(" "))   # decoders put spaces between tokens: every token
    empty = IncrementalDetokenizer(LetterTokenizer())
    assert empty.may_write(2, frozenset("C")) and not empty.may_write(3, frozenset("C"))


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_stop_string_across_tokens_ends_at_the_token_completing_it(tiny, pipeline, monkeypatch):
    tokenizer = LetterTokenizer()
    free = RequestSpec(0, prompt="HELLO", params=SamplingParams(max_tokens=24, temperature=0.0))
    [probe], _ = generate_batch(make_engine(tiny), [free], tokenizer=tokenizer, pipeline=pipeline)
    text = probe.text
    stop = text[6:9]   # three tokens: the check at the third one's event sees the other two with it
    end = text.index(stop) + len(stop)
    fed = []
    accept = LaneGroup.accept_text
    monkeypatch.setattr(LaneGroup, "accept_text", lambda self, i, tokens: fed.append(len(tokens)) or
                        accept(self, i, tokens))
    spec = RequestSpec(0, prompt="HELLO", params=SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,)))
    [cut], _ = generate_batch(make_engine(tiny), [spec], tokenizer=tokenizer, pipeline=pipeline)
    assert cut.output_ids == probe.output_ids[:end] and cut.text == text[:end - len(stop)]
    assert cut.stop_reason == "stop_string"
    # fed at the tokens writing the stop string's last letter only, every token once
    assert sum(fed) == end and len(fed) == text[:end].count(stop[-1]) < end


class PairTokenizer(LetterTokenizer):
    """Writes "!" after the letters of tokens 0 and 1 in a row: a text that depends on the tokens around it."""

    def decode(self, ids):
        ids = [int(i) for i in ids]
        return "".join(chr(65 + i % 26) + ("!" if k and ids[k - 1] % 26 == 0 and i % 26 == 1 else "")
                       for k, i in enumerate(ids))


def test_a_tokenizer_writing_text_no_token_holds_is_refused(tiny):
    tokenizer = PairTokenizer()
    ids = tokenizer.encode("HELLO")

    def logits_ab(input_ids, scores):   # writes A B A B ...: "!" after every B, which no token's own text holds
        scores = torch.full_like(scores, -1e9)
        scores[0, 1 if int(input_ids[0, -1]) == 0 else 0] = 0
        return scores

    spec = RequestSpec(0, prompt_ids=tuple(ids), params=SamplingParams(max_tokens=8, temperature=0.0, stop=("!",),
                                                                      logits_processors=[logits_ab]))
    with pytest.raises(RuntimeError, match=r"stop string '!' ended at a token whose own text holds none of the stop "
                                           r"strings' last characters .*\(PairTokenizer\)"):
        generate_batch(make_engine(tiny), [spec], tokenizer=tokenizer)


def test_keys_past_the_kept_ones_take_the_rows_no_lane_uses():
    tokenizer, events = LetterTokenizer(), TextEvents(512)

    def key(stop, live):
        decode = Decode(0, SamplingParams(), StopRule(4, stop_strings=(stop,)), tokenizer=tokenizer)
        return events.key(decode, IncrementalDetokenizer(tokenizer), np.asarray(live, dtype=np.int64))

    rows = [key(chr(0x4E00 + i), []) for i in range(KEPT_KEYS)]
    assert rows == list(range(KEPT_KEYS)) and key(chr(0x4E00), [5]) == 0   # a known key: its row
    assert events.due(np.array([0, 1]), np.array([3, 4])).tolist() == [False, False]
    assert key("D", list(range(1, KEPT_KEYS))) == 0   # row 0 unused: taken, classified afresh
    assert events.due(np.array([0]), np.array([3])).tolist() == [True]
    assert key("E", list(range(KEPT_KEYS))) == KEPT_KEYS   # every row in use: a new one
    assert key(chr(0x4E00 + 1), []) == 1
