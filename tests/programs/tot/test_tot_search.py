"""Tree-of-Thought BFS / DFS on the tiny random model (CPU): batching, pruning, backtracking, bad input.

The tasks here take their values from a script (in evaluation order), so which states a
search keeps is decided by the test, not by what the random model writes.
"""
import json
import math
import re

import pytest

from bench.tot import main as bench_tot_main
from treedec.sampling.params import GREEDY, SamplingParams
from treedec.cli import main as cli_main
from treedec.engine import Engine
from treedec.errors import PoolExhaustedError
from treedec.programs.tot.game24 import Game24Task
from treedec.programs.tot import BFSConfig, ByteTokenizer, DFSConfig, ToTTask, tot_batch, tot_bfs, tot_dfs
from tests.engines import tiny_model

VALUE_PROMPT = "\nV:"


class CharTokenizer:
    """One character per token (ids < 512): every token decodes to exactly one character."""

    bos_id = None

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


class ScriptedTask(ToTTask):
    """Values come from ``values`` in evaluation order (then 1.0); solved at ``solved_depth`` thoughts."""

    thought_stop = ()

    def __init__(self, values=(), thought_max_tokens=3, value_max_tokens=2, step="", solved_depth=None,
                 thought_stop=()):
        self.values, self.step = list(values), step
        self.thought_max_tokens, self.value_max_tokens = thought_max_tokens, value_max_tokens
        self.solved_depth, self.thought_stop = solved_depth, thought_stop
        self.evaluated = []   # (thoughts, outputs) per parse_value call

    def root_prompt(self):
        return "Q: 3 5 7?"

    def step_prompt(self, thoughts):
        return self.step

    def value_prompt(self, thoughts):
        return VALUE_PROMPT

    def parse_value(self, thoughts, outputs):
        self.evaluated.append((thoughts, outputs))
        return self.values.pop(0) if self.values else 1.0

    def is_solved(self, thoughts):
        return len(thoughts) == self.solved_depth


def make_engine(page_size=4, kv_tokens=2048):
    return Engine(tiny_model(), kv_tokens=kv_tokens, page_size=page_size, backend="torch")


def record_steps(engine):
    """Wrap ``engine.step``: before each step, record its pending nodes as (node, parent, tokens, pending count)."""
    steps, inner = [], engine.step

    def step(*args, **kwargs):
        tree, nodes = engine.tree, engine.pending_nodes().tolist()
        steps.append([(n, tree.parent(n), tuple(tree.tokens(n)), nodes.count(n)) for n in dict.fromkeys(nodes)])
        return inner(*args, **kwargs)

    engine.step = step
    return steps


def pages_held(tree):
    """Pages the tree's nodes hold: each node starts on fresh pages."""
    return sum(tree.pool.pages_for(len(tree.tokens(n))) for r in tree.roots for n in tree.subtree(r))


def nodes_on_live_paths(tree):
    return {n for leaf in tree.live_leaves() for n in tree.path(leaf)}


@pytest.mark.parametrize("page_size, step", [(4, ""), (1, "\nNext:"), (16, "")])
def test_bfs_levels_batch_keep_n_and_free_the_rest(page_size, step):
    k, n, m, v = 3, 2, 3, 2
    # level 1: keep (1,) and (2,); level 2 (states (1,), (2,)): keep (2, 0) and (1, 2); level 3: ties keep order
    values = [0.1, 0.9, 0.5] + [0.2, 0.3, 0.8, 0.9, 0.1, 0.4]
    task = ScriptedTask(values, thought_max_tokens=m, value_max_tokens=v, step=step)
    engine = make_engine(page_size)
    steps = record_steps(engine)
    tree = engine.tree

    def check_level(stats):
        # Only the kept states' paths are left: every node lies on a path to one of the n leaves.
        assert len(tree.live_leaves()) == n == stats.kept
        assert nodes_on_live_paths(tree) == {n for r in tree.roots for n in tree.subtree(r)}
        assert stats.pages_after == pages_held(tree) == engine.pool.num_pages - engine.pool.num_free_pages
        tree.check_invariants()

    result = tot_bfs(engine, task, CharTokenizer(), BFSConfig(k=k, n=n, depth=3, sampling=GREEDY),
                     on_level=check_level)
    assert result.expanded == [(), (1,), (2,), (2, 0), (1, 2)]
    assert [s.index for s in result.best] == [(2, 0, 0), (2, 0, 1)] and result.solved is None
    assert [len(s.thoughts) for s in result.best] == [3, 3] and all(s.num_tokens == m for s in result.best)
    assert [(s.states, s.thoughts, s.kept) for s in result.levels] == [(1, 3, 2), (2, 6, 2), (2, 6, 2)]

    # One engine step per token for all thoughts of a level; the value prompts in one step with the
    # thoughts' last tokens; then one step per value token for all evaluations.
    value_len, step_len = len(VALUE_PROMPT), len(step)
    expected = []
    for states in (1, 2, 2):
        expected += [states * step_len] if step else []
        expected += [states * k] * (m - 1) + [states * k * (1 + value_len)] + [states * k] * (v - 1)
    assert [sum(c for *_, c in s) for s in steps[1:]] == expected   # steps[0]: the prompt
    assert [s.steps for s in result.levels] == [(1 if step else 0) + m + v - 1] * 3

    # Each value prompt is a child of its own thought's node (the thought's last token is in the same step).
    eval_steps = [s for s in steps if any(tokens == tuple(map(ord, VALUE_PROMPT)) for _, _, tokens, _ in s)]
    assert len(eval_steps) == 3
    for s in eval_steps:
        thoughts = {node: tokens for node, _, tokens, count in s if count == 1 and len(tokens) == m}
        parents = [parent for _, parent, tokens, _ in s if tokens == tuple(map(ord, VALUE_PROMPT))]
        assert sorted(parents) == sorted(thoughts) and len(thoughts) in (k, 2 * k)

    # No token is computed twice: every query is a new token of the tree.
    for stats in result.levels:
        evaluations = stats.thoughts
        assert stats.queries == stats.thought_tokens + stats.prompt_tokens + stats.value_tokens - evaluations
    assert len(task.evaluated) == 3 + 6 + 6 and all(len(out) == 1 for _, out in task.evaluated)
    assert tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages


def test_bfs_sampling_is_seeded_and_selection_samples():
    def run(seed, selection):
        task = ScriptedTask([0.0, 5.0, 0.0, 5.0] + [1.0] * 8)
        config = BFSConfig(k=4, n=2, depth=2, sampling=SamplingParams(temperature=1.0), seed=seed, selection=selection)
        result = tot_bfs(make_engine(), task, CharTokenizer(), config)
        return [(s.index, s.thoughts) for s in result.best], result.expanded

    first, again, other = run(7, "sample"), run(7, "sample"), run(8, "sample")
    assert first == again and first[0] != other[0]
    # Zero-valued thoughts are drawn only when the valued ones run out: level 1 keeps (1,) and (3,).
    assert sorted(first[1][1:]) == sorted(other[1][1:]) == [(1,), (3,)]


def test_dfs_prunes_below_threshold_and_backtracks():
    # root -> (0,) 0.9, (1,) 0.1 (pruned at once), (2,) 0.6; (0,) -> all below: backtrack; (2,) -> 0.7, 0.2, 0.8
    values = [0.9, 0.1, 0.6] + [0.2, 0.3, 0.1] + [0.7, 0.2, 0.8]
    task = ScriptedTask(values)
    engine = make_engine()
    tree, seen = engine.tree, []

    def check(stats):
        seen.append((tree.num_nodes, len(tree.live_leaves()), stats.kept))
        assert stats.pages_after == pages_held(tree)
        tree.check_invariants()

    result = tot_dfs(engine, task, CharTokenizer(), DFSConfig(k=3, depth=2, threshold=0.5, sampling=GREEDY),
                     on_level=check)
    assert result.expanded == [(), (0,), (2,)]
    assert [(s.index, s.value) for s in result.best] == [((2, 2), 0.8), ((2, 0), 0.7)]
    # after expanding the root: root + (0,) + (2,); after (0,): its thoughts gone, (0,) waits as a leaf
    # until the search comes back; after (2,): (0,) was pruned on the way back, (2,) has 2 survivors
    assert seen == [(3, 2, 2), (3, 2, 0), (4, 2, 2)]
    assert result.levels[1].pages_after == result.levels[0].pages_after   # (0,)'s thoughts freed at once
    assert tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages

    budget = tot_dfs(make_engine(), ScriptedTask(values), CharTokenizer(),
                     DFSConfig(k=3, depth=2, threshold=0.5, sampling=GREEDY, max_expansions=2))
    assert budget.expanded == [(), (0,)] and budget.best == []


@pytest.mark.parametrize("search, config", [(tot_bfs, BFSConfig(k=2, n=2, depth=4, sampling=GREEDY)),
                                            (tot_dfs, DFSConfig(k=2, depth=4, sampling=GREEDY))])
def test_search_stops_at_a_solved_state(search, config):
    values = [1.0, 2.0] + [1.0, 3.0, 1.0, 1.0]
    engine = make_engine()
    result = search(engine, ScriptedTask(values, solved_depth=2), CharTokenizer(), config)
    # Both go into (1,) (value 2) first; its thought (1, 1) (value 3) is the best solved one.
    assert result.solved is not None and len(result.levels) == 2
    assert result.solved.index == (1, 1) and result.solved.value == 3.0 and len(result.solved.thoughts) == 2
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_thought_ends_at_a_stop_string():
    engine = make_engine()
    config = BFSConfig(k=2, n=2, depth=1, sampling=GREEDY)
    free = tot_bfs(engine, ScriptedTask(thought_max_tokens=6), CharTokenizer(), config)
    first = next(s.thoughts[0] for s in free.best if s.index == (0,))
    stop = first[2]
    cut = tot_bfs(engine, ScriptedTask(thought_max_tokens=6, thought_stop=(stop,)), CharTokenizer(), config)
    by_index = {s.index: s for s in cut.best}
    assert by_index[(0,)].thoughts == (first[:first.index(stop) + 1],)
    assert by_index[(0,)].num_tokens == first.index(stop) + 1
    other = by_index[(1,)]
    assert other.thoughts[0].endswith(stop) or other.num_tokens == 6


def test_thought_ends_at_an_eos_id(monkeypatch):
    """A thought ends on an EOS id (the model's by default), kept as its last token; the others go on."""
    engine = make_engine()
    config = BFSConfig(k=2, n=2, depth=1, sampling=GREEDY)
    free = tot_bfs(engine, ScriptedTask(thought_max_tokens=6), CharTokenizer(), config, eos_token_id=None)
    first = next(s.thoughts[0] for s in free.best if s.index == (0,))
    eos = first[3]
    monkeypatch.setattr(tiny_model(), "eos_token_ids", (ord(eos),))
    task = ScriptedTask(thought_max_tokens=6)
    cut = tot_bfs(engine, task, CharTokenizer(), config)
    by_index = {s.index: s for s in cut.best}
    assert by_index[(0,)].thoughts == (first[:first.index(eos) + 1],)
    assert by_index[(0,)].num_tokens == first.index(eos) + 1
    other = by_index[(1,)]
    assert eos not in other.thoughts[0][:-1] and (other.thoughts[0].endswith(eos) or other.num_tokens == 6)
    assert all(eos not in out[:-1] and len(out) <= 2 for _, outputs in task.evaluated for out in outputs)
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_default_value_map_parse():
    task = ScriptedTask()
    outputs = [" sure\nimpossible", "likely", "no idea", "not impossible, sure"]
    assert ToTTask.parse_value(task, (), outputs) == pytest.approx(20 + 1 + 0 + 0.001)


@pytest.mark.parametrize("make, match", [
    (lambda: BFSConfig(k=0), r"BFSConfig.k must be an int >= 1, got 0"),
    (lambda: BFSConfig(n=0), r"BFSConfig.n must be an int >= 1, got 0"),
    (lambda: BFSConfig(n=-2), r"BFSConfig.n must be an int >= 1, got -2"),
    (lambda: BFSConfig(depth=1.5), r"BFSConfig.depth must be an int"),
    (lambda: BFSConfig(selection="best"), r"selection must be one of \('greedy', 'sample'\)"),
    (lambda: BFSConfig(sampling=SamplingParams(temperature=-0.1)),
     r"temperature must be a number in \[0, 3.4028235e\+38\]"),
    (lambda: BFSConfig(sampling=0.7), r"BFSConfig.sampling must be a SamplingParams, got float 0.7"),
    (lambda: DFSConfig(value_sampling=SamplingParams(temperature=0, repetition_penalty=1.2)),
     r"DFSConfig.value_sampling: a ToT search's token draws does not implement repetition_penalty=1.2"),
    (lambda: BFSConfig(sampling=SamplingParams(max_tokens=5)), r"does not implement max_tokens=5"),
    (lambda: DFSConfig(k=-1), r"DFSConfig.k must be an int >= 1, got -1"),
    (lambda: DFSConfig(threshold=math.nan), r"threshold must be a finite number, got nan"),
    (lambda: DFSConfig(threshold="0.5"), r"threshold must be a finite number, got '0.5'"),
    (lambda: DFSConfig(max_expansions=0), r"max_expansions must be an int >= 1, got 0"),
])
def test_bad_configs_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("run, error, match", [
    (lambda e: tot_bfs(e, ScriptedTask(), CharTokenizer(), BFSConfig(k=513)), ValueError,
     r"BFSConfig.k must be at most the vocabulary size 512, got 513"),
    (lambda e: tot_dfs(e, ScriptedTask(), CharTokenizer(), BFSConfig()), TypeError, "config must be a DFSConfig"),
    (lambda e: tot_bfs(e, ScriptedTask(thought_max_tokens=0), CharTokenizer()), ValueError,
     r"ScriptedTask.thought_max_tokens must be an int >= 1, got 0"),
    (lambda e: tot_bfs(e, ScriptedTask(thought_stop="\n"), CharTokenizer()), ValueError,
     r"thought_stop must be a tuple of non-empty strings"),
    (lambda e: tot_bfs(e, ScriptedTask(values=[math.inf]), CharTokenizer()), ValueError,
     r"parse_value must return a finite number, got inf"),
    (lambda e: tot_bfs(e, ScriptedTask(step="\u0400"), CharTokenizer()), ValueError,
     r"step_prompt\(\) encodes to ids outside the model's vocabulary \[0, 512\): \[1024\]"),
    (lambda e: tot_bfs(e, ScriptedTask(thought_max_tokens=4), ByteTokenizer(), BFSConfig(k=8, n=8, depth=3)),
     PoolExhaustedError, "KV pool exhausted"),
])
def test_bad_input_raises_and_leaves_the_engine_as_it_was(run, error, match):
    engine = make_engine(page_size=4, kv_tokens=4 * 40)
    other = engine.prefill([1, 2, 3]).node   # another request of the forest, untouched
    before = (engine.tree.num_nodes, engine.pool.num_free_pages)
    with pytest.raises(error, match=match):
        run(engine)
    assert (engine.tree.num_nodes, engine.pool.num_free_pages) == before and engine.tree.tokens(other) == [1, 2, 3]
    engine.tree.check_invariants()


def test_cli_tot_writes_results(tmp_path, capsys):
    out = tmp_path / "tot.json"
    assert cli_main(["tot", "--k", "2", "--n", "2", "--depth", "2", "--thought-max-tokens", "4",
                     "--value-max-tokens", "2", "--no-check-steps", "--no-progress", "--kv-tokens", "4096",
                     "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    assert results["model"] == "tiny (random weights)" and results["tokenizer"] == "bytes"
    assert results["task"]["numbers"] == [4, 9, 10, 13] and results["pages_free_at_end"]
    levels = results["result"]["levels"]
    assert [lv["thoughts"] for lv in levels] == [2, 4] and all(lv["value_tokens"] > 0 for lv in levels)
    assert all(lv["tokens_per_s"] > 0 for lv in levels)
    assert "thought tok" in printed and "ToT-BFS on the Game of 24 [4, 9, 10, 13]" in printed
    assert cli_main(["tot", "--k", "0", "--no-progress"]) == 2
    assert capsys.readouterr().err == ("treedec tot: error: argument --k: must be an int >= 1, got 0 "
                                       "(see 'treedec tot --help')\n")


def test_cli_tot_with_a_checkpoint_and_its_tokenizer(tmp_path):
    """``--model DIR`` loads the checkpoint and the tokenizer saved with it (BOS before the prompt only)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from tests.models.test_llama import tiny_hf

    # (positions for the 960-character root prompt and the search below it)
    tiny_hf("llama", seed=3, max_position_embeddings=1024).save_pretrained(tmp_path)
    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    tok = Tokenizer(models.WordLevel({"<s>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(chars)}}, "<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")   # one token per character
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>").save_pretrained(tmp_path)
    out = tmp_path / "tot.json"
    assert cli_main(["tot", "--model", str(tmp_path), "--k", "2", "--n", "1", "--depth", "2", "--thought-max-tokens",
                     "3", "--value-max-tokens", "2", "--no-check-steps", "--no-progress", "--kv-tokens", "4096",
                     "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["tokenizer"] == str(tmp_path) and results["model"] == str(tmp_path)
    root = Game24Task((4, 9, 10, 13)).root_prompt()
    assert results["result"]["prompt_tokens"] == 1 + len(root)   # BOS + one token per character
    assert [lv["thoughts"] for lv in results["result"]["levels"]] == [2, 2] and results["pages_free_at_end"]


def test_bench_tot_smoke(tmp_path):
    assert bench_tot_main(["--smoke", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*-tot-smoke.json")
    results = json.loads(path.read_text())
    assert results["smoke"] and results["model"] == "tiny" and results["planners"] == ["flatten", "path"]
    for planner in ("flatten", "path"):
        run = results["runs"][planner]
        assert len(run["search_s"]) == results["reps"] and all(t > 0 for t in run["search_s"])
        assert run["pages_free_at_end"] and run["levels"][0]["thoughts"] == results["search"]["k"]
    assert results["speedup"]["path"] > 0


def summary(result):
    """A search's decisions and outputs (not its timings)."""
    levels = [(lv.depth, lv.states, lv.thoughts, lv.kept, lv.thought_tokens, lv.value_tokens, lv.best_value)
              for lv in result.levels]
    best = [(s.index, s.thoughts, s.value) for s in result.best]
    return levels, best, result.expanded, None if result.solved is None else result.solved.index


@pytest.mark.parametrize("config", [BFSConfig(k=2, n=2, depth=2, sampling=SamplingParams(temperature=0.8), seed=5),
                                    DFSConfig(k=2, depth=2, threshold=0.0, max_expansions=3,
                                              sampling=SamplingParams(temperature=0.8))])
@pytest.mark.slow
@pytest.mark.parametrize("kv_tokens", [8192, 4 * 300])
def test_tot_batch_searches_are_each_search_alone(config, kv_tokens):
    """Game-of-24 searches over different numbers, all in one forest (one engine step for every live
    search), give each search's result alone; with a small pool some wait for pages. Pages all freed."""
    tasks = [Game24Task(numbers, check_steps=False, thought_max_tokens=5, value_max_tokens=2)
             for numbers in ([4, 9, 10, 13], [1, 1, 4, 6], [2, 3, 5, 12], [6, 6, 6, 6])]
    engine = make_engine(kv_tokens=kv_tokens)
    seen = []
    results, stats = tot_batch(engine, tasks, ByteTokenizer(), config, on_task_done=lambda i, r: seen.append(i))
    search = tot_bfs if isinstance(config, BFSConfig) else tot_dfs
    alone = [search(make_engine(), task, ByteTokenizer(), config) for task in tasks]
    assert [summary(r) for r in results] == [summary(r) for r in alone]
    assert sorted(seen) == [0, 1, 2, 3]
    if kv_tokens == 8192:
        assert max(stats.programs_per_step) == 4 and stats.waits == 0
        assert stats.steps < sum(lv.steps for r in alone for lv in r.levels)   # the searches share steps
    else:   # one search's peak (about 260 pages) fits the 300 pages, four do not (about 350: their root prompts'
        assert stats.waits > 0 and stats.peak_pages <= 300   # few-shot examples are one copy, the rest each's own)
    assert engine.pool.num_free_pages == engine.pool.num_pages and engine.tree.num_nodes == 0


TASK_MODULE = '''
from treedec.programs.tot import ToTTask


class Countdown(ToTTask):
    """A user task: the model's values come from the prompt, no parsing."""

    thought_max_tokens = 3
    value_max_tokens = 2

    def __init__(self, start):
        self.start = start

    def root_prompt(self):
        return f"Count down from {self.start}:"

    def step_prompt(self, thoughts):
        return ""

    def value_prompt(self, thoughts):
        return "ok?"

    def parse_value(self, thoughts, outputs):
        return float(len(thoughts))
'''


def test_cli_tot_runs_a_tasks_file_batched_and_a_user_task(tmp_path, capsys, monkeypatch):
    tasks = tmp_path / "puzzles.jsonl"
    tasks.write_text('{"id": "a", "numbers": [4, 9, 10, 13]}\n{"numbers": [1, 1, 4, 6]}\n')
    out = tmp_path / "results.jsonl"
    common = ["--k", "2", "--n", "1", "--depth", "2", "--thought-max-tokens", "3", "--value-max-tokens", "2",
              "--no-progress", "--kv-tokens", "16384"]
    assert cli_main(["tot", "--tasks", str(tasks), "--no-check-steps", "--out", str(out), *common]) == 0
    printed = capsys.readouterr().out
    assert "2 tasks (BFSConfig)" in printed and "all free at the end: True" in printed
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == ["a", "1"] and lines[1]["task"]["numbers"] == [1, 1, 4, 6]
    assert all(len(line["result"]["levels"]) == 2 for line in lines)
    # The same searches one at a time give the same results (fp32 CPU).
    alone = tot_bfs(make_engine(kv_tokens=16384), Game24Task([1, 1, 4, 6], check_steps=False, thought_max_tokens=3,
                                                            value_max_tokens=2), ByteTokenizer(),
                    BFSConfig(k=2, n=1, depth=2, sampling=SamplingParams(temperature=0.7), seed=0))
    assert [(b["index"], b["thoughts"], b["value"]) for b in lines[1]["result"]["best"]] == \
        [(list(c.index), list(c.thoughts), c.value) for c in alone.best]

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mytasks.py").write_text(TASK_MODULE)
    (tmp_path / "counts.jsonl").write_text('{"start": 5}\n{"start": 9}\n')
    assert cli_main(["tot", "--task", "mytasks:Countdown", "--tasks", "counts.jsonl", *common]) == 0
    assert "2 tasks (BFSConfig)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, match", [
    (["--task", "nosuchmodule:Task"], "--task nosuchmodule:Task: no module named 'nosuchmodule'"),
    (["--task", "treedec.programs.tot.game24:INSTRUCTION"],
     r"'INSTRUCTION' of module .* is not a ToTTask subclass \(it is of type str\)"),
    (["--task", "Game24Task"], "--task must be module:Class"),
    (["--tasks", "TASKS", "--numbers", "1", "2", "3", "4"], "--numbers goes with a single Game-of-24 search"),
    (["--tasks", "BAD"], r"bad.jsonl:2: Game24Task\(\*\*\{\"numbers\": \[1, 2\]\}\): Game24Task.numbers must be four"),
])
def test_cli_tot_task_errors_are_one_line(argv, match, tmp_path, capsys):
    (tmp_path / "tasks.jsonl").write_text('{"numbers": [4, 9, 10, 13]}\n')
    (tmp_path / "bad.jsonl").write_text('{"numbers": [4, 9, 10, 13]}\n{"numbers": [1, 2]}\n')
    argv = [str(tmp_path / "tasks.jsonl") if a == "TASKS" else str(tmp_path / "bad.jsonl") if a == "BAD" else a
            for a in argv]
    assert cli_main(["tot", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(match, err), err
