"""treedec.commands.requests_file: prompts JSONL in (checked line by line), results JSONL out."""
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from treedec.sampling.params import SAMPLING_EPS, SamplingParams
from treedec.commands import requests_file
from treedec.runtime.requests import RequestResult, RequestSpec
from treedec.commands.requests_file import DEFAULT_PARAMETERS, RequestsFileError, read_requests, write_results_jsonl
from treedec.sampling.stops import StopRule


def write_lines(tmp_path, *lines, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# ================================================================ reading


def test_reads_the_three_prompt_kinds_with_defaults(tmp_path):
    path = write_lines(
        tmp_path,
        '{"prompt": "The capital of France is", "max_tokens": 8, "stop": "\\n"}',
        "",
        '{"messages": [{"role": "user", "content": "日本?"}], "temperature": 0.7, "seed": 3, "n": 2}',
        "   ",
        '{"id": "q3", "prompt_ids": [1, 450, 7483], "stop_token_ids": [13, 13], "top_k": 5, "top_p": 0.9}',
    )
    a, b, c = read_requests(path)
    assert (a.id, a.line, a.prompt, a.messages, a.prompt_ids) == (1, 1, "The capital of France is", None, None)
    p = a.params
    assert (p.max_tokens, p.stop, p.temperature, p.n, p.top_k, p.seed) == (8, ("\n",), 1.0, 1, None, None)
    assert (b.id, b.line, b.messages) == (3, 3, ({"role": "user", "content": "日本?"},))   # empty lines skipped
    p = b.params
    assert (p.temperature, p.seed, p.n, p.max_tokens) == (0.7, 3, 2, DEFAULT_PARAMETERS["max_tokens"])
    p = c.params
    assert (c.id, c.line, c.prompt_ids, p.stop_token_ids, p.top_k, p.top_p) == ("q3", 5, (1, 450, 7483), (13,), 5, 0.9)


def test_the_documented_example_reads(tmp_path):
    example = [line.strip() for line in requests_file.__doc__.splitlines() if line.startswith("    {")]
    specs = read_requests(write_lines(tmp_path, *example))
    assert [s.id for s in specs] == [1, 2, "q3"] and specs[0].params.stop == ("\n",) and specs[2].params.n == 4


def test_defaults_fill_what_a_line_leaves_out(tmp_path):
    path = write_lines(tmp_path, '{"prompt": "a"}', '{"prompt": "b", "temperature": 0.0, "stop": []}')
    a, b = read_requests(path, defaults={"temperature": 0.5, "max_tokens": 64, "stop": ["###"], "seed": 7})
    fields = lambda p: (p.temperature, p.max_tokens, p.stop, p.seed)   # noqa: E731
    assert fields(a.params) == (0.5, 64, ("###",), 7)
    assert fields(b.params) == (0.0, 64, (), 7)     # the line wins


@pytest.mark.parametrize("defaults, message", [
    ({"max_new_tokens": 3}, "defaults has unknown parameter 'max_new_tokens'"),
    ({"prompt": "x"}, "defaults has unknown parameter 'prompt'"),
    ({"temperature": -1}, r"defaults: temperature must be a number in \[0, 3.4028235e\+38\] \(finite in float32; "
                          r"0 is greedy\), got -1"),
    ({"n": 0}, "defaults: n must be an int >= 1, got 0"),
    ([("n", 2)], "defaults must be a mapping"),
])
def test_bad_defaults(tmp_path, defaults, message):
    path = write_lines(tmp_path, '{"prompt": "a"}')
    with pytest.raises(ValueError, match=message) as e:
        read_requests(path, defaults=defaults)
    assert not isinstance(e.value, RequestsFileError)


def test_vllms_new_fields_read_back(tmp_path):
    line = ('{"prompt": "a", "min_tokens": 2, "logit_bias": {"5": -100, "7": 2.5}, "allowed_token_ids": [5, 7, 7], '
            '"bad_words": ["no"], "detokenize": false, "skip_special_tokens": false, '
            '"spaces_between_special_tokens": false, "truncate_prompt_tokens": 4, "best_of": 1}')
    [spec] = read_requests(write_lines(tmp_path, line))
    p = spec.params
    assert (p.min_tokens, dict(p.logit_bias), p.allowed_token_ids, p.bad_words) == (2, {5: -100.0, 7: 2.5}, (5, 7),
                                                                                  ("no",))
    assert (p.detokenize, p.skip_special_tokens, p.spaces_between_special_tokens) == (False, False, False)
    assert (p.truncate_prompt_tokens, p.best_of) == (4, 1)
    [default] = read_requests(write_lines(tmp_path, '{"prompt": "a"}', name="d.jsonl"),
                              {"min_tokens": 1, "bad_words": ["x"]})
    assert default.params.min_tokens == 1 and default.params.bad_words == ("x",)


def test_vllm_style_top_k_off_and_null_seed(tmp_path):
    path = write_lines(tmp_path, '{"prompt": "a", "top_k": -1, "seed": null}', '{"prompt": "b", "top_k": 0}')
    assert [(r.params.top_k, r.params.seed) for r in read_requests(path)] == [(None, None), (None, None)]


BAD_LINES = [
    ('{"prompt": "a"', "not valid JSON: Expecting ',' delimiter at column 15"),
    ('["a"]', r"must be a JSON object \(one request\), got a JSON list: \[\"a\"\]"),
    ('"just text"', "must be a JSON object"),
    ('{"prompt": "a", "max_new_tokens": 4}',
     r"unknown key 'max_new_tokens' \(did you mean 'max_tokens'\?\); a request takes id, prompt,"),
    ('{"prompt": "a", "line": 4}', "unknown key 'line'"),
    ('{"prompt": "a", "prompt": "b"}', "key 'prompt' is given twice"),
    ('{"max_tokens": 4}', "needs exactly one of prompt, messages, prompt_ids, got none of them"),
    ('{"prompt": "a", "prompt_ids": [1]}',
     "needs exactly one of prompt, messages, prompt_ids, got prompt and prompt_ids"),
    ('{"prompt": null}', "prompt is null"),
    ('{"prompt": ""}', "prompt must be a non-empty string, got str ''"),
    ('{"prompt": 5}', "prompt must be a non-empty string, got int 5"),
    ('{"prompt_ids": []}', r"prompt_ids must hold at least one token id"),
    ('{"prompt_ids": [1, -2]}', r"prompt_ids must be token ids \(ints >= 0\), got int -2"),
    ('{"prompt_ids": [1, 2.0]}', r"prompt_ids must be token ids \(ints >= 0\), got float 2.0"),
    ('{"prompt_ids": "1 2"}', "prompt_ids must be a list of token ids"),
    ('{"messages": []}', "messages is an empty list"),
    ('{"messages": [{"role": "user"}]}', r"messages\[0\]\['content'\] must be a string, got nothing"),
    ('{"messages": "hi"}', "messages must be a list of chat messages"),
    ('{"prompt": "a", "max_tokens": 0}', "max_tokens must be an int >= 1, got 0"),
    ('{"prompt": "a", "max_tokens": 8.0}', "max_tokens must be an int >= 1, got 8.0"),
    ('{"prompt": "a", "temperature": true}', "temperature must be a number in .*got True"),
    ('{"prompt": "a", "temperature": NaN}', "NaN is not a JSON number"),
    ('{"prompt": "a", "temperature": Infinity}', "Infinity is not a JSON number"),
    ('{"prompt": "a", "temperature": 1e999}', "temperature must be a number in .*got inf"),
    ('{"prompt": "a", "temperature": "0.7"}', "temperature must be a number in .*got '0.7'"),
    ('{"prompt": "a", "top_p": 0}', r"top_p must be a number in \(0, 1\], got 0"),
    ('{"prompt": "a", "top_p": 1.5}', r"top_p must be a number in \(0, 1\], got 1.5"),
    ('{"prompt": "a", "top_k": 2.5}', "top_k must be an int >= 1, or None / -1 / 0 for no top-k cut, got float 2.5"),
    ('{"prompt": "a", "top_k": -3}', "top_k must be an int >= 1"),
    ('{"prompt": "a", "seed": -9223372036854775809}',
     r"seed must be an int in \[-2\*\*63, 2\*\*63\) \(an int64\) or None, got int -9223372036854775809"),
    ('{"prompt": "a", "seed": 9223372036854775808}', r"seed must be an int in \[-2\*\*63, 2\*\*63\)"),
    ('{"prompt": "a", "n": 0}', "n must be an int >= 1, got 0"),
    ('{"prompt": "a", "stop": [""]}', "stop must be non-empty strings, got str ''"),
    ('{"prompt": "a", "stop": 5}', "stop must be a string or a sequence of strings, got int 5"),
    ('{"prompt": "a", "stop_token_ids": ["13"]}', r"stop_token_ids must be token ids \(ints >= 0\), got str '13'"),
    ('{"prompt": "a", "include_stop_str_in_output": "yes"}',
     "include_stop_str_in_output must be true or false, got str 'yes'"),
    ('{"prompt": "a", "min_p": 1.5}', r"min_p must be a number in \[0, 1\] \(0: no cut\), got float 1.5"),
    ('{"prompt": "a", "repetition_penalty": 0}',
     r"repetition_penalty must be a number in .*\(> 0 and finite in float32; 1: no penalty\)"),
    ('{"prompt": "a", "presence_penalty": "x"}', r"presence_penalty must be a number in \[-2, 2\] .*got 'x'"),
    ('{"prompt": "a", "logprobs": -1}', r"logprobs must be None or an int >= 0"),
    ('{"prompt": "a", "ignore_eos": 1}', "ignore_eos must be true or false, got int 1"),
    ('{"prompt": "a", "logits_processors": []}', "unknown key 'logits_processors'"),
    ('{"prompt": "a", "id": true}', "id must be an int or a non-empty string, got bool True"),
    ('{"prompt": "a", "id": ""}', "id must be an int or a non-empty string"),
    ('{"prompt": "a", "id": [1]}', "id must be an int or a non-empty string, got list"),
    ('{"prompt": "a", "best_of": 2}', r"best_of=2 is not supported \(vLLM v1 does not support best_of either\)"),
    ('{"prompt": "a", "logit_bias": {"5": 300}}', r"logit_bias\[5\] must be a number in \[-100, 100\]"),
    ('{"prompt": "a", "logit_bias": {"-5": 1}}', r"logit_bias keys must be token ids .*got str '-5'"),
    ('{"prompt": "a", "min_tokens": 20}', r"min_tokens must be at most max_tokens \(16\), got 20"),
    ('{"prompt": "a", "allowed_token_ids": []}', r"allowed_token_ids must be None \(every token\)"),
    ('{"prompt": "a", "stop": ["' + "x" * 2000 + '"]}', r"stop\[0\] must be at most 1024 characters, got 2000"),
    ('{"prompt": "a", "detokenize": false, "stop": ["."]}', r"need detokenize=True"),
]


@pytest.mark.parametrize("line, message", BAD_LINES, ids=[m[:40] for _, m in BAD_LINES])
def test_bad_line_names_file_line_and_problem(tmp_path, line, message):
    path = write_lines(tmp_path, '{"prompt": "fine"}', "", line)
    with pytest.raises(RequestsFileError, match=message) as e:
        read_requests(path)
    assert str(e.value).startswith(f"{path}:3: ")
    assert (e.value.path, e.value.line) == (str(path), 3) and isinstance(e.value, ValueError)


def test_repeated_id_names_both_lines(tmp_path):
    path = write_lines(tmp_path, '{"prompt": "a", "id": "x"}', '{"prompt": "b", "id": 1}', '{"prompt": "c", "id": "x"}')
    with pytest.raises(RequestsFileError, match="id 'x' is also the id of line 1") as e:
        read_requests(path)
    assert e.value.line == 3
    clash = write_lines(tmp_path, '{"prompt": "a"}', '{"prompt": "b", "id": 1}', name="clash.jsonl")
    with pytest.raises(RequestsFileError, match=r"clash.jsonl:2: id 1 is also the id of line 1"):
        read_requests(clash)
    same_text = write_lines(tmp_path, '{"prompt": "a"}', '{"prompt": "b", "id": "1"}', name="ok.jsonl")
    assert [r.id for r in read_requests(same_text)] == [1, "1"]          # "1" and 1 are different ids


def test_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(RequestsFileError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 16: invalid continuation"):
        read_requests(path)


def test_byte_order_mark_and_crlf_are_read(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes('\ufeff{"prompt": "é"}\r\n\r\n{"prompt": "b"}\r\n'.encode())
    assert [(r.id, r.prompt) for r in read_requests(path)] == [(1, "é"), (3, "b")]


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_file_without_requests(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(RequestsFileError, match="empty.jsonl: no requests") as e:
        read_requests(path)
    assert e.value.line is None


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_requests(tmp_path / "nope.jsonl")


# ================================================================ RequestSpec in code


def test_request_spec_checks_fields_in_code():
    spec = RequestSpec(id="a", prompt_ids=np.array([3, 4]), params=SamplingParams(stop="\n", top_k=0))
    assert spec.prompt_ids == (3, 4) and spec.params.stop == ("\n",) and spec.params.top_k is None and spec.line is None
    with pytest.raises(ValueError, match="got prompt and messages"):
        RequestSpec(id=1, prompt="a", messages=[{"role": "user", "content": "b"}])
    with pytest.raises(ValueError, match="got none of them"):
        RequestSpec(id=1)
    with pytest.raises(ValueError, match="line must be an int >= 1, got 0"):
        RequestSpec(id=1, prompt="a", line=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.params.n = 2
    with pytest.raises(ValueError, match="params must be a SamplingParams, got dict"):
        RequestSpec(id=1, prompt="a", params={"n": 2})


def test_stop_rule_puts_request_stop_ids_after_the_checkpoint_eos():
    params = SamplingParams(max_tokens=9, stop=["\n\n"], stop_token_ids=[13, 2], include_stop_str_in_output=True)
    assert params.stop_rule(eos_token_ids=(2, 32000)) == StopRule(9, (2, 32000, 13), ("\n\n",), True,
                                                                  stop_token_ids=(13, 2))
    assert params.stop_rule().eos_token_ids == (13, 2)
    assert params.replace(ignore_eos=True).stop_rule(eos_token_ids=(2, 32000)).eos_token_ids == (13, 2)
    with pytest.raises(ValueError, match="eos_token_ids must be token ids"):
        params.stop_rule(eos_token_ids=[-1])


PARAMETERS = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(1, 10**6),
    "stop": st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1, max_size=5), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 10**6), max_size=4),
    "include_stop_str_in_output": st.booleans(),
    "ignore_eos": st.booleans(),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.1, 3),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "temperature": st.floats(0, 5, allow_nan=False),
    "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.one_of(st.none(), st.integers(1, 1000)),
    "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    "n": st.integers(1, 16),
    "id": st.one_of(st.integers(100, 10**9), st.text(min_size=1, max_size=8)),
})
PROMPTS = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=20)}),
    st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=10)}), min_size=1,
        max_size=3)}),
    st.fixed_dictionaries({"prompt_ids": st.lists(st.integers(0, 10**6), min_size=1, max_size=8)}),
)


@given(requests=st.lists(st.tuples(PROMPTS, PARAMETERS), min_size=1, max_size=5))
@settings(max_examples=100, deadline=None)
def test_any_valid_file_reads_back_what_it_says(tmp_path_factory, requests):
    ids = [repr(params["id"]) for _, params in requests if "id" in params]   # explicit ids > the line numbers
    assume(len(set(ids)) == len(ids))
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("".join(json.dumps({**prompt, **params}) + "\n" for prompt, params in requests), encoding="utf-8")
    specs = read_requests(path)
    assert len(specs) == len(requests)
    for number, (spec, (prompt, params)) in enumerate(zip(specs, requests), start=1):
        assert spec.line == number and spec.id == params.get("id", number)
        assert (spec.prompt, spec.prompt_ids) == (prompt.get("prompt"), tuple(prompt.get("prompt_ids", ())) or None)
        assert spec.messages == (tuple(prompt["messages"]) if "messages" in prompt else None)
        for key, default in DEFAULT_PARAMETERS.items():
            value = params.get(key, default)
            if key == "stop":
                value = tuple(dict.fromkeys([value] if isinstance(value, str) else value))
            elif key == "stop_token_ids":
                value = tuple(dict.fromkeys(value))
            elif key == "temperature" and value < SAMPLING_EPS:
                value = 0.0   # (greedy below vLLM's _SAMPLING_EPS)
            assert getattr(spec.params, key) == value, key


# ================================================================ writing


@dataclasses.dataclass
class Timing:
    seconds: float
    per_step: list


def test_results_round_trip_as_json_lines(tmp_path):
    path = tmp_path / "results.jsonl"
    results = [
        RequestResult(id=1, index=0, prompt="日本は", prompt_ids=[1, 5], output_ids=[7, 2], text="東京 🎉",
                      stop_reason="eos", stats={"steps": 2, "timing": Timing(0.5, [0.25, 0.25])}),
        {"id": "q2", "output_ids": np.array([3, 4]), "logprob": np.float32(-0.5), "hidden": torch.tensor([1, 2]),
         "model": Path("/ckpt"), "pairs": (1, 2)},
    ]
    assert write_results_jsonl(path, results) == 2
    raw = path.read_text(encoding="utf-8")
    assert "日本は" in raw and "🎉" in raw                       # non-ASCII text stays readable
    first, second = [json.loads(line) for line in raw.splitlines()]
    assert first == {"id": 1, "index": 0, "prompt": "日本は", "prompt_ids": [1, 5], "output_ids": [7, 2],
                     "text": "東京 🎉", "stop_reason": "eos",
                     "stats": {"steps": 2, "timing": {"seconds": 0.5, "per_step": [0.25, 0.25]}},
                     "logprobs": None, "prompt_logprobs": None, "cumulative_logprob": None}
    assert second == {"id": "q2", "output_ids": [3, 4], "logprob": -0.5, "hidden": [1, 2], "model": "/ckpt",
                      "pairs": [1, 2]}


def test_results_are_written_as_they_come(tmp_path):
    path = tmp_path / "results.jsonl"

    def finished():
        yield {"id": 1}
        assert path.read_text() == '{"id": 1}\n'                   # on disk before the next result exists
        yield {"id": 2}

    assert write_results_jsonl(path, finished()) == 2
    assert path.read_text().splitlines() == ['{"id": 1}', '{"id": 2}']


@pytest.mark.parametrize("results, error, message", [
    ([{"id": 1}, {"id": 2, "seconds": float("nan")}], ValueError, r"results\[1\] cannot be written as JSON"),
    ([{"id": 1, "x": object()}], TypeError, r"results\[0\] cannot be written as JSON: object .* not JSON serializable"),
    ([[1, 2]], TypeError, r"results\[0\] must be a dataclass instance or a mapping, got list"),
    ([RequestResult], TypeError, r"results\[0\] must be a dataclass instance or a mapping, got type"),
])
def test_unwritable_results(tmp_path, results, error, message):
    path = tmp_path / "results.jsonl"
    with pytest.raises(error, match=message):
        write_results_jsonl(path, results)
    if len(results) == 2:
        assert path.read_text() == '{"id": 1}\n'                   # the results before the bad one are kept
