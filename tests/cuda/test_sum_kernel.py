"""The summing kernel alone, bit for bit against the reference's sum (tide.ops.reference.sum_contributions_)."""
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
    for trial in range(4):
        n = rng.choice([1, 7, 8, 9, 4096 + rng.randint(1, 15), rng.randint(1, 300_000)])
        pad = rng.choice([0, 1, 3, 8])  # elements between contributions: 0/8 keep 16-B alignment, 1/3 break it
        stride = n + pad
        base = torch.randn(k * stride, device="cuda").to(dtype)
        scale = rng.choice([1.0, 0.125, rng.uniform(0.01, 4.0)])
        accumulate = trial % 2 == 1
        ctas = rng.choice([1, 3, 16])
        init = torch.randn(n + 5, device="cuda")
        out = init.clone() if accumulate else torch.full_like(init, float("nan"))
        ext.sum_strided(out, base, k, stride * base.element_size(), n, scale, accumulate, ctas)
        contributions = base.cpu().view(k, stride)[:, :n]
        want = init.cpu().clone() if accumulate else torch.full((n + 5,), float("nan"))
        sum_contributions_(want[:n], contributions, scale, True) if accumulate else None
        if not accumulate:
            ref = torch.empty(n)
            sum_contributions_(ref, contributions, scale, False)
            want[:n] = ref
        assert_bits(f"k={k} n={n} pad={pad} acc={accumulate} ctas={ctas}", out, want)
