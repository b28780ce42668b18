"""Tensor-subclass parameters and gradients (CPU, gloo, 2 ranks; tests/fsdp/pair_weights.py): an op call
with a subclass is dispatched through the subclass (``TwoTensor`` runs it once per inner tensor), so such
calls take stock FSDP2, ``subclass_param`` / ``subclass_grad``, and train bit for bit like stock, also when
each reduce accumulates into existing gradients (``zero_grad(set_to_none=False)``)."""
import pytest

from tests.fsdp import workers
from tide.launch import run_ranks

STEPS = 3


@pytest.mark.parametrize("set_to_none", [False, True])
def test_subclass_gradients_reduce_like_stock(set_to_none):
    for rank, r in enumerate(run_ranks(workers.subclass_weights, 2, True, set_to_none, STEPS, timeout=180)):
        workers.assert_like_stock(rank, r["tide"], r["stock"], exact=True)
        stats = r["tide"]["stats"]
        # The extension's inputs are the plain inner shards: TIDE gathers them. Each of the 3 blocks gathers in
        # forward and in backward and reduces once (the root has no parameter of its own).
        assert stats["all_gather"] == {"tide": 3 * 2 * (STEPS + 1)}, stats
        assert stats["reduce_scatter"] == {"stock:subclass_grad": 3 * (STEPS + 1)}, stats


def test_subclass_shards_gather_like_stock():
    for rank, r in enumerate(run_ranks(workers.subclass_weights, 2, False, False, STEPS, timeout=180)):
        workers.assert_like_stock(rank, r["tide"], r["stock"], exact=True)
        stats = r["tide"]["stats"]
        # Every weight's shard is a subclass; the unsharded weights, and so their gradients, are plain.
        assert stats["all_gather"] == {"stock:subclass_param": 3 * 2 * (STEPS + 1)}, stats
        assert stats["reduce_scatter"] == {"tide": 3 * (STEPS + 1)}, stats
