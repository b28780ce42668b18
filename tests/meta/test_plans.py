"""Transport plans (tide.meta.plans, pure Python): Slot-Reuse reads each gradient where the same
param's all-gather output lies, and the reduce-scatter rounds cover every gradient element once."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.meta.test_layout import SHAPE  # the layout tests' shapes: 0-d, empty, 1-3 dims
from tide.meta.layout import shard_rows
from tide.meta import plans


DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@st.composite
def cases(draw):
    world_size = draw(st.integers(1, 16))
    shapes = draw(st.lists(SHAPE, min_size=1, max_size=10))
    dtype = draw(st.sampled_from(DTYPES))
    entry_bytes = draw(st.sampled_from([4096, 1 << 16]))
    rank = draw(st.integers(0, world_size - 1))
    return world_size, shapes, dtype, entry_bytes, rank


@st.composite
def mixed_cases(draw):
    world_size = draw(st.integers(1, 16))
    shapes = draw(st.lists(SHAPE, min_size=1, max_size=10))
    dtypes = [draw(st.sampled_from(DTYPES)) for _ in shapes]
    entry_bytes = draw(st.sampled_from([32, 4096, 1 << 16]))
    return world_size, shapes, dtypes, entry_bytes


def _padded_shard(shape, world_size):
    d0 = shape[0] if shape else 1
    return (shard_rows(d0, world_size), *shape[1:])


@settings(max_examples=200, deadline=None)
@given(cases())
def test_slot_reuse_gradient_offsets_are_the_all_gather_output_offsets(case):
    world_size, shapes, dtype, entry_bytes, rank = case
    rs = plans.rs_plan_info(shapes, [dtype] * len(shapes), world_size, rank, entry_bytes)
    # FSDP binds the 1-D padded shards' all-gather outputs; the hooks put each gradient at its output.
    flat_shards = [(math.prod(_padded_shard(s, world_size)),) for s in shapes]
    ag = plans.all_gather_layout(flat_shards, [dtype] * len(shapes), world_size)
    assert [p.slot_offset for p in rs.layout.params] == [p.slot_offset for p in ag.params]
    assert rs.layout.slot_bytes == ag.slot_bytes
    for p, s in zip(rs.layout.params, shapes):  # each gradient fits the region of its output
        assert math.prod(s) * dtype.itemsize <= p.out_bytes


@settings(max_examples=200, deadline=None)
@given(cases())
def test_rounds_cover_every_destination_shard_once_within_entries(case):
    world_size, shapes, dtype, entry_bytes, rank = case
    rs = plans.rs_plan_info(shapes, [dtype] * len(shapes), world_size, rank, entry_bytes)
    for d in range(world_size):
        seen = {i: [] for i in range(len(shapes))}
        for rnd in rs.rounds[d]:
            ends = []
            for param, grad_off, shard_off, numel, entry_off in rnd:
                assert entry_off % plans.ALIGN == 0 and numel > 0
                ends.append(entry_off + numel * dtype.itemsize)
                seen[param].append((shard_off, grad_off, numel))
            assert max(ends) <= entry_bytes
        for i, s in enumerate(shapes):
            d0 = s[0] if s else 1
            row = math.prod(s[1:]) if len(s) > 1 else 1
            c = shard_rows(d0, world_size)
            real_rows = max(0, min(c, d0 - d * c))  # rows of shard d that exist (the rest is padding)
            pieces = sorted(seen[i])
            covered = 0
            for shard_off, grad_off, numel in pieces:
                assert shard_off == covered and grad_off == d * c * row + shard_off
                assert shard_off % plans.SPLIT_ELEMS == 0  # pieces keep the vector path's 16-B alignment
                covered += numel
            assert covered == real_rows * row


@settings(max_examples=300, deadline=None)
@given(mixed_cases())
def test_rounds_are_as_few_as_the_entries_need_none_empty_and_the_same_on_every_rank(case):
    world_size, shapes, dtypes, entry_bytes = case
    itemsizes = [d.itemsize for d in dtypes]
    try:
        plans_by_rank = [plans.rs_plan_info(shapes, dtypes, world_size, r, entry_bytes) for r in range(world_size)]
    except ValueError:  # an entry too small for 8 elements of the widest dtype
        assert entry_bytes < plans.SPLIT_ELEMS * max(itemsizes)
        return
    rs = plans_by_rank[0]
    assert all(p.rounds == rs.rounds for p in plans_by_rank)  # flag values build on these counts
    for d in range(world_size):
        full = plans._pack(rs.layout.rs_chunks(d), itemsizes, entry_bytes)  # every round filling its entry
        assert len(rs.rounds[d]) == len(full)
        for rnd in rs.rounds[d]:
            assert rnd, rs.rounds[d]
            for param, _, shard_off, numel, entry_off in rnd:
                assert entry_off % plans.ALIGN == 0 and numel > 0
                assert entry_off + numel * itemsizes[param] <= entry_bytes


def test_entry_too_small_for_a_split_is_refused():
    with pytest.raises(ValueError, match="entry_bytes=16"):
        plans.rs_plan_info([(64,)], [torch.float32], 2, 0, 16)


ENTRY = 1 << 16


@pytest.mark.parametrize("per_dest,want_rounds", [
    (ENTRY - 256, 1),        # fits one entry: one round
    (ENTRY + 256, 2),        # just over one entry: two equal rounds, not a full one and a tiny one
    (3 * ENTRY, 3),          # whole entries: full rounds
    (5 * ENTRY // 2, 3),     # two and a half entries: three equal rounds
])
def test_rounds_are_the_fewest_that_fit_and_of_equal_size(per_dest, want_rounds):
    # Two 1-D fp32 params, W = 2: each destination gets half of each, per_dest bytes in all.
    rows = per_dest // 4
    rs = plans.rs_plan_info([(rows,), (rows,)], [torch.float32] * 2, 2, 0, ENTRY)
    assert [len(r) for r in rs.rounds] == [want_rounds] * 2
    for r in rs.rounds:
        sizes = [sum(n * 4 for _, _, _, n, _ in rnd) for rnd in r]
        assert sum(sizes) == per_dest
        # Each round may overshoot an equal share by its split granularity and alignment, so the last
        # falls short by at most that much per earlier round.
        assert max(sizes) - min(sizes) <= want_rounds * (plans.SPLIT_ELEMS * 4 + 2 * plans.ALIGN), sizes


def test_each_destination_is_cut_on_its_own():
    # Few long rows shard unevenly: of (3, r1) destination 0 gets 2 rows and destination 1 one, of (2, r2)
    # one each. Destination 0 (1.2 entries) takes two rounds of 0.6; destination 1 (0.9) still fits one.
    r1, r2 = 4912, 9824  # fp32 elements per row: 0.3 and 0.6 of an entry
    rs = plans.rs_plan_info([(3, r1), (2, r2)], [torch.float32] * 2, 2, 0, ENTRY)
    assert [len(r) for r in rs.rounds] == [2, 1]
    sizes = [sum(n * 4 for _, _, _, n, _ in rnd) for rnd in rs.rounds[0]]
    assert abs(sizes[0] - sizes[1]) <= 2 * (plans.SPLIT_ELEMS * 4 + 2 * plans.ALIGN), sizes


def test_entry_not_a_multiple_of_the_alignment_is_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        plans.rs_plan_info([(25,), (16,)], [torch.float32] * 2, 1, 0, 100)


@settings(max_examples=200, deadline=None)
@given(mixed_cases())
def test_an_entry_of_the_piece_bytes_carries_every_destination_in_one_round(case):
    # What FSDP sizes the ring's entries by (tide/fsdp/wiring.py): the padded shards' bytes, aligned.
    world_size, shapes, dtypes, _ = case
    itemsizes = [d.itemsize for d in dtypes]
    piece = plans.rs_piece_bytes([math.prod(_padded_shard(s, world_size)) for s in shapes], itemsizes)
    entry = max(piece, plans.SPLIT_ELEMS * max(itemsizes))
    rs = plans.rs_plan_info(shapes, dtypes, world_size, 0, entry)
    assert all(len(r) <= 1 for r in rs.rounds), rs.rounds
    # And no smaller entry does: destination 0 holds whole shards, which fill it to the byte.
    if piece > entry - plans.ALIGN >= plans.SPLIT_ELEMS * max(itemsizes):
        assert len(plans._pack(rs.layout.rs_chunks(0), itemsizes, entry - plans.ALIGN)) == 2
