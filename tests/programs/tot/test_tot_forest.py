"""ToT searches in one forest: their root prompts' common start is one copy (within a run and in a prefix cache
across runs), and each search's result is the one it has alone."""
import os

import pytest

from treedec.engine import Engine
from treedec.programs.tot import BFSConfig, ByteTokenizer, ToTProgram, tot_batch, tot_bfs
from treedec.programs.tot.game24 import Game24Task
from treedec.runtime.prefix_cache import PrefixCache
from treedec.runtime.scheduler import run_programs
from treedec.sampling.params import SamplingParams
from tests.engines import tiny_model

CONFIG = BFSConfig(k=2, n=1, depth=2, sampling=SamplingParams(temperature=0.8), seed=3)
NUMBERS = ([4, 9, 10, 13], [1, 1, 4, 6], [2, 3, 5, 12])


def make_engine(kv_tokens=8192):
    return Engine(tiny_model(), kv_tokens=kv_tokens, page_size=4, backend="torch")


def tasks():
    return [Game24Task(numbers, check_steps=False, thought_max_tokens=4, value_max_tokens=2) for numbers in NUMBERS]


def summary(result):
    levels = [(lv.depth, lv.states, lv.thoughts, lv.kept, lv.thought_tokens, lv.value_tokens, lv.prompt_tokens,
               lv.steps, lv.queries, lv.best_value) for lv in result.levels]
    return (levels, [(s.index, s.thoughts, s.value, s.num_tokens) for s in result.best], result.expanded,
            result.prompt_tokens, None if result.solved is None else result.solved.index)


@pytest.fixture(scope="module")
def alone():
    return [summary(tot_bfs(make_engine(), task, ByteTokenizer(), CONFIG)) for task in tasks()]


def test_a_forest_computes_the_root_prompts_common_start_once(alone):
    engine = make_engine()
    results, stats = tot_batch(engine, tasks(), ByteTokenizer(), CONFIG)
    assert [summary(r) for r in results] == alone
    common = len(os.path.commonprefix([t.root_prompt() for t in tasks()])) // 4 * 4   # (whole pages)
    assert common > 900 and stats.shared_prefix_tokens == 2 * common
    assert stats.prompt_steps == 1   # every search's own tail of the prompt in one step
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages


def test_searches_read_their_root_prompt_from_the_prefix_cache(alone):
    engine = make_engine()
    cache = PrefixCache(engine.tree)
    results, cached = [], []
    for task in tasks():   # one run each: the second and third read the first one's prompt from the cache
        [result], stats = run_programs(engine, [ToTProgram(engine, task, ByteTokenizer(), CONFIG)], prefix_cache=cache)
        results.append(summary(result))
        cached.append(stats.cached_tokens)
    assert results == alone
    common = len(os.path.commonprefix([t.root_prompt() for t in tasks()])) // 4 * 4
    assert cached[0] == 0 and min(cached[1:]) >= common


def test_root_prompt_outside_the_vocabulary_is_refused_on_construction():
    class Wide(ByteTokenizer):
        def encode(self, text):
            return [1000] + super().encode(text)

    with pytest.raises(ValueError, match=r"Game24Task.root_prompt\(\) encodes to ids outside the model's vocabulary "
                                         r"\[0, 512\): \[1000\]"):
        ToTProgram(make_engine(), tasks()[0], Wide(), CONFIG)
