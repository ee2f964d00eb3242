"""The lanes' draw over a block of rows (treedec/runtime/lane_draw.py): the buckets a graphed step draws, and that
padding rows past the lanes change no lane's token, counter or count."""
import numpy as np
import pytest
import torch

from treedec.runtime.lane_draw import draw_block, lane_bucket
from treedec.runtime.lane_table import LaneTable
from treedec.sampling.params import SamplingParams

VOCAB = 48


@pytest.mark.parametrize("lanes, capacity, bucket", [(1, 16, 1), (2, 16, 2), (3, 16, 4), (9, 16, 16), (16, 16, 16),
                                                      (17, 32, 32), (33, 33, 33), (33, 64, 64), (64, 128, 64),
                                                      (257, 1024, 320), (300, 1024, 320), (321, 1024, 384),
                                                      (384, 1024, 384), (385, 1024, 512), (300, 310, 310)])
def test_a_bucket_is_the_graphs_query_bucket_within_the_capacity(lanes, capacity, bucket):
    """The step graphs' buckets (powers of two, past 256 also 5/8 and 3/4): a lanes' draw of 300 rows rides in a
    step graph of 320 queries (64 ToT tasks of six thoughts: 384 lanes, a 512-row draw failed in a 384-row
    graph on an H200)."""
    assert lane_bucket(lanes, capacity) == bucket


@pytest.mark.parametrize("lanes, capacity", [(0, 16), (17, 16), (-1, 4)])
def test_a_bucket_needs_lanes_within_the_capacity(lanes, capacity):
    with pytest.raises(ValueError, match="a draw covers 1 .. capacity"):
        lane_bucket(lanes, capacity)


def table_of(params: list[SamplingParams], garbage: bool) -> LaneTable:
    """A lane table of one lane per ``params`` (seeds 100 + i); with ``garbage``, the rows past them hold what
    ended lanes leave: other parameters, counters, EOS ids and counts."""
    table = LaneTable(VOCAB, torch.device("cpu"))
    table._penalty_columns()
    if garbage:
        gen = torch.Generator().manual_seed(5)
        table.fparams[:] = torch.rand(table.fparams.shape, generator=gen) * 2
        table.iparams[:] = torch.randint(0, 40, table.iparams.shape, generator=gen)
        table.eos[:] = torch.randint(-1, VOCAB, table.eos.shape, generator=gen)
        table.out[:] = torch.randint(0, 30, table.out.shape, generator=gen)
        table.counts[:] = torch.randint(0, 3, table.counts.shape, generator=gen, dtype=torch.int32)
        table.prompt_mask[:] = torch.rand(table.prompt_mask.shape, generator=gen) < 0.3
    for i, p in enumerate(params):
        table.seed[i], table.stream[i] = 100 + i, 0
        table.write_params(i, p, table.seed[i:i + 1])
        table.out[i] = torch.tensor([0, 0, 1, 3 + i])
        table.eos[i] = torch.tensor([5])
        table.counts[i] = 0
        table.prompt_mask[i] = False
        table.prompt_mask[i, :4] = True
    table.size = len(params)
    return table


PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=1),
          SamplingParams(temperature=1.1, top_k=7, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.4,
                         frequency_penalty=0.2, seed=2),
          SamplingParams(temperature=0.6, seed=3)]


@pytest.mark.parametrize("lanes", [1, 3, 4])
def test_padding_rows_change_no_lane(lanes):
    """A block of the bucket's rows (the lanes, then padding rows over garbage) draws every lane's token, stop flag,
    counter and counts as the draw of the lanes alone, over several draws."""
    params = PARAMS[:lanes]
    alone, padded = table_of(params, garbage=False), table_of(params, garbage=True)
    block = lane_bucket(lanes, 16) if lanes > 1 else 2   # (one lane: a block of 2, the padding row a copy)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        logits = torch.randn(lanes, VOCAB, generator=gen) * 3
        want = draw_block(alone, logits, alone.sampling_rows())
        rows = torch.cat([logits, logits[:1].expand(block - lanes, -1)])   # padding: copies of the first row
        got = draw_block(padded, rows, padded.sampling_rows(block))
        assert torch.equal(got[:lanes], want)
        assert torch.equal(padded.out[:lanes], alone.out[:lanes])
        assert torch.equal(padded.counts[:lanes], alone.counts[:lanes])
    assert np.array_equal(padded.out[:lanes, 3].numpy(), np.arange(lanes) + 7)   # four draws each
