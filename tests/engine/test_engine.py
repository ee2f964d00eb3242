"""Engine API: prefill/step contracts, errors that change nothing, pool sizing, the CUDA-graph padding."""
import dataclasses
import importlib.util

import numpy as np
import pytest
import torch

from treedec.engine import CudaGraphConfig, Engine, PrefillOutput, StepOutput, greedy
from treedec.models import ModelConfig, from_config
from treedec.errors import PoolExhaustedError, TreeError

from treedec.workloads.deft import medusa_tree


@pytest.fixture(scope="module")
def tiny():
    return from_config("tiny", seed=0, dtype=torch.float32, device="cpu")


def make_engine(model, **kw):
    return Engine(model, **{"kv_tokens": 512, "page_size": 4, "backend": "torch", **kw})


def test_step_without_pending_tokens(tiny):
    engine = make_engine(tiny)
    with pytest.raises(TreeError, match="needs pending tokens"):
        engine.step()
    engine.prefill([1, 2, 3])
    with pytest.raises(TreeError, match="needs pending tokens"):
        engine.step()


def test_prefill_contracts(tiny):
    engine = make_engine(tiny, kv_tokens=64)
    root = engine.prefill(list(range(10)))
    assert root.logits.shape == (512,) and engine.tree.tokens(root.node) == list(range(10))
    engine.tree.extend(root.node, [4])
    with pytest.raises(TreeError, match="1 pending token"):
        engine.prefill([1, 2])
    engine.step()
    with pytest.raises(TreeError, match="at least one prompt token"):
        engine.prefill([])
    with pytest.raises(TreeError, match="unknown parent"):
        engine.prefill([1], parent=99)
    with pytest.raises(ValueError, match=r"prompt_ids must be token ids in \[0, 512\), got \[512\]"):
        engine.prefill([1, 512])
    free, tokens = engine.pool.num_free_pages, engine.tree.num_tokens
    with pytest.raises(PoolExhaustedError, match="nothing was changed"):
        engine.prefill(list(range(60)))
    assert (engine.pool.num_free_pages, engine.tree.num_tokens) == (free, tokens)
    engine.tree.check_invariants()


def test_chunk_prompt_checks_and_cuts_without_changing_anything(tiny):
    """The one prefill path's chunks: what prefill steps and what a scheduler program adds chunk by chunk."""
    engine = make_engine(tiny, prefill_chunk=4)
    root = engine.prefill([1, 2, 3])
    tokens, free = engine.tree.num_tokens, engine.pool.num_free_pages
    prompt = engine.chunk_prompt(list(range(10)), parent=root.node)
    assert prompt.pieces == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9)) and prompt.parent == root.node
    assert (prompt.first_position, prompt.last_position, prompt.num_tokens, prompt.pages) == (3, 12, 10, 3)
    assert (engine.tree.num_tokens, engine.pool.num_free_pages, engine.tree.num_pending) == (tokens, free, 0)
    for call, match in [(lambda: engine.chunk_prompt([]), "at least one prompt token"),
                        (lambda: engine.chunk_prompt([1], parent=99), "unknown parent"),
                        (lambda: engine.chunk_prompt([512]), r"token ids in \[0, 512\)")]:
        with pytest.raises(ValueError, match=match):
            call()
    node = prompt.add(engine.tree, 0)
    assert engine.tree.parent(node) == root.node and engine.tree.num_pending == 4
    with pytest.raises(ValueError, match="pass the node chunk 0 returned"):
        prompt.add(engine.tree, 1)


@pytest.mark.parametrize("prompt,error,match", [
    ("123", TypeError, "prompt_ids must be a sequence of integers, got str"),   # was [1, 2, 3]
    ([1.5, 2], TypeError, r"prompt_ids\[0\] must be an integer, got float"),  # was truncated to 1
    ([True], TypeError, "got bool"),
    ([2**70], ValueError, "fit in int64"),
])
def test_prompt_ids_are_integers_or_rejected(tiny, prompt, error, match):
    engine = make_engine(tiny, kv_tokens=64)
    with pytest.raises(error, match=match):
        engine.prefill(prompt)
    assert engine.tree.num_tokens == 0 and engine.pool.num_free_pages == engine.pool.num_pages


@pytest.mark.parametrize("rows,error", [([0.5], TypeError), ([2], ValueError), (["a"], TypeError), ([-1], ValueError)])
def test_bad_logits_rows_change_nothing(tiny, rows, error):
    engine = make_engine(tiny, kv_tokens=64)
    root = engine.prefill([1, 2, 3]).node
    engine.tree.extend(root, [4, 5])
    with pytest.raises(error, match="logits_rows"):
        engine.step(logits_rows=rows)
    assert engine.tree.layout().num_queries == 2   # still pending: nothing ran
    engine.step(logits_rows=[1])


def test_chunked_prefill_equals_one_step(tiny):
    prompt = np.random.default_rng(0).integers(0, 512, 37).tolist()
    one, chunked = make_engine(tiny), make_engine(tiny, prefill_chunk=8)
    results = []
    for engine in (one, chunked):
        root = engine.prefill(prompt)
        child = engine.prefill([7, 8, 9, 10, 11], parent=root.node)   # a continuation under the prompt
        engine.tree.extend(child.node, [3])
        results.append((root.logits, child.logits, engine.step().logits, engine.tree.sequence(child.node)))
    assert chunked.stats["steps"] == 5 + 1 + 1 and one.stats["steps"] == 3
    for a, b in zip(results[0][:3], results[1][:3]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert results[0][3] == results[1][3] == prompt + [7, 8, 9, 10, 11, 3]
    torch.testing.assert_close(one.pool.k, chunked.pool.k, atol=1e-5, rtol=0)


def test_logits_rows_and_query_order(tiny):
    engine = make_engine(tiny)
    root = engine.prefill([1, 2, 3, 4]).node
    kids = engine.tree.branch(root, [[5, 6], [7]])
    assert engine.pending_nodes().tolist() == [kids[0], kids[0], kids[1]]
    assert engine.tree.pending_tokens().tolist() == [5, 6, 7]
    with pytest.raises(ValueError, match=r"logits_rows must be query indices in \[0, 3\)"):
        engine.step(logits_rows=[3])
    full = make_engine(tiny)
    full.prefill([1, 2, 3, 4])
    full.tree.branch(0, [[5, 6], [7]])
    all_rows = full.step().logits
    some = engine.step(logits_rows=torch.tensor([2, 0])).logits
    torch.testing.assert_close(some, all_rows[[2, 0]], atol=1e-6, rtol=0)
    assert greedy(all_rows).tolist() == all_rows.argmax(-1).tolist()


def test_return_hidden_gives_the_lm_head_input(tiny):
    engine, plain = make_engine(tiny), make_engine(tiny)
    root = engine.prefill([1, 2, 3, 4], return_hidden=True)
    assert root.hidden.shape == (tiny.config.hidden_size,)
    torch.testing.assert_close(root.logits, plain.prefill([1, 2, 3, 4]).logits, atol=0, rtol=0)
    torch.testing.assert_close(tiny.lm_head(root.hidden), root.logits, atol=1e-5, rtol=0)
    for e in (engine, plain):
        e.tree.branch(root.node, [[5, 6], [7]])
    some = engine.step(logits_rows=[2, 0], return_hidden=True)
    assert some.hidden.shape == (2, tiny.config.hidden_size)
    torch.testing.assert_close(some.logits, plain.step().logits[[2, 0]], atol=1e-6, rtol=0)
    torch.testing.assert_close(tiny.lm_head(some.hidden), some.logits, atol=1e-5, rtol=0)


def test_step_and_prefill_return_their_typed_outputs_with_unasked_fields_none(tiny):
    engine = make_engine(tiny)
    engine.capture_hidden_layers([0])
    engine.add_row_head("two", _two_heads)
    root = engine.prefill([1, 2, 3, 4])
    assert isinstance(root, PrefillOutput) and isinstance(root.node, int) and root.node in engine.tree
    assert root.logits.shape == (tiny.config.vocab_size,) and root.hidden is None and root.heads is None
    engine.tree.branch(root.node, [[5, 6], [7]])
    plain = engine.step(logits_rows=[2, 0])
    assert isinstance(plain, StepOutput) and plain.logits.shape == (2, tiny.config.vocab_size)
    assert plain.hidden is None and plain.aux is None and plain.heads is None
    engine.tree.extend_many({leaf: [8] for leaf in engine.tree.live_leaves()})
    every = engine.step(logits_rows=[1], hidden_rows=[0, 1], return_hidden=True, return_aux=True, return_heads=True)
    assert every.hidden.shape == (2, tiny.config.hidden_size) and every.aux.shape == (2, 1, tiny.config.hidden_size)
    assert list(every.heads) == ["two"] and every.heads["two"].shape == (1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        every.logits = None


def _two_heads(hidden):
    """A row head: [rows, hidden] -> [rows, 2] (sum and first feature)."""
    return torch.stack([hidden.sum(-1), hidden[:, 0]], dim=-1)


def _row_head_run(engine):
    """Steps with a row head: prefill, a branched step, a token tree; each step's (logits, hidden, heads)."""
    engine.add_row_head("two", _two_heads)
    root = engine.prefill([1, 2, 3, 4], return_hidden=True, return_heads=True)
    out = [(root.logits, root.hidden, root.heads)]
    engine.tree.branch(root.node, [[5, 6], [7]])
    step = engine.step(logits_rows=[2, 0], return_hidden=True, return_heads=True)
    out.append((step.logits, step.hidden, step.heads))
    leaf = engine.tree.live_leaves()[0]
    engine.tree.add_token_tree(leaf, [9, 10, 11], [-1, 0, 0])
    step = engine.step(return_heads=True)
    out.append((step.logits, step.hidden, step.heads))
    return out


def test_row_heads_run_at_the_step_rows(tiny):
    plain = make_engine(tiny)
    for logits, hidden, heads in _row_head_run(plain):
        assert list(heads) == ["two"]
        if hidden is not None:
            torch.testing.assert_close(heads["two"], _two_heads(hidden.reshape(-1, hidden.shape[-1])).reshape(
                heads["two"].shape), atol=1e-5, rtol=0)
        assert heads["two"].shape[:-1] == logits.shape[:-1]
    assert plain.row_heads == ("two",) and plain.row_head("two") is _two_heads
    with pytest.raises(ValueError, match="a row head named 'two' is already added"):
        plain.add_row_head("two", _two_heads)
    with pytest.raises(TypeError, match="head must be callable"):
        plain.add_row_head("other", 3)
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        plain.add_row_head("", _two_heads)
    plain.remove_row_head("two")
    with pytest.raises(ValueError, match=r"no row head named 'two'; the engine has \[\]"):
        plain.remove_row_head("two")
    assert plain.row_heads == ()


@pytest.mark.triton
def test_row_heads_in_static_steps_equal_eager(tiny, triton_device):
    """A row head computed in the graphed (static, uncaptured here) forward over every row equals
    the eager step's at the asked rows."""
    if triton_device.type == "cuda":
        pytest.skip("covered by the GPU test with real capture")
    eager = _row_head_run(make_engine(tiny))
    static_engine = make_engine(tiny, backend="triton", cuda_graphs=CudaGraphConfig(max_queries=64, capture=False))
    static = _row_head_run(static_engine)
    assert static_engine.graph_stats["static_eager"] == 3      # every step, the prefill's too, in a bucket
    for a, b in zip(eager, static):
        for x, y in zip(a[:2], b[:2]):
            if x is not None:
                torch.testing.assert_close(x, y, atol=2e-5, rtol=0)
        torch.testing.assert_close(a[2]["two"], b[2]["two"], atol=2e-4, rtol=0)


def test_pending_rows_give_token_order(tiny):
    engine = make_engine(tiny)
    root = engine.prefill([1, 2, 3]).node
    parents = [-1, 0, -1, 1, 0]
    ids = engine.tree.add_token_tree(root, [10, 11, 12, 13, 14], parents)
    rows = engine.pending_rows(ids)
    assert engine.tree.pending_tokens()[rows].tolist() == [10, 11, 12, 13, 14]
    assert sorted(rows.tolist()) == list(range(5)) and rows.tolist() != list(range(5))  # depth-first != token order
    ordered = engine.step(logits_rows=rows).logits
    engine.tree.prune(ids[0])
    engine.tree.prune(ids[2])
    ids = engine.tree.add_token_tree(root, [10, 11, 12, 13, 14], parents)
    torch.testing.assert_close(engine.step().logits[rows], ordered, atol=1e-6, rtol=0)
    engine.tree.extend(ids[3], [5])
    with pytest.raises(TreeError, match=r"node\(s\) \[%d\] have no pending tokens" % ids[4]):
        engine.pending_rows([ids[3], ids[4]])


def test_pool_size(tiny):
    engine = make_engine(tiny, kv_tokens=103, page_size=8)
    assert engine.kv_capacity_tokens == 96 and engine.pool.num_pages == 12
    assert "kv_tokens=103" in engine.kv_pool_reason
    with pytest.raises(ValueError, match="kv_tokens is required on cpu"):
        Engine(tiny, backend="torch")
    with pytest.raises(ValueError, match="kv_tokens must be an int >= page_size"):
        Engine(tiny, kv_tokens=3, page_size=4, backend="torch")


def test_sliding_window_is_refused():
    """A config's window its layers' variants do not attend caps the positions (every family's layers declare
    their windows now: a model that does not, stands in)."""
    from treedec.attention.variant import AttentionVariant

    model = from_config(ModelConfig.from_name("tiny", sliding_window=8), dtype=torch.float32, device="cpu")
    model.attention_variants = lambda: (AttentionVariant(),) * model.config.num_layers
    engine = make_engine(model)
    with pytest.raises(NotImplementedError, match="past the model's sliding window of 8"):
        engine.prefill(list(range(9)))
    root = engine.prefill(list(range(8))).node
    engine.tree.extend(root, [1])
    with pytest.raises(NotImplementedError, match="sliding window"):
        engine.step()


def test_cuda_graph_options_are_checked(tiny):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_engine(tiny, cuda_graphs=True)
    with pytest.raises(ValueError, match="needs a kernel attention backend"):
        make_engine(tiny, cuda_graphs=CudaGraphConfig(capture=False))
    with pytest.raises(ValueError, match="max_queries must be an int >= 1"):
        CudaGraphConfig(max_queries=0)


@pytest.mark.slow
@pytest.mark.triton
def test_static_padded_steps_equal_eager(tiny, triton_device):
    """The arithmetic of CUDA-graph steps (padded plans in static buffers, the Triton kernels),
    run without capture: logits and the pool's K/V equal eager steps, over buckets that are
    reused by other trees and grown."""
    if triton_device.type == "cuda":
        pytest.skip("covered by the GPU test with real capture")
    eager = make_engine(tiny)
    static = make_engine(tiny, backend="triton", cuda_graphs=CudaGraphConfig(max_queries=64, max_graphs=3,
                                                                             capture=False))
    medusa = medusa_tree(32)
    results = []
    for engine in (eager, static):
        out = []
        root = engine.prefill(list(range(40, 77)))
        out.append(root.logits[None])
        kids = engine.tree.branch(root.node, [[1], [3], [4]])
        out.append(engine.step().logits)
        engine.tree.add_token_tree(kids[0], list(range(32)), medusa.parents)
        engine.tree.extend(kids[1], [9])
        out.append(engine.step().logits)                 # 33 queries: the 64 bucket, after the prefill
        engine.tree.extend_many({leaf: [7] for leaf in engine.tree.live_leaves()})
        step = engine.step(logits_rows=[0, 5], return_hidden=True)   # a Medusa-heads step: graphed too
        out += [step.logits, step.hidden]
        engine.tree.extend_many({leaf: [8] for leaf in engine.tree.live_leaves()})
        step = engine.step(return_hidden=True)
        out += [step.logits, step.hidden]
        root2 = engine.prefill(list(range(100, 170)))   # 70 queries: past max_queries, eager
        out.append(root2.logits[None])
        engine.tree.branch(root2.node, [[2]])
        out.append(engine.step().logits)                 # 1 query: a fourth bucket, past max_graphs
        results.append(out)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    torch.testing.assert_close(eager.pool.k, static.pool.k, atol=2e-5, rtol=0)
    torch.testing.assert_close(eager.pool.v, static.pool.v, atol=2e-5, rtol=0)
    stats = static.graph_stats
    assert stats["static_eager"] == 5
    assert stats["eager: more than max_queries=64 queries"] == 1
    assert stats["eager: max_graphs=3 graphs already captured"] == 1


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graph_steps_equal_eager_steps(compiled):
    """Captured and replayed steps over changing trees give the eager steps' logits and K/V."""
    model = from_config("tiny", seed=0, dtype=torch.bfloat16, device="cuda")
    if compiled:
        model.compile_pointwise()
    eager = Engine(model, kv_tokens=8192, page_size=16)
    graphed = Engine(model, kv_tokens=8192, page_size=16, cuda_graphs=True)
    medusa = medusa_tree(64)
    results = []
    for engine in (eager, graphed):
        gen = np.random.default_rng(1)
        out = []
        root = engine.prefill(gen.integers(0, 512, 3000).tolist()).node
        for step in range(12):   # a speculative loop: verify a token tree, keep one path, repeat
            ids = engine.tree.add_token_tree(root, gen.integers(0, 512, 64).tolist(), medusa.parents)
            verified = engine.step(return_hidden=bool(step % 2))
            out += [verified.logits] + ([verified.hidden] if step % 2 else [])
            engine.tree.prune(ids[0])
            engine.tree.extend(root, gen.integers(0, 512, int(gen.integers(1, 300))).tolist())
            out.append(engine.step(logits_rows=[0]).logits)
        kids = engine.tree.branch(root, [[int(t)] for t in gen.integers(0, 512, 5)])
        for _ in range(3):
            out.append(engine.step().logits)
            engine.tree.extend_many({k: [int(gen.integers(0, 512))] for k in kids})
        out.append(engine.step().logits)
        results.append(out)
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(eager.pool.k.float(), graphed.pool.k.float(), atol=2e-2, rtol=2e-2)
    assert graphed.graph_stats["replays"] > graphed.graph_stats["captures"] > 0
    eager = {key for key in graphed.graph_stats if key.startswith("eager")}
    long_pieces = f"eager: more than max_queries={CudaGraphConfig().max_queries} queries"
    assert eager <= {long_pieces}, graphed.graph_stats   # long prompt pieces only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pool_sized_from_free_gpu_memory():
    model = from_config("tiny", dtype=torch.bfloat16, device="cuda")
    free_before = torch.cuda.mem_get_info()[0]
    engine = Engine(model, memory_fraction=0.5)
    c = model.config
    pool_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2 * engine.kv_capacity_tokens
    assert 0 < pool_bytes <= 0.5 * free_before
    assert "sized from free GPU memory" in engine.kv_pool_reason
    logits = engine.prefill([1, 2, 3]).logits
    assert logits.shape == (c.vocab_size,) and logits.device.type == "cuda"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_backend_steps_equal_triton_steps():
    """An eager engine on auto (cuda on H100/H200, for the 128-token tree and the decode step alike)
    computes the logits of an engine pinned to triton."""
    model = from_config("tiny", seed=0, dtype=torch.bfloat16, device="cuda")
    engines = [Engine(model, kv_tokens=8192, page_size=16, backend=b) for b in ("auto", "triton")]
    if torch.cuda.get_device_capability() == (9, 0):   # tiny: 2 query heads per KV head
        assert engines[0].attn.backend == "cuda"
    medusa = medusa_tree(128)
    results = []
    for engine in engines:
        gen = np.random.default_rng(3)
        root = engine.prefill(gen.integers(0, 512, 2500).tolist()).node
        ids = engine.tree.add_token_tree(root, gen.integers(0, 512, 128).tolist(), medusa.parents)
        verify = engine.step().logits
        engine.tree.prune(ids[0])
        engine.tree.extend(root, [int(gen.integers(0, 512))])  # a decode step under the same prompt
        results.append((verify, engine.step(logits_rows=[0]).logits))
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("graphs", [False, True])
def test_step_reads_device_tokens_instead_of_placeholders(tiny, graphs):
    """step(tokens=...): the pending tokens' ids come from a tensor (pipelined decoding), eagerly and
    through the static buffers of a graphed step; bad tensors are refused before anything runs."""
    if graphs and (importlib.util.find_spec("triton") is None or torch.cuda.is_available()):
        pytest.skip("the uncaptured static path runs the triton kernels in the CPU interpreter")
    options = dict(backend="triton", cuda_graphs=CudaGraphConfig(capture=False)) if graphs else {}
    real, placeholders = make_engine(tiny, **options), make_engine(tiny, **options)
    for engine in (real, placeholders):
        root = engine.prefill(list(range(30, 50))).node
        engine.tree.branch(root, [[7], [0]] if engine is real else [[0], [0]])
    expected = real.step().logits
    for bad, error in [(torch.tensor([7]), ValueError), (torch.tensor([7.0, 0.0]), TypeError), ([7, 0], TypeError)]:
        with pytest.raises(error, match="tokens must"):
            placeholders.step(tokens=bad)
    torch.testing.assert_close(placeholders.step(tokens=torch.tensor([7, 0])).logits, expected, atol=1e-5, rtol=0)
