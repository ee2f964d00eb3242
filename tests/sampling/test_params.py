"""treedec.sampling.params: a seed's range (an int64, as vLLM's) and a negative seed's word."""
import pytest
import torch

from tests.engines import tiny_model
from treedec import LLM, SamplingParams
from treedec.sampling.params import SEED_MAX, SEED_MIN, seed_word
from treedec.sampling.rng import counter_uniform


def test_a_seed_is_any_int64():
    assert (SEED_MIN, SEED_MAX) == (-2**63, 2**63 - 1)
    assert SamplingParams(seed=-1).seed == -1 and SamplingParams(seed=SEED_MIN).seed == SEED_MIN
    for bad in (SEED_MIN - 1, SEED_MAX + 1, 1.5, True):
        with pytest.raises(ValueError, match=r"seed must be an int in \[-2\*\*63, 2\*\*63\) \(an int64\) or None"):
            SamplingParams(seed=bad)


def test_a_negative_seed_is_its_two_s_complement_word():
    """Every int64 seed is one distinct 64-bit word: -1 is 2**64 - 1, and the counter-based generator's int64
    tensors hold those bits (its hash of -1 is the hash of that word, not of 1 or of 2**63 - 1)."""
    assert seed_word(-1) == 2**64 - 1 and seed_word(SEED_MIN) == 2**63 and seed_word(5) == 5
    counters = torch.arange(64, dtype=torch.int64)
    draws = {s: counter_uniform(torch.tensor(s, dtype=torch.int64), torch.tensor(0), counters)
             for s in (-1, 1, SEED_MAX, SEED_MIN, 0)}
    assert len({tuple(d.tolist()) for d in draws.values()}) == len(draws)
    assert torch.equal(draws[-1], counter_uniform(torch.tensor(-1), torch.tensor(0), counters))   # deterministic


def test_generate_with_a_negative_seed_is_reproducible_and_its_own():
    llm = LLM(tiny_model(), None, kv_tokens=1024, page_size=4, backend="torch")
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}

    def run(seed):
        [out] = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=12, seed=seed, n=2), use_tqdm=False)
        return [o.token_ids for o in out.outputs]

    assert run(-7) == run(-7) != run(7)
    assert run(-7)[0] != run(-7)[1]   # (the outputs of one seed differ by their index)
