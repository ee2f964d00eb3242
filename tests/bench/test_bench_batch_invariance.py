import json

import pytest

from bench.batch_invariance import compare, conversations, main
from bench.real_checkpoint import CheckpointUnavailable, smollm2_checkpoint


def test_conversations_are_distinct_and_bounded():
    convs = conversations(48)
    assert len({c[1]["content"] for c in convs}) == 48 and all(c[0]["role"] == "system" for c in convs)
    with pytest.raises(ValueError, match="at most 48"):
        conversations(49)


def test_compare_counts_bitwise_and_token_equality():
    from types import SimpleNamespace as NS
    from treedec.sampling.logits import Logprob

    def out(tokens, logprobs):
        steps = [{t: Logprob(lp, 1)} for t, lp in zip(tokens, logprobs)]
        return NS(outputs=[NS(token_ids=tokens, logprobs=steps)])

    found = compare([out([1, 2], [-0.5, -1.0]), out([1, 2], [-0.5, -1.0]), out([1, 3], [-0.5, -1.0])],
                    [out([1, 2], [-0.5, -1.0]), out([1, 2], [-0.5, -1.25]), out([1, 2], [-0.5, -1.0])])
    assert (found["equal"], found["tokens_equal"], found["of"]) == (1, 2, 3)
    assert found["first_difference"] == [{"tokens": 2, "logprobs": 1}, {"tokens": 1, "logprobs": 2}]


@pytest.mark.slow
def test_batch_invariance_bench_smoke_run(tmp_path, capsys):
    try:
        smollm2_checkpoint()
    except CheckpointUnavailable as e:
        pytest.skip(str(e))
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*-batch-invariance-smoke.json")
    results = json.loads(path.read_text())
    invariant = results["modes"]["invariant"]
    # in the mode (CPU: F.linear a row at a time) every pair is equal bit for bit
    assert invariant["greedy"]["equal"] == 3 and invariant["sampled"]["equal"] == 2
    cache = invariant["prefix_cache"]
    assert cache["hit_vs_alone"]["equal"] == 2 and cache["cached_tokens_hit"] > 0
    assert invariant["speculative"]["equal"] == 2
    assert "the batched greedy call in the mode" in capsys.readouterr().out


def test_random_weights_smoke_run(tmp_path, capsys):
    """--random-weights (the 8B shape's equalities on a GPU): the tiny shape on the CPU, token-id prompts; in the mode
    every pair is equal bit for bit, and the results name the shape."""
    assert main(["--random-weights", "--smoke", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*-batch-invariance-smoke-random-tiny.json")
    results = json.loads(path.read_text())
    assert results["settings"]["config"] == "tiny" and results["settings"]["random_weights"] is True
    invariant = results["modes"]["invariant"]
    assert invariant["greedy"]["equal"] == 3 and invariant["sampled"]["equal"] == 2
    assert invariant["prefix_cache"]["hit_batched_vs_alone"]["equal"] == 2
    assert invariant["prefix_cache"]["cached_tokens_hit"] > 0 and invariant["speculative"]["equal"] == 2


def test_config_needs_random_weights(capsys):
    with pytest.raises(SystemExit):
        main(["--config", "tiny"])
    assert "add --random-weights" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--random-weights", "--config", "no-such-shape"])
    assert "--config must be one of" in capsys.readouterr().err
