"""Graphed steps send their logits and hidden rows with the step's inputs (GraphRunner.load's gathers):
what they return equals the eager step's, for every shape of rows (repeats past the bucket included)."""
import importlib.util
import os

import numpy as np
import pytest
import torch

from treedec.engine import CudaGraphConfig, Engine
from treedec.models import from_config
from treedec.engine.cuda_graphs import GraphRunner


@pytest.fixture(scope="module")
def tiny():
    return from_config("tiny", seed=0, dtype=torch.float32, device="cpu")


def _steps(engine: Engine) -> list:
    """Steps over a branch of 5 tokens with logits, hidden and aux rows of every kind."""
    engine.capture_hidden_layers([1])
    root = engine.prefill(list(range(20, 33))).node
    cases = [dict(logits_rows=[4, 0, 4]),                                        # fewer rows, in any order
             dict(logits_rows=[1] * 40, return_hidden=True),                      # more rows than the bucket
             dict(logits_rows=[2], hidden_rows=[0, 1, 2, 3, 4], return_hidden=True, return_aux=True),
             dict(logits_rows=None, hidden_rows=[3] * 20, return_hidden=True),     # hidden rows past the bucket
             dict(logits_rows=np.array([3, 1]), hidden_rows=[], return_aux=True)]
    out = []
    for case in cases:
        leaf = engine.tree.branch(root, [[5, 6, 7, 8, 9]])[0]
        result = engine.step(**case)
        out.append(tuple(t for t in (result.logits, result.hidden, result.aux) if t is not None))
        engine.tree.prune(leaf)
        engine.tree.commit_step()
    return out


@pytest.mark.slow
@pytest.mark.triton
def test_gathered_rows_of_graphed_steps_equal_eager(tiny, triton_device, monkeypatch):
    if triton_device.type == "cuda":
        pytest.skip("the uncaptured static path runs the triton kernels in the CPU interpreter")
    eager = _steps(Engine(tiny, kv_tokens=512, page_size=4, backend="torch"))
    graphed_engine = Engine(tiny, kv_tokens=512, page_size=4, backend="triton",
                            cuda_graphs=CudaGraphConfig(max_queries=16, capture=False))
    indexed = []
    original = GraphRunner.gather_index
    monkeypatch.setattr(GraphRunner, "gather_index",
                        lambda self, entry, which: indexed.append((which, original(self, entry, which))) or indexed[-1][1])
    graphed = _steps(graphed_engine)
    assert graphed_engine.graph_stats["static_eager"] == 6    # the prefill and the five steps
    # Rows within the bucket were indexed on the device from the inputs' copy; 40 and 20 rows were not.
    assert {(which, index is not None) for which, index in indexed} == {(0, True), (0, False), (1, True), (1, False)}
    for a, b in zip(eager, graphed):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert x.shape == y.shape
            torch.testing.assert_close(x, y, atol=2e-5, rtol=0)


def test_load_refuses_more_gathers_than_its_section(tiny):
    runner = Engine(tiny, kv_tokens=512, page_size=4, backend="triton",
                    cuda_graphs=CudaGraphConfig(capture=False)).graph_runner if _triton_here() else None
    if runner is None:
        pytest.skip("needs a kernel backend (triton)")
    with pytest.raises(ValueError, match="at most 3 gathers, got 4"):
        runner.load(None, None, None, None, (None, None, None, None))


def _triton_here() -> bool:
    return importlib.util.find_spec("triton") is not None and (torch.cuda.is_available()
                                                                or os.environ.get("TRITON_INTERPRET") == "1")
