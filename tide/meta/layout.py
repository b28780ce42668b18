"""Layout plan of one FSDP2 parameter group: where every shard lands, which gradient bytes go where.

Pure Python and device-free: built once per param group from parameter shapes, element sizes and the
world size W, then read by the ops, the CUDA transport and the FSDP2 seam.

FSDP2 shards every parameter on dim 0 with padding: param i with ``d0_i`` rows of ``row_i`` elements
gets ``c_i = ceil(d0_i / W)`` rows per shard, and rank r owns rows ``[r*c_i, (r+1)*c_i)``; rows
``>= d0_i`` are padding (zero in shards, ignored in gradients). The all-gather output of param i is
``W*c_i*row_i`` elements, param-major, so rank r's shard of param i lands at element
``r*c_i*row_i`` of that output. Inside an all-gather slot the outputs sit one after another, each
starting on an ``align``-byte boundary (16 by default: the widest vector access the kernels make).

A 0-d parameter is treated as one row of one element, as a ``(1,)`` tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "GroupLayout",
    "ParamLayout",
    "RsChunk",
    "PadRange",
    "shard_rows",
    "rank_row_range",
    "rows_and_row_numel",
]

DEFAULT_ALIGN_BYTES = 16
DEFAULT_RS_CHUNK_BYTES = 1 << 20


def shard_rows(d0: int, world_size: int) -> int:
    """Rows per padded shard, FSDP2's ``ceil(d0 / W)``."""
    return -(-d0 // world_size)


def rank_row_range(d0: int, world_size: int, rank: int) -> tuple[int, int]:
    """Real (unpadded) rows ``[start, stop)`` of rank ``rank``; empty when the rank holds only padding."""
    c = shard_rows(d0, world_size)
    start = min(rank * c, d0)
    return start, min(start + c, d0)


def rows_and_row_numel(shape: Sequence[int]) -> tuple[int, int]:
    """``(d0, elements per row)`` of a parameter shape; a 0-d shape is one row of one element."""
    if len(shape) == 0:
        return 1, 1
    return int(shape[0]), math.prod(int(s) for s in shape[1:])


def align_up(n: int, align: int) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


@dataclass(frozen=True)
class ParamLayout:
    """Placement of one parameter of a group (element counts unless a name says bytes)."""

    index: int
    shape: tuple[int, ...]
    itemsize: int  # bytes per element of the all-gather output (FSDP2's param dtype)
    grad_itemsize: int  # bytes per element of the unsharded gradient (reduce-scatter input)
    world_size: int
    d0: int
    row_numel: int
    shard_rows: int  # c
    slot_offset: int  # bytes from the slot start to this param's all-gather output

    @property
    def shard_numel(self) -> int:
        return self.shard_rows * self.row_numel

    @property
    def out_numel(self) -> int:
        return self.world_size * self.shard_numel

    @property
    def numel(self) -> int:
        """Real (unpadded) elements of the parameter."""
        return self.d0 * self.row_numel

    @property
    def out_bytes(self) -> int:
        return self.out_numel * self.itemsize

    def rows(self, rank: int) -> tuple[int, int]:
        return rank_row_range(self.d0, self.world_size, rank)

    def real_numel(self, rank: int) -> int:
        start, stop = self.rows(rank)
        return (stop - start) * self.row_numel

    def final_offset(self, rank: int) -> int:
        """Element offset of rank ``rank``'s shard inside this param's all-gather output."""
        return rank * self.shard_numel

    def slot_byte_range(self, rank: int) -> tuple[int, int]:
        """Bytes ``[start, stop)`` of rank ``rank``'s shard inside an all-gather slot."""
        start = self.slot_offset + self.final_offset(rank) * self.itemsize
        return start, start + self.shard_numel * self.itemsize


@dataclass(frozen=True)
class RsChunk:
    """``numel`` gradient elements of param ``param`` from element ``grad_offset`` of the unsharded
    gradient, reduced into element ``shard_offset`` of destination rank ``dest``'s shard grad."""

    dest: int
    param: int
    grad_offset: int
    shard_offset: int
    numel: int


@dataclass(frozen=True)
class PadRange:
    """Padding elements ``[shard_offset, shard_offset + numel)`` of ``dest``'s shard grad of ``param``:
    written as zero (or left unchanged when accumulating)."""

    dest: int
    param: int
    shard_offset: int
    numel: int


class GroupLayout:
    """All placements of one param group on ``world_size`` ranks.

    Arguments:
        shapes: unsharded parameter shapes.
        itemsizes: bytes per element of each all-gather output (the param dtype).
        world_size: ranks in the shard group.
        grad_itemsizes: bytes per element of each unsharded gradient (default: ``itemsizes``).
        rs_chunk_bytes: upper bound of one reduce-scatter chunk, in gradient bytes.
        align: byte alignment of every param's output inside a slot (a power of two).
    """

    def __init__(
        self,
        shapes: Sequence[Sequence[int]],
        itemsizes: Sequence[int],
        world_size: int,
        *,
        grad_itemsizes: Sequence[int] | None = None,
        rs_chunk_bytes: int = DEFAULT_RS_CHUNK_BYTES,
        align: int = DEFAULT_ALIGN_BYTES,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"GroupLayout: world_size must be >= 1, got {world_size}")
        if len(itemsizes) != len(shapes):
            raise ValueError(f"GroupLayout: {len(shapes)} shapes but {len(itemsizes)} itemsizes")
        grad_itemsizes = list(itemsizes if grad_itemsizes is None else grad_itemsizes)
        if len(grad_itemsizes) != len(shapes):
            raise ValueError(f"GroupLayout: {len(shapes)} shapes but {len(grad_itemsizes)} grad_itemsizes")
        if align < 1 or align & (align - 1):
            raise ValueError(f"GroupLayout: align must be a power of two, got {align}")
        if rs_chunk_bytes < max(grad_itemsizes, default=1):
            raise ValueError(f"GroupLayout: rs_chunk_bytes={rs_chunk_bytes} is smaller than one element")
        self.world_size = world_size
        self.align = align
        self.rs_chunk_bytes = rs_chunk_bytes
        params = []
        offset = 0
        for i, (shape, itemsize, grad_itemsize) in enumerate(zip(shapes, itemsizes, grad_itemsizes)):
            shape = tuple(int(s) for s in shape)
            if any(s < 0 for s in shape):
                raise ValueError(f"GroupLayout: shapes[{i}]={shape} has a negative size")
            d0, row_numel = rows_and_row_numel(shape)
            p = ParamLayout(
                index=i,
                shape=shape,
                itemsize=int(itemsize),
                grad_itemsize=int(grad_itemsize),
                world_size=world_size,
                d0=d0,
                row_numel=row_numel,
                shard_rows=shard_rows(d0, world_size),
                slot_offset=offset,
            )
            params.append(p)
            offset = align_up(offset + p.out_bytes, align)
        self.params: tuple[ParamLayout, ...] = tuple(params)
        self.slot_bytes = offset

    def __len__(self) -> int:
        return len(self.params)

    def __repr__(self) -> str:
        return (
            f"GroupLayout(params={len(self.params)}, world_size={self.world_size}, "
            f"slot_bytes={self.slot_bytes}, rs_chunk_bytes={self.rs_chunk_bytes})"
        )

    def rs_chunks(self, dest: int) -> list[RsChunk]:
        """Chunks reduced into rank ``dest``'s shard grads, param by param, each at most
        ``rs_chunk_bytes`` of gradient bytes. Together they cover every real element of ``dest``'s
        rows exactly once."""
        chunks = []
        for p in self.params:
            start, stop = p.rows(dest)
            first = start * p.row_numel
            total = (stop - start) * p.row_numel
            step = max(1, self.rs_chunk_bytes // p.grad_itemsize)
            for done in range(0, total, step):
                n = min(step, total - done)
                chunks.append(RsChunk(dest, p.index, first + done, done, n))
        return chunks

    def pad_ranges(self, dest: int) -> list[PadRange]:
        """Padding tails of rank ``dest``'s shard grads (only params whose rows end early)."""
        pads = []
        for p in self.params:
            real = p.real_numel(dest)
            if real < p.shard_numel:
                pads.append(PadRange(dest, p.index, real, p.shard_numel - real))
        return pads

    def unsharded_bytes(self) -> int:
        """The group's unsharded bytes in the all-gather dtype (NS of the memory model)."""
        return sum(p.numel * p.itemsize for p in self.params)

    def layout_conversion_bytes(self, shard_itemsizes: Sequence[int], reduce_itemsize: int = 4) -> dict[str, int]:
        """Bytes (read + written) stock FSDP2 moves per unshard and per reduce to convert layouts, on one rank.

        Stock unshard: a foreach cast of the shards (``shard_itemsizes``) into a flat param-dtype buffer
        (``cast``), ``all_gather_copy_in`` packing that buffer into this rank's block of the rank-major
        output, and ``split_with_sizes_copy`` copying the whole gathered group out per parameter.
        Stock reduce: ``chunk_cat`` reads every unsharded gradient and writes a padded rank-major buffer
        in ``reduce_itemsize``. TIDE keeps only the cast (straight into the final address), so
        ``removed`` counts the other three.
        """
        cast = sum(p.shard_numel * (s + p.itemsize) for p, s in zip(self.params, shard_itemsizes))
        copy_in = sum(2 * p.shard_numel * p.itemsize for p in self.params)
        copy_out = sum(2 * p.out_numel * p.itemsize for p in self.params)
        chunk_cat = sum(p.numel * p.grad_itemsize + p.out_numel * reduce_itemsize for p in self.params)
        return {
            "cast": cast,
            "all_gather_copy_in": copy_in,
            "split_with_sizes_copy": copy_out,
            "chunk_cat": chunk_cat,
            "removed": copy_in + copy_out + chunk_cat,
        }
