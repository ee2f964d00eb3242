"""Split-KV chunks for unshared steps (treedec.attention.split_kv) on the persistent grid's flatten plans."""
import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from treedec.attention import AttentionVariant, PlanConfig, make_plan, reference_tree_attention
from treedec.attention.read_intervals import read_intervals
from treedec.attention.planners import PERSISTENT_MAX_CHUNK
from treedec.attention.split_kv import split_kv_bounds, unshared_segments
from treedec.attention.torch_executor import run_plan_torch
from treedec.tree import PagedKVPool, SequenceTree, TreeLayout
from tests.attention.test_planners import read_pairs_from_plan
from tests.trees import path_slots, rel_error


def unshared_layout(lengths):
    """Independent sequences, one query at the end of each."""
    n = len(lengths)
    return TreeLayout.from_parents([-1] * n, list(lengths), [(i, length - 1) for i, length in enumerate(lengths)])


def segments_of(layout):
    q_idx, lo, hi, kv_slots, *_ = read_intervals(layout)
    return unshared_segments(q_idx, lo, hi, len(kv_slots))


def grid(ctas, heads=8):
    return PlanConfig(query_tile=32, num_kv_heads=heads, persistent_ctas=ctas)


def test_segments_are_the_sequences_and_none_where_a_token_is_shared():
    assert segments_of(unshared_layout([5, 7, 3])).tolist() == [0, 5, 12, 15]
    # a prompt read by two branches' queries: not an unshared step
    shared = TreeLayout.from_parents([-1, 0, 0], [10, 2, 2], [(1, 1), (2, 1)])
    assert segments_of(shared) is None
    # a query inside its node leaves the node's tail unread: the tail joins the segment
    tail = TreeLayout.from_parents([-1, -1], [10, 6], [(0, 4), (1, 5)])
    assert segments_of(tail).tolist() == [0, 10, 16]
    # two queries of one sequence (a chain of pending tokens) read one prefix twice
    assert segments_of(TreeLayout.from_parents([-1], [8], [(0, 6), (0, 7)])) is None


def test_many_sequences_run_whole():
    # 32 x 2000 tokens with 8 KV heads make 256 units on 132 CTAs: two rounds of whole sequences;
    # cutting one more sequence in two does not shorten the longest CTA, so none is cut
    lengths = [2000] * 32
    plan = make_plan(unshared_layout(lengths), grid(132), group_size=4)
    assert plan.chunk_kv_start.tolist() == np.cumsum([0] + lengths).tolist()
    assert plan.num_entries == plan.num_queries == 32 and plan.entry_direct.all()


def test_few_sequences_keep_flattens_even_chunks():
    # 8 x ~2000 tokens make 64 whole units for 132 CTAs: one round of even chunks across sequences balances better
    lengths = [1500, 2500, 1700, 2300, 1900, 2100, 1600, 2400]
    layout = unshared_layout(lengths)
    plan = make_plan(layout, grid(132), group_size=4)
    q_idx, lo, hi, kv_slots, *_ = read_intervals(layout)
    segments = unshared_segments(q_idx, lo, hi, len(kv_slots))
    assert split_kv_bounds(segments, 8, 132, 4, 256, PERSISTENT_MAX_CHUNK) is None
    lens = np.diff(plan.chunk_kv_start)
    assert lens[:-1].min() == lens.max() and not set(plan.chunk_kv_start.tolist()) >= set(np.cumsum(lengths).tolist())


def test_long_sequences_are_cut_into_even_pieces():
    # 3 sequences of 40000 / 9000 / 500 tokens on 16 CTAs with 2 KV heads: whole (at most
    # PERSISTENT_MAX_CHUNK-token) pieces make 2 * (10 + 3 + 1) = 28 units, so the cut is split-KV
    lengths = [40000, 9000, 500]
    plan = make_plan(unshared_layout(lengths), grid(16, heads=2), group_size=4)
    bounds = plan.chunk_kv_start
    assert {0, 40000, 49000, 49500} <= set(bounds.tolist())
    for start, end in zip([0, 40000, 49000], [40000, 49000, 49500]):
        pieces = np.diff(bounds[(bounds >= start) & (bounds <= end)])
        assert pieces.max() <= PERSISTENT_MAX_CHUNK and pieces.max() - pieces.min() <= 1
    assert plan.num_chunks * 2 >= 16


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 6000), min_size=1, max_size=24), ctas=st.sampled_from([4, 16, 132]),
       heads=st.sampled_from([1, 2, 8]))
def test_split_kv_plans_read_exactly_each_sequence(lengths, ctas, heads):
    layout = unshared_layout(lengths)
    plan = make_plan(layout, grid(ctas, heads), group_size=4)
    bounds = plan.chunk_kv_start
    borders = np.cumsum([0] + lengths)
    q_idx, lo, hi, kv_slots, *_ = read_intervals(layout)
    split = split_kv_bounds(unshared_segments(q_idx, lo, hi, len(kv_slots)), heads, ctas, 4, 256,
                            PERSISTENT_MAX_CHUNK)
    if split is not None:
        assert np.array_equal(split, bounds)
        assert set(borders.tolist()) <= set(bounds.tolist())  # no chunk crosses a sequence
        assert np.diff(bounds).max() <= PERSISTENT_MAX_CHUNK
        assert plan.num_entries == plan.num_chunks  # one reader per chunk
    else:
        assert heads * sum(-(-n // PERSISTENT_MAX_CHUNK) for n in lengths) < ctas
    expected = {(q, int(s)) for q, (start, end) in enumerate(zip(borders[:-1], borders[1:]))
                for s in layout.kv_slots[start:end]}
    assert read_pairs_from_plan(plan) == expected


def test_split_kv_plan_output_equals_the_reference():
    # 6 paged sequences (one decode token pending each) on a grid of 4 CTAs, 2 KV heads, fp32: the long one is cut
    pool = PagedKVPool(num_pages=1200, page_size=4, num_layers=1, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    tree = SequenceTree(pool)
    rng = np.random.default_rng(0)
    roots = [tree.add_prompt(rng.integers(0, 1000, length)) for length in (3000, 90, 300, 1, 520, 260)]
    tree.commit_step()
    for root in roots:
        tree.extend(root, [int(rng.integers(1000))])
    pool.k.normal_(generator=torch.Generator().manual_seed(1))
    pool.v.normal_(generator=torch.Generator().manual_seed(2))
    layout = tree.layout()
    plan = make_plan(layout, grid(4, heads=2), group_size=4)
    assert plan.num_chunks > 6 and plan.num_entries > plan.num_queries  # cut: some query merges partials
    for q, (node, offset) in enumerate(zip(layout.query_node, layout.query_offset)):
        read = {int(s) for s in path_slots(tree, int(layout.node_ids[node]), int(offset))}
        assert {s for qq, s in read_pairs_from_plan(plan) if qq == q} == read
    k_cache, v_cache = pool.layer(0)
    q = torch.randn(plan.num_queries, 8, 32, generator=torch.Generator().manual_seed(3))
    out, lse = run_plan_torch(q, k_cache, v_cache, plan, AttentionVariant())
    ref, ref_lse = reference_tree_attention(q, k_cache, v_cache, layout, AttentionVariant())
    assert rel_error(out, ref) < 1e-5
    assert torch.allclose(lse, ref_lse, atol=1e-5)
