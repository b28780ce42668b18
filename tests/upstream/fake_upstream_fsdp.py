"""An upstream-style FSDP2 test file of the harness's own, for tests/upstream/test_harness.py: PyTorch's
multi-process and multi-thread FSDP test classes with ``fully_shard`` on 2 ranks, one test that passes and one
that fails on one rank. Not collected by the suite itself (its name does not start with ``test_``)."""
import torch
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.common_fsdp import FSDPTest, FSDPTestMultiThread, MLP


def _train_step() -> None:
    torch.manual_seed(0)
    model = MLP(8)
    fully_shard(model.in_proj)
    fully_shard(model)
    model(torch.randn(2, 8)).sum().backward()


class TestRankProcesses(FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    def test_train_step(self):
        _train_step()

    def test_rank_1_disagrees(self):
        _train_step()
        self.assertEqual(self.rank, 0, "rank 1 disagrees")


class TestRankThreads(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_forward(self):
        model = MLP(8)
        fully_shard(model)
        model(torch.randn(2, 8))
