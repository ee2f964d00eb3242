"""bench/tile_pace.py: the per-tile difference (the GPU part needs sm_90a)."""
import pytest

from bench.tile_pace import TOKENS, per_tile_us


def test_per_tile_time_is_the_difference_over_the_tiles_each_unit_gains():
    # 2 chunks: units grow by (16384 - 8192) / 2 = 4096 tokens = 64 tiles
    assert TOKENS == (8192, 16384)
    assert per_tile_us(70.0, 134.0, chunks=2) == pytest.approx(1.0)
    assert per_tile_us(20.0, 28.0, chunks=16) == pytest.approx(1.0)   # 8 tiles
