"""Fuzzed ``treedec`` command lines: every one exits 0, or exits 2 with one line on stderr and no traceback.

Values are drawn per option from valid ones, near misses (0, -1, 2**31, nan, unknown names, a
folder for a file, a missing folder) and junk text. ``demo`` runs for real (its forest is small;
chunk and tile sizes stay >= 16 so a run takes milliseconds). ``generate``, ``replay``, ``spec``
and ``tot`` stop where their model would load, so only their checks run: an example costs
milliseconds. Files include prompts files with a lone surrogate or JSON nested too deeply, and
outputs may name an input file (refused).
"""
import contextlib
import io
import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from treedec.attention import PLANNERS
from treedec.cli import main
from treedec.models.config import MODEL_SIZES
from treedec.workloads import fewshot_schedule


class ReachedModelLoad(BaseException):
    """Raised by the stub ``load_model``: every check before it passed (a BaseException, so main lets it through)."""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Paths the fuzzed options draw from: a folder, a missing folder, files of every kind an option reads.

    The tests run in that folder, with ``load_model`` stubbed out."""
    root = tmp_path_factory.mktemp("fuzz_cli")
    step = {"kind": "decode", "total_ms": 1.0, "plan_ms": 0.1, "bookkeeping_ms": 0.1, "attention_ms": None,
            "other_ms": 0.8}
    contents = {
        "results.json": json.dumps({"workload": "fewshot", "schedule": {"name": "f"}, "model": "tiny",
                                    "device": "cpu", "runs": [{"planner": "flatten", "steps": [{"step": 1, **step}]}]}),
        "not.json": "not json", "list.json": "[1, 2]", "empty.json": "",
        "tree.json": json.dumps({"parents": [-1, 0, 0], "tokens": [1, 2]}),
        "bad_tree.json": json.dumps({"parents": [-1, 5], "tokens": [1]}),
        "prompts.jsonl": '{"prompt_ids": [1, 2, 3]}\n{"prompt": "hi", "stop": ["\\n"]}\n',
        "surrogate.jsonl": '{"prompt": "a\\ud800"}\n', "deep.jsonl": "[" * 5000 + "]" * 5000 + "\n",
    }
    for name, text in contents.items():
        (root / name).write_text(text)
    (root / "binary.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")   # not UTF-8
    contents["binary.json"] = None
    fewshot_schedule(8, 2, 3).save(root / "schedule.json")
    paths = {name: str(root / name) for name in contents}
    paths.update(folder=str(root), schedule=str(root / "schedule.json"), missing=str(root / "no" / "such.json"),
                 out=str(root / "out.json"), png=str(root / "fig.png"))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)  # what a run writes to a relative path (plot's default --out, a junk path) lands here
        for module in ("treedec.commands.args", "treedec.commands.generate", "treedec.commands.replay",
                       "treedec.commands.spec", "treedec.commands.tot"):
            mp.setattr(f"{module}.load_model", _stop)
        yield paths


def _stop(args):
    raise ReachedModelLoad


JUNK = st.one_of(st.text(max_size=8).filter(lambda t: not t.startswith("-")),
                 st.sampled_from(["", " ", "-1", "-0", "1e3", "0x10", "١٢", "--", "-", "--nope"]))


def ints(valid_lo: int, valid_hi: int):
    """Small ints around [valid_lo, valid_hi], ints too big for any count, and junk (as argv text)."""
    return st.one_of(st.integers(valid_lo - 3, valid_hi).map(str), st.integers(2**31 - 1, 2**80).map(str),
                     st.integers(-(2**70), -1).map(str), JUNK)


def names(*valid):
    """The valid names, and junk."""
    return st.one_of(st.sampled_from(valid), JUNK)


FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.integers(-5, 5).map(str),
                   st.sampled_from(["1e999", "-1e-9", "nan", "-inf", "0.0"]), JUNK)
SEEDS = st.one_of(st.integers(-3, 2**64).map(str), JUNK)
DEVICES = names("cpu", "cuda", "cuda:0", "cuda:7", "cpu:0", "CPU", "mps", "meta", "gpu", "cuda:x")
BACKENDS = names("auto", "reference", "torch", "cuda", "hybrid", "")  # triton: interpreted here, too slow to fuzz
FLAG = None
FILES = st.sampled_from(["results.json", "not.json", "list.json", "empty.json", "binary.json", "tree.json",
                         "bad_tree.json", "schedule.json", "folder", "missing", "out", "prompts.jsonl",
                         "surrogate.jsonl", "deep.jsonl"])
OUTS = st.one_of(st.sampled_from(["out", "folder", "missing", "results.json", "png", "prompts.jsonl", "tree.json",
                                  "schedule.json"]), st.just(""))

MODEL = {"--model": st.sampled_from(["folder", "missing"]), "--config": names(*MODEL_SIZES), "--device": DEVICES,
         "--dtype": names("bf16", "fp16", "fp32")}
OPTIONS = {
    "demo": {"--backend": BACKENDS, "--planner": names(*PLANNERS), "--page-size": ints(1, 1100),
             "--chunk-size": st.one_of(st.integers(16, 5000).map(str), ints(-2, 0)),
             "--query-tile": st.one_of(st.integers(16, 5000).map(str), ints(-2, 0)), "--seed": SEEDS,
             "--device": DEVICES, "--dtype": names("fp32", "fp16", "bf16"), "--json": FLAG},
    "replay": {**MODEL, "--backend": BACKENDS, "--planner": names(*PLANNERS),
               "--compare": names("flatten,node", ",", "path,,node", " node ", "flatten,nope"),
               "--page-size": ints(1, 64), "--kv-tokens": ints(1, 10**6), "--iterations": ints(1, 20),
               "--tree": ints(0, 120), "--record": ints(0, 100), "--prompt-tokens": ints(1, 5000),
               "--branches": ints(1, 50), "--warmup": ints(0, 5), "--profile-split": FLAG, "--seed": SEEDS,
               "--out": OUTS, "--save-schedule": OUTS, "--no-progress": FLAG},
    "plot": {"--out": st.one_of(OUTS, st.sampled_from(["fig.docx", "fig"]))},
    "generate": {**MODEL, "--prompts": FILES, "--out": OUTS, "--chat-template": FLAG, "--max-tokens": ints(1, 64),
                 "--temperature": FLOATS, "--top-p": FLOATS, "--top-k": ints(1, 50), "--n": ints(1, 4),
                 "--stop": JUNK, "--backend": BACKENDS, "--page-size": ints(1, 64), "--kv-tokens": ints(1, 10**6),
                 "--seed": SEEDS, "--no-progress": FLAG},
    "spec": {**MODEL, "--chat-template": FLAG, "--speculative": names("ngram", "medusa", "draft_model", "tree"),
             "--accept": names("greedy", "typical", "sample"), "--max-tokens": ints(1, 64),
             "--eos": names("1,2", "none", "NONE", "600", "1,-2", ",", "x"),
             "--prompt": JUNK, "--prompt-ids": names("1,2,3", "1,-2", ",", "5 6", "x"), "--backend": BACKENDS,
             "--page-size": ints(1, 64), "--kv-tokens": ints(1, 10**6), "--seed": SEEDS, "--temperature": FLOATS,
             "--posterior-threshold": FLOATS, "--posterior-alpha": FLOATS, "--medusa": FILES,
             "--medusa-heads": ints(1, 8),
             "--medusa-choices": st.one_of(st.recursive(st.integers(-2, 3), lambda c: st.lists(c, max_size=3),
                                                        max_leaves=6).map(json.dumps), JUNK),
             "--draft-model": st.sampled_from(["folder", "missing"]), "--draft-config": names(*MODEL_SIZES),
             "--draft-seed": SEEDS, "--depth": ints(1, 8), "--draft-top-k": ints(1, 8), "--top-k": ints(1, 8),
             "--top-p": FLOATS, "--total-tokens": ints(1, 32),
             "--max-ngram": ints(1, 5), "--num-draft-tokens": ints(1, 16), "--max-matches": ints(1, 4),
             "--tree-json": FILES, "--check": FLAG, "--no-progress": FLAG,
             "--prompts": FILES, "--out": OUTS},
    "tot": {**MODEL, "--algorithm": names("bfs", "dfs"), "--k": ints(1, 5), "--n": ints(1, 5),
            "--depth": ints(1, 5), "--selection": names("greedy", "sample"), "--threshold": FLOATS,
            "--max-expansions": ints(1, 50), "--temperature": FLOATS, "--value-samples": ints(1, 3),
            "--value-temperature": FLOATS, "--thought-max-tokens": ints(1, 64), "--value-max-tokens": ints(1, 16),
            "--no-check-steps": FLAG, "--backend": BACKENDS, "--planner": names(*PLANNERS),
            "--page-size": ints(1, 64), "--kv-tokens": ints(1, 10**6), "--seed": SEEDS, "--out": OUTS,
            "--no-progress": FLAG},
}
POSITIONAL = {"replay": st.lists(st.one_of(names("fewshot", "tot-keyword", "medusa-32", "medusa-7", "tot-nope"),
                                           FILES), min_size=0, max_size=1),
              "plot": st.lists(FILES, min_size=0, max_size=2)}


@st.composite
def command_lines(draw):
    command = draw(st.sampled_from(sorted(OPTIONS)))
    argv = [command] + draw(POSITIONAL.get(command, st.just([])))
    names = draw(st.lists(st.sampled_from(sorted(OPTIONS[command])), unique=True, max_size=4))
    for name in names:
        strategy = OPTIONS[command][name]
        argv += [name] if strategy is FLAG else [name, draw(strategy)]
    if command == "tot" and draw(st.booleans()):
        argv += ["--numbers"] + draw(st.lists(ints(1, 30), min_size=3, max_size=5))
    return argv


def run_quietly(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except ReachedModelLoad:
            code = 0
        except SystemExit as e:  # --help
            code = e.code
    return code, out.getvalue(), err.getvalue()


def check_outcome(argv: list[str], code: int, out: str, err: str) -> None:
    if code == 0:
        if argv[0] == "demo" and "--json" in argv:
            json.loads(out)
        return
    assert code == 2, (argv, code, err)
    assert err.endswith("\n") and err.count("\n") == 1, (argv, err)
    assert err.startswith("treedec") and ": error: " in err and "Traceback" not in err, (argv, err)


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(argv=command_lines())
def test_any_command_line_exits_0_or_2_with_one_line(argv, files):
    argv = [files.get(a, a) for a in argv]
    check_outcome(argv, *run_quietly(argv))


def _mutations(doc: dict):
    """A results document with one field deleted or replaced by arbitrary JSON, anywhere in it."""
    json_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.floats() | st.text(max_size=4),
                               lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                               max_leaves=5)

    @st.composite
    def mutate(draw):
        doc_copy = json.loads(json.dumps(doc))
        node = doc_copy
        while True:
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            key = draw(st.sampled_from(keys))
            child = node[key]
            if isinstance(child, (dict, list)) and child and draw(st.booleans()):
                node = child
                continue
            if isinstance(node, dict) and draw(st.booleans()):
                del node[key]
            else:
                node[key] = draw(json_values)
            return doc_copy
    return mutate()


RESULTS_DOC = {"workload": "fewshot", "schedule": {"name": "f"}, "model": "tiny", "device": "cpu",
               "profile_split": False, "runs": [{"planner": "flatten", "steps": [
                   {"step": 1, "kind": "decode", "total_ms": 1.0, "plan_ms": 0.1, "bookkeeping_ms": 0.1,
                    "attention_ms": None, "other_ms": 0.8}]}]}


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=st.one_of(_mutations(RESULTS_DOC), _mutations({"families": {"fewshot": RESULTS_DOC}})))
def test_plot_of_any_mutated_results_file_exits_0_or_2_with_one_line(doc, files):
    path = files["out"].replace("out.json", "mutated.json")
    with open(path, "w") as f:
        json.dump(doc, f)
    argv = ["plot", path, "--out", files["png"]]
    check_outcome(argv, *run_quietly(argv))
