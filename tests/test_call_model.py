"""The one model of a call that every backend compares and every fault report words (``tide.agreement``,
``tide.timeouts``, ``tide.procfs``): the same call is the same record whoever compares it, and each wording
is written once."""
import os
import zlib

import torch

import tide
from tide import procfs
from tide.agreement import CallRecord, call_desc, different_calls, not_reached
from tide.timeouts import TIMEOUT_WORDS, did_not_complete


def _tensors(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [tuple(int(d) for d in torch.randint(1, 9, (int(torch.randint(1, 4, (1,), generator=g)),),
                                                  generator=g)) for _ in range(3)]
    return [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]


def test_a_call_record_is_its_description_digest_and_declared_identity():
    for seed in range(5):
        ts = _tensors(seed)
        call = CallRecord.of("all_gather_start", 7, (ts,), ("flag=1",))
        assert call.desc == call_desc("all_gather_start", (ts,), ("flag=1",))
        assert call.digest == zlib.crc32(call.desc.encode()) and call.n == 7 and call.identity == ""
        with tide.call_identity(step=seed):
            declared = CallRecord.of("all_gather_start", 7, (ts,), ("flag=1",))
        assert declared.digest == call.digest and f"step {seed}" in declared.identity
        # another shape is another call, whatever its identity
        other = CallRecord.of("all_gather_start", 7, ([torch.cat([ts[0], ts[0]]), *ts[1:]],), ("flag=1",))
        assert other.digest != call.digest


def test_the_wordings_are_shared():
    assert different_calls("tide.x: ranks of group 'g'", 3, 0, "a", 1, "b") == \
        "tide.x: ranks of group 'g' issued different calls at call 3: this rank 0 issued a, rank 1 issued b"
    assert different_calls("tide.x: ranks", None, 1, "a", 0, "b", kind="graph calls") == \
        "tide.x: ranks issued different graph calls at the same point: this rank 1 issued a, rank 0 issued b"
    assert not_reached("lease #2", (1, 2), 0.3) == \
        "lease #2: rank(s) [1, 2] did not reach this call within 0.3 s (a peer died or issued fewer TIDE ops)"
    assert did_not_complete("tide.x", "group 'g'", 12.34, "it was issued", 10) == \
        f"tide: tide.x on group 'g' did not complete 12.3 s after it was issued (timeout 10 s: {TIMEOUT_WORDS})"


def test_a_process_has_ended_when_proc_says_gone_zombie_or_dead():
    assert not procfs.ended(procfs.state(os.getpid()))
    for state, ended in (("gone", True), ("Z (zombie)", True), ("X (dead)", True), ("S (sleeping)", False),
                         ("D (disk sleep)", False)):
        assert procfs.ended(state) is ended

