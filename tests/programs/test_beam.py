"""Beam search on the tree engine against transformers' beam search (tiny random Llama, fp32, CPU)."""
from collections import Counter

import pytest
import torch

from treedec.engine import Engine
from treedec.programs.beam import beam_search

PROMPT = [158, 198, 212, 41, 0, 98, 171, 81, 122]
NEW_TOKENS = 8


def make_engine(model, page_size=4):
    return Engine(model, kv_tokens=1024, page_size=page_size, backend="torch")


def hf_beam_search(hf, prompt, num_beams, max_new_tokens, **kwargs):
    """transformers' hypotheses (new tokens, lengths from beam_indices) and sequences_scores."""
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      num_beams=num_beams, do_sample=False, max_new_tokens=max_new_tokens,
                      num_return_sequences=num_beams, return_dict_in_generate=True, output_scores=True, **kwargs)
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    sequences = [out.sequences[i, len(prompt):len(prompt) + n].tolist() for i, n in enumerate(lengths)]
    return sequences, out.sequences_scores.tolist()


def frequent_token(model, prompt, num_beams):
    """An EOS id the model emits: the most common token of the EOS-free beams."""
    beams = beam_search(make_engine(model), prompt, num_beams, NEW_TOKENS).sequences
    return Counter(t for seq in beams for t in seq).most_common(1)[0][0]


CASES = [   # num_beams, length_penalty, early_stopping, with an EOS id
    (2, 1.0, False, False),
    (3, 0.5, True, False),
    (4, 2.0, "never", False),
    (2, 1.0, False, True),
    (3, 1.0, True, True),
    (4, 1.0, False, True),
    (3, 0.5, "never", True),
    (4, -1.0, False, True),
    (5, 0.0, True, True),
]


@pytest.mark.parametrize("num_beams,length_penalty,early_stopping,with_eos", CASES)
def test_beam_search_equals_transformers(hf, model, num_beams, length_penalty, early_stopping, with_eos):
    eos = frequent_token(model, PROMPT, num_beams) if with_eos else None
    engine = make_engine(model)
    result = beam_search(engine, PROMPT, num_beams, NEW_TOKENS, length_penalty=length_penalty, eos_token_id=eos,
                         early_stopping=early_stopping)
    ref_sequences, ref_scores = hf_beam_search(hf, PROMPT, num_beams, NEW_TOKENS, length_penalty=length_penalty,
                                               eos_token_id=eos, early_stopping=early_stopping)
    assert result.sequences == ref_sequences
    torch.testing.assert_close(torch.tensor(result.scores), torch.tensor(ref_scores), rtol=1e-5, atol=1e-4)
    assert result.scores == sorted(result.scores, reverse=True)
    if with_eos:   # the EOS path is taken: a finished hypothesis ends on it, shorter than the others
        assert any(seq[-1] == eos and len(seq) < NEW_TOKENS for seq in result.sequences)
    else:
        assert all(len(seq) == NEW_TOKENS for seq in result.sequences)
    stats = result.stats
    assert engine.stats["steps"] == 1 + stats.steps and stats.steps <= NEW_TOKENS - 1
    assert stats.queries_per_step == [num_beams] * stats.steps   # all beams in one step
    assert engine.pool.num_free_pages == engine.pool.num_pages and engine.tree.num_nodes == 0


def test_early_stopping_ends_the_search_before_max_new_tokens(hf, model):
    """Two EOS ids: the first step's two best tokens, so two hypotheses finish at once. With
    early_stopping=True the search ends as soon as 3 are finished; with False, when the
    heuristic says the best live beam cannot beat the worst finished one (a step later here)."""
    eos = [seq[0] for seq in beam_search(make_engine(model), PROMPT, 4, 1).sequences[:2]]
    steps = {}
    for early_stopping in (True, False):
        result = beam_search(make_engine(model), PROMPT, 3, 12, length_penalty=0.0, eos_token_id=eos,
                             early_stopping=early_stopping)
        ref_sequences, ref_scores = hf_beam_search(hf, PROMPT, 3, 12, length_penalty=0.0, eos_token_id=eos,
                                                   early_stopping=early_stopping)
        assert result.sequences == ref_sequences
        torch.testing.assert_close(torch.tensor(result.scores), torch.tensor(ref_scores), rtol=1e-5, atol=1e-4)
        steps[early_stopping] = result.stats.steps
    assert steps[True] < steps[False] < 11


@pytest.mark.parametrize("prompt,num_beams,length_penalty,early_stopping,eos,max_new_tokens", [
    ([145], 2, 0.0, "never", 144, 4),                    # an EOS candidate ranked below num_beams
    ([118, 147, 102], 4, 0.5, True, 91, 8),              # ... must not finish (top_num_beam_mask)
    ([128, 147], 4, 2.0, True, [141, 32], 12),
    ([15, 60, 220], 2, 1.0, "never", 176, 8),            # "never": the heuristic uses max_new_tokens
])
def test_settings_where_a_detail_decides(hf, model, prompt, num_beams, length_penalty, early_stopping, eos,
                                         max_new_tokens):
    """Settings, found by comparing random ones with transformers, whose result changes if one
    detail of the algorithm (commented) is done differently."""
    kwargs = dict(length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos)
    result = beam_search(make_engine(model), prompt, num_beams, max_new_tokens, **kwargs)
    ref_sequences, ref_scores = hf_beam_search(hf, prompt, num_beams, max_new_tokens, **kwargs)
    assert result.sequences == ref_sequences
    torch.testing.assert_close(torch.tensor(result.scores), torch.tensor(ref_scores), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("prompt,max_new_tokens,page_size", [([7], 1, 1), ([7], 3, 16), ([9, 250, 3, 0, 0, 1], 5, 2)])
def test_short_prompts_and_runs(hf, model, prompt, max_new_tokens, page_size):
    engine = make_engine(model, page_size)
    result = beam_search(engine, prompt, 3, max_new_tokens, eos_token_id=[5, 6])   # two EOS ids: 9 candidates
    assert (result.sequences, pytest.approx(result.scores, rel=1e-5, abs=1e-4)) == hf_beam_search(
        hf, prompt, 3, max_new_tokens, eos_token_id=[5, 6])
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_beams_share_the_prompt_and_prefixes(model):
    """Beams are leaves of one tree: the request never holds one prompt copy per beam,
    and dropped beams give their pages back during the search."""
    prompt = list(range(100, 228))        # 128 tokens: 32 pages of 4
    engine = make_engine(model, page_size=4)
    result = beam_search(engine, prompt, 4, 12)
    # The prompt once, and at most one fresh page per beam per step (a child, or a full last page).
    assert 32 < result.stats.peak_pages <= 32 + 4 * 12 < 4 * 32
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_other_requests_are_left_alone(model):
    engine = make_engine(model)
    other = engine.prefill([1, 2, 3, 4, 5]).node
    free = engine.pool.num_free_pages
    beam_search(engine, PROMPT, 2, 4)
    assert engine.tree.roots == [other] and engine.pool.num_free_pages == free
    engine.tree.check_invariants()


def test_default_eos_is_the_model_s(model, monkeypatch):
    assert model.eos_token_ids == ()   # from_hf_model: none
    free = beam_search(make_engine(model), PROMPT, 3, NEW_TOKENS)
    eos = frequent_token(model, PROMPT, 3)
    explicit = beam_search(make_engine(model), PROMPT, 3, NEW_TOKENS, eos_token_id=eos)
    monkeypatch.setattr(model, "eos_token_ids", (eos,))
    default = beam_search(make_engine(model), PROMPT, 3, NEW_TOKENS)
    assert (default.sequences, default.scores) == (explicit.sequences, explicit.scores)
    assert any(seq[-1] == eos for seq in default.sequences)
    off = beam_search(make_engine(model), PROMPT, 3, NEW_TOKENS, eos_token_id=None)
    assert (off.sequences, off.scores) == (free.sequences, free.scores) != (default.sequences, default.scores)


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_beams=0), "num_beams must be an int >= 1, got 0"),
    (dict(num_beams=-2), "num_beams must be an int >= 1, got -2"),
    (dict(num_beams=2.0), "num_beams must be an int >= 1, got 2.0"),
    (dict(num_beams=True), "num_beams must be an int >= 1, got True"),
    (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
    (dict(length_penalty=float("nan")), "length_penalty must be a finite number, got nan"),
    (dict(length_penalty="1"), "length_penalty must be a finite number, got '1'"),
    (dict(eos_token_id=256), r"eos_token_id must be token ids in \[0, 256\), got 256"),
    (dict(eos_token_id=[3, -1]), r"eos_token_id must be token ids in \[0, 256\), got \[3, -1\]"),
    (dict(eos_token_id=[]), r"eos_token_id must be token ids"),
    (dict(eos_token_id="eos"), r"eos_token_id must be 'model' \(the model's own EOS ids\), a token id"),
    (dict(early_stopping="always"), "early_stopping must be False, True or 'never', got 'always'"),
    (dict(early_stopping=1), "early_stopping must be False, True or 'never', got 1"),
    (dict(num_beams=129), "keeps 258 candidates per step, more than the vocabulary"),
])
def test_bad_arguments_raise_and_change_nothing(model, kwargs, message):
    engine = make_engine(model)
    args = dict(num_beams=2, max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=message):
        beam_search(engine, PROMPT, **args)
    assert engine.tree.num_nodes == 0 and engine.stats["steps"] == 0
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_a_failing_step_frees_the_request(model):
    engine = Engine(model, kv_tokens=64, page_size=4, backend="torch")   # 16 pages: too few for 4 beams
    with pytest.raises(Exception, match="KV pool exhausted"):
        beam_search(engine, list(range(40)), 4, 8)
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages
