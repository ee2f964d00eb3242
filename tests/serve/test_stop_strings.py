"""Stop strings through the server, in both engine modes: the behaviour a move of detokenization and stop strings out
of the engine core (issue #51) must keep. A stop string that starts inside one token and ends inside a later one cuts
the text where it starts (with ``include_stop_str_in_output``: after it), whole and streamed alike, and no streamed
chunk shows a piece of it; with n > 1 only the outputs that meet it stop, the others run to their length; every page
is free again afterwards."""
import pytest

from tests.serve.server import free_again
from treedec import SamplingParams

PROMPT = "The quick brown fox"
MAX_TOKENS = 16


def _greedy(reference):
    [out] = reference.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
    return out.prompt_token_ids, out.outputs[0].token_ids, out.outputs[0].text


def _split_stop(reference, tokenizer) -> tuple[str, int]:
    """A stop string of the greedy output's text that spans two tokens (a character or two of each, inside them
    where their texts are longer), its first occurrence; and where it starts in the text."""
    prompt_ids, ids, text = _greedy(reference)
    head = len(tokenizer.decode(prompt_ids))
    ends = [len(tokenizer.decode(prompt_ids + ids[:k])) - head for k in range(len(ids) + 1)]
    shown = [tokenizer.decode(prompt_ids + ids[:k])[head:] for k in range(len(ids) + 1)]
    for wide in (2, 1):   # (two characters of each token if the text has them, else one)
        for k in range(1, len(ids)):   # (the boundary between tokens k - 1 and k)
            start, end = ends[k] - 1, ends[k] + 1
            if ends[k] - ends[k - 1] < wide or ends[k + 1] - ends[k] < wide or not text.startswith(shown[k + 1]):
                continue
            stop = text[start:end]
            if text.find(stop) == start and "\ufffd" not in stop:   # (whole characters, its first occurrence)
                return stop, start
    pytest.fail(f"no token boundary of {text!r} with a character of its own on each side")


def _streamed(client, **kwargs) -> tuple[list[str], str | None]:
    chunks, reason = [], None
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, stream=True, **kwargs):
        for c in chunk.choices:
            chunks.append(c.text)
            reason = c.finish_reason or reason
    return chunks, reason


@pytest.mark.parametrize("include", [False, True], ids=["cut-before", "include_stop_str_in_output"])
def test_a_stop_string_split_across_tokens_cuts_the_text_whole_and_streamed(server, client, reference, tokenizer,
                                                                           include):
    stop, start = _split_stop(reference, tokenizer)
    text = _greedy(reference)[2]
    want = text[:start + len(stop)] if include else text[:start]
    [ref] = reference.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                                      stop=(stop,), include_stop_str_in_output=include), use_tqdm=False)
    assert ref.outputs[0].text == want and ref.outputs[0].finish_reason == "stop"
    body = dict(max_tokens=MAX_TOKENS, temperature=0, stop=[stop],
                extra_body={"ignore_eos": True, "include_stop_str_in_output": include, "return_token_ids": True})
    [choice] = client.completions.create(model="tiny", prompt=PROMPT, **body).choices
    assert (choice.text, choice.finish_reason) == (want, "stop")
    assert choice.model_extra["token_ids"] == list(ref.outputs[0].token_ids)   # (up to the token that completed it)
    chunks, reason = _streamed(client, **body)   # (text once streamed is never taken back: joined, the chunks
    assert ("".join(chunks), reason) == (want, "stop")   # equal to the cut text show no piece of the stop string)
    assert free_again(server) == 0


def test_with_n_outputs_only_those_that_meet_the_stop_string_stop(server, client, reference):
    """A seed whose n=3 sampled outputs stop at the string ("e") in some outputs and run to their length in
    another: each choice's text and finish reason as LLM.generate's, whole and streamed; every page free after."""
    case = dict(max_tokens=12, temperature=1.0, n=3)

    def outputs(seed):
        [out] = reference.generate(PROMPT, SamplingParams(**case, seed=seed, stop=("e",), ignore_eos=True),
                                   use_tqdm=False)
        return [(o.text, o.finish_reason) for o in out.outputs]

    seed = next((s for s in range(200) if {r for _, r in outputs(s)} == {"stop", "length"}), None)
    assert seed is not None, "no seed among 200 gives n=3 outputs both stopped and run to their length"
    want = outputs(seed)
    body = dict(**case, seed=seed, stop=["e"], extra_body={"ignore_eos": True})
    got = client.completions.create(model="tiny", prompt=PROMPT, **body)
    assert [(c.text, c.finish_reason) for c in sorted(got.choices, key=lambda c: c.index)] == want
    texts, reasons = {}, {}
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, stream=True, **body):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    assert [(texts[i], reasons[i]) for i in range(3)] == want
    assert free_again(server) == 0
