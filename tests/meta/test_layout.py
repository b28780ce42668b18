"""Property tests of GroupLayout: coverage, no overlap, exact padding, alignment, Latin squares."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from tide.meta.layout import GroupLayout, rank_row_range, shard_rows

ITEMSIZES = st.sampled_from([1, 2, 4, 8])
# d0 from 0 (empty) upward, often smaller than W; 0-d and 1-d shapes included.
SHAPE = st.one_of(
    st.just(()),
    st.tuples(st.integers(0, 300)),
    st.tuples(st.integers(0, 200), st.integers(1, 9)),
    st.tuples(st.integers(0, 70), st.integers(1, 5), st.integers(1, 4)),
)


@st.composite
def groups(draw):
    world_size = draw(st.integers(1, 64))
    shapes = draw(st.lists(SHAPE, min_size=1, max_size=12))
    itemsizes = draw(st.lists(ITEMSIZES, min_size=len(shapes), max_size=len(shapes)))
    grad_itemsizes = draw(st.lists(st.sampled_from([2, 4]), min_size=len(shapes), max_size=len(shapes)))
    chunk = draw(st.sampled_from([4, 16, 100, 1 << 12, 1 << 20]))
    align = draw(st.sampled_from([1, 16, 128]))
    return GroupLayout(shapes, itemsizes, world_size, grad_itemsizes=grad_itemsizes, rs_chunk_bytes=chunk,
                       align=align)


@settings(max_examples=300, deadline=None)
@given(groups())
def test_shards_cover_each_row_once_with_exact_padding(layout):
    W = layout.world_size
    for p in layout.params:
        assert p.shard_rows == math.ceil(p.d0 / W)
        assert p.numel == (math.prod(p.shape) if p.shape else 1)
        covered = []
        for r in range(W):
            start, stop = p.rows(r)
            assert 0 <= stop - start <= p.shard_rows
            # real rows first, then padding up to c rows: rank r's rows start at r*c unless past d0
            assert start == min(r * p.shard_rows, p.d0)
            covered.extend(range(start, stop))
            assert p.real_numel(r) + (p.shard_rows - (stop - start)) * p.row_numel == p.shard_numel
        assert covered == list(range(p.d0))
        # total padding is exactly W*c - d0 rows
        assert W * p.shard_rows - p.d0 == sum(p.shard_rows - (b - a) for a, b in map(p.rows, range(W)))


@settings(max_examples=300, deadline=None)
@given(groups())
def test_slot_is_param_major_aligned_and_non_overlapping(layout):
    W = layout.world_size
    intervals = []
    for p in layout.params:
        assert p.slot_offset % layout.align == 0
        for r in range(W):
            start, stop = p.slot_byte_range(r)
            assert start == p.slot_offset + r * p.shard_numel * p.itemsize  # out_i + r*c_i*row_i
            assert p.final_offset(r) == r * p.shard_rows * p.row_numel
            if stop > start:
                intervals.append((start, stop))
        assert p.slot_offset + p.out_bytes <= layout.slot_bytes
    intervals.sort()
    for (a0, a1), (b0, b1) in zip(intervals, intervals[1:]):
        assert a1 <= b0, "two shards overlap inside the slot"
    assert layout.slot_bytes % layout.align == 0
    assert layout.slot_bytes < sum(p.out_bytes for p in layout.params) + layout.align * len(layout.params) + 1


@settings(max_examples=300, deadline=None)
@given(groups())
def test_rs_chunks_cover_every_real_element_once(layout):
    W = layout.world_size
    seen = {p.index: [0] * p.numel for p in layout.params}
    for d in range(W):
        shard_cover = {p.index: [0] * p.shard_numel for p in layout.params}
        for c in layout.rs_chunks(d):
            p = layout.params[c.param]
            assert c.dest == d and c.numel > 0
            assert c.numel * p.grad_itemsize <= layout.rs_chunk_bytes
            start, _ = p.rows(d)
            assert c.grad_offset - start * p.row_numel == c.shard_offset
            for e in range(c.grad_offset, c.grad_offset + c.numel):
                seen[c.param][e] += 1
            for e in range(c.shard_offset, c.shard_offset + c.numel):
                shard_cover[c.param][e] += 1
        for pad in layout.pad_ranges(d):
            for e in range(pad.shard_offset, pad.shard_offset + pad.numel):
                shard_cover[pad.param][e] += 1
        for counts in shard_cover.values():
            assert all(n == 1 for n in counts), "a shard element is not covered exactly once by chunks + padding"
    for counts in seen.values():
        assert all(n == 1 for n in counts), "a gradient element is not reduced exactly once"


@pytest.mark.parametrize("d0,W,expect", [(0, 4, 0), (1, 4, 1), (3, 4, 1), (4, 4, 1), (5, 4, 2), (10, 3, 4)])
def test_shard_rows(d0, W, expect):
    assert shard_rows(d0, W) == expect


def test_ranks_past_the_rows_hold_only_padding():
    assert [rank_row_range(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert [rank_row_range(2, 8, r) for r in range(8)] == [(0, 1), (1, 2)] + [(2, 2)] * 6


def test_zero_d_param_is_one_row():
    (p,) = GroupLayout([()], [4], 3).params
    assert (p.d0, p.row_numel, p.shard_rows, p.out_numel) == (1, 1, 1, 3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(shapes=[(4,)], itemsizes=[2], world_size=0), "world_size"),
    (dict(shapes=[(4,)], itemsizes=[2, 2], world_size=2), "itemsizes"),
    (dict(shapes=[(-1,)], itemsizes=[2], world_size=2), "negative"),
    (dict(shapes=[(4,)], itemsizes=[2], world_size=2, align=3), "align"),
    (dict(shapes=[(4,)], itemsizes=[4], world_size=2, rs_chunk_bytes=2), "rs_chunk_bytes"),
])
def test_bad_layout_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GroupLayout(**kwargs)


def test_layout_conversion_bytes_counts_stock_copies():
    # two bf16 params on 4 ranks, fp32 shards: (8, 3) -> c=2 and (5,) -> c=2
    layout = GroupLayout([(8, 3), (5,)], [2, 2], 4)
    b = layout.layout_conversion_bytes(shard_itemsizes=[4, 4])
    assert b["cast"] == 6 * (4 + 2) + 2 * (4 + 2)
    assert b["all_gather_copy_in"] == 2 * (6 + 2) * 2
    assert b["split_with_sizes_copy"] == 2 * (24 + 8) * 2
    assert b["chunk_cat"] == (24 * 2 + 24 * 4) + (5 * 2 + 8 * 4)
    assert b["removed"] == b["all_gather_copy_in"] + b["split_with_sizes_copy"] + b["chunk_cat"]
