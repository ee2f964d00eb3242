"""Bad inputs to the ``treedec`` commands, as an attacker or a careless user gives them (issue 34).

Each is refused with one line on stderr naming the argument, file, line or request (exit 2;
exit 1 only where the failure is a user's own task code), before anything is overwritten or a
model is loaded where it can be, and a batch that fails keeps every result it finished. Every
test here failed before the fix it guards, except where a comment says it passed already.
"""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.commands.test_cli import assert_one_line_error, results_file, run
from treedec.commands.tot_tasks import DEFAULT_TASK, load_task_class
from treedec.workloads import fewshot_schedule

BIG_KV = str(2**31 - 1)   # the largest --kv-tokens the parser takes: 4 TiB of the tiny model's KV pool


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a command gets as far as loading a model (its checks come first)."""
    for module in ("treedec.commands.args", "treedec.commands.generate", "treedec.commands.replay",
                   "treedec.commands.spec", "treedec.commands.tot"):
        monkeypatch.setattr(f"{module}.load_model", lambda args: pytest.fail("loaded a model"))


@pytest.fixture
def clean_import_path(tmp_path, monkeypatch):
    """Work in ``tmp_path``, with neither it nor '' (the current directory) on the import path, as the
    ``treedec`` script runs (``python -m pytest`` put the directory it started in there)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path), os.getcwd())])
    return tmp_path


def write_lines(path: Path, *records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# ================================================================ code from the current directory (item 1)


def test_the_default_task_imports_nothing_from_the_current_directory(clean_import_path, monkeypatch):
    """A ``fractions.py`` where ``treedec tot`` runs is not executed (was: the directory was put first
    on the import path, and the Game of 24's module imports fractions)."""
    import treedec.programs.tot

    marker = clean_import_path / "MARKER"
    (clean_import_path / "fractions.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    # import the default task's module afresh, as a first import would, and put everything back after
    monkeypatch.setattr(treedec.programs.tot, "game24", treedec.programs.tot.game24)
    monkeypatch.delitem(sys.modules, "treedec.programs.tot.game24")
    monkeypatch.delitem(sys.modules, "fractions")
    path = list(sys.path)
    cls = load_task_class(DEFAULT_TASK)
    assert cls.__name__ == "Game24Task" and not marker.exists() and sys.path == path


def test_a_user_task_module_cannot_stand_in_for_an_installed_one(clean_import_path, monkeypatch):
    """``--task mine:Task`` finds mine.py in the current directory, but a ``tabnanny.py`` beside it is not
    imported in place of the standard library's (the directory is searched last, and only for the task)."""
    marker = clean_import_path / "MARKER"
    (clean_import_path / "tabnanny.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (clean_import_path / "mine_t1.py").write_text("import tabnanny\nfrom treedec.programs.tot import Game24Task\n\n"
                                                  "class Task(Game24Task):\n    pass\n")
    monkeypatch.delitem(sys.modules, "tabnanny", raising=False)
    path = list(sys.path)
    try:
        cls = load_task_class("mine_t1:Task")
    finally:
        sys.modules.pop("mine_t1", None)
        sys.modules.pop("tabnanny", None)
    assert cls.__name__ == "Task" and not marker.exists() and sys.path == path


TASK_MODULES = [  # (module source, --task's class, fragments of the error); the module is named per test
    ("def f(:\n", "T", ["failed at import: SyntaxError: invalid syntax"]),
    ("1 / 0\n", "T", ["failed at import: ZeroDivisionError: division by zero"]),
    ("import sys\nsys.exit(3)\n", "T", ["called sys.exit(3) at import"]),
    ("raise ImportError('needs the frobnicator')\n", "T", ["failed at import: ImportError: needs the frobnicator"]),
    ("raise RuntimeError('no GPU here')\n", "T", ["failed at import: RuntimeError: no GPU here"]),
    ("import no_such_module_for_treedec_tests\n", "T",   # passed before
     ["failed at import: ModuleNotFoundError: No module named 'no_such_module_for_treedec_tests'"]),
    ("x = 1\n", "T", ["has no 'T'"]),                                                      # passed before
    ("x = 1\n", "x", ["'x' of module", "is not a ToTTask subclass (it is of type int)"]),
    ("from treedec.programs.tot.task import ToTTask\n\nclass T(ToTTask):\n    pass\n", "T",
     ["T is abstract (it does not define root_prompt, value_prompt)"]),
]


@pytest.mark.parametrize("source, cls, fragments", TASK_MODULES, ids=[f[0] for _, _, f in TASK_MODULES])
def test_a_task_module_that_fails_is_one_line_exit_2(source, cls, fragments, request, clean_import_path, capsys,
                                                     no_model):
    name = f"task_{request.node.callspec.indices['source']}_{os.getpid()}"
    (clean_import_path / f"{name}.py").write_text(source)
    try:
        code, _, err = run(["tot", "--task", f"{name}:{cls}"], capsys)
    finally:
        sys.modules.pop(name, None)
    assert code == 2
    assert_one_line_error(err, f"--task {name}:{cls}: ", *fragments, prog="treedec tot")


@pytest.mark.parametrize("spec, fragment", [
    ("..rel:T", "'..rel' is a relative module name; give the module's full name"),
    ("nosuch_t.py:T", "no module named 'nosuch_t' (give the module name without .py: --task nosuch_t:...)"),
])
def test_a_task_name_that_is_no_module_name_says_what_to_give(spec, fragment, clean_import_path, capsys, no_model):
    code, _, err = run(["tot", "--task", spec], capsys)
    assert code == 2
    assert_one_line_error(err, f"--task {spec}: {fragment}", prog="treedec tot")


# ================================================================ finished results are kept (item 4)


def fail_request(monkeypatch, module: str, request_id, error: BaseException) -> None:
    """Make the request ``request_id`` raise ``error`` as it finishes (after the requests that finish first)."""
    original = getattr(sys.modules[module], "request_results")

    def results(spec, *args, **kwargs):
        if spec.id == request_id:
            raise error
        return original(spec, *args, **kwargs)
    monkeypatch.setattr(f"{module}.request_results", results)


PROMPTS = [{"id": "a", "prompt_ids": [1, 2, 3], "max_tokens": 2},
           {"id": "b", "prompt_ids": [4, 5, 6, 7], "max_tokens": 3},
           {"id": "bad", "prompt_ids": [8, 9], "max_tokens": 12}]


@pytest.mark.parametrize("command, module", [
    (["generate"], "treedec.programs.generate"), (["spec", "--no-progress"], "treedec.programs.speculative.batch")])
def test_a_failing_request_loses_none_that_finished(command, module, tmp_path, capsys, monkeypatch):
    """Was: no results file at all. Now each request's lines are written as it finishes, and the error
    says which requests finished, where they are, and which did not (the prompts file's line)."""
    prompts = write_lines(tmp_path / "p.jsonl", *PROMPTS)
    out = tmp_path / "r.jsonl"
    out.write_text("an older run's results\n")
    fail_request(monkeypatch, module, "bad", ValueError("token 700 is not in the tokenizer"))
    code, _, err = run([*command, "--prompts", str(prompts), "--out", str(out)], capsys)
    assert code == 2   # (spec prints what it runs on stderr first)
    assert_one_line_error(err.splitlines(keepends=True)[-1], "token 700 is not in the tokenizer (2 of 3 requests "
                                                              f"finished, their results are in {out}; not finished: "
                                                              "'bad' (line 3))")
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == ["a", "b"] and [len(r["output_ids"]) for r in lines] == [2, 3]


def test_ctrl_c_keeps_the_finished_results(tmp_path, capsys, monkeypatch):
    prompts = write_lines(tmp_path / "p.jsonl", *PROMPTS)
    out = tmp_path / "r.jsonl"
    fail_request(monkeypatch, "treedec.programs.generate", "bad", KeyboardInterrupt())
    code, _, err = run(["generate", "--prompts", str(prompts), "--out", str(out)], capsys)
    assert code == 130 and [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "b"]
    assert err.splitlines(keepends=True)[-1] == f"treedec generate: error: interrupted (2 of 3 requests finished, " \
                                                f"their results are in {out}; not finished: 'bad' (line 3))\n"


def test_a_run_that_fails_before_any_request_finishes_leaves_the_results_file_alone(tmp_path, capsys):
    prompts = write_lines(tmp_path / "p.jsonl", {"prompt_ids": [1, 2], "max_tokens": 100000})
    out = tmp_path / "r.jsonl"
    out.write_text("an older run's results\n")
    code, _, err = run(["generate", "--prompts", str(prompts), "--out", str(out), "--kv-tokens", "4096"], capsys)
    assert code == 2 and out.read_text() == "an older run's results\n"
    assert_one_line_error(err, "request 1", f"(no request finished; {out} was not written)")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full (every write: no space left)")
def test_a_results_file_that_cannot_be_written_is_named(tmp_path, capsys):
    """Was: '[Errno 28] No space left on device', naming no file (and the close after it raised again)."""
    prompts = write_lines(tmp_path / "p.jsonl", *PROMPTS[:2])
    code, _, err = run(["generate", "--prompts", str(prompts), "--out", "/dev/full"], capsys)
    assert code == 2
    assert_one_line_error(err, "cannot write the results file /dev/full: No space left on device")


PROBE_TASKS = '''from dataclasses import dataclass

from treedec.programs.tot.task import ToTTask


@dataclass
class Probe(ToTTask):
    """Solved by its first thought, or (fail) raising when its search is two thoughts deep."""
    fail: bool = False
    thought_max_tokens: int = 2
    value_max_tokens: int = 2

    def root_prompt(self):
        return "Q: "

    def value_prompt(self, thoughts):
        if self.fail and len(thoughts) >= 2:
            raise RuntimeError("the probe task failed")
        return None

    def is_solved(self, thoughts):
        return not self.fail and len(thoughts) >= 1
'''


def test_a_failing_tot_search_loses_none_that_finished(clean_import_path, capsys):
    (clean_import_path / "probe_tasks_t.py").write_text(PROBE_TASKS)
    tasks = write_lines(clean_import_path / "tasks.jsonl", {"id": "good"}, {"id": "bad", "fail": True},
                        {"id": "good2"})
    out = clean_import_path / "out.jsonl"
    try:
        code, _, err = run(["tot", "--task", "probe_tasks_t:Probe", "--tasks", str(tasks), "--out", str(out),
                            "--depth", "3", "--k", "2", "--n", "1", "--no-progress"], capsys)
    finally:
        sys.modules.pop("probe_tasks_t", None)
    assert code == 1   # the task's own code raised: unexpected, --debug shows where
    assert_one_line_error(err, "RuntimeError: the probe task failed (2 of 3 tasks finished, their results are in "
                               f"{out}; not finished: 'bad')")
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["good", "good2"]


# ================================================================ out of memory (item 5)


@pytest.mark.parametrize("command", [["generate", "--prompts", "PROMPTS", "--out", "OUT"], ["spec", "--no-progress"],
                                     ["spec", "--prompts", "PROMPTS", "--out", "OUT"], ["tot", "--no-progress"],
                                     ["replay", "fewshot", "--iterations", "2", "--no-progress"]])
def test_a_kv_pool_larger_than_memory_is_out_of_memory_exit_2(command, tmp_path, capsys, monkeypatch):
    """Was: the allocator's RuntimeError, 'unexpected', exit 1."""
    prompts = write_lines(tmp_path / "p.jsonl", {"prompt_ids": [1, 2, 3]})
    monkeypatch.setattr("treedec.commands.kv_memory.Engine", lambda *a, **k: pytest.fail("allocated the pool"))
    argv = [{"PROMPTS": str(prompts), "OUT": str(tmp_path / "r.jsonl")}.get(a, a) for a in command]
    code, _, err = run([*argv, "--kv-tokens", BIG_KV], capsys)
    assert code == 2 and not (tmp_path / "r.jsonl").exists()
    assert_one_line_error(err, f"out of memory: --kv-tokens {BIG_KV} asks for a KV pool of 4096.0 GiB "
                               f"({(2**31 - 1) // 16 * 16 * 2048} bytes at 2048 B/token), but ", "lower --kv-tokens")


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nGPU 0 has a total capacity of ..."),
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                 "tried to allocate 8388608 bytes. Error code 12 (Cannot allocate memory)"),
    MemoryError()])
def test_a_pool_allocation_that_fails_anyway_is_out_of_memory_exit_2(error, tmp_path, capsys, monkeypatch):
    def engine(*args, **kwargs):
        raise error
    monkeypatch.setattr("treedec.commands.kv_memory.Engine", engine)
    prompts = write_lines(tmp_path / "p.jsonl", {"prompt_ids": [1, 2, 3]})
    code, _, err = run(["generate", "--prompts", str(prompts), "--out", str(tmp_path / "r.jsonl"), "--kv-tokens",
                        "4096"], capsys)
    assert code == 2
    assert_one_line_error(err, "out of memory: --kv-tokens 4096 asks for a KV pool of 8.0 MiB (8388608 bytes at "
                               "2048 B/token); lower --kv-tokens, or use a smaller --dtype", prog="treedec generate")


def test_the_pool_is_checked_against_free_memory_before_it_is_allocated(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("treedec.engine.pool_sizing.available_memory", lambda device: 1 << 20)
    monkeypatch.setattr("treedec.commands.kv_memory.Engine", lambda *a, **k: pytest.fail("allocated the pool"))
    prompts = write_lines(tmp_path / "p.jsonl", {"prompt_ids": [1, 2, 3]})
    code, _, err = run(["generate", "--prompts", str(prompts), "--out", str(tmp_path / "r.jsonl"), "--kv-tokens",
                        "4096"], capsys)
    assert code == 2
    assert_one_line_error(err, "asks for a KV pool of 8.0 MiB (8388608 bytes at 2048 B/token), but 1.0 MiB is "
                               "available on cpu; lower --kv-tokens (about 512 tokens fit)")


PAGE_PAST_THE_POOL = "(--kv-tokens, or its default) is smaller than one page of --page-size 100000; give a larger " \
                     "--kv-tokens or a smaller --page-size"
PAGE_PAST_THE_CONTEXT = "--page-size 100000 is more tokens than the model's 4096 positions"


@pytest.mark.parametrize("command, fragment", [
    (["generate", "--prompts", "PROMPTS", "--out", "OUT"], PAGE_PAST_THE_CONTEXT),
    (["generate", "--prompts", "PROMPTS", "--out", "OUT", "--kv-tokens", "4096"], PAGE_PAST_THE_POOL),
    (["spec", "--no-progress"], PAGE_PAST_THE_POOL), (["tot", "--no-progress"], PAGE_PAST_THE_CONTEXT)])
def test_a_page_larger_than_the_pool_names_both_flags(command, fragment, tmp_path, capsys):
    """Was: 'kv_tokens must be an int >= page_size (100000), got 32768', the library's names for the flags. A pool
    sized from the requests holds whole pages: a page past the model's context is refused instead (tot's search
    tree could not grow in a pool of one such page)."""
    prompts = write_lines(tmp_path / "p.jsonl", {"prompt_ids": [1, 2, 3]})
    argv = [{"PROMPTS": str(prompts), "OUT": str(tmp_path / "r.jsonl")}.get(a, a) for a in command]
    code, _, err = run([*argv, "--page-size", "100000"], capsys)
    assert code == 2
    assert_one_line_error(err, fragment)


# ================================================================ outputs that would overwrite inputs (item 9)


def _overwrite_files(root: Path) -> dict:
    write_lines(root / "p.jsonl", {"prompt_ids": [1, 2, 3]})
    write_lines(root / "tasks.jsonl", {"numbers": [4, 9, 10, 13]})
    fewshot_schedule(8, 2, 3).save(root / "schedule.json")
    (root / "tree.json").write_text(json.dumps({"parents": [-1, 0, 0], "tokens": [1, 2]}))
    (root / "heads.pt").write_bytes(b"not really heads")
    results_file(root).rename(root / "results.png")   # a results JSON under an image's name
    (root / "link.jsonl").symlink_to(root / "p.jsonl")
    os.link(root / "p.jsonl", root / "hard.jsonl")
    return {name: str(root / name) for name in ("p.jsonl", "tasks.jsonl", "schedule.json", "tree.json", "heads.pt",
                                                "results.png", "link.jsonl", "hard.jsonl")}


OVERWRITES = [  # (argv, the output's flag and the input's flag in the message)
    (["generate", "--prompts", "p.jsonl", "--out", "p.jsonl"], "--out 'p.jsonl' is the file of --prompts"),
    (["generate", "--prompts", "p.jsonl", "--out", "./sub/../p.jsonl"], "is the file of --prompts"),
    (["generate", "--prompts", "p.jsonl", "--out", "link.jsonl"], "--out 'link.jsonl' is the file of --prompts"),
    (["generate", "--prompts", "hard.jsonl", "--out", "p.jsonl"], "--out 'p.jsonl' is the file of --prompts"),
    (["replay", "schedule.json", "--out", "schedule.json"], "--out 'schedule.json' is the file of workload"),
    (["replay", "schedule.json", "--save-schedule", "schedule.json"], "--save-schedule 'schedule.json' is the "
                                                                      "file of workload"),
    (["replay", "fewshot", "--out", "x.json", "--save-schedule", "x.json"], "--out 'x.json' and --save-schedule "
                                                                           "'x.json' are the same file"),
    (["spec", "--prompts", "p.jsonl", "--out", "p.jsonl"], "--out 'p.jsonl' is the file of --prompts"),
    (["spec", "--speculative", "tree", "--tree-json", "tree.json", "--out", "tree.json"], "--out 'tree.json' "
                                                                                         "is the file of --tree-json"),
    (["spec", "--speculative", "medusa", "--medusa", "heads.pt", "--out", "heads.pt"], "is the file of --medusa"),
    (["tot", "--tasks", "tasks.jsonl", "--out", "tasks.jsonl"], "--out 'tasks.jsonl' is the file of --tasks"),
    (["plot", "results.png", "--out", "results.png"], "--out 'results.png' is the file of results"),
]


@pytest.mark.parametrize("argv, fragment", OVERWRITES, ids=[" ".join(a) for a, _ in OVERWRITES])
def test_an_output_that_is_an_input_is_refused_before_anything_runs(argv, fragment, tmp_path, capsys, monkeypatch,
                                                                    no_model):
    (tmp_path / "sub").mkdir()
    files = _overwrite_files(tmp_path)
    before = {name: Path(path).read_bytes() for name, path in files.items()}
    monkeypatch.chdir(tmp_path)
    code, out, err = run(argv, capsys)
    assert code == 2 and out == ""
    assert_one_line_error(err, fragment, f"treedec {argv[0]}: error: ")
    assert {name: Path(path).read_bytes() for name, path in files.items()} == before
    assert not (tmp_path / "x.json").exists()


# ================================================================ text that is not text, absurd files (item 10)


SURROGATE_LINES = [
    ('{"prompt": "\\ud800"}', "request 1: prompt is not text: a lone surrogate (U+D800) at character 0"),
    ('{"prompt": "caf\\udce9"}', "request 1: prompt is not text: a lone surrogate (U+DCE9) at character 3"),
    ('{"messages": [{"role": "user", "content": "hi \\udfff"}]}', "request 1: messages[0]['content'] is not text"),
    ('{"messages": [{"role": "user", "content": "hi", "name": "\\ud83d"}]}',
     "request 1: messages[0]['name'] is not text"),
    ('{"prompt": "hi", "stop": ["\\n", "\\udc80"]}', "request 1: stop[1] is not text"),
]


@pytest.mark.parametrize("command", [["generate"], ["spec"]])
@pytest.mark.parametrize("line, fragment", SURROGATE_LINES, ids=[line for line, _ in SURROGATE_LINES])
def test_a_lone_surrogate_in_a_prompts_file_names_the_line(command, line, fragment, tmp_path, capsys, no_model):
    prompts = write_lines(tmp_path / "p.jsonl", '{"prompt_ids": [1]}', line)
    code, _, err = run([*command, "--prompts", str(prompts), "--out", str(tmp_path / "r.jsonl")], capsys)
    assert code == 2
    assert_one_line_error(err, f"{prompts}:2: " + fragment.replace("request 1", "request 2"),
                          "fix the input's encoding")


@pytest.mark.parametrize("prompt, fragment", [
    ("\udcff", "--prompt is not text: a lone surrogate (U+DCFF) at character 0"),   # the byte 0xff in argv
    ("caf\udce9", "--prompt is not text: a lone surrogate (U+DCE9) at character 3"),
    ("", "--prompt is empty; give a text"),
])
def test_a_prompt_argument_that_is_not_text_is_refused(prompt, fragment, capsys, no_model):
    code, _, err = run(["spec", "--prompt", prompt], capsys)
    assert code == 2
    assert_one_line_error(err, fragment, prog="treedec spec")


def test_a_lone_surrogate_reaches_no_tokenizer(tmp_path, capsys):
    """End to end with a real checkpoint and tokenizer (was: the tokenizer's TypeError 'TextEncodeInput must be
    Union[...]', naming nothing)."""
    from tests.models.test_llama import tiny_hf
    from tests.tokenizers_local import build_tokenizer

    tiny_hf("llama", seed=9).save_pretrained(tmp_path / "model")
    build_tokenizer(tmp_path / "model")
    prompts = write_lines(tmp_path / "p.jsonl", {"prompt": "fine"}, '{"prompt": "x\\ud800"}')
    capsys.readouterr()
    code, _, err = run(["generate", "--model", str(tmp_path / "model"), "--device", "cpu", "--prompts",
                        str(prompts), "--out", str(tmp_path / "r.jsonl")], capsys)
    assert code == 2
    assert_one_line_error(err, f"{prompts}:2: request 2: prompt is not text: a lone surrogate (U+D800) at character 1")


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _doc_with(**step) -> str:
    base = {"kind": "decode", "step": 1, "total_ms": 1.0, "plan_ms": 0.1, "bookkeeping_ms": 0.1,
            "attention_ms": None, "other_ms": 0.8}
    return json.dumps({"workload": "fewshot", "schedule": {"name": "f"}, "model": "tiny", "device": "cpu",
                       "runs": [{"planner": "flatten", "steps": [{**base, **step}]}]})


ABSURD_RESULTS = [  # (the results file's text, fragment of the error after the file's name)
    (_nested(100_000), "is not JSON this reader takes (nested too deeply)"),
    ('{"a": ' * 100_000 + "1" + "}" * 100_000, "is not JSON this reader takes (nested too deeply)"),
    (_doc_with(step=10**400), "runs[0] steps[0] 'step' must be a number of magnitude at most 1e+15"),
    (_doc_with(total_ms=1e308), "runs[0] steps[0] 'total_ms' must be a number of magnitude at most 1e+15, got float"),
    (_doc_with(other_ms=-1e300), "'other_ms' must be a number of magnitude at most 1e+15"),
    (_doc_with(plan_ms=float("inf")), "'plan_ms' must be a number of magnitude at most 1e+15, got float inf"),
    (_doc_with(kind=["decode"]), "runs[0] steps[0] 'kind' must be a string, got list"),
    (_doc_with().replace('"f"', '"\\ud800"'), "'schedule' 'name' is not text (a lone surrogate at character 0)"),
    (_doc_with().replace('"flatten"', '"flat\\udfff"'), "runs[0] 'planner' is not text"),
    (_doc_with().replace('"fewshot"', '{"a": [1, 2]}'), "the top level 'workload' must be a string, got dict"),
    (_doc_with().replace('"tiny"', _nested(50)), "the top level 'model' must be a string, got list"),
    (_doc_with().replace('"step": 1', '"step": ' + "9" * 5000),
     "is not JSON this reader takes (Exceeds the limit (4300 digits) for integer string conversion"),
]


@pytest.mark.parametrize("text, fragment", ABSURD_RESULTS, ids=[f"{i}" for i in range(len(ABSURD_RESULTS))])
def test_plot_of_an_absurd_results_file_is_one_line_naming_it(text, fragment, tmp_path, capsys):
    path = tmp_path / "absurd.json"
    path.write_text(text)
    fig = tmp_path / "fig.png"
    code, out, err = run(["plot", str(path), "--out", str(fig)], capsys)
    assert code == 2 and out == "" and not fig.exists()
    assert_one_line_error(err, str(path), fragment, prog="treedec plot")


@pytest.mark.parametrize("argv, fragment", [
    (["--speculative", "tree", "--tree-json", "NESTED"], "--tree-json NESTED is not JSON this reader takes (nested too "
                                                   "deeply)"),
    (["--medusa-choices", _nested(100_000)], "argument --medusa-choices: must be a non-empty JSON list of index "
                                             "paths, e.g. '[[0],[1],[0,0]]': nested too deeply"),
])
def test_spec_json_nested_too_deeply_is_one_line(argv, fragment, tmp_path, capsys, no_model):
    nested = tmp_path / "tree.json"
    nested.write_text(_nested(100_000))
    code, _, err = run(["spec", *[a.replace("NESTED", str(nested)) for a in argv]], capsys)
    assert code == 2
    assert_one_line_error(err, fragment.replace("NESTED", str(nested)), prog="treedec spec")


@pytest.mark.parametrize("line, fragment", [
    (b"\xff\xfe not text", "not UTF-8 text (byte 1: invalid start byte)"),
    (_nested(100_000).encode(), "not JSON: nested too deeply"),
    (b'{"numbers": [' + b"9" * 5000 + b", 1, 1, 1]}", "not JSON: Exceeds the limit (4300 digits)"),
    (b'{"numbers": [1, 2, 3, 4], "check_steps": "yes", "extra": 1}', "Game24Task(**"),   # passed before
])
def test_a_bad_tasks_line_names_the_file_and_line(line, fragment, tmp_path, capsys, no_model):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(b'{"numbers": [4, 9, 10, 13]}\n' + line + b"\n")
    code, _, err = run(["tot", "--tasks", str(tasks)], capsys)
    assert code == 2
    assert_one_line_error(err, f"{tasks}:2: {fragment}", prog="treedec tot")
