import numpy as np
import pytest
import torch

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


def test_exhausted_pool_changes_nothing():
    pool = PagedKVPool(4, 16, allocate_storage=False)
    pool.allocate(3)
    before = (pool.refcount.copy(), list(pool._free))
    with pytest.raises(PoolExhaustedError, match=r"need 2 page\(s\) of 16 tokens, 1 of 4 free"):
        pool.allocate(2)
    assert np.array_equal(pool.refcount, before[0]) and pool._free == before[1]


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
    with pytest.raises(RuntimeError, match="allocate_storage=False"):
        pool.layer(0)


def test_gather_scatter_moves_kv_of_every_layer():
    pool = PagedKVPool(4, 2, num_layers=3, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    pool.k.normal_()
    pool.v.normal_()
    k, v = pool.gather(np.array([1, 6]))
    assert k.shape == (3, 2, 2, 64)
    pool.scatter(np.array([2, 3]), (k, v))
    for layer in range(3):
        lk, lv = pool.layer(layer)
        assert torch.equal(lk.reshape(-1, 2, 64)[2], lk.reshape(-1, 2, 64)[1])
        assert torch.equal(lv.reshape(-1, 2, 64)[3], lv.reshape(-1, 2, 64)[6])
