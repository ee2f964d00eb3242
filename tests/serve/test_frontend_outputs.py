"""Detokenization and stop strings in the frontend (treedec/core/output_processor.py; issue #51): the engine core
streams a generated request's token ids and makes no text for it; the frontend's text, stop strings, logprobs and usage
are the ones LLM.generate gives, on both transports; a stop string found in the frontend aborts the request in the core
and keeps its result."""
import threading

import pytest

from tests.serve.server import ENGINES, RunningServer, free_again, make_llm
from treedec import SamplingParams
from treedec.models.text import IncrementalDetokenizer
from treedec.core.engine_core import EngineCore
from treedec.core.messages import AddRequest, IterationOutputs, PositionLogprobs, TokenDelta, dumps
from treedec.core.output_processor import RequestOutputs

PROMPT = "The quick brown fox"


def _reference(reference, **kwargs):
    [out] = reference.generate(PROMPT, SamplingParams(**kwargs), use_tqdm=False)
    return out


def test_the_core_makes_no_text_for_a_generated_request(tokenizer, monkeypatch):
    """In-process: no detokenizer is made or fed on the engine's thread, streamed or not, stop strings and all; the
    frontend's are."""
    threads = []
    for name in ("__init__", "feed", "feed_checked", "finish"):
        original = getattr(IncrementalDetokenizer, name)

        def spy(self, *args, _original=original, **kwargs):
            threads.append(threading.current_thread().name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(IncrementalDetokenizer, name, spy)
    import openai
    running = RunningServer(make_llm(tokenizer), "tiny")
    try:
        with openai.OpenAI(base_url=running.base_url, api_key="none", max_retries=0, timeout=60) as client:
            body = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=["zzz"], n=2,
                        extra_body={"ignore_eos": True})
            whole = client.completions.create(**body)
            streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **body)
                               if c.choices and c.choices[0].index == 0)
        assert whole.choices[0].text == streamed and whole.choices[0].text
        assert threads and "treedec-online" not in threads, sorted(set(threads))
        assert free_again(running) == 0
    finally:
        running.stop()


def test_the_engine_core_sends_token_ids_and_no_results_for_a_generated_request(tokenizer, reference):
    """The core itself (as its process runs it): TokenDelta items only, one token each, joining to LLM.generate's
    ids, its end and no pickled results."""
    messages, done = [], threading.Event()

    def sink(message):
        messages.append(message)
        if isinstance(message, IterationOutputs) and message.finished:
            done.set()

    core = EngineCore(make_llm(tokenizer), sink)
    try:
        ids = tokenizer.encode(PROMPT)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=("e",), logprobs=1)
        core.handle([AddRequest("a", ids, dumps(params), stream_tokens=True)])
        assert done.wait(60)
    finally:
        core.shutdown(10)
    deltas = [d for m in messages for d in m.tokens]
    assert not any(m.outputs for m in messages) and all(len(d.token_ids) == 1 for d in deltas)
    [finished] = [f for m in messages for f in m.finished]
    assert finished.results is None
    want = _reference(reference, max_tokens=8, temperature=0.0, ignore_eos=True).outputs[0].token_ids
    assert [d.token_ids[0] for d in deltas] == list(want)   # (the stop string is the frontend's: not matched here)
    assert [d.end for d in deltas] == [None] * 7 + ["length"] and all(len(d.logprobs) == 1 for d in deltas)


def test_stop_strings_logprobs_and_usage_as_llm_generate_gives_them(server, client, reference):
    """A stop string found in the frontend ends its output with finish reason "stop" and keeps its text, token ids
    and logprobs (the core's request aborted: every page free after); usage counts the kept tokens, streamed too."""
    full = _reference(reference, max_tokens=16, temperature=0.0, ignore_eos=True).outputs[0].text
    stop = full[5:7]
    want = _reference(reference, max_tokens=16, temperature=0.0, ignore_eos=True, stop=(stop,), logprobs=2).outputs[0]
    body = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop], logprobs=2,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    got = client.completions.create(**body)
    [choice] = got.choices
    assert (choice.text, choice.finish_reason) == (want.text, "stop")
    assert choice.model_extra["token_ids"] == list(want.token_ids)
    assert choice.logprobs.tokens and len(choice.logprobs.token_logprobs) == len(want.token_ids)
    assert choice.logprobs.token_logprobs == pytest.approx([e[t].logprob for e, t in zip(want.logprobs,
                                                                                         want.token_ids)], abs=1e-4)
    assert got.usage.completion_tokens == len(want.token_ids)
    body.pop("logprobs")   # (not with stream=true)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **body))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert free_again(server) == 0


def next_turn_cached(client, reference, model):
    """A first turn (16 prompt ids: 4 whole pages) that a stop string ends in the frontend (past its 8th token, as
    greedy decoding gives it), then the next (its prompt, its output's ids, a new message): the next turn's cached
    tokens, and those the first turn's conversation to its stop has in whole pages."""
    prompt = list(range(40, 56))
    [full] = reference.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=24, temperature=0.0,
                                                                            ignore_eos=True), use_tqdm=False)
    out, decode = full.outputs[0].token_ids, reference.tokenizer.decode
    stop = next(piece for k in range(8, len(out)) for piece in [decode(out[k:k + 1])]
                if piece.strip() and "\ufffd" not in piece and piece not in decode(out[:k]))
    body = dict(model=model, max_tokens=24, temperature=0, stop=[stop],
                extra_body={"ignore_eos": True, "return_token_ids": True})
    [first] = client.completions.create(prompt=prompt, **body).choices
    ids = first.model_extra["token_ids"]
    assert first.finish_reason == "stop" and 9 <= len(ids) < 24
    again = client.completions.create(prompt=prompt + ids + [7, 8, 9], **body)
    return again.usage.prompt_tokens_details.cached_tokens, len(prompt) + 4 * ((len(ids) - 1) // 4)


def test_a_conversation_a_frontend_stop_string_ended_stays_in_the_prefix_cache(server, client, reference):
    """The request a stop string ended in the frontend is aborted in the core, its output's conversation to the stop
    offered to the prefix cache first: the next turn (the prompt, the output's ids, a new message) reads it."""
    cached, conversation = next_turn_cached(client, reference, "tiny")
    assert cached >= conversation > 16, (cached, conversation)
    assert free_again(server) == 0


def test_a_chat_s_next_turn_reads_the_reply_a_stop_string_ended_from_the_prefix_cache(server, client, reference):
    """Multi-turn chat re-sent as text: the reply a stop string ended (words that re-encode to themselves: allowed
    tokens only) is read back from the prefix cache by the next turn, past the first turn's prompt."""
    import re
    tok = reference.tokenizer
    words = [i for i in range(len(tok)) if re.fullmatch(r" [a-z]{2,}", tok.decode([i]))
             and tok.encode(tok.decode([i]), add_special_tokens=False) == [i]]
    messages = [{"role": "user", "content": "Tell me about the quick brown fox and the lazy dog"}]
    options = dict(max_tokens=24, temperature=1.0, seed=1)
    [full] = reference.generate({"messages": messages}, SamplingParams(**options, ignore_eos=True,
                                                                       allowed_token_ids=words), use_tqdm=False)
    out = full.outputs[0].token_ids
    stop = next(piece for k in range(8, len(out)) for piece in [tok.decode(out[k:k + 1])]
                if piece not in tok.decode(out[:k]))
    first = client.chat.completions.create(model="tiny", messages=messages, stop=[stop], **options,
                                           extra_body={"ignore_eos": True, "allowed_token_ids": words})
    reply = first.choices[0].message.content
    assert first.choices[0].finish_reason == "stop" and len(reply.split()) >= 8
    again = client.chat.completions.create(model="tiny", max_tokens=2, temperature=0, messages=messages + [
        {"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}])
    assert again.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens, again.usage
    assert free_again(server) == 0


@pytest.mark.parametrize("mode", sorted(ENGINES))
def test_a_speculative_server_s_stop_strings_are_the_frontend_s_as_plain_decoding_gives_them(tokenizer, reference,
                                                                                             mode, monkeypatch):
    """A speculative request streams each step's accepted token ids too (n-gram drafts): its text, finish reason,
    token ids, usage and logprobs with stop strings are LLM.generate's plain greedy ones, streamed or not, on both
    transports; the core makes no text for it (in-process: no detokenizer on the engine's thread); every page is free
    after the aborts, the speculative metrics still count its steps, and a conversation a stop string ended is read
    from the prefix cache by its next turn."""
    import openai
    from tests.serve.test_server import metric_values
    threads = []
    init = IncrementalDetokenizer.__init__
    monkeypatch.setattr(IncrementalDetokenizer, "__init__", lambda self, *a, **k: threads.append(
        threading.current_thread().name) or init(self, *a, **k))
    full = _reference(reference, max_tokens=24, temperature=0.0, ignore_eos=True).outputs[0].text
    running = RunningServer(ENGINES[mode](tokenizer, speculative_config={"method": "ngram",
                                                                        "num_speculative_tokens": 3}), "s")
    try:
        with openai.OpenAI(base_url=running.base_url, api_key="none", max_retries=0, timeout=60) as client:
            for stop in (full[3:5], full[9:12], "zzz"):
                want = _reference(reference, max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,),
                                  logprobs=1).outputs[0]
                body = dict(model="s", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                            extra_body={"ignore_eos": True, "return_token_ids": True})
                [choice] = client.completions.create(logprobs=1, **body).choices
                assert (choice.text, choice.finish_reason) == (want.text, "stop" if stop != "zzz" else "length")
                assert choice.model_extra["token_ids"] == list(want.token_ids)
                assert choice.logprobs.token_logprobs == pytest.approx(
                    [e[t].logprob for e, t in zip(want.logprobs, want.token_ids)], abs=1e-4)
                chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **body))
                assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
                assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
                assert chunks[-1].usage.completion_tokens == len(want.token_ids)
            assert metric_values(running.url)[("treedec_spec_verify_steps_total", ())] > 0
            cached, conversation = next_turn_cached(client, reference, "s")   # (multi-turn: the cache read)
            assert cached >= conversation > 16, (cached, conversation)
        assert "treedec-online" not in threads, sorted(set(threads))
        assert free_again(running) == 0
    finally:
        running.stop()


# ------------------------------------------------------------------ RequestOutputs alone

class Letters:
    """Token id i is the letter chr(97 + i % 26)."""

    def __len__(self):
        return 26

    def decode(self, ids):
        return "".join(chr(97 + int(i) % 26) for i in ids)


def _delta(index, token, end=None, logprob=None):
    return TokenDelta("r", index, [token], None if logprob is None else [PositionLogprobs([token], [logprob], [1])],
                      end, 4)


def test_a_stop_string_found_in_the_frontend_ends_its_output_and_asks_for_the_abort():
    outputs = RequestOutputs("r", [0], SamplingParams(n=2, max_tokens=5, stop=("cd",), logprobs=0), Letters(), [25])
    items = [outputs.take(_delta(0, t, logprob=-1.0)) for t in (1, 2, 3)]   # b, c (held back), d: "bcd" -> "b"
    assert [[(i.text, i.stop_reason) for i in step] for step in items] == [[("b", None)], [], [("", "stop_string")]]
    assert outputs.take(_delta(0, 4, logprob=-1.0)) == []   # (a step late: dropped)
    for t, end in ((1, None), (25, "eos")):
        last = outputs.take(_delta(1, t, end, -0.5))
    assert outputs.done and outputs.needs_abort and (last[0].stop_reason, last[0].token_ids) == ("eos", [1, 25])
    first, second = outputs.results()
    assert (first.text, first.output_ids, first.stop_reason, first.stats["stop_string"]) == ("b", [1, 2, 3],
                                                                                             "stop_string", "cd")
    assert len(first.logprobs) == 3 and first.cumulative_logprob == -3.0 and first.stats["cached_tokens"] == 4
    assert (second.text, second.stop_reason) == ("bz", "eos")


def test_an_end_the_core_found_alone_ends_the_output_there_and_needs_no_abort():
    outputs = RequestOutputs("r", [0], SamplingParams(max_tokens=9), Letters(), [])   # (a grammar's stop id, say)
    [end] = outputs.take(_delta(0, 7, "eos"))
    assert (end.text, end.stop_reason) == ("h", "eos") and outputs.done and not outputs.needs_abort


def test_a_token_the_tokenizer_cannot_decode_is_refused():
    outputs = RequestOutputs("r", [0], SamplingParams(max_tokens=9), Letters(), [])
    with pytest.raises(ValueError, match="token_ids"):
        outputs.take(_delta(0, 40))


def test_a_stop_string_inside_a_speculative_steps_run_cuts_it_where_token_by_token_would():
    """A speculative output's delta holds a verification step's accepted run (several tokens): a stop string found
    inside it ends the output at the same token, with the same text and logprobs, as one token a delta; its steps'
    draft accounting goes to its result's stats."""
    params = SamplingParams(max_tokens=9, stop=("de",), logprobs=0)
    entry = [PositionLogprobs([t], [-1.0], [1]) for t in (1, 2, 3, 4, 5, 6)]
    one = RequestOutputs("r", [0], params, Letters(), [25])
    singly = [i for t, e in zip((1, 2, 3, 4, 5, 6), entry) for i in one.take(TokenDelta("r", 0, [t], [e], None, 4))]
    runs = RequestOutputs("r", [0], params, Letters(), [25])
    together = runs.take(TokenDelta("r", 0, [1, 2], entry[:2], None, 4, accepted=[], draft_sizes=[])) + \
        runs.take(TokenDelta("r", 0, [3, 4, 5, 6], entry[2:], None, 4, accepted=[3], draft_sizes=[5]))
    assert "".join(i.text for i in together) == "".join(i.text for i in singly) == "bc"
    assert (together[-1].stop_reason, together[-1].token_ids) == (singly[-1].stop_reason, singly[-1].token_ids) == \
        ("stop_string", [1, 2, 3, 4])
    assert runs.done and runs.needs_abort
    [r], [s] = runs.results(), one.results()
    want = ("bc", [1, 2, 3, 4], 4)
    assert (r.text, r.output_ids, len(r.logprobs)) == (s.text, s.output_ids, len(s.logprobs)) == want
    assert (r.stats["accepted"], r.stats["draft_sizes"]) == ([3], [5]) and "accepted" not in s.stats
