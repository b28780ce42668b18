"""``tide.sums``: the reference sum against the documented order computed independently (numpy
float32, one rounded operation per step), the own term at every position, and the CPU dispatch's count.
The CUDA kernel is checked against this reference bit for bit in tests/cuda/test_kernels.py."""
import random

import numpy as np
import pytest
import torch

import tide
from tide import sums

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _pieces(rng: random.Random, n: int, parts: int) -> list[int]:
    """``n`` elements cut into ``parts`` consecutive pieces (some of them empty)."""
    cuts = sorted(rng.randint(0, n) for _ in range(parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, n])]


def _documented(terms: list[torch.Tensor], scale: float, old: np.ndarray | None) -> np.ndarray:
    """acc = x_0; acc = acc + x_k in order; v = acc * scale; out = old + v (or v), all in numpy float32."""
    acc = terms[0].float().numpy().astype(np.float32)
    for t in terms[1:]:
        acc = (acc + t.float().numpy().astype(np.float32)).astype(np.float32)
    v = (acc * np.float32(scale)).astype(np.float32)
    return v if old is None else (old + v).astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_rows_follows_the_documented_order(dtype):
    rng = random.Random(len(str(dtype)))
    for trial in range(24):
        k, n = rng.randint(1, 6), rng.choice([0, 1, 7, 64, rng.randint(1, 3000)])
        terms = [torch.randn(n).mul_(rng.choice([1.0, 1e3, 1e-3])).to(dtype) for _ in range(k)]
        own_row = rng.randrange(k) if trial % 2 else -1
        sizes = _pieces(rng, n, rng.choice([1, 2, 5]))
        rows = torch.stack([t for i, t in enumerate(terms) if i != own_row]) if k > (own_row >= 0) \
            else torch.empty(0, n, dtype=dtype)
        owns = list(terms[own_row].split(sizes)) if own_row >= 0 else []
        scale, accumulate = rng.choice([1.0, 0.25, rng.uniform(0.1, 3.0)]), trial % 3 == 0
        old = torch.randn(n)
        out = old.clone() if accumulate else torch.full((n,), float("nan"))
        sums.sum_rows_reference(list(out.split(sizes)), rows, owns, own_row, scale, accumulate)
        want = _documented(terms, scale, old.numpy() if accumulate else None)
        assert np.array_equal(out.numpy().view(np.int32), want.view(np.int32)), \
            f"{dtype} trial {trial}: k={k} n={n} own_row={own_row} pieces={sizes}"
        if not accumulate and n:
            f64 = scale * sum(t.double() for t in terms)
            assert torch.allclose(out.double(), f64, rtol=1e-5, atol=1e-5 * float(f64.abs().max()))


def test_an_own_term_stands_where_its_row_would():
    """Any own position gives the bits of the same terms all staged as rows."""
    g = torch.Generator().manual_seed(7)
    terms = torch.randn(5, 333, generator=g).to(torch.bfloat16)
    everything = torch.empty(333)
    sums.sum_rows_reference([everything], terms, scale=0.5)
    for own_row in range(5):
        out = torch.full((333,), float("nan"))
        sizes = [100, 0, 233]
        sums.sum_rows_reference(list(out.split(sizes)), torch.cat([terms[:own_row], terms[own_row + 1:]]),
                       list(terms[own_row].split(sizes)), own_row, scale=0.5)
        assert torch.equal(out.view(torch.int32), everything.view(torch.int32)), own_row


def test_cpu_tensors_take_the_reference_and_count_it():
    tide.reset_stats()
    rows, out = torch.randn(3, 10), torch.empty(10)
    sums.sum_rows([out], rows)
    want = torch.empty(10)
    sums.sum_rows_reference([want], rows)
    assert torch.equal(out, want)
    assert tide.stats()["multinode"] == {"sum:torch": 1}


def test_the_reference_refuses_inconsistent_own_terms():
    rows, out = torch.randn(2, 4), torch.empty(4)
    cases = [(dict(owns=[], own_row=0), "own_row = -1 without owns"),
             (dict(owns=[torch.randn(4)], own_row=3), "own_row=3 not in [0, 3)"),
             (dict(owns=[torch.randn(2), torch.randn(2)], own_row=0), "one tensor per out"),
             (dict(owns=[torch.randn(4).half()], own_row=0), "rows' dtype")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match="tide.sum_rows_reference") as e:
            sums.sum_rows_reference([out], rows, **kwargs)
        assert message in str(e.value), (message, str(e.value))
