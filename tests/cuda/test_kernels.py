"""TIDE's kernels alone: the summing kernel bit for bit against the reference's sum
(tide.ops.reference.sum_contributions_), and the own-shard cast bit for bit against torch's ``to``."""
import random

import pytest
import torch

from tests.cuda.ranks import assert_bits
from tide.ops.reference import sum_contributions_

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", [1, 2, 3, 8, 11])
def test_sum_matches_reference(ext, dtype, k):
    rng = random.Random(k * 31 + len(str(dtype)))
    # (n, pad) by hand first, so every K reaches the vector paths: contribution k starts k * (n + pad)
    # elements in, so the stride decides the alignment (16 B for fp32, 8 B for 16-bit sources), then the
    # seeded random ones. Trials alternate writing and accumulating.
    fixed = [(3 * 4096 + 4, 0), (4100, 4), (8, 4), (4096 + 3, 1)]
    for trial in range(len(fixed) + 4):
        if trial < len(fixed):
            n, pad = fixed[trial]
        else:
            n = rng.choice([1, 7, 8, 9, 4096 + rng.randint(1, 15), rng.randint(1, 300_000)])
            pad = rng.choice([0, 1, 3, 4, 8])
        stride = n + pad
        base = torch.randn(k * stride, device="cuda").to(dtype)
        scale = rng.choice([1.0, 0.125, rng.uniform(0.01, 4.0)])
        accumulate = trial % 2 == 1
        ctas = rng.choice([1, 3, 16])
        init = torch.randn(n + 5, device="cuda")
        out = init.clone() if accumulate else torch.full_like(init, float("nan"))
        ext.sum_strided(out=out, base=base, k=k, stride_bytes=stride * base.element_size(), n=n, scale=scale,
                        accumulate=accumulate, ctas=ctas)
        contributions = base.cpu().view(k, stride)[:, :n]
        want = init.cpu().clone() if accumulate else torch.full((n + 5,), float("nan"))
        sum_contributions_(want[:n], contributions, scale, True) if accumulate else None
        if not accumulate:
            ref = torch.empty(n)
            sum_contributions_(ref, contributions, scale, False)
            want[:n] = ref
        assert_bits(f"k={k} n={n} pad={pad} acc={accumulate} ctas={ctas}", out, want)


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
