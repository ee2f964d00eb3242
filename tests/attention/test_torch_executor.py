"""The torch backend's three forms (dense, chunks, rows) against the dense reference, and what ``auto`` picks."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from treedec import PlanConfig, TreeAttention
from treedec.attention import AttentionVariant, reference_tree_attention
from treedec.attention.backends import TorchBackend
from treedec.attention.torch_executor import DENSE_MAX_WASTE, prepare_torch, run_torch
from treedec.tree import PagedKVPool, SequenceTree
from tests.engines import make_engine, plain_greedy, tiny_model
from tests.trees import random_forest, rel_error


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from([1, 3, 16]), group=st.sampled_from([1, 3, 4]),
       planner=st.sampled_from(["flatten", "node", "node_chunk", "path", "batch-invariant path"]),
       chunk_size=st.sampled_from([7, 32, 128]), form=st.sampled_from(["dense", "chunks", "rows", "auto"]),
       return_lse=st.booleans())
def test_every_form_equals_the_reference(seed, page_size, group, planner, chunk_size, form, return_lse):
    rng = np.random.default_rng(seed)
    hkv = int(rng.integers(1, 3))
    tree = random_forest(rng, page_size, num_kv_heads=hkv, head_dim=64)
    invariant = planner == "batch-invariant path"
    attn = TreeAttention(hkv * group, hkv, 64, backend="torch", device="cpu", dtype=torch.float32,
                         plan_config=PlanConfig(planner.split()[-1], chunk_size, int(rng.integers(1, 9)),
                                                batch_invariant=invariant))
    plan = attn.plan(tree).plan
    q = torch.randn(plan.num_queries, hkv * group, 64, generator=torch.Generator().manual_seed(seed))
    k_cache, v_cache = tree.pool.layer(0)
    launch = prepare_torch(plan, "cpu", form)
    assert launch.form in ("dense", "chunks", "rows") and (form == "auto" or launch.form == form)
    out, lse = run_torch(q, k_cache, v_cache, launch, attn.variant, return_lse=return_lse)
    ref, ref_lse = reference_tree_attention(q, k_cache, v_cache, plan.layout, attn.variant)
    assert out.dtype == torch.float32 and out.shape == q.shape
    assert rel_error(out, ref) < 1e-5
    if return_lse or launch.form != "dense":   # the chunks and rows forms merge by the LSE: they have it anyway
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
    else:
        assert lse is None


def _tree(prompts, page_size=4, pending=1):
    """One request per prompt in a fresh pool, each with ``pending`` tokens to decode."""
    pool = PagedKVPool(64, page_size, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    pool.k.normal_(generator=torch.Generator().manual_seed(0))
    pool.v.normal_(generator=torch.Generator().manual_seed(1))
    tree = SequenceTree(pool)
    roots = [tree.add_prompt(range(n)) for n in prompts]
    tree.commit_step()
    for root in roots:
        tree.extend(root, list(range(pending)))
    return tree, roots


def test_auto_is_dense_for_one_request_and_chunks_for_a_forest_and_reports_it():
    attn = TreeAttention(4, 2, 64, backend="torch", device="cpu", dtype=torch.float32)
    one, _ = _tree([37])
    plan = attn.plan(one)
    assert plan.prepared.form == "dense" and plan.prepared.reads is None   # one query reading every token
    assert plan.prepared.slot_range == (0, 38)                              # a fresh pool's pages, in order
    prompt = SequenceTree(PagedKVPool(16, 4, num_kv_heads=2, head_dim=64, dtype=torch.float32))
    prompt.add_prompt(range(20))                                            # a prompt chunk: causal
    plan = attn.plan(prompt)
    assert plan.prepared.form == "dense" and plan.prepared.reads is not None
    forest, _ = _tree([40, 40, 40, 40])
    plan = attn.plan(forest)
    needed = 4 * 41   # each query reads its own request's tokens
    assert 4 * plan.plan.num_tokens > DENSE_MAX_WASTE * needed and plan.prepared.form == "chunks"
    assert attn.backend_impl.forms == {"dense": 2, "chunks": 1}


def test_a_branched_tree_gathers_its_slots_and_equals_the_reference():
    tree, [root] = _tree([10], pending=0)
    leaves = tree.branch(root, [[1, 2], [3]])
    tree.commit_step()
    tree.extend(leaves[1], [4])   # the second branch's slots follow the first's: not consecutive from the root
    attn = TreeAttention(4, 2, 64, backend="torch", device="cpu", dtype=torch.float32)
    plan = attn.plan(tree)
    launch = plan.prepared
    assert launch.form == "dense" and launch.slot_range is None and launch.slots is not None
    q = torch.randn(1, 4, 64)
    k_cache, v_cache = tree.pool.layer(0)
    ref, _ = reference_tree_attention(q, k_cache, v_cache, plan.plan.layout, attn.variant)
    assert rel_error(attn.run(q, k_cache, v_cache, plan), ref) < 1e-6


def test_forms_are_named_or_refused():
    tree, _ = _tree([5])
    plan = TreeAttention(4, 2, 64, backend="torch", device="cpu").plan_host(tree)
    with pytest.raises(ValueError, match="form must be one of"):
        prepare_torch(plan, "cpu", "sparse")
    with pytest.raises(ValueError, match="form must be one of"):
        TorchBackend(AttentionVariant(sm_scale=0.125), form="sparse")


@pytest.mark.parametrize("form", ["dense", "chunks", "rows"])
def test_greedy_decoding_is_the_same_in_every_form(form):
    model = tiny_model()
    prompt = list(range(3, 40))
    reference = plain_greedy(model, prompt, 12)   # auto: dense (one request)
    engine = make_engine(model)
    engine.attn.backend_impl.form = form
    prefilled = engine.prefill(prompt)
    out = [int(prefilled.logits.argmax())]
    while len(out) < 12:
        engine.tree.extend(prefilled.node, out[-1:])
        out.append(int(engine.step().logits[0].argmax()))
    assert out == reference
    assert set(engine.attn.backend_impl.forms) == {form}
