"""Tiny engines for tests: a random tiny Llama on the CPU and plain greedy decoding as the reference."""
from __future__ import annotations

import functools

import torch

from treedec.engine import Engine, from_config, greedy


@functools.lru_cache(maxsize=1)
def tiny_model():
    """The tiny random Llama (fp32, CPU), made once per test session."""
    return from_config("tiny", seed=0, dtype=torch.float32, device="cpu")


def make_engine(model, page_size=4):
    return Engine(model, kv_tokens=1024, page_size=page_size, backend="torch")


def plain_greedy(model, prompt, n):
    """The first ``n`` greedy tokens after ``prompt``, one token per step."""
    engine = make_engine(model)
    node, logits = engine.prefill(prompt)
    out = [int(greedy(logits))]
    while len(out) < n:
        engine.tree.extend(node, out[-1:])
        out.append(int(greedy(engine.step()[0])))
    return out
