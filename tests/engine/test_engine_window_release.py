"""Pages outside every layer's window go back to the pool during decoding (a model whose every layer slides):
greedy tokens equal transformers' and the same engine's with the freeing off, the pool's pages in use stay
bounded by the window, none leaks; with the prefix cache, preemption and several requests outputs stay equal.
Beam forks and speculative trees (accepted paths, rollbacks) read what they must. A model with a global layer
(Gemma 3's mix) keeps every page."""
import pytest
import torch
from transformers import Gemma3TextConfig, MistralConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3ForCausalLM
from transformers.models.mistral.modeling_mistral import MistralForCausalLM

from tests.models.families import tiny
from tests.programs.test_beam import hf_beam_search
from tests.programs.test_generate_batch import outputs
from tests.runtime.test_prefix_cache import drive, spec, tokens
from treedec.engine import Engine
from treedec.engine.engine import greedy
from treedec.models import from_hf_model
from treedec.programs.beam import beam_search
from treedec.programs.generate import GenerateProgram
from treedec.programs.speculative.draft_model import DraftModelDraft
from treedec.programs.speculative.program import speculative_generate

WINDOW, PS = 8, 4


@pytest.fixture(scope="module")
def mistral():
    hf = tiny(MistralConfig, MistralForCausalLM, seed=5, sliding_window=WINDOW)
    return hf, from_hf_model(hf)


def decode(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], list[int]]:
    """``n`` greedy tokens after ``prompt`` one step each, and the pages in use after each step."""
    out, used = [], []
    logits = engine.prefill(prompt).logits
    node = engine.tree.live_leaves()[0]
    for _ in range(n):
        out.append(int(greedy(logits)))
        engine.tree.extend(node, [out[-1]])
        logits = engine.step().logits[0]
        engine.tree.check_invariants()
        used.append(engine.pool.num_pages - engine.pool.num_free_pages)
    engine.tree.prune(node)
    assert engine.pool.num_free_pages == engine.pool.num_pages   # nothing leaked
    return out, used


def test_greedy_with_freeing_equals_transformers_and_freeing_off(mistral):
    hf, model = mistral
    prompt = list(range(3, 23))
    on, used_on = decode(Engine(model, kv_tokens=512, page_size=PS, backend="torch"), prompt, 48)
    off_engine = Engine(model, kv_tokens=512, page_size=PS, backend="torch")
    off_engine._release_window = None   # the same engine, its pages all kept
    off, used_off = decode(off_engine, prompt, 48)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False, min_new_tokens=48,
                             pad_token_id=0)[0, len(prompt):].tolist()
    assert on == off == theirs
    # window + a page's margin + the page being filled + the one the next token takes
    assert max(used_on) <= (WINDOW + PS) // PS + 2 < used_off[-1] == (len(prompt) + 48 + PS - 1) // PS


def test_prefix_cache_preemption_and_sharing_with_freeing_equal_freeing_off(mistral):
    _, model = mistral
    system = tokens(3, 14)
    specs = [spec(i, system + tokens(10 + i, 3 + i % 3), n=1 + i % 2, temperature=0.7 * (i % 2), seed=i,
                  max_tokens=30) for i in range(6)]

    def run(release: bool, prefix_cache: bool):
        engine = Engine(model, kv_tokens=96, page_size=PS, backend="torch")   # 24 pages: requests wait, preempt
        if not release:
            engine._release_window = None
        # (the tree's invariants checked after every step where pages are freed with the cache on: the others
        # only give the outputs to compare, and the checks were most of this test's time)
        checked = release and prefix_cache
        results, sched = drive(engine, [GenerateProgram(s, list(s.prompt_ids)) for s in specs],
                               prefix_cache=prefix_cache,
                               between=None if not checked else lambda s: s.engine.tree.check_invariants(
                                   held=None if s.cache is None else s.cache.held()))
        assert not any(isinstance(r, Exception) for r in results), results
        if sched.cache is not None:
            sched.cache.clear()
        assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages
        return [outputs(r) for r in results], sched.stats

    on, stats_on = run(True, True)
    assert on == run(False, True)[0] == run(True, False)[0] == run(False, False)[0]
    assert stats_on.cached_tokens > 0 and stats_on.preemptions > 0


def test_beam_and_speculative_decoding_with_freeing(mistral):
    hf, model = mistral
    prompt = [5, 9, 11, 5, 9, 11, 5, 9, 30, 31, 5, 9, 11] * 2
    engine = Engine(model, kv_tokens=1024, page_size=PS, backend="torch")
    beams = beam_search(engine, prompt, 3, 30, eos_token_id=[255])   # (an id it never emits: 30 tokens each)
    assert beams.sequences == hf_beam_search(hf, prompt, 3, 30, eos_token_id=[255])[0]
    assert engine.pool.num_free_pages == engine.pool.num_pages
    greedy_ids, _ = decode(Engine(model, kv_tokens=512, page_size=PS, backend="torch"), prompt, 40)
    target = Engine(model, kv_tokens=512, page_size=PS, backend="torch")
    draft = DraftModelDraft(Engine(model, kv_tokens=512, page_size=PS, backend="torch"), depth=3, top_k=2,
                            total_tokens=10)
    ids, _ = speculative_generate(target, prompt, draft, 40)
    assert ids == greedy_ids
    target.tree.check_invariants()
    assert target.pool.num_pages - target.pool.num_free_pages <= (WINDOW + 2 * PS + 4 + 10) // PS + 2


def test_a_model_with_a_global_layer_keeps_every_page():
    hf = tiny(Gemma3TextConfig, Gemma3ForCausalLM, seed=1, sliding_window=4, sliding_window_pattern=2,
              layer_types=["sliding_attention", "full_attention"] * 2, query_pre_attn_scalar=64)
    engine = Engine(from_hf_model(hf), kv_tokens=256, page_size=PS, backend="torch")
    assert engine._release_window is None
    _, used = decode(engine, list(range(3, 15)), 12)
    assert used[-1] == (12 + 12 + PS - 1) // PS
