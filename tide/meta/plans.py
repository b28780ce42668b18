"""Plans of the CUDA transport, built once per group layout from :class:`tide.meta.layout.GroupLayout`.

An all-gather plan says where this rank's shard of every parameter sits in a slot (``own_off``), where
each parameter's output starts (``out_off``), and how the own-shard cast is cut into pipeline chunks
(:func:`ag_chunks`): the copy engines push chunk c to the peers while chunk c + 1 is cast. A
reduce-scatter plan packs the chunks of
``GroupLayout.rs_chunks(dest)`` into rounds of one staging entry of ``entry_bytes`` each (each piece
16-B aligned in its entry; a chunk that does not fit is split to fill the round; a destination's
rounds are cut to about equal size), one list of rounds per destination, plus this rank's padding
ranges. For Slot-Reuse the
gradients lie in a slot exactly where the same params' all-gather outputs do (``GroupLayout`` of the
unpadded gradient shapes pads them as the all-gather layout of the padded shards does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from tide.meta.layout import GroupLayout, align_up

ALIGN = 16
# Chunks split across staging entries at multiples of 8 elements: the remainder keeps the 16-B
# alignment of the summing kernel's vector path in the gradient, the entry and the fp32 shard.
SPLIT_ELEMS = 8


def all_gather_layout(shard_shapes: Sequence[Sequence[int]], out_dtypes: Sequence[torch.dtype],
                      world_size: int) -> GroupLayout:
    """The slot layout of an all-gather of padded shards ``(c_i, *rest)`` into ``(W*c_i, *rest)`` outputs."""
    shapes = [(world_size * int(s[0]), *(int(x) for x in s[1:])) for s in shard_shapes]
    return GroupLayout(shapes, [d.itemsize for d in out_dtypes], world_size)


# The own-shard cast's pipeline: the first chunk is small (its cast is the only one the pushes wait
# for in full), every next one twice the last, up to the cap. The cast moves bytes about 8x faster than
# one NVLink direction (3 TB/s of HBM against 0.38 TB/s), so each chunk is cast before the copy
# engines have pushed the one before it.
AG_FIRST_CHUNK_BYTES = 2 << 20
AG_MAX_CHUNK_BYTES = 64 << 20


class ShardRange(NamedTuple):
    """Elements ``[first, first + numel)`` of param ``param``'s own shard (an all-gather chunk) or of its
    shard grad (padding); the extension's ``ShardRange`` has the same fields (csrc/transport/plans.h)."""

    param: int
    first: int
    numel: int


class RsPiece(NamedTuple):
    """``numel`` gradient elements of ``param`` from ``grad_offset``, staged at byte ``entry_offset`` of a
    staging entry and summed into element ``shard_offset`` of the destination's shard grad; the
    extension's ``RsChunk`` has the same fields."""

    param: int
    grad_offset: int
    shard_offset: int
    numel: int
    entry_offset: int


@dataclass
class AgPlanInfo:
    layout: GroupLayout
    own_offset: list  # bytes from slot start to this rank's shard of each param
    out_offset: list  # bytes from slot start to each param's output
    out_numel: list
    chunks: list  # chunks[c] = [ShardRange, ...]


def ag_chunks(layout: GroupLayout, first_bytes: int = AG_FIRST_CHUNK_BYTES,
              max_bytes: int = AG_MAX_CHUNK_BYTES) -> list:
    """The own shards in slot order, cut into chunks of ``first_bytes``, then twice as many bytes as the
    chunk before, up to ``max_bytes`` (bytes of the output dtype). A parameter is cut only at multiples
    of ``SPLIT_ELEMS`` elements (the cast kernel's vector width stays aligned); every shard element lies
    in exactly one chunk."""
    if first_bytes < 1 or max_bytes < first_bytes:
        raise ValueError(f"tide.meta.plans: need 1 <= first_bytes <= max_bytes, got {first_bytes}, {max_bytes}")
    chunks, cur, filled, target = [], [], 0, first_bytes
    for p in layout.params:
        pos, n = 0, p.shard_numel
        while pos < n:
            room = (target - filled) // p.itemsize // SPLIT_ELEMS * SPLIT_ELEMS
            take = min(n - pos, room if cur else max(room, SPLIT_ELEMS))
            if take == 0:  # this chunk is full
                chunks.append(cur)
                cur, filled, target = [], 0, min(2 * target, max_bytes)
                continue
            cur.append(ShardRange(p.index, pos, take))
            filled += take * p.itemsize
            pos += take
    if cur:
        chunks.append(cur)
    return chunks


def ag_plan_info(layout: GroupLayout, rank: int) -> AgPlanInfo:
    own_offset = [p.slot_byte_range(rank)[0] for p in layout.params]
    return AgPlanInfo(layout, own_offset, [p.slot_offset for p in layout.params], [p.out_numel for p in layout.params],
                      ag_chunks(layout))


@dataclass
class RsPlanInfo:
    layout: GroupLayout
    rounds: list  # rounds[d][j] = [RsPiece, ...]
    pads: list  # [ShardRange] of this rank's padding


def _pack(chunks: Sequence, itemsizes: Sequence[int], capacity: int) -> list:
    """``chunks`` (each with ``param``, ``grad_offset``, ``shard_offset``, ``numel``) packed into rounds of
    at most ``capacity`` bytes: each piece 16-B aligned in its entry; a chunk that does not fit a round's
    room fills it (split at a multiple of SPLIT_ELEMS elements) and goes on in the next round, so every
    round but the last is full."""
    rounds, cur, off = [], [], 0
    for c in chunks:
        size = itemsizes[c.param]
        grad_off, shard_off, left = c.grad_offset, c.shard_offset, c.numel
        while left:
            room = (capacity - off) // size // SPLIT_ELEMS * SPLIT_ELEMS
            n = left if left * size <= capacity - off else room
            if n == 0:
                rounds.append(cur)
                cur, off = [], 0
                continue
            cur.append(RsPiece(c.param, grad_off, shard_off, n, off))
            off = align_up(off + n * size, ALIGN)
            grad_off, shard_off, left = grad_off + n, shard_off + n, left - n
    if cur:
        rounds.append(cur)
    return rounds


def rs_piece_bytes(shard_numels: Sequence[int], itemsizes: Sequence[int]) -> int:
    """The bytes one destination's pieces of a reduce-scatter take in a staging entry (each piece 16-B
    aligned, as :func:`_pack` places them): padded shards of ``shard_numels`` elements of ``itemsizes``
    bytes. An entry this large carries the op in one round per destination."""
    return sum(align_up(n * size, ALIGN) for n, size in zip(shard_numels, itemsizes))


def check_entry_bytes(itemsizes: Sequence[int], entry_bytes: int) -> None:
    if entry_bytes % ALIGN or (itemsizes and entry_bytes < SPLIT_ELEMS * max(itemsizes)):
        raise ValueError(f"tide.meta.plans: entry_bytes={entry_bytes} must be a multiple of {ALIGN} "
                         f"and hold {SPLIT_ELEMS} elements")


def pack_rounds(chunks: Sequence, itemsizes: Sequence[int], entry_bytes: int) -> list:
    """One destination's ``chunks`` in the fewest rounds that fit its entries, cut to about equal size, so
    that a destination just over a whole number of entries does not end in a round of a few KiB whose
    push and sum hardly overlap with the rest. On 2 x H200 a 32 MiB op (16 MiB + 2 KiB for destination 0)
    took 135 us at ring depth 2 as 16 MiB + 2 KiB, and 124 us at depth 4 as 8 + 8 MiB + 2 KiB
    (bench/results/timeline_push_streams_run54.csv)."""
    rounds = _pack(chunks, itemsizes, entry_bytes)
    if len(rounds) >= 2:
        # This destination's bytes as packed (alignment included), cut in as many rounds, with room for the
        # split granularity and each round's alignment; never beyond the entry.
        min_round = SPLIT_ELEMS * max(itemsizes)
        total = sum(align_up(k * itemsizes[p], ALIGN) for rnd in rounds for p, _, _, k, _ in rnd)
        even = align_up(-(-total // len(rounds)), ALIGN) + min_round + ALIGN
        if even < entry_bytes:
            cut = _pack(chunks, itemsizes, even)
            rounds = cut if len(cut) <= len(rounds) else rounds  # never more rounds than the entries need
    return rounds


def rs_plan_info(grad_shapes: Sequence[Sequence[int]], grad_dtypes: Sequence[torch.dtype], world_size: int,
                 rank: int, entry_bytes: int) -> RsPlanInfo:
    """The reduce-scatter's rounds, per destination (:func:`pack_rounds`); every rank computes every
    destination's rounds alike."""
    itemsizes = [d.itemsize for d in grad_dtypes]
    check_entry_bytes(itemsizes, entry_bytes)
    layout = GroupLayout(grad_shapes, itemsizes, world_size, rs_chunk_bytes=entry_bytes)
    rounds = [pack_rounds(layout.rs_chunks(d), itemsizes, entry_bytes) for d in range(world_size)]
    pads = [ShardRange(p.param, p.shard_offset, p.numel) for p in layout.pad_ranges(rank)]
    return RsPlanInfo(layout, rounds, pads)
