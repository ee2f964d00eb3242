"""bench/serve.py: its workload generators and statistics, a replay against a stand-in OpenAI server, and an
end-to-end run against ``treedec serve`` with a tiny model on the CPU (slow)."""
import asyncio
import importlib.util
import json
import math

import numpy as np
import pytest

from bench.serve import headline, main, parse_args, server_args
from bench.serve_stats import Record, cache_reuse, itls, metric_changes, parse_metrics, percentiles, summarize
from bench.serve_workloads import (WORDS, Session, Turn, arrival_times, lognormal_lengths, multiturn, multiturn_ids,
                                   sharegpt, tot)


def words(text: str) -> int:
    return len(text.split())


# ---------------------------------------------------------------- workloads


def test_sharegpt_is_seeded_and_within_bounds():
    a = sharegpt(3, 200, input_median=100, output_median=50, sigma=1.0, context=512, max_output=64)
    assert a == sharegpt(3, 200, input_median=100, output_median=50, sigma=1.0, context=512, max_output=64)
    assert a != sharegpt(4, 200, input_median=100, output_median=50, sigma=1.0, context=512, max_output=64)
    assert len(a) == 200 and [s.index for s in a] == list(range(200)) and len({s.batch for s in a}) == 200
    prompt_words = [words(s.turns[0].text) for s in a]
    outputs = [s.turns[0].max_tokens for s in a]
    assert all(4 <= w <= 256 for w in prompt_words) and all(1 <= o <= 64 for o in outputs)
    assert max(prompt_words) == 256 and min(outputs) < max(outputs)   # the long tail is clipped, lengths vary
    assert 60 < np.median(prompt_words) < 160                          # around the median asked for
    assert all(not s.chat and len(s.turns) == 1 and set(s.turns[0].text.split()) <= set(WORDS) for s in a)


def test_lognormal_lengths_clip_and_refuse_bad_bounds():
    x = lognormal_lengths(np.random.default_rng(0), 1000, 10, 2.0, 3, 50)
    assert x.dtype.kind == "i" and x.min() == 3 and x.max() == 50
    assert lognormal_lengths(np.random.default_rng(0), 5, 7, 0.0, 1, 100).tolist() == [7] * 5   # no spread
    with pytest.raises(ValueError, match="low <= high"):
        lognormal_lengths(np.random.default_rng(0), 5, 7, 1.0, 9, 8)


def test_multiturn_history_grows_by_each_answer():
    [conv, other] = multiturn(0, 2, 4, user_median=10, output_median=8, system_words=6, context=256)
    assert conv == multiturn(0, 2, 4, user_median=10, output_median=8, system_words=6, context=256)[0]
    assert conv.chat and len(conv.turns) == 4 and conv.batch != other.batch and words(conv.system) == 6
    assert all(1 <= t.max_tokens <= (256 - 6) // 8 and 1 <= words(t.text) <= (256 - 6) // 8 for t in conv.turns)
    answers = ["first answer", "second answer", "third answer"]
    previous = None
    for turn in range(4):
        messages = conv.prompt(turn, answers[:turn])
        assert messages[0] == {"role": "system", "content": conv.system}
        assert messages[-1] == {"role": "user", "content": conv.turns[turn].text}
        assert len(messages) == 2 + 2 * turn
        if previous is not None:   # the last turn's messages, then its answer, then the new user message
            assert messages[:-2] == previous and messages[-2] == {"role": "assistant", "content": answers[turn - 1]}
        previous = messages
    with pytest.raises(ValueError, match="answers"):
        conv.prompt(2, ["only one"])


def test_multiturn_ids_resends_the_exact_ids_of_the_conversation():
    [conv, _] = multiturn_ids(0, 2, 3, user_median=10, output_median=8, system_tokens=6, context=256, max_token_id=300)
    assert conv.token_ids and not conv.chat and len(conv.system_ids) == 6
    assert all(10 <= t < 300 for turn in conv.turns for t in turn.ids) and all(turn.ids for turn in conv.turns)
    answers = [[1, 2, 3], [4, 5]]
    ids = conv.prompt(2, answers)
    assert ids == (list(conv.system_ids) + list(conv.turns[0].ids) + answers[0] + list(conv.turns[1].ids) + answers[1]
                   + list(conv.turns[2].ids))
    assert conv.prompt(1, answers[:1])[:len(conv.prompt(0, []))] == conv.prompt(0, [])


def test_tot_branches_share_the_problem_and_arrive_together():
    sessions = tot(1, problems=2, branches=3, problem_words=40, branch_words=5, output_tokens=7, context=1000)
    assert len(sessions) == 6 and [s.batch for s in sessions] == [0, 0, 0, 1, 1, 1]
    texts = [s.turns[0].text for s in sessions]
    statements = [t.split("\nBranch")[0] for t in texts]
    assert statements[0] == statements[1] == statements[2] != statements[3] == statements[5]
    assert words(statements[0]) == 40 and len(set(texts)) == 6
    assert all(f"\nBranch {i % 3 + 1}: " in t for i, t in enumerate(texts))
    assert all(s.turns[0].max_tokens == 7 and s.prompt(0, []) == s.turns[0].text for s in sessions)
    assert words(tot(1, 1, 1, problem_words=5000, context=1000)[0].turns[0].text.split("\nBranch")[0]) == 500


def test_arrival_times_are_poisson_or_all_at_once():
    assert arrival_times(0, 4, math.inf).tolist() == [0, 0, 0, 0]
    t = arrival_times(0, 20000, 10.0)
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    assert np.mean(np.diff(t)) == pytest.approx(0.1, rel=0.03)    # exponential gaps of mean 1 / rate
    assert arrival_times(0, 5, 2.0).tolist() == arrival_times(0, 5, 2.0).tolist()
    with pytest.raises(ValueError, match="rate"):
        arrival_times(0, 3, 0.0)


# ---------------------------------------------------------------- statistics


def record(workload="w", turn=0, arrivals=(), end=1.0, prompt=10, completion=5, cached=None, error=None):
    return Record(workload, 0, turn, 0.0, list(arrivals), end, prompt, completion, cached, "length", "", error)


def test_percentiles_interpolate_between_order_statistics():
    p = percentiles(range(1, 101))
    assert p["n"] == 100 and p["mean"] == 50.5 and p["max"] == 100
    assert p["p50"] == pytest.approx(50.5) and p["p90"] == pytest.approx(90.1) and p["p99"] == pytest.approx(99.01)
    assert percentiles([2.0], scale=1e3) == {"n": 1, "mean": 2000.0, "p50": 2000.0, "p90": 2000.0, "p99": 2000.0,
                                             "max": 2000.0}
    assert percentiles([]) is None


def test_itl_ttft_and_tpot_from_arrival_times():
    assert itls([0.5, 0.6, 0.8, 1.1]) == pytest.approx([0.1, 0.2, 0.3])
    assert itls([0.5]) == [] and itls([]) == []
    r = record(arrivals=[0.5, 0.6, 0.8, 1.1], end=1.1, completion=4)
    assert r.ttft == 0.5 and r.tpot == pytest.approx(0.2)   # (1.1 - 0.5) / 3
    assert record(arrivals=[], completion=0).ttft is None and record(arrivals=[0.1], completion=1).tpot is None
    j = r.to_json()
    assert j["ttft_ms"] == 500.0 and j["itl_ms"] == [100.0, 200.0, 300.0] and j["chunks"] == 4 and "text" not in j


def test_summarize_counts_errors_and_cache_reuse():
    records = [record(turn=0, arrivals=[0.1, 0.2], end=0.2, prompt=100, completion=2, cached=0),
               record(turn=1, arrivals=[0.1, 0.3], end=0.3, prompt=200, completion=2, cached=190),
               record(turn=2, arrivals=[0.2, 0.4], end=0.4, prompt=300, completion=2, cached=280),
               record(turn=1, error="APIError: boom", prompt=None, completion=None),
               record(turn=1, error="APIError: boom", prompt=None, completion=None)]
    s = summarize(records, seconds=2.0)
    assert (s["requests"], s["succeeded"], s["failed"]) == (5, 3, 2) and s["errors"] == {"APIError: boom": 2}
    assert s["requests_per_s"] == 1.5 and s["output_tokens"] == 6 and s["output_tokens_per_s"] == 3.0
    assert s["ttft_ms"]["n"] == 3 and s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["itl_ms"]["n"] == 3 and s["itl_ms"]["mean"] == pytest.approx(500 / 3)
    assert s["cache"] == {"prompt_tokens": 600, "cached_tokens": 470, "reuse": pytest.approx(470 / 600),
                          "unreported": 0}
    assert s["cache_after_first_turn"]["reuse"] == pytest.approx(470 / 500)
    assert "cache_after_first_turn" not in summarize(records[:1], 1.0)
    assert "cache_of_history" not in s   # (text conversations: the new message's tokens are not known)
    for r, new in zip(records[1:3], (20, 10)):
        r.new_tokens = new
    assert summarize(records, 2.0)["cache_of_history"] == {"history_tokens": 180 + 290, "cached_tokens": 470,
                                                          "reuse": 1.0}
    unreported = cache_reuse([record(cached=None), record(prompt=20, cached=5)])
    assert unreported == {"prompt_tokens": 20, "cached_tokens": 5, "reuse": 0.25, "unreported": 1}


METRICS_BEFORE = """# HELP treedec_prompt_tokens Prompt tokens.
# TYPE treedec_prompt_tokens counter
treedec_prompt_tokens_total 100.0
treedec_prompt_tokens_created 1.7e9
# TYPE treedec_cached_prompt_tokens counter
treedec_cached_prompt_tokens_total 10.0
# TYPE treedec_cache_hit_rate gauge
treedec_cache_hit_rate 0.1
# TYPE treedec_engine_step_seconds histogram
treedec_engine_step_seconds_bucket{le="0.01"} 1.0
treedec_engine_step_seconds_bucket{le="+Inf"} 2.0
treedec_engine_step_seconds_count 2.0
treedec_engine_step_seconds_sum 0.03
# TYPE treedec_spec_verify_steps counter
treedec_spec_verify_steps_total 0.0
# TYPE treedec_spec_accepted_tokens counter
treedec_spec_accepted_tokens_total 0.0
# TYPE treedec_spec_acceptance_length histogram
treedec_spec_acceptance_length_count 0.0
treedec_spec_acceptance_length_sum 0.0
# TYPE python_gc_objects_collected counter
python_gc_objects_collected_total{generation="0"} 5.0
"""


def test_metrics_parse_and_change():
    before = parse_metrics(METRICS_BEFORE)
    assert before["treedec_prompt_tokens_total"] == 100 and before["treedec_engine_step_seconds_bucket{le=0.01}"] == 1
    assert not any(k.startswith("python_") or k.endswith("_created") for k in before)
    after = parse_metrics(METRICS_BEFORE.replace("prompt_tokens_total 100.0", "prompt_tokens_total 500.0")
                          .replace("tokens_total 10.0", "tokens_total 370.0").replace("hit_rate 0.1", "hit_rate 0.8")
                          .replace("seconds_count 2.0", "seconds_count 12.0").replace("sum 0.03", "sum 0.23")
                          .replace("steps_total 0.0", "steps_total 8.0").replace("accepted_tokens_total 0.0",
                                                                                 "accepted_tokens_total 12.0")
                          .replace("length_count 0.0", "length_count 4.0").replace("length_sum 0.0", "length_sum 10.0"))
    changes = metric_changes(before, after)
    assert changes["delta"]["treedec_prompt_tokens_total"] == 400
    assert "treedec_engine_step_seconds_sum" in changes["delta"] and "treedec_cache_hit_rate" in changes["after"]
    assert changes["means"]["treedec_engine_step_seconds"] == pytest.approx(0.02)
    assert changes["means"]["treedec_spec_acceptance_length"] == pytest.approx(2.5)
    assert headline(changes) == {"cache_hit_rate": pytest.approx(0.9), "engine_cache_hit_rate": 0.8,
                                 "step_ms": pytest.approx(20.0), "accepted_per_step": 1.5, "acceptance_length": 2.5}
    assert headline(metric_changes(before, before)) == {"engine_cache_hit_rate": 0.1}   # nothing moved


def test_arguments_make_the_server_command():
    args = parse_args(["--config", "llama3-8b", "--tokenizer", "smollm2", "--server-args", "--kv-tokens 4096",
                       "--drafter", "/d", "--compare-speculative", "eagle3"])
    assert server_args(args, None) == ["--config", "llama3-8b", "--seed", "0", "--tokenizer", "smollm2",
                                       "--kv-tokens", "4096"]
    assert server_args(args, "eagle3")[-6:] == ["--speculative", "eagle3", "--drafter", "/d", "--kv-tokens", "4096"]
    with pytest.raises(SystemExit):
        parse_args(["--url", "http://x", "--speculative", "ngram"])
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--workloads", "sharegpt,chat"])


# ---------------------------------------------------------------- replay against a stand-in server


def test_replay_sends_conversations_in_order_and_records_errors():
    """The client against an in-process stand-in of the OpenAI API (httpx's ASGI transport, no sockets): every
    turn re-sends the answers the stand-in gave, its usage is read, and a failing request is recorded."""
    pytest.importorskip("fastapi")
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from openai import AsyncOpenAI

    from bench.serve_client import replay

    app, seen = FastAPI(), []

    def sse(chunks):
        async def body():
            for c in chunks:
                yield f"data: {json.dumps(c)}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.append(body)
        if "fail" in body["messages"][-1]["content"]:
            return JSONResponse({"error": {"message": "bad", "type": "invalid_request_error"}}, status_code=400)
        n = len(body["messages"])
        base = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        pieces = [f"answer{n} ", "done"]
        return sse([{**base, "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]}
                    for p in pieces] +
                   [{**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
                    {**base, "choices": [], "usage": {"prompt_tokens": 10 * n, "completion_tokens": 2,
                                                      "total_tokens": 10 * n + 2,
                                                      "prompt_tokens_details": {"cached_tokens": 10 * n - 5}}}])

    sessions = [Session("multiturn", 0, 0, (Turn("hi", 2), Turn("more", 2), Turn("end", 2)), chat=True, system="s"),
                Session("multiturn", 1, 1, (Turn("fail now", 2), Turn("never", 2)), chat=True)]

    async def go():
        client = AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0,
                             http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)))
        return await replay(client, "m", sessions, math.inf, 4, 0, {"temperature": 0.0})

    records, seconds = asyncio.run(go())
    assert seconds > 0 and len(records) == 4 and len(seen) == 4   # the failed conversation stops at its turn
    failed = [r for r in records if r.error]
    assert len(failed) == 1 and failed[0].session == 1 and "400" in failed[0].error
    turns = sorted((r for r in records if not r.error), key=lambda r: r.turn)
    assert [r.turn for r in turns] == [0, 1, 2] and [r.prompt_tokens for r in turns] == [20, 40, 60]
    assert [r.cached_tokens for r in turns] == [15, 35, 55] and all(len(r.arrivals) == 2 for r in turns)
    assert turns[0].text == "answer2 done" and turns[0].finish_reason == "length"
    third = [b for b in seen if b["messages"][-1]["content"] == "end"][0]["messages"]
    assert [m["content"] for m in third if m["role"] == "assistant"] == ["answer2 done", "answer4 done"]
    assert seen[0]["stream"] and seen[0]["stream_options"] == {"include_usage": True}


# ---------------------------------------------------------------- end to end, the real server


def tiny_checkpoint(folder):
    from tests.models.test_llama import tiny_hf
    from tests.tokenizers_local import build_tokenizer
    tiny_hf("llama", seed=4, vocab_size=400).save_pretrained(folder)   # (the tokenizer's 400 tokens)
    build_tokenizer(folder)
    return folder


@pytest.mark.slow   # (a python -m treedec start, or a model load: > 5 s on this machine)
def test_a_server_that_exits_is_reported_with_its_log(tmp_path):
    from bench.serve_client import ServerProcess
    log = tmp_path / "server.log"
    with pytest.raises(RuntimeError, match="exited with status") as e:
        with ServerProcess(["--no-such-option-here"], log, startup_timeout=120):
            pass
    assert "--no-such-option-here" in str(e.value) and "--no-such-option-here" in log.read_text()


@pytest.mark.slow
def test_llm_generate_is_timed_per_engine_step(tmp_path):
    """--single-stream's in-process yardstick on a tiny checkpoint: the engine's steps stamped, restored after."""
    from bench.serve_single import single_session, time_llm_generate
    prompt = single_session(0, 6, 5).turns[0].text
    timed = time_llm_generate({"model": str(tiny_checkpoint(tmp_path / "ckpt")), "device": "cpu"}, prompt, 5,
                              rounds=2, ignore_eos=True, speculative=None, drafter=None)
    assert len(timed["rounds"]) == 2 and timed["tokens"] == 5 and timed["step_ms"] > 0
    for r in timed["rounds"]:
        assert r["tokens"] == 5 and r["engine_steps"] >= 5 and r["step_intervals_ms"]["n"] == r["engine_steps"] - 1
        assert r["ms_per_token"] == pytest.approx(r["step_ms"] * r["steps"] / 5)


@pytest.mark.slow
def test_serve_bench_end_to_end_on_a_tiny_model(tmp_path, capsys):
    """bench/serve.py --smoke starts ``treedec serve`` on a tiny checkpoint and runs every workload, then
    --single-stream against LLM.generate."""
    if importlib.util.find_spec("treedec.serve") is None:
        pytest.skip("treedec serve is not in this tree (the serve branch)")
    model = str(tiny_checkpoint(tmp_path / "ckpt"))
    out = tmp_path / "results"
    assert main(["--model", model, "--device", "cpu", "--smoke", "--out", str(out)]) == 0
    [path] = out.glob("*-serve-smoke.json")
    results = json.loads(path.read_text())
    assert path.with_suffix(".png").exists()
    assert [s["exit_status"] is not None for s in results["servers"]] == [True]
    runs = {r["workload"]: r for r in results["runs"]}
    assert set(runs) == {"sharegpt", "multiturn", "multiturn-ids", "tot"}
    expected = {"sharegpt": 4, "multiturn": 2 * 3, "multiturn-ids": 2 * 3, "tot": 3}
    for name, run in runs.items():
        s = run["summary"]
        assert s["requests"] == expected[name] and s["failed"] == 0 and s["not_sent"] == 0, (name, s["errors"])
        assert s["output_tokens"] > 0 and s["requests_per_s"] > 0 and s["ttft_ms"]["p50"] > 0, name
        assert s["e2e_ms"]["p99"] >= s["e2e_ms"]["p50"] and s["itl_ms"]["n"] > 0, name
        assert len(run["requests"]) == expected[name] and run["metrics"] is not None, name
        assert s["cache"]["unreported"] == 0 and 0 <= s["cache"]["reuse"] <= 1, name
    after = runs["multiturn"]["summary"]["cache_after_first_turn"]
    assert after["prompt_tokens"] > 0 and 0 <= after["reuse"] <= 1
    exact = runs["multiturn-ids"]["summary"]["cache_after_first_turn"]   # every turn but the first reads the cache
    assert exact["prompt_tokens"] > 0 and exact["reuse"] > 0.5, exact
    text = capsys.readouterr().out
    assert text.rstrip().splitlines()[-1].startswith("| - | tot |")   # the table comes last

    assert main(["--model", model, "--device", "cpu", "--smoke", "--single-stream", "--out", str(out),
                 "--tag", "single"]) == 0
    [path] = out.glob("*-serve-smoke-single.json")
    [entry] = json.loads(path.read_text())["single_stream"]
    assert entry["server"]["failed"] == 0 and len(entry["server"]["rounds"]) == 2
    assert entry["server"]["itl_p50_ms"] > 0 and entry["llm_generate"]["step_ms"] > 0
    assert entry["llm_generate"]["tokens"] == 6 and entry["itl_ratio"] > 0
