"""`treedec serve`'s command line: its help, arguments refused before any model loads, its default Host names, and
a real server process ended by a signal."""
import importlib.util
import json
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from treedec.cli import main


def test_help_names_the_options(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--model", "--config", "--tokenizer", "--page-size", "--host", "--port", "--served-model-name",
                   "--kv-tokens", "--speculative", "--drafter", "--num-speculative-tokens", "--max-queued-requests",
                   "--chat-template"):
        assert option in out


@pytest.mark.parametrize("argv, message", [
    (["serve"], "--model"),
    (["serve", "--config", "tiny"], "--tokenizer"),
    (["serve", "--config", "llama9"], "--config"),
    (["serve", "--model", "smollm2", "--speculative", "ngram", "--drafter", "x"], "--drafter"),
    (["serve", "--model", "smollm2", "--max-queued-requests", "-1"], "--max-queued-requests"),
    (["serve", "--model", "smollm2", "--speculative", "lookahead"], "--speculative"),
])
def test_bad_arguments_are_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_a_missing_fastapi_names_the_extra(capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    assert main(["serve", "--model", "smollm2"]) == 2
    assert "pip install 'treedec[serve]'" in capsys.readouterr().err


def test_the_new_limits_are_options(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for option in ("--max-n", "--max-prompts", "--max-body-bytes", "--read-timeout", "--engine-iteration-timeout",
                   "--chat-template-timeout", "--allowed-hosts", "--enable-docs", "--api-key", "--secure-metrics",
                   "--max-model-len", "--gpu-memory-utilization", "--tensor-parallel-size"):
        assert option in out, option


@pytest.mark.parametrize("host, allowed", [
    ("127.0.0.1", ["localhost", "127.0.0.1", "[::1]"]),
    ("localhost", ["localhost", "127.0.0.1", "[::1]"]),
    ("::1", ["localhost", "127.0.0.1", "[::1]"]),
    ("127.0.0.2", ["localhost", "127.0.0.1", "[::1]", "127.0.0.2"]),
    ("0.0.0.0", None), ("10.1.2.3", None), ("myhost.example", None)])
def test_a_loopback_server_answers_only_loopback_names_by_default(host, allowed):
    from treedec.commands.serve import default_allowed_hosts
    assert default_allowed_hosts(host) == allowed


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_the_first_signal_ends_live_streams_and_the_server_in_seconds(tmp_path, sig):
    """#48 item 10: `treedec serve` (a real process) with 10 live streams: the first Ctrl-C / SIGTERM aborts them (each
    ends with an error event and [DONE]) and the process exits within seconds, exit code 0, without "interrupted"."""
    from tests.tokenizers_local import build_tokenizer
    folder = build_tokenizer(tmp_path / "tok")
    log = open(tmp_path / "log", "w+")
    process = subprocess.Popen([sys.executable, "-m", "treedec", "serve", "--config", "tiny", "--tokenizer",
                                str(folder), "--port", "0", "--kv-tokens", "8192", "--page-size", "4"],
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline, port = time.monotonic() + 120, None
        while port is None:
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()
            found = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", (tmp_path / "log").read_text())
            port = found and int(found.group(1))
            time.sleep(0.1)
        ends, ended, first = [None] * 10, [None] * 10, [threading.Event() for _ in range(10)]

        def stream(k):
            body = {"model": "tiny", "prompt": f"The quick brown fox {k}", "max_tokens": 4000, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            lines = []
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        first[k].set()
            ends[k], ended[k] = lines[-2:], time.monotonic()

        threads = [threading.Thread(target=stream, args=(k,), daemon=True) for k in range(10)]
        for thread in threads:
            thread.start()
        assert all(event.wait(60) for event in first)
        started = time.monotonic()
        process.send_signal(sig)
        finished = None
        while process.poll() is None and time.monotonic() < started + 60:
            if finished is None and "Finished server process" in (tmp_path / "log").read_text():
                finished = time.monotonic() - started
            time.sleep(0.02)
        for thread in threads:
            thread.join(10)
        output = (tmp_path / "log").read_text()
        assert process.returncode == 0 and "interrupted" not in output, output[-2000:]
        # The streams end at once and the server is done within seconds; the interpreter's own teardown after it
        # (a process that loaded torch and transformers) takes about 5 s more on a loaded 2-core machine.
        assert max(ended) - started < 3 and finished is not None and finished < 5, (max(ended) - started, finished)
        for end in ends:   # every stream ended: the abort's error event, then [DONE]
            assert end is not None and end[-1] == "[DONE]" and json.loads(end[0])["error"]["code"] == \
                "server_shutdown", end
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


@pytest.mark.parametrize("argv, message", [
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: must be a number in (0, 1], got '1.5'"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization: must be a number in (0, 1]"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
    (["--secure-metrics"], "--secure-metrics puts /health and /metrics behind the API key: give --api-key"),
    (["--api-key", "two words"], "--api-key (or TREEDEC_API_KEY): api_key must not hold whitespace"),
    (["--max-core-restarts", "-1"], "--max-core-restarts: must be an int >= 0, got -1"),
    (["--max-core-restarts", "1", "--no-engine-process"], "--max-core-restarts starts the engine core's own process "
                                                           "again: it needs --engine-process"),
])
def test_bad_serving_sizes_and_keys_are_one_line_before_any_model_loads(capsys, monkeypatch, argv, message):
    monkeypatch.delenv("TREEDEC_API_KEY", raising=False)
    assert main(["serve", "--model", "smollm2", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1 and "two words" not in err


class _Recorded:
    """``build_app`` and ``make_server`` of ``treedec serve`` recorded: the server returns at once."""

    def __init__(self, monkeypatch):
        import treedec.serve
        import treedec.serve.http
        self.kwargs = None
        real = treedec.serve.build_app

        def build_app(llm, name, **kwargs):
            self.llm, self.kwargs = llm, kwargs
            return real(llm, name, **kwargs)

        class Server:
            def run(self):
                pass

        monkeypatch.setattr(treedec.serve, "build_app", build_app)
        monkeypatch.setattr(treedec.serve.http, "make_server", lambda app, host, port: Server())


def tiny_serve(tmp_path, *argv):
    """``treedec serve`` of the tiny model, its engine core in this process (the recorded app gets its LLM)."""
    from tests.tokenizers_local import build_tokenizer
    return main(["serve", "--config", "tiny", "--tokenizer", str(build_tokenizer(tmp_path / "tok")), "--kv-tokens",
                 "256", "--page-size", "4", "--no-engine-process", *argv])


def test_the_engine_core_runs_in_a_process_of_its_own_by_default_and_says_so(tmp_path, capsys, monkeypatch):
    from tests.tokenizers_local import build_tokenizer
    from treedec.core.process_client import ProcessClient
    monkeypatch.delenv("TREEDEC_API_KEY", raising=False)
    recorded = _Recorded(monkeypatch)
    assert main(["serve", "--config", "tiny", "--tokenizer", str(build_tokenizer(tmp_path / "tok")), "--kv-tokens",
                 "256", "--page-size", "4", "--max-model-len", "512", "--max-core-restarts", "2"]) == 0
    err = capsys.readouterr().err
    assert isinstance(recorded.llm, ProcessClient) and recorded.llm.ready.max_model_len == 512
    assert recorded.llm.max_restarts == 2
    assert f"engine core: process {recorded.llm.pid}" in err and "max_model_len 512" in err and "256 KV tokens" in err
    assert not recorded.llm.process_handle.is_alive()   # (stopped with the command)
    assert tiny_serve(tmp_path) == 0 and "engine core: in-process" in capsys.readouterr().err


def test_a_core_that_cannot_start_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TREEDEC_API_KEY", raising=False)
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    started = time.monotonic()
    assert main(["serve", "--config", "tiny", "--tokenizer", str(empty), "--kv-tokens", "256"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("treedec serve: error: ") and str(empty) in err and err.count("\n") == 1, err
    assert "has no tokenizer" in err and "unexpected" not in err, err
    assert "Traceback" not in err and time.monotonic() - started < 120


@pytest.mark.slow
def test_a_killed_engine_core_ends_the_server_with_exit_code_1(tmp_path):
    """A supervisor's case: `treedec serve` whose engine-core process is killed answers its streams 503
    engine_failed and exits 1 by itself."""
    import os

    from tests.tokenizers_local import build_tokenizer
    folder = build_tokenizer(tmp_path / "tok")
    log = open(tmp_path / "log", "w+")
    process = subprocess.Popen([sys.executable, "-m", "treedec", "serve", "--config", "tiny", "--tokenizer",
                                str(folder), "--port", "0", "--kv-tokens", "8192", "--page-size", "4"],
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline, port = time.monotonic() + 120, None
        while port is None:
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()
            text = (tmp_path / "log").read_text()
            found = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", text)
            port = found and int(found.group(1))
            time.sleep(0.1)
        core = int(re.search(r"engine core: process (\d+)", text).group(1))
        lines, first = [], threading.Event()

        def stream():
            body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4000, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        first.set()

        thread = threading.Thread(target=stream, daemon=True)
        thread.start()
        assert first.wait(60)
        os.kill(core, signal.SIGKILL)
        process.wait(60)
        thread.join(10)
        output = (tmp_path / "log").read_text()
        assert process.returncode == 1 and "the engine core is gone" in output, output[-2000:]
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "engine_failed", lines[-2:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


def test_the_api_key_and_the_sizes_reach_the_app_and_the_llm_and_the_key_is_never_printed(tmp_path, capsys,
                                                                                          monkeypatch):
    key = "sk-secret-7f3a"
    monkeypatch.setenv("TREEDEC_API_KEY", key)
    recorded = _Recorded(monkeypatch)
    assert tiny_serve(tmp_path, "--host", "0.0.0.0", "--max-model-len", "512", "--gpu-memory-utilization", "0.5",
                      "--secure-metrics") == 0
    err = capsys.readouterr().err
    assert recorded.kwargs["api_key"] == key and recorded.kwargs["secure_metrics"] is True
    assert recorded.llm.max_model_len == 512 and "max_model_len 512" in err and "API key required" in err
    assert key not in err and "warning" not in err
    monkeypatch.delenv("TREEDEC_API_KEY")
    assert tiny_serve(tmp_path, "--api-key", key) == 0
    assert recorded.kwargs["api_key"] == key and key not in capsys.readouterr().err


def test_a_server_on_a_non_loopback_address_without_a_key_warns_once(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TREEDEC_API_KEY", raising=False)
    recorded = _Recorded(monkeypatch)
    assert tiny_serve(tmp_path, "--host", "0.0.0.0") == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert recorded.kwargs["api_key"] is None and len(warnings) == 1
    assert "listening on 0.0.0.0 without an API key" in warnings[0] and "--api-key" in warnings[0]
    assert tiny_serve(tmp_path, "--host", "127.0.0.1") == 0
    assert "warning" not in capsys.readouterr().err


def test_a_tensor_parallel_size_the_server_cannot_run_is_one_line_before_the_model_loads(capsys, monkeypatch):
    monkeypatch.delenv("TREEDEC_API_KEY", raising=False)
    assert main(["serve", "--model", "smollm2", "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "--tensor-parallel-size 2: treedec serve runs one process" in err and "torchrun" in err, err
    assert "Traceback" not in err and err.count("\n") == 1
