"""TIDE-AG / TIDE-RS on CUDA through the tide ops, bit for bit against the reference backend.

Several processes share one GPU (gloo group, symmetric memory with
TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1) when there are fewer GPUs than ranks; with W GPUs each
rank has its own and the same tests run unchanged.
"""
import pytest

from tests.cuda import ranks
from tide.launch import run_ranks

pytestmark = pytest.mark.cuda


def _run(fn, world_size, *args, backend="gloo", timeout=420, env=None):
    return run_ranks(fn, world_size, *args, backend=backend, device_type="cuda", env={**ranks.ENV, **(env or {})},
                     timeout=timeout)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_bitexact_against_reference(ext, world_size):
    results = _run(ranks.bitexact, world_size, 1234 + world_size, 12 if world_size < 8 else 8)
    for r in results:
        assert r["checked"] > 0
        calls = r["stats"]
        # Unbound all-gather outputs take the reference path, by design and with their reason.
        stock = {k for k in calls if ":stock" in k} - {"all_gather_into_params_:stock:outputs_not_in_slot"}
        assert not stock, calls
        assert calls.get("all_gather_into_params_:tide", 0) > 0, calls
        assert calls.get("reduce_scatter_params_:tide", 0) > 0, calls


def test_bitexact_at_ring_depth_4_with_one_cast_cta(ext):
    """The knobs off their defaults (ring depth 2, 4 cast CTAs per SM): depth 4, the default until commit
    6c3feff, and the own-shard kernel on a single CTA (TIDE_AG_CAST_CTAS) stay bit-exact."""
    results = _run(ranks.bitexact, 2, 4321, 8, env={"TIDE_RS_RING_DEPTH": "4", "TIDE_AG_CAST_CTAS": "1"})
    for r in results:
        assert (r["ring_depth"], r["cast_ctas"]) == (4, 1), r
        assert r["checked"] > 0 and r["stats"].get("reduce_scatter_params_:tide", 0) > 0, r


def test_ranks_with_different_ring_settings_refuse_to_enable(ext):
    for msg in _run(ranks.mismatched_layout, 2):
        assert "TIDE_RS_RING_DEPTH" in msg and "ring_depth=2" in msg and "ring_depth=3" in msg, msg


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_randomized_stress(ext, world_size):
    results = _run(ranks.stress, world_size, 99 + world_size, 40 if world_size < 8 else 24)
    for r in results:
        assert r["checked"] > 0, r


def test_repeated_calls_bitexact(ext):
    """The same plans called again and again: both slots, unbound outputs, refilled and fresh
    gradients and gradients in either slot, a ring of depth 2 that the pushes wrap; all bit-exact, each
    all-gather into a slot marking that slot used once, and the calls on a layout seen before taken by the C++
    kernels without Python."""
    for rank, r in enumerate(_run(ranks.repeated_calls, 3, 4321, 8)):
        c = r["counters"]
        assert r["checked"] == 16 and r["slots"] == [0, 1] and r["marked"] == [1] * 6, (rank, r)
        assert c["all_gathers"] > 0 and c["reduce_scatters"] == 8 and c["ce_copies"] > 0, (rank, c)
        assert r["stats"].get("all_gather_into_params_:stock:outputs_not_in_slot") == 2, (rank, r["stats"])
        # After each shape's first call (Python builds its plan) every call stays in C++, but the unbound
        # all-gathers, whose outputs lie in no slot (Python takes the reference path).
        assert r["steady"] == {"all_gather_into_params_": 5, "reduce_scatter_params_": 7}, (rank, r["steady"])


def test_leases_cycle_without_stray_writes(ext):
    """The data region released and leased again four times, ops bit-exact in every lease, a region kept
    alive by slot views past its release left untouched, old leases' store keys deleted."""
    for rank, r in enumerate(_run(ranks.lease_cycles, 3, 515, 4)):
        assert r["mode"] == "allocator" and r["leases"] == 4, (rank, r)
        assert r["kept_intact"], (rank, r)
        assert r["old_keys_left"] == [], (rank, r)


def test_leases_fall_back_to_symmetric_memory_under_expandable_segments(ext):
    """Legacy CUDA IPC cannot export expandable segments: every rank then keeps the data region in symmetric
    memory, says why, and the ops stay bit-exact."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for rank, r in enumerate(_run(ranks.lease_cycles, 2, 516, 3, env=env)):
        assert r["mode"].startswith("symmetric (rank "), (rank, r)
        assert r["leases"] == 1, (rank, r)


def test_gradients_in_a_slot_are_read_where_they_lie(ext):
    """Gradients at their places in a slot (where FSDP's Slot-Reuse hooks put them) cost exactly the
    copies and kernels of gradients in autograd's memory, and keep that slot busy until they are read."""
    for rank, r in enumerate(_run(ranks.grads_in_slot, 3, 77)):
        d = r["deltas"]
        for k in ("ce_copies", "kernels", "flags"):
            assert d[0][k] == d[1][k] == d[2][k] == d[3][k] > 0, (rank, k, d)
        assert r["slot_marked_busy"] == [False, True, False, True], (rank, r)


def test_bad_input_raises_naming_op_and_argument(ext):
    for rank, r in enumerate(_run(ranks.bad_input, 2)):
        wrong = {case: v for case, v in r["messages"].items() if v != "ok"}
        assert not wrong, (rank, wrong)
        assert r["after_ok"], rank


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_tide_ag_launches_no_kernel_but_the_own_shard_cast(ext, tmp_path, world_size):
    results = _run(ranks.profile_zero_sm, world_size, str(tmp_path))
    for rank, r in enumerate(results):
        shared_gpu = r["gpus"] < world_size

        def kernels(case):
            names = [e["name"] for e in r[case] if e["cat"] == "kernel"]
            # One GPU: same-device "peer" copies run as the runtime's copy kernels on the SMs.
            return [k for k in names if not (shared_gpu and ("copy" in k.lower() or "memcpy" in k.lower()))]

        for case in ("ag_bf16", "ag_fp32_to_bf16"):
            assert any(e["cat"] in ("kernel", "gpu_memcpy") for e in r[case]), \
                f"rank {rank}: no GPU activity: {r[case]}"
        # One kernel writes this rank's own shard into its slot (a copy or the cast): the peers' pieces
        # move by copy engine only.
        for case in ("ag_bf16", "ag_fp32_to_bf16"):
            own = kernels(case)
            assert own and all("cast_segments_kernel" in k for k in own), f"rank {rank} {case}: {own}"
        rs = kernels("rs")
        assert rs and all("sum_contributions_kernel" in k for k in rs), f"rank {rank}: {rs}"


def test_fallbacks_no_arena_and_lease_across_capture(ext):
    (r,) = _run(ranks.fallbacks, 1, backend="nccl")
    assert r["no_arena_ok"] and r["tide_ok"] and r["graph_ok"], r
    calls = r["stats"]
    assert calls.get("all_gather_into_params_:stock:no_arena") == 1, calls
    # The eager call and the warm-up on the transport; the captured call gathers into outputs bound in the
    # eager lease, which a graph must not bake in: the reference backend (NCCL) is captured instead.
    assert calls.get("all_gather_into_params_:tide", 0) == 2, calls
    assert calls.get("all_gather_into_params_:stock:lease_across_capture") == 1, calls
    assert "CUDA-graph capture" in r["rendezvous_in_capture"], r["rendezvous_in_capture"]
    assert r["multicast_allowed"] is False
    assert r["env"]["NCCL_NVLS_ENABLE"] == "0" and r["env"]["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"


def test_disable_frees_the_arena(ext):
    """disable() gives the symmetric memory back: after each enable/disable cycle the device's free memory
    returns to one level (the first cycle may leave a little first-use driver state behind, once)."""
    world_size = 2
    for rank, r in enumerate(_run(ranks.disable_frees, world_size)):
        before, on1, off1, on2, off2 = r["free"]
        sharers = world_size if r["gpus"] < world_size else 1  # ranks whose arenas live on this GPU
        arena = sharers * r["arena_bytes"]
        slack = 16 << 20
        assert before - on1 >= arena and off1 - on1 >= arena - slack, (rank, r)  # came and went
        assert off2 - on2 >= arena - slack and abs(off2 - off1) <= slack, (rank, r)  # no growth per cycle
        assert before - off1 <= 256 << 20, (rank, r)  # the one-time part stays small
