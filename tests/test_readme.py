"""Every code block of README.md runs here, so that none of them can rot.

Each Python block runs on its own, as a reader pastes it: in a fresh process (or namespace), on the CPU, the
real model SmolLM2 where a block names it (skipped, with the reason, where its checkpoint cannot be had). The two
install commands are the ones `.ci/run` runs (installing is CI's part); the main job the first ends with runs here on the
real model (skipped, with the reason, where its checkpoint cannot be had), and must print what
the README says it prints (the tokens, steps and text; not the times); the replay command runs
here too.
"""
from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engines import smollm2_or_skip

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"


def readme_blocks(language: str) -> list[str]:
    """The README's fenced code blocks of ``language``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def real_model_blocks() -> list[str]:
    """The Python blocks that run the real model (``LLM("smollm2")``): run by their own test."""
    return [block for block in readme_blocks("python") if 'LLM("smollm2"' in block]


SERVER_URL = "http://127.0.0.1:8000/v1"


def client_blocks() -> list[str]:
    """The Python blocks that talk to a running ``treedec serve`` (the openai client at :data:`SERVER_URL`): run by
    their own test, against a server it starts."""
    return [block for block in readme_blocks("python") if SERVER_URL in block]


def test_readme_has_the_blocks_this_test_knows():
    assert len(readme_blocks("python")) == 8 and len(real_model_blocks()) == 1 and len(client_blocks()) == 1
    assert len(readme_blocks("bash")) == 5
    assert len(readme_blocks("text")) >= 1
    for block in own_process_blocks():   # each checked by its test below
        assert sum(marker in block for marker in BLOCK_CHECKS) == 1, block[:300]
    assert not any("/models/" in block for block in readme_blocks("python")), "a placeholder path: it cannot run"


@pytest.mark.slow
def test_the_llm_block_runs_on_the_real_model(capsys):
    """The front-door block: SmolLM2 through LLM / SamplingParams / speculative_config / beam_search (its assert:
    speculative greedy == plain greedy); skipped where the checkpoint cannot be had."""
    smollm2_or_skip()
    [block] = real_model_blocks()
    namespace: dict = {"__name__": "readme"}
    exec(compile(block, "README.md's LLM block", "exec"), namespace)
    answer = namespace["answer"].outputs[0]
    assert "Paris" in answer.text and answer.finish_reason in ("stop", "length") and len(answer.logprobs[0]) >= 2
    assert len(namespace["samples"]) == 2 and len(namespace["samples"][0].outputs) == 2
    beams = namespace["beams"].sequences
    assert len(beams) == 3 and all(seq.text.startswith("The capital of France is") for seq in beams)
    assert "Paris" in capsys.readouterr().out


#: Each Python block run in a process of its own, by a line it holds -> the checks of what it made (run after it).
BLOCK_CHECKS = {
    "out = attn.run(": "assert out.shape == (4, 32, 128) and torch.isfinite(out).all()",
    "logits = engine.step().logits": "assert logits.shape == (4, model.config.vocab_size)",
    "vote = self_consistency(": """
assert 1 <= len(tokens) <= 32 and stats.steps >= 1
assert 1 <= len(eagle_tokens) <= 8 and eagle_stats.steps >= 1 and 1 <= len(chain_tokens) <= 8
assert run is not None and len(best.sequences) == 4 and len(vote.answers) == 8""",
    "generate_batch(engine, requests)": "assert len(results) == 16 and batch_stats.steps >= 15",
    "batch_invariant=True, kv_tokens": "assert llm.engine.batch_invariance.kernel == 'rows'",
    "run_programs(engine, beams)": """
assert len(first.sequences) == 3 and len(others) == 3
assert max(run_stats.programs_per_step) == 4   # the four searches share their steps""",
}


def own_process_blocks() -> list[str]:
    """The Python blocks :func:`test_each_python_block_runs_on_its_own` runs (not the real-model LLM block, nor the
    client's, which have tests of their own)."""
    return [b for b in readme_blocks("python") if b not in real_model_blocks() + client_blocks()]


def _block_id(block: str) -> str:
    return next((marker.split("(")[0].split(" = ")[-1] for marker in BLOCK_CHECKS if marker in block), "unknown")


@pytest.mark.slow
@pytest.mark.parametrize("block", own_process_blocks(), ids=_block_id)
def test_each_python_block_runs_on_its_own(block, tmp_path):
    """Each block runs as a reader would paste it: alone, in a fresh Python process (was: in order in one
    namespace, so a block using an earlier one's engine or prompt, or a placeholder path, passed here and failed
    when pasted). The blocks on SmolLM2 are skipped where it cannot be had."""
    if "smollm2" in block:
        smollm2_or_skip()
    [check] = [check for marker, check in BLOCK_CHECKS.items() if marker in block]
    proc = subprocess.run([sys.executable, "-c", block + "\n" + check], capture_output=True, text=True, cwd=tmp_path,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _commands(block: str) -> list[str]:
    return [c.strip() for c in block.strip().split("&&")]


def test_install_commands_are_what_ci_runs():
    main_job, tests = (_commands(b) for b in readme_blocks("bash")[:2])
    ci = (REPO / ".ci" / "run").read_text()
    for command in tests:
        if not command.startswith((". ", "python3 -m venv")):  # CI makes its own virtual environment
            assert command in ci, f"README test command part {command!r} is not in .ci/run"
    assert main_job[:3] == tests[:3], "both commands start the same way (fresh venv, the same torch)"


def _main_job() -> tuple[dict[str, str], list[str]]:
    """The main job's environment assignments and its argv (``treedec ...``)."""
    words = shlex.split(_commands(readme_blocks("bash")[0])[-1])
    env = {}
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def _deterministic(printed: str) -> list[str]:
    """The lines of ``treedec spec --check``'s output that do not depend on time: the table's tokens, steps
    and tokens/step columns, the check, and the text."""
    lines = printed.strip().splitlines()
    table = [line.rsplit(None, 1)[0] for line in lines if line.startswith(("method", "speculative", "plain greedy"))]
    checks = [line for line in lines if line.startswith(("check:", "accepted length histogram", "eos:"))]
    return table + checks + lines[lines.index("text:"):]


def test_main_job_is_speculative_decoding_on_the_real_model():
    env, argv = _main_job()
    assert argv[:4] == ["treedec", "spec", "--model", "smollm2"] and "--check" in argv
    assert "pip install -e '.[gguf]'" in readme_blocks("bash")[0], "the main job needs the gguf extra"
    assert set(env) <= {"OMP_NUM_THREADS"}


@pytest.mark.slow
def test_main_job_runs_on_the_real_model_and_prints_what_the_readme_says(tmp_path):
    """The README's main command (the model cached, as on its second run): exit 0, the tokens equal plain greedy
    decoding's, and the README's expected output, times aside. It must run in well under a minute (~35 s on a
    2-core CPU); the time is not asserted (a loaded machine is slower), the run's own is printed."""
    smollm2_or_skip()
    env, argv = _main_job()
    result = subprocess.run([sys.executable, "-m", "treedec", *argv[1:], "--no-progress"], capture_output=True,
                            text=True, cwd=tmp_path, timeout=600, env={**os.environ, **env})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "check: equal to plain greedy decoding" in result.stdout
    [expected] = [b for b in readme_blocks("text") if b.startswith("spec: smollm2")]
    assert _deterministic(result.stdout) == _deterministic(expected), result.stdout


@pytest.mark.slow
def test_medusa_training_block_trains_heads_and_decodes_with_them(tmp_path):
    """The train-drafter block (minutes on a 2-core CPU): Medusa heads trained for SmolLM2 on 64 shipped prompts,
    saved in Medusa's layout, then treedec spec with them prints tokens a step and the speedup against plain
    greedy decoding in the same run, its tokens equal to plain greedy decoding's."""
    smollm2_or_skip()
    [block] = [b for b in readme_blocks("bash") if "treedec train-drafter" in b]
    outputs = []
    for command in _commands(block):
        words = shlex.split(command)
        env = {}
        while "=" in words[0]:
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        assert words[0] == "treedec", command
        result = subprocess.run([sys.executable, "-m", "treedec", *words[1:]], capture_output=True, text=True,
                                cwd=tmp_path, timeout=3600, env={**os.environ, **env})
        assert result.returncode == 0, result.stderr[-3000:]
        outputs.append(result.stdout)
    assert (tmp_path / "medusa-smollm2" / "medusa_lm_head.safetensors").is_file()
    assert (tmp_path / "medusa-smollm2" / "loss.png").is_file()
    spec = outputs[-1]
    assert "check: equal to plain greedy decoding" in spec and "draft: Medusa heads from medusa-smollm2" in spec
    assert re.search(r"tokens/step \(accepted", spec) and re.search(r"^speedup: [0-9.]+x", spec, flags=re.M), spec


@pytest.mark.slow
def test_replay_command_runs(tmp_path):
    [replay] = [b.strip() for b in readme_blocks("bash") if b.strip().startswith("treedec replay")]
    argv = shlex.split(replay)
    result = subprocess.run([sys.executable, "-m", "treedec", *argv[1:], "--out", str(tmp_path / "replay.json")],
                            capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "flatten" in result.stdout and (tmp_path / "replay.json").is_file()


def _table_modules() -> set[str]:
    """The modules the README's "What is here" table names (its second column)."""
    text = (REPO / "README.md").read_text()
    table = text[text.index("## What is here"):]
    table = table[:table.index("\n\n", table.index("| layer |"))]
    names = set()
    for row in table.splitlines()[2:]:
        names.update(re.findall(r"`(treedec(?:\.\w+)*)`", row.split("|")[2]))
    return names


def test_module_table_matches_the_tree():
    """Every package of treedec has a row (a class row counts for its package), and every module named imports."""
    named = _table_modules()
    covered = {".".join(n.split(".")[:k]) for n in named for k in range(1, len(n.split(".")) + 1)}
    package = REPO / "treedec"
    packages = {"treedec." + str(p.parent.relative_to(package)).replace("/", ".")
                for p in package.rglob("*.py") if p.parent != package and "__pycache__" not in p.parts}
    missing = sorted(p for p in packages if p not in covered)
    assert not missing, f"README's module table has no row for {missing}"
    for name in named:
        module, _, attr = name.rpartition(".")
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            assert hasattr(importlib.import_module(module), attr), f"README names {name}, which does not exist"


def test_serve_command_parses():
    """The README's serve command is a valid ``treedec serve`` command line (running it is the next test's)."""
    from treedec.cli import build_parser
    [block] = [b.strip() for b in readme_blocks("bash") if b.strip().startswith("treedec serve")]
    argv = shlex.split(block.split("#")[0])
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve" and args.model == "smollm2" and f"http://{args.host}:{args.port}/v1" == SERVER_URL
    assert args.api_key and f'api_key="{args.api_key}"' in client_blocks()[0]   # (the client sends the server's key)


def serve_command_key() -> str:
    """The ``--api-key`` of the README's serve command."""
    from treedec.cli import build_parser
    [block] = [b.strip() for b in readme_blocks("bash") if b.strip().startswith("treedec serve")]
    return build_parser().parse_args(shlex.split(block.split("#")[0])[1:]).api_key


def test_client_block_runs_against_a_server(tmp_path, capsys):
    """The openai-client block, against ``treedec serve``'s app serving the tiny random Llama (with a small local
    tokenizer) as "smollm2" on a free port: its reply and its stream print."""
    from tests.serve.server import RunningServer
    from tests.tokenizers_local import build_tokenizer
    from tests.engines import tiny_model
    from treedec import LLM
    from treedec.models.text import load_tokenizer

    llm = LLM(tiny_model(), load_tokenizer(build_tokenizer(tmp_path / "tok")), kv_tokens=2048, page_size=4,
              backend="torch")
    server = RunningServer(llm, "smollm2", api_key=serve_command_key())
    try:
        [block] = client_blocks()
        namespace: dict = {"__name__": "readme"}
        exec(compile(block.replace(SERVER_URL, server.base_url), "README.md's client block", "exec"), namespace)
        reply = namespace["reply"]
        assert reply.model == "smollm2" and reply.choices[0].message.role == "assistant"
        assert str(reply.usage.completion_tokens) in capsys.readouterr().out
        assert namespace["place"].choices[0].message.content.startswith("{")   # (a random model: JSON begun, at least)
        assert namespace["yes_no"].choices[0].text in (" yes", " no")
    finally:
        server.stop()
