"""TIDE's kernels alone: the summing kernel bit for bit against the reference's sum
(tide.sums.sum_rows_reference), and the own-shard cast bit for bit against torch's ``to``."""
import random

import pytest
import torch

from tests.cuda.ranks import assert_bits
from tests.ops.test_sums import _pieces
from tide.sums import sum_rows_reference

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", [1, 2, 3, 8, 11])
def test_sum_matches_reference(ext, dtype, k):
    """``sum_rows``: K terms as strided rows, or K - 1 rows plus own terms at any position, read where
    they lie (the multi-node schedule's form); one or several outputs; writing and accumulating."""
    rng = random.Random(k * 31 + len(str(dtype)))
    # (n, pad) by hand first, so every K reaches the vector paths: row k starts k * (n + pad) elements in,
    # so the stride decides the alignment (16 B for fp32, 8 B for 16-bit sources), then the seeded random
    # ones. Trials alternate writing and accumulating, and rows only / rows plus own terms.
    fixed = [(3 * 4096 + 4, 0), (4100, 4), (8, 4), (4096 + 3, 1)]
    for trial in range(len(fixed) + 6):
        if trial < len(fixed):
            n, pad = fixed[trial]
        else:
            n = rng.choice([1, 7, 8, 9, 4096 + rng.randint(1, 15), rng.randint(1, 300_000)])
            pad = rng.choice([0, 1, 3, 4, 8])
        with_own = trial % 4 >= 2
        nrows = k - 1 if with_own else k
        stride = n + pad
        rows = torch.randn(max(nrows, 1) * stride, device="cuda").to(dtype)[:nrows * stride].view(nrows, stride)[:, :n]
        sizes = _pieces(rng, n, rng.choice([1, 1, 3, 7]))
        own_row, owns = -1, []
        if with_own:
            own_row = rng.randrange(k)
            lead = rng.choice([0, 0, 1, 3])  # own terms at an offset: 1 and 3 break the vector alignment
            own = torch.randn(n + lead, device="cuda").to(dtype)[lead:]
            owns = list(own.split(sizes))
        scale = rng.choice([1.0, 0.125, rng.uniform(0.01, 4.0)])
        accumulate = trial % 2 == 1
        ctas = rng.choice([1, 3, 16])
        init = torch.randn(n + 5, device="cuda")
        out = init.clone() if accumulate else torch.full_like(init, float("nan"))
        ext.sum_rows(outs=list(out[:n].split(sizes)), rows=rows, owns=owns, own_row=own_row, scale=scale,
                     accumulate=accumulate, ctas=ctas)
        want = init.cpu().clone() if accumulate else torch.full((n + 5,), float("nan"))
        sum_rows_reference(list(want[:n].split(sizes)), rows.cpu(), [o.cpu() for o in owns], own_row, scale, accumulate)
        assert_bits(f"k={k} n={n} pad={pad} own_row={own_row} pieces={len(sizes)} acc={accumulate} ctas={ctas}",
                    out, want)


def test_sum_splits_many_outputs_into_launches(ext):
    """More outputs than one launch's segments (96): exactly 96, 97 and 250 pieces, some empty."""
    rng = random.Random(96)
    for parts in (96, 97, 250):
        n = 40_000
        sizes = _pieces(rng, n, parts)
        rows = torch.randn(3, n, device="cuda").to(torch.bfloat16)
        own = torch.randn(n, device="cuda").to(torch.bfloat16)
        out = torch.full((n,), float("nan"), device="cuda")
        ext.sum_rows(outs=list(out.split(sizes)), rows=rows, owns=list(own.split(sizes)), own_row=2, scale=0.5,
                     accumulate=False, ctas=8)
        want = torch.empty(n)
        sum_rows_reference(list(want.split(sizes)), rows.cpu(), list(own.cpu().split(sizes)), 2, 0.5, False)
        assert_bits(f"{parts} pieces", out, want)


def test_sum_rejects_bad_arguments(ext):
    """Every misuse names ``tide.sum_rows`` and what is wrong; nothing runs."""
    rows = torch.randn(2, 8, device="cuda")
    out = torch.zeros(8, device="cuda")
    cases = [
        (dict(outs=[], rows=rows, owns=[], own_row=-1), "outs is empty"),
        (dict(outs=[out[:4]], rows=rows, owns=[], own_row=-1), "columns"),
        (dict(outs=[out], rows=rows, owns=[], own_row=0), "own_row = -1 without owns"),
        (dict(outs=[out], rows=rows, owns=[torch.randn(8, device="cuda")], own_row=3), "own_row=3 not in [0, 3)"),
        (dict(outs=[out], rows=rows, owns=[torch.randn(8, device="cuda").half()], own_row=0), "owns[0]"),
        (dict(outs=[out.double()], rows=rows, owns=[], own_row=-1), "outs[0]"),
        (dict(outs=[out], rows=rows.to(torch.int32), owns=[], own_row=-1), "fp32, bf16 or fp16"),
        (dict(outs=[out], rows=rows[:0], owns=[], own_row=-1), "no terms"),
    ]
    for kwargs, message in cases:
        with pytest.raises(RuntimeError, match="tide.sum_rows") as e:
            ext.sum_rows(scale=1.0, accumulate=False, ctas=4, **kwargs)
        assert message in str(e.value), (message, str(e.value))
    with pytest.raises(RuntimeError, match="tide.sum_rows: ctas must be >= 1"):
        ext.sum_rows(outs=[out], rows=rows, owns=[], own_row=-1, scale=1.0, accumulate=False, ctas=0)


DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
def test_cast_matches_torch(ext, src_dtype, dst_dtype):
    """Every dtype pair, vector and element paths (16-B aligned or not), tails of 0-7 elements, grids
    smaller and larger than the elements need; the output is poisoned first."""
    rng = random.Random(hash((str(src_dtype), str(dst_dtype))) & 0xFFFF)
    for trial in range(6):
        n = rng.choice([1, 7, 8, 9, 1000, 8 * 4096 + rng.randint(0, 7), rng.randint(1, 3_000_000)])
        src_off, dst_off = rng.choice([(0, 0), (0, 1), (3, 0), (8, 8)])  # elements: 1 and 3 break 16-B alignment
        src = torch.randn(n + src_off, device="cuda").mul_(rng.choice([1.0, 1e4, 1e-4])).to(src_dtype)[src_off:]
        dst = torch.full((n + dst_off,), float("nan"), device="cuda", dtype=dst_dtype)[dst_off:]
        ext.cast_into(dst=dst, src=src, max_ctas=rng.choice([1, 7, 528]))
        assert_bits(f"{src_dtype}->{dst_dtype} n={n} offsets={src_off, dst_off}", dst, src.to(dst_dtype))
