"""Two threads in one engine raise instead of corrupting it; a vocabulary limit keeps ids the
tokenizer lacks out of every output (#34 items 4 and 11)."""
from __future__ import annotations

import threading

import pytest
import torch

from engines import make_engine, tiny_model
from treedec.sampling.params import SamplingParams
from treedec.errors import ConcurrentUseError
from treedec.tree.thread_guard import ThreadGuard


def test_guard_is_reentrant_for_one_thread_and_refuses_another():
    guard = ThreadGuard("this Engine")
    errors: list[BaseException] = []

    def other():
        try:
            with guard:
                pass
        except BaseException as error:   # collected for the main thread to check
            errors.append(error)

    with guard:
        with guard:   # re-entry (run_programs -> step) is fine
            thread = threading.Thread(target=other, name="intruder")
            thread.start()
            thread.join()
    assert len(errors) == 1 and isinstance(errors[0], ConcurrentUseError)
    assert "thread 'MainThread'" in str(errors[0]) and "'intruder'" in str(errors[0])
    other()   # released: another thread may now enter
    assert len(errors) == 1


def test_a_second_thread_stepping_the_engine_raises_and_changes_nothing():
    engine = make_engine(tiny_model())
    node = engine.prefill([1, 2, 3]).node
    engine.tree.extend(node, [4])
    free_before, pending_before = engine.pool.num_free_pages, engine.tree.num_pending
    errors: list[BaseException] = []

    def step_from_another_thread():
        try:
            engine.step()
        except BaseException as error:
            errors.append(error)

    with engine.guard:   # the engine's own thread is inside it (as a scheduler run is)
        thread = threading.Thread(target=step_from_another_thread)
        thread.start()
        thread.join()
    assert len(errors) == 1 and isinstance(errors[0], ConcurrentUseError), errors
    assert engine.tree.num_pending == pending_before and engine.pool.num_free_pages == free_before
    engine.step()   # the owner goes on: nothing was half-done
    assert engine.tree.num_pending == 0


def test_threads_taking_turns_are_fine():
    engine = make_engine(tiny_model())
    results = []

    def run(prompt):
        prefilled = engine.prefill(prompt)
        results.append(int(prefilled.logits.argmax()))
        engine.tree.prune(prefilled.node)

    for prompt in ([1, 2, 3], [4, 5]):
        thread = threading.Thread(target=run, args=(prompt,))
        thread.start()
        thread.join()
    assert len(results) == 2 and engine.pool.num_free_pages == engine.pool.num_pages


def test_restrict_vocab_masks_every_output_row():
    model = tiny_model()
    engine = make_engine(model)
    vocab = model.config.vocab_size
    prefilled = engine.prefill([1, 2, 3])
    top = int(prefilled.logits.argmax())
    engine.restrict_vocab(top)   # the id greedy would take is now out of range
    assert engine.vocab_limit == top
    engine.tree.extend(prefilled.node, [top - 1])
    out = engine.step().logits
    assert out.shape[-1] == vocab
    assert torch.isneginf(out[..., top:]).all() and torch.isfinite(out[..., :top]).all()
    assert int(out.argmax()) < top
    engine.restrict_vocab(vocab)   # a larger size does not widen it
    assert engine.vocab_limit == top


@pytest.mark.parametrize("size", [0, -1, 10**9, 2.5, True, "8", None])
def test_restrict_vocab_names_a_bad_size(size):
    engine = make_engine(tiny_model())
    with pytest.raises(ValueError, match=r"size must be an int in \[1, \d+\]"):
        engine.restrict_vocab(size)
    assert engine.vocab_limit is None


def test_restrict_vocab_to_the_whole_vocabulary_changes_nothing():
    model = tiny_model()
    engine = make_engine(model)
    engine.restrict_vocab(model.config.vocab_size)
    assert engine.vocab_limit is None
    assert torch.isfinite(engine.prefill([1, 2, 3]).logits).all()


class _PaddedTokenizer:
    """A tokenizer that knows only the first ``size`` ids of a model whose embedding is larger."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def encode(self, text):
        return [ord(c) % self.size for c in text]

    def decode(self, ids):
        if any(int(i) >= self.size for i in ids):
            raise ValueError(f"ids past the tokenizer's {self.size}: {list(ids)}")
        return "".join(chr(65 + int(i) % 26) for i in ids)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_batch_with_a_smaller_tokenizer_never_samples_ids_it_cannot_decode(temperature):
    from treedec.programs.generate import generate_batch
    from treedec.runtime.requests import RequestSpec
    model = tiny_model()
    engine = make_engine(model)
    prompt = [1, 2, 3]
    prefilled = engine.prefill(prompt)
    size = int(prefilled.logits.argmax())   # greedy's first pick lies past the tokenizer
    engine.tree.prune(prefilled.node)
    tokenizer = _PaddedTokenizer(size)
    specs = [RequestSpec(0, prompt_ids=prompt, params=SamplingParams(max_tokens=8, temperature=temperature, seed=1))]
    [result], _ = generate_batch(engine, specs, tokenizer=tokenizer)
    assert engine.vocab_limit == size and len(result.output_ids) == 8
    assert max(result.output_ids) < size and result.text == tokenizer.decode(result.output_ids)
