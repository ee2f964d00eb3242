import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from treedec import PoolExhaustedError
from treedec.tree import PagedKVPool


def test_allocate_free_reuse():
    pool = PagedKVPool(8, 4, allocate_storage=False)
    a = pool.allocate(3)
    assert sorted(a.tolist()) == [0, 1, 2] and pool.num_free_pages == 5
    assert np.all(pool.refcount[a] == 1)
    pool.incref(a[:1])
    assert pool.decref(a).tolist() == sorted(a[1:].tolist())  # a[0] still held once
    assert pool.decref(a[:1]).tolist() == [a[0]]
    pool.check_invariants()
    assert pool.num_free_pages == 8
    assert len(pool.allocate(8)) == 8  # every freed page is reusable



def test_free_pages_are_handed_out_most_recently_freed_first():
    """The free list is a stack: free_pages lists what allocate hands out next, in order; freed pages go on top,
    the lowest first; taking or returning many pages is one call."""
    pool = PagedKVPool(8, 4, allocate_storage=False)
    assert pool.free_pages.tolist() == list(range(8))
    taken = pool.allocate(5)
    assert taken.tolist() == [0, 1, 2, 3, 4] and pool.free_pages.tolist() == [5, 6, 7]
    assert pool.decref(np.array([3, 1])).tolist() == [1, 3]
    assert pool.free_pages.tolist() == [1, 3, 5, 6, 7]
    assert pool.allocate(3).tolist() == [1, 3, 5] and pool.allocate_slots(6).tolist() == [24, 25, 26, 27, 28, 29]
    assert pool.free_pages.tolist() == [] and pool.num_free_pages == 0
    pool.free_pages[:] = -1   # a copy: the pool's list is not the caller's
    pool.check_invariants()


def test_release_drops_a_callers_own_holds_and_refuses_to_go_below_zero():
    """release (decref without the argument checks, for a tree's own holds) frees as decref does; dropping a
    page below zero holders raises and changes nothing."""
    pool = PagedKVPool(8, 4, allocate_storage=False)
    pages = pool.allocate_slots(6) // 4          # pages 0 (4 holders) and 1 (2)
    before = (pool.refcount.copy(), pool.free_pages.tolist())
    with pytest.raises(ValueError, match=r"release: pages \[1\] are listed \[3\] times but have only \[2\]"):
        pool.release(np.array([0, 1]), np.array([1, 3]))
    assert np.array_equal(pool.refcount, before[0]) and pool.free_pages.tolist() == before[1]
    assert pool.release(np.array([1, 0]), np.array([2, 3])).tolist() == [1]
    assert pool.free_pages.tolist()[:2] == [1, 2] and pool.refcount[0] == 1 and sorted(set(pages.tolist())) == [0, 1]
    pool.check_invariants()

def test_exhausted_pool_changes_nothing():
    pool = PagedKVPool(4, 16, allocate_storage=False)
    pool.allocate(3)
    before = (pool.refcount.copy(), pool.free_pages.tolist())
    with pytest.raises(PoolExhaustedError, match=r"need 2 page\(s\) of 16 tokens, 1 of 4 free"):
        pool.allocate(2)
    assert np.array_equal(pool.refcount, before[0]) and pool.free_pages.tolist() == before[1]


@pytest.mark.parametrize("name,value", [("num_pages", 0), ("page_size", -1), ("head_dim", 1.5)])
def test_bad_sizes(name, value):
    kwargs = dict(num_pages=4, page_size=4)
    kwargs[name] = value
    with pytest.raises(ValueError, match=name):
        PagedKVPool(**kwargs)


def test_write_and_layer_views():
    pool = PagedKVPool(4, 2, num_layers=2, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    k = torch.randn(3, 3, 64)
    v = torch.randn(3, 3, 64)
    pool.write(1, np.array([0, 5, 6]), k, v)
    k1, v1 = pool.layer(1)
    assert k1.shape == (4, 2, 3, 64)
    assert torch.equal(k1[2, 1], k[1]) and torch.equal(v1[3, 0], v[2])
    assert torch.count_nonzero(pool.layer(0)[0]) == 0
    with pytest.raises(ValueError, match=r"k must have shape \(3, 3, 64\)"):
        pool.write(0, [0, 1, 2], torch.randn(3, 2, 64), v)
    with pytest.raises(IndexError, match="layer must be in"):
        pool.layer(2)


def test_bookkeeping_only_pool_has_no_storage():
    pool = PagedKVPool(4, 2, allocate_storage=False)
    assert not pool.has_storage and pool.k is None and pool.k_slots == ()
    for call in (lambda: pool.layer(0), lambda: pool.gather([0]), lambda: pool.copy_slots([0], [1])):
        with pytest.raises(RuntimeError, match="allocate_storage=False"):
            call()


@pytest.mark.parametrize("as_tensor,checked", [(False, True), (True, True), (True, False)])
def test_copy_slots_moves_kv_of_every_layer(as_tensor, checked):
    """Host slots, tensors, and tensors used as they are (``checked=False``: the verify group's) move the same."""
    pool = PagedKVPool(4, 2, num_layers=3, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    pool.k.normal_()
    pool.v.normal_()
    k, v = pool.gather(np.array([1, 6]))
    assert k.shape == (3, 2, 2, 64)
    src, dst = np.array([1, 6]), np.array([2, 3])
    pool.copy_slots(*((torch.as_tensor(src), torch.as_tensor(dst)) if as_tensor else (src, dst)), checked=checked)
    for layer in range(3):
        lk, lv = pool.layer(layer)
        assert torch.equal(lk.reshape(-1, 2, 64)[2], lk.reshape(-1, 2, 64)[1])
        assert torch.equal(lv.reshape(-1, 2, 64)[3], lv.reshape(-1, 2, 64)[6])


def test_copy_slots_reads_every_source_before_writing():
    """Overlapping slots: each destination gets its source's K/V as it was before the copy."""
    pool = PagedKVPool(4, 2, num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    pool.k.normal_()
    pool.v.normal_()
    k, v = pool.gather([0, 1, 2])
    pool.copy_slots([0, 1, 2], [1, 2, 3])
    moved_k, moved_v = pool.gather([1, 2, 3])
    assert torch.equal(moved_k, k) and torch.equal(moved_v, v)


def test_storage_is_one_allocation_with_its_scratch_pages():
    """The pool's pages and the scratch page are one tensor per K and V, each layer contiguous: the layout the
    kernels read, and what a step's stores (k_slots) and a CUDA graph's padded rows (scratch_slot) address."""
    pool = PagedKVPool(4, 2, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, scratch_pages=1)
    assert pool.k.shape == (3, 4, 2, 2, 8) and pool.scratch_slot == pool.num_slots == 8
    assert all(pool.layer(i)[0].is_contiguous() for i in range(3))
    assert pool.k_slots[1].shape == (10, 2, 8)   # the scratch page's 2 slots too
    assert pool.k_slots[1].data_ptr() == pool.layer(1)[0].data_ptr()
    assert pool.k_slots[2].data_ptr() - pool.k_slots[1].data_ptr() == 5 * 2 * 2 * 8 * 4   # 5 pages a layer
    pool.k_slots[0][pool.scratch_slot] = 1.0   # a padded row's store: no page of the pool changes
    assert torch.count_nonzero(pool.k) == 0
    assert pool.allocate(4).tolist() == [0, 1, 2, 3] and pool.num_free_pages == 0   # never hands it out
    with pytest.raises(RuntimeError, match="no scratch pages"):
        PagedKVPool(4, 2).scratch_slot


# ================================================================ bad page ids and slots

def pool_state(pool):
    """Everything a pool operation could change."""
    kv = () if pool.k is None else (pool.k.clone(), pool.v.clone())
    return pool.refcount.tolist(), pool.free_pages.tolist(), kv


def assert_same_state(pool, before):
    refcount, free, kv = pool_state(pool)
    assert (refcount, free) == before[:2]
    assert all(torch.equal(a, b) for a, b in zip(kv, before[2]))


# (value, exception, message) for a pool of 8 pages of 4 slots whose pages 0-3 are in use
BAD_PAGES = [
    ([-1], ValueError, r"pages\[0\] = -1"),            # used to wrap to page 7 (numpy negative index)
    (np.array([2, -8]), ValueError, r"pages\[1\] = -8"),
    ([8], ValueError, r"pages must be in \[0, 7\], got pages\[0\] = 8"),
    ([2**63], ValueError, "pages"),
    ([2**64], ValueError, "pages"),
    (np.array([2**64 - 1], dtype=np.uint64), ValueError, "pages"),
    ([1.0], TypeError, r"pages\[0\] must be an integer, got float 1.0"),
    (np.array([1.0]), TypeError, "pages must be integers, got a float64 array"),
    (torch.tensor([1.5]), TypeError, "pages must be integers, got a torch.float32 tensor"),
    ([True], TypeError, r"pages\[0\] must be an integer, got bool True"),
    (np.array([True]), TypeError, "bool array"),
    ("1", TypeError, "pages must be a sequence of integers, got str '1'"),
    (b"\x01", TypeError, "got bytes"),
    ([None], TypeError, "got NoneType"),
    (None, TypeError, "got NoneType"),
    (1, TypeError, "got int 1"),
    ([[1]], TypeError, r"pages\[0\] must be an integer, got list \[1\]"),
    (np.array([[1]]), ValueError, r"pages must be 1-D, got an array of shape \(1, 1\)"),
    ({1: 1}, TypeError, "got dict"),
    ([1, "2"], TypeError, r"pages\[1\] must be an integer, got str '2'"),
    ([5], ValueError, r"pages must be in use, but pages \[5\] are free"),
]


def pool_in_use():
    pool = PagedKVPool(8, 4, num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    pool.allocate(4)
    pool.k.normal_()
    pool.v.normal_()
    return pool


@pytest.mark.parametrize("op", ["incref", "decref"])
@pytest.mark.parametrize("pages, error, match", BAD_PAGES)
def test_bad_page_ids_raise_and_change_nothing(op, pages, error, match):
    pool = pool_in_use()
    before = pool_state(pool)
    with pytest.raises(error, match=match):
        getattr(pool, op)(pages)
    assert_same_state(pool, before)
    pool.check_invariants()


def test_decref_more_often_than_held_changes_nothing():
    pool = pool_in_use()
    pool.incref([1])
    before = pool_state(pool)
    with pytest.raises(ValueError, match=r"pages \[0\] are listed \[2\] times but have only \[1\] holder"):
        pool.decref([1, 0, 0])   # page 1 would be fine; page 0 would go to -1
    assert_same_state(pool, before)
    assert pool.decref([1, 1, 0]).tolist() == [0, 1]


@pytest.mark.parametrize("pages, times, error, match", [
    ([0, 1], [1], ValueError, r"times must hold one count per page \(2\), got 1"),
    ([0, 0], [1, 1], ValueError, "pages must be distinct when times are given"),
    ([0, 1], [1, 0], ValueError, r"times must be >= 1 .*times\[1\] = 0"),
    ([0, 1], [1, 1.0], TypeError, r"times\[1\] must be an integer, got float"),
    ([0, 1], [1, 3], ValueError, r"pages \[1\] are listed \[3\] times but have only \[2\] holder"),
    ([0, 5], [1, 1], ValueError, r"pages must be in use, but pages \[5\] are free"),
])
def test_decref_by_counts_checks_them_and_changes_nothing(pages, times, error, match):
    pool = pool_in_use()
    pool.incref([1])
    before = pool_state(pool)
    with pytest.raises(error, match=match):
        pool.decref(pages, times)
    assert_same_state(pool, before)
    assert pool.decref([3, 1, 0], [1, 2, 1]).tolist() == [0, 1, 3]   # ascending, as without counts
    assert pool.decref(np.array([2]), np.array([1])).tolist() == [2] and pool.num_free_pages == 8
    pool.check_invariants()


def test_allocate_slots_packs_pages_with_a_holder_per_slot():
    pool = PagedKVPool(8, 4, allocate_storage=False)
    slots = pool.allocate_slots(6)
    pages = sorted(set((slots // 4).tolist()))
    assert slots.tolist() == [pages[0] * 4 + i for i in range(4)] + [pages[1] * 4, pages[1] * 4 + 1]
    assert pool.refcount[pages].tolist() == [4, 2] and pool.num_free_pages == 6
    assert len(pool.allocate_slots(0)) == 0
    before = pool_state(pool)
    for bad, error in [(25, PoolExhaustedError), (-1, ValueError), (1.5, TypeError), (True, TypeError)]:
        with pytest.raises(error):
            pool.allocate_slots(bad)
        assert_same_state(pool, before)
    assert pool.decref(pages, [4, 2]).tolist() == pages
    pool.check_invariants()


def test_negative_page_id_cannot_alias_a_live_page():
    """decref([-1]) used to free page 7, the last live page: the next allocation got its K/V."""
    pool = PagedKVPool(8, 4, allocate_storage=False)
    live = pool.allocate(8)
    with pytest.raises(ValueError, match="pages"):
        pool.decref([-1])
    with pytest.raises(PoolExhaustedError):
        pool.allocate(1)
    assert pool.refcount[live].tolist() == [1] * 8


# (value, exception, message) for 32 slots
BAD_SLOTS = [
    ([-1], ValueError, r"slots\[0\] = -1"),            # used to overwrite slot 31, a live token's K/V
    ([0, 32], ValueError, r"slots must be in \[0, 31\], got slots\[1\] = 32"),
    (torch.tensor([3, -2]), ValueError, r"slots\[1\] = -2"),
    ([2**64], ValueError, "slots"),
    ([0.0], TypeError, r"slots\[0\] must be an integer, got float 0.0"),
    (np.array([0.0]), TypeError, "float64 array"),
    (torch.tensor([0.0]), TypeError, "torch.float32 tensor"),
    ([False], TypeError, "bool"),
    (torch.tensor([True]), TypeError, "torch.bool tensor"),
    ("0", TypeError, "slots must be a sequence of integers, got str '0'"),
    ([[0]], TypeError, r"slots\[0\] must be an integer"),
    (torch.tensor([[0]]), ValueError, "slots must be 1-D"),
    ([None], TypeError, "NoneType"),
]


@pytest.mark.parametrize("op", ["write", "gather", "copy_slots"])
@pytest.mark.parametrize("slots, error, match", BAD_SLOTS)
def test_bad_slots_raise_and_change_nothing(op, slots, error, match):
    pool = pool_in_use()
    before = pool_state(pool)
    kv = torch.ones(1, 1, 8)
    if op == "copy_slots":   # the bad slots as the destination: checked before anything is copied
        match = match.replace("slots", "dst_slots")
    with pytest.raises(error, match=match):
        if op == "write":
            pool.write(0, slots, kv, kv)
        elif op == "gather":
            pool.gather(slots)
        else:
            pool.copy_slots([0], slots)
    assert_same_state(pool, before)


def test_copy_slots_checks_both_slot_lists_before_writing():
    pool = pool_in_use()
    before = pool_state(pool)
    with pytest.raises(ValueError, match="src_slots and dst_slots must be 1-D of one length, got 1 and 2 slots"):
        pool.copy_slots([0], [1, 2])
    with pytest.raises(ValueError, match=r"src_slots must be in \[0, 31\], got src_slots\[1\] = 32"):
        pool.copy_slots([0, 32], [1, 2])
    assert_same_state(pool, before)
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got list"):
        pool.write(0, [0], [[0.0] * 8], torch.ones(1, 1, 8))
    assert_same_state(pool, before)


@pytest.mark.parametrize("call, error, match", [
    (lambda p: p.layer(True), TypeError, "layer must be an int, got bool True"),
    (lambda p: p.layer(0.0), TypeError, "layer must be an int, got float 0.0"),
    (lambda p: p.layer(-1), IndexError, r"layer must be in \[0, 2\)"),
    (lambda p: p.allocate(1.5), TypeError, "num_pages must be an integer, got float 1.5"),
    (lambda p: p.allocate(True), TypeError, "num_pages must be an integer, got bool"),
    (lambda p: p.allocate("2"), TypeError, "num_pages must be an integer, got str '2'"),
    (lambda p: p.allocate(-1), ValueError, "num_pages must be >= 0"),
    (lambda p: p.pages_for(-5), ValueError, "num_tokens must be >= 0"),
    (lambda p: p.pages_for(2.5), TypeError, "num_tokens must be an integer, got float 2.5"),
    (lambda p: PagedKVPool(True, 4), ValueError, "num_pages must be an int >= 1, got True"),
])
def test_bad_scalars_raise_and_change_nothing(call, error, match):
    pool = pool_in_use()
    before = pool_state(pool)
    with pytest.raises(error, match=match):
        call(pool)
    assert_same_state(pool, before)


@pytest.mark.parametrize("corrupt, match", [
    (lambda p: p.refcount.__setitem__(6, 1), r"free pages \[6\] have refcounts \[1\], expected 0"),
    (lambda p: p._free.__setitem__(p._num_free - 1, p._free[0]), r"pages \[7\] are on the free list twice"),
    (lambda p: p._free.__setitem__(0, -1), r"free list holds page ids outside \[0, 8\): \[-1\]"),
    (lambda p: p.refcount.__setitem__(2, -1), r"pages \[2\] have negative refcounts \[-1\]"),
    (lambda p: setattr(p, "_num_free", p._num_free - 1), "5 pages have refcount 0 but 4 are on the free list"),
])
def test_check_invariants_names_the_broken_invariant(corrupt, match):
    """(That these checks also run under ``python -O`` is tested in test_sequence_tree.py, one subprocess for both.)"""
    pool = PagedKVPool(8, 4, allocate_storage=False)
    pool.allocate(3)
    pool.check_invariants()
    corrupt(pool)
    with pytest.raises(RuntimeError, match=match):
        pool.check_invariants()


def _junk_pages():
    """Page-id arguments, most of them bad: ints out of range, floats, bools, strings, None, arrays."""
    item = st.one_of(st.integers(-2, 7), st.integers(), st.booleans(), st.floats(), st.text(max_size=2), st.none())
    return st.one_of(
        st.lists(st.integers(0, 5), max_size=4),
        st.lists(item, max_size=4),
        st.lists(st.integers(-2, 7), max_size=4).map(np.array),
        st.lists(st.floats(0, 5), min_size=1, max_size=3).map(np.array),
        st.lists(st.integers(0, 5), max_size=3).map(lambda x: torch.tensor(x, dtype=torch.int32)),
        item,
    )


def _valid_pages(arg, refcount, op):
    """The oracle: would a correct pool accept ``op(arg)``?"""
    if isinstance(arg, torch.Tensor):
        arg = arg.numpy()
    if isinstance(arg, np.ndarray):
        if arg.dtype.kind not in "iu":
            return False
        arg = arg.tolist()
    if not isinstance(arg, list) or not all(type(x) is int and 0 <= x < len(refcount) for x in arg):
        return False
    counts = np.bincount(np.asarray(arg, dtype=np.int64), minlength=len(refcount))
    return bool(np.all(refcount[counts > 0] > 0) and (op == "incref" or np.all(counts <= refcount)))


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.one_of(st.tuples(st.just("allocate"), st.one_of(st.integers(-1, 3), st.floats(0, 3),
                                                                         st.booleans(), st.text(max_size=1))),
                              st.tuples(st.sampled_from(["incref", "decref"]), _junk_pages())),
                    max_size=25))
def test_random_pool_operations_with_bad_arguments(ops):
    """Random incref/decref/allocate sequences, bad arguments mixed in: a rejected call changes nothing,
    an accepted one does exactly what a refcount model says."""
    pool = PagedKVPool(6, 2, allocate_storage=False)
    model = np.zeros(6, dtype=np.int64)
    for op, arg in ops:
        before = pool_state(pool)
        expect_ok = _valid_pages(arg, model, op) if op != "allocate" else (
            type(arg) is int and 0 <= arg <= pool.num_free_pages)
        try:
            result = getattr(pool, op)(arg)
        except (TypeError, ValueError, PoolExhaustedError):
            assert not expect_ok, f"{op}({arg!r}) was rejected"
            assert_same_state(pool, before)
            continue
        assert expect_ok, f"{op}({arg!r}) was accepted"
        if op == "allocate":
            assert np.all(model[result] == 0)
            model[result] = 1
        else:
            pages = np.asarray(torch.as_tensor(arg) if isinstance(arg, torch.Tensor) else arg, dtype=np.int64)
            np.add.at(model, pages, 1 if op == "incref" else -1)
            if op == "decref":
                assert result.tolist() == sorted(set(pages.tolist()) & set(np.flatnonzero(model == 0).tolist()))
        assert pool.refcount.tolist() == model.tolist()
        pool.check_invariants()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a torch without a GPU")
def test_a_cuda_pool_without_cuda_is_a_clear_error():
    """Was: AssertionError 'Torch not compiled with CUDA enabled' from torch.zeros."""
    from treedec import BackendUnavailableError
    with pytest.raises(BackendUnavailableError, match=r"device 'cuda' asked for, but this machine has .* use "
                                                      r"device='cpu'"):
        PagedKVPool(num_pages=4, page_size=4, device="cuda")
    with pytest.raises(ValueError, match="device must be a torch.device or a device string"):
        PagedKVPool(num_pages=4, page_size=4, device="gpu")
