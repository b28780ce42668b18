"""Bad input fails at once with an error naming the op and the argument: in eager (before any
collective) and under FakeTensor (the fake kernels run the same checks)."""
import datetime

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

import tide  # noqa: F401
from tide.launch import free_port

ops = torch.ops.tide


@pytest.fixture(scope="module")
def group_name():
    """A real one-rank gloo group in this process: enough to check group resolution and size."""
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def _f32(*shape):
    return torch.randn(*shape)


def _bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


# (op, args builder (group_name, world_size=1) -> args, expected exception, message pattern)
BAD_CALLS = {
    "ag_length_mismatch": (ops.all_gather_into_params_,
                           lambda g: ([_f32(2, 3)], [_f32(2, 3), _f32(2)], 1, g),
                           ValueError, r"tide\.all_gather_into_params_: shards has 1 tensors but outs has 2"),
    "ag_out_shape": (ops.all_gather_into_params_, lambda g: ([_f32(2, 3)], [_f32(3, 3)], 1, g),
                     ValueError, r"tide\.all_gather_into_params_: outs\[0\] has shape \(3, 3\)"),
    "ag_int_dtype": (ops.all_gather_into_params_,
                     lambda g: ([torch.ones(2, dtype=torch.int32)], [_f32(2)], 1, g),
                     TypeError, r"tide\.all_gather_into_params_: shards\[0\] has dtype torch\.int32"),
    "ag_bytes_into_float": (ops.all_gather_into_params_,
                            lambda g: ([torch.ones(2, dtype=torch.uint8)], [_bf16(2)], 1, g),
                            TypeError, r"tide\.all_gather_into_params_: shards\[0\] has dtype torch\.uint8 and "
                                       r"outs\[0\] has dtype torch\.bfloat16; bytes \(uint8\)"),
    "ag_float8_not_viewed": (ops.all_gather_into_params_,
                             lambda g: ([_f32(2).to(torch.float8_e4m3fn)], [_f32(2).to(torch.float8_e4m3fn)], 1, g),
                             TypeError, r"tide\.all_gather_into_params_: shards\[0\] has dtype "
                                        r"torch\.float8_e4m3fn; .*view other payloads as uint8"),
    "ag_non_contiguous": (ops.all_gather_into_params_, lambda g: ([_f32(3, 2).t()], [_f32(2, 3)], 1, g),
                          ValueError, r"tide\.all_gather_into_params_: shards\[0\] must be contiguous"),
    "ag_zero_d_shard": (ops.all_gather_into_params_, lambda g: ([torch.tensor(1.0)], [_f32(1)], 1, g),
                        ValueError, r"tide\.all_gather_into_params_: shards\[0\] is 0-d"),
    "ag_bad_world_size": (ops.all_gather_into_params_, lambda g: ([_f32(2)], [_f32(0)], 0, g),
                          ValueError, r"tide\.all_gather_into_params_: world_size must be >= 1"),
    "rs_length_mismatch": (ops.reduce_scatter_params_, lambda g: ([_bf16(4)], [], 1.0, False, 1, g),
                           ValueError, r"tide\.reduce_scatter_params_: grads has 1 tensors but shard_grads has 0"),
    "rs_shard_dtype": (ops.reduce_scatter_params_, lambda g: ([_bf16(4, 2)], [_bf16(4, 2)], 1.0, False, 1, g),
                       TypeError, r"tide\.reduce_scatter_params_: shard_grads\[0\] has dtype torch\.bfloat16"),
    "rs_shard_shape": (ops.reduce_scatter_params_, lambda g: ([_bf16(4, 2)], [_f32(4, 3)], 1.0, False, 1, g),
                       ValueError, r"tide\.reduce_scatter_params_: shard_grads\[0\] has shape \(4, 3\)"),
    "rs_non_contiguous": (ops.reduce_scatter_params_,
                          lambda g: ([_bf16(2, 4).t()], [_f32(4, 2)], 1.0, False, 1, g),
                          ValueError, r"tide\.reduce_scatter_params_: grads\[0\] must be contiguous"),
    "ag_functional_zero_d": (ops.all_gather, lambda g: ([torch.tensor(2.0)], 1, g),
                             ValueError, r"tide\.all_gather: shards\[0\] is 0-d"),
    "rs_functional_indivisible": (ops.reduce_scatter, lambda g: ([_f32(3, 2)], 1.0, None, 2, g),
                                  ValueError, r"tide\.reduce_scatter: inputs\[0\] has shape \(3, 2\)"),
    "rs_functional_out_dtype": (ops.reduce_scatter, lambda g: ([_f32(2)], 1.0, torch.int64, 1, g),
                                TypeError, r"tide\.reduce_scatter: out_dtype torch\.int64"),
    "ag_start_int_dtype": (ops.all_gather_start, lambda g: ([_f32(2), torch.ones(2, dtype=torch.int32)], 1, g),
                           TypeError, r"tide\.all_gather_start: shards\[1\] has dtype torch\.int32; .*view other "
                                      r"payloads as uint8"),
    "ag_start_zero_d": (ops.all_gather_start, lambda g: ([torch.tensor(2.0)], 1, g),
                        ValueError, r"tide\.all_gather_start: shards\[0\] is 0-d"),
    "ag_start_non_contiguous": (ops.all_gather_start, lambda g: ([_f32(3, 2).t()], 1, g),
                                ValueError, r"tide\.all_gather_start: shards\[0\] must be contiguous"),
    "ag_start_bad_world_size": (ops.all_gather_start, lambda g: ([_f32(2)], 0, g),
                                ValueError, r"tide\.all_gather_start: world_size must be >= 1"),
    "rs_start_byte_grads": (ops.reduce_scatter_start, lambda g: ([torch.ones(2, dtype=torch.uint8)], 1.0, None, 1, g),
                            TypeError, r"tide\.reduce_scatter_start: grads\[0\] has dtype torch\.uint8"),
    "rs_start_non_contiguous": (ops.reduce_scatter_start, lambda g: ([_bf16(2), _bf16(2, 4).t()], 1.0, None, 1, g),
                                ValueError, r"tide\.reduce_scatter_start: grads\[1\] must be contiguous"),
    "rs_start_out_dtype": (ops.reduce_scatter_start, lambda g: ([_bf16(3)], 1.0, torch.int64, 1, g),
                           TypeError, r"tide\.reduce_scatter_start: out_dtype torch\.int64"),
}
# Calls without any tensor reach no backend kernel (and no fake kernel): the ops' catch-all refuses them.
EMPTY_CALLS = {
    "ag_empty": (ops.all_gather_into_params_, lambda g: ([], [], 1, g),
                 r"tide\.all_gather_into_params_: shards is empty"),
    "rs_empty": (ops.reduce_scatter_params_, lambda g: ([], [], 1.0, False, 1, g),
                 r"tide\.reduce_scatter_params_: grads is empty"),
    "ag_functional_empty": (ops.all_gather, lambda g: ([], 1, g), r"tide\.all_gather: shards is empty"),
    "rs_functional_empty": (ops.reduce_scatter, lambda g: ([], 1.0, None, 1, g),
                            r"tide\.reduce_scatter: inputs is empty"),
    "ag_start_empty": (ops.all_gather_start, lambda g: ([], 1, g), r"tide\.all_gather_start: shards is empty"),
    "rs_start_empty": (ops.reduce_scatter_start, lambda g: ([], 1.0, None, 1, g),
                       r"tide\.reduce_scatter_start: grads is empty"),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_input_is_rejected_in_eager(case, group_name):
    op, build, exc, pattern = BAD_CALLS[case]
    with pytest.raises(exc, match=pattern):
        op(*build(group_name))


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_input_is_rejected_by_the_fake_kernel(case):
    op, build, exc, pattern = BAD_CALLS[case]
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(exc, match=pattern):
            op(*build("no-group-needed-for-shape-checks"))


@pytest.mark.parametrize("case", sorted(EMPTY_CALLS))
def test_empty_lists_are_rejected(case, group_name):
    op, build, pattern = EMPTY_CALLS[case]
    with pytest.raises(ValueError, match=pattern):
        op(*build(group_name))


def test_mixed_devices_are_rejected():
    meta = torch.empty(4, device="meta")
    with pytest.raises(ValueError,
                       match=r"tide\.all_gather_into_params_: outs\[0\] is on meta but shards\[0\] is on cpu"):
        ops.all_gather_into_params_([_f32(4)], [meta], 1, "g")


@pytest.mark.parametrize("call", [
    lambda g: ops.all_gather_into_params_([_f32(2)], [_f32(4)], 2, g),
    lambda g: ops.reduce_scatter_params_([_bf16(4)], [_f32(2)], 1.0, False, 2, g),
    lambda g: ops.all_gather([_f32(2)], 2, g),
    lambda g: ops.reduce_scatter([_f32(4)], 1.0, None, 2, g),
    lambda g: ops.all_gather_start([_f32(2)], 2, g),
    lambda g: ops.reduce_scatter_start([_bf16(3)], 1.0, None, 2, g),
])
def test_world_size_must_match_the_group(call, group_name):
    with pytest.raises(ValueError, match=r"tide\.\w+: world_size=2 but group .* has 1 ranks"):
        call(group_name)


@pytest.mark.parametrize("call", [
    lambda: ops.all_gather_into_params_([_f32(2)], [_f32(2)], 1, "no-such-group"),
    lambda: ops.reduce_scatter_params_([_bf16(2)], [_f32(2)], 1.0, False, 1, "no-such-group"),
    lambda: ops.all_gather_start([_f32(2)], 1, "no-such-group"),
    lambda: ops.reduce_scatter_start([_bf16(2)], 1.0, None, 1, "no-such-group"),
])
def test_unknown_group_name(call, group_name):
    with pytest.raises(ValueError,
                       match=r"tide\.\w+: group_name 'no-such-group' does not name a registered process group"):
        call()


def test_one_rank_group_is_an_identity(group_name):
    """The smallest real collective: W=1 gathers the shard and reduces to scale * grad."""
    shard, out = _f32(3, 2), torch.full((3, 2), float("nan"), dtype=torch.bfloat16)
    ops.all_gather_into_params_([shard], [out], 1, group_name)
    assert torch.equal(out, shard.to(torch.bfloat16))
    grad, sg = _bf16(3, 2), torch.full((3, 2), float("nan"))
    ops.reduce_scatter_params_([grad], [sg], 0.5, False, 1, group_name)
    assert torch.equal(sg, grad.float() * 0.5)


def test_typed_wrappers_call_the_ops(group_name):
    """tide.ops' typed entry points: the same results as the ops they call (one rank: identities)."""
    group = dist.group.WORLD
    shard, out = _f32(3, 2), torch.full((3, 2), float("nan"), dtype=torch.bfloat16)
    tide.ops.all_gather_into_params([shard], [out], group)
    assert torch.equal(out, shard.to(torch.bfloat16))
    grad, sg = _bf16(3, 2), torch.full((3, 2), float("nan"))
    tide.ops.reduce_scatter_params([grad], [sg], group, scale=0.5)
    assert torch.equal(sg, grad.float() * 0.5)
    tide.ops.reduce_scatter_params([grad], [sg], group, scale=0.5, accumulate=True)
    assert torch.equal(sg, grad.float())
    (gathered,) = tide.ops.all_gather([shard], group)
    assert torch.equal(gathered, shard)
    (reduced,) = tide.ops.reduce_scatter([grad], group, scale=2.0, out_dtype=torch.float32)
    assert reduced.dtype == torch.float32 and torch.equal(reduced, grad.float() * 2)


def test_graph_ops_on_one_rank(group_name):
    """W = 1: the gather is the shard in its dtype, the reduce ``scale * grad`` in fp32 (or ``out_dtype``),
    a 0-d gradient one row; and each output's work is registered until wait_tensor takes it."""
    wait = torch.ops._c10d_functional.wait_tensor
    before = torch._C._distributed_c10d._get_work_registry_size()
    shard, grad, scalar = _bf16(3, 2), _bf16(3, 2), torch.randn(())
    (gathered,) = ops.all_gather_start([shard], 1, group_name)
    reduced, reduced_scalar = ops.reduce_scatter_start([grad, scalar], 0.5, None, 1, group_name)
    (reduced_bf16,) = ops.reduce_scatter_start([grad], 0.5, torch.bfloat16, 1, group_name)
    assert torch._C._distributed_c10d._get_work_registry_size() == before + 4
    assert wait(gathered) is gathered and torch.equal(gathered, shard)
    assert torch.equal(wait(reduced), grad.float() * 0.5) and torch.equal(wait(reduced_scalar), scalar.view(1) * 0.5)
    assert torch.equal(wait(reduced_bf16), (grad.float() * 0.5).to(torch.bfloat16))
    assert torch._C._distributed_c10d._get_work_registry_size() == before


@pytest.mark.parametrize("call", [
    lambda g, x: ops.all_gather_start([x], 1, g),
    lambda g, x: ops.reduce_scatter_start([x], 1.0, None, 1, g),
])
def test_graph_ops_have_no_backward(call, group_name):
    """Not differentiable: outputs of inputs that do not require grad do not either, and a backward through
    outputs of inputs that do raises, naming the op (no gradient silently dropped)."""
    wait = torch.ops._c10d_functional.wait_tensor
    (out,) = call(group_name, _f32(2, 3))
    assert not wait(out).requires_grad
    (out,) = call(group_name, _f32(2, 3).requires_grad_())
    with pytest.raises(RuntimeError, match=r"Trying to backward through tide\.\w+_start\.default but no autograd "
                                           r"formula was registered"):
        wait(out).sum().backward()


def _views(buf, *spans):
    """Views of ``buf`` (1-D) as ``(start, shape)`` pairs: outputs that share memory."""
    return [buf[start:start + torch.Size(shape).numel()].view(shape) for start, shape in spans]


# Outputs that overlap each other or an input (the ops would return wrong data): refused in eager by their
# byte ranges. (Fake tensors have no memory: the fake kernels do not compare them.) W = 1.
OVERLAPS = {
    "ag_outs_alias": (ops.all_gather_into_params_,
                      lambda g, b: ([_f32(2, 3), _f32(2, 3)], _views(b, (0, (2, 3)), (0, (2, 3))), 1, g),
                      r"tide\.all_gather_into_params_: outs\[1\] overlaps outs\[0\]"),
    "ag_outs_overlap_partly": (ops.all_gather_into_params_,
                               lambda g, b: ([_f32(2, 3), _f32(4)], _views(b, (0, (2, 3)), (5, (4,))), 1, g),
                               r"tide\.all_gather_into_params_: outs\[1\] overlaps outs\[0\]"),
    "ag_out_over_another_params_shard": (ops.all_gather_into_params_,
                                         lambda g, b: ([_f32(2, 3), b[4:8]], [b[:6].view(2, 3), _f32(4)], 1, g),
                                         r"tide\.all_gather_into_params_: shards\[1\] overlaps outs\[0\]"),
    "ag_shard_off_its_own_rows": (ops.all_gather_into_params_,
                                  lambda g, b: ([b[1:7].view(2, 3)], [b[:6].view(2, 3)], 1, g),
                                  r"tide\.all_gather_into_params_: shards\[0\] overlaps outs\[0\]"),
    "rs_shard_grads_alias": (ops.reduce_scatter_params_,
                             lambda g, b: ([_bf16(2, 3), _bf16(2, 3)], _views(b, (0, (2, 3)), (0, (2, 3))),
                                           1.0, False, 1, g),
                             r"tide\.reduce_scatter_params_: shard_grads\[1\] overlaps shard_grads\[0\]"),
    "rs_shard_grads_overlap_partly": (ops.reduce_scatter_params_,
                                      lambda g, b: ([_bf16(2, 3), _bf16(4)], _views(b, (0, (2, 3)), (3, (4,))),
                                                    1.0, True, 1, g),
                                      r"tide\.reduce_scatter_params_: shard_grads\[1\] overlaps shard_grads\[0\]"),
    "rs_shard_grad_over_a_grad": (ops.reduce_scatter_params_,
                                  lambda g, b: ([b[:6].view(2, 3), _f32(4)], [b[2:8].view(2, 3), _f32(4)],
                                                1.0, False, 1, g),
                                  r"tide\.reduce_scatter_params_: grads\[0\] overlaps shard_grads\[0\]"),
    "rs_shard_grad_is_its_grad": (ops.reduce_scatter_params_,
                                  lambda g, b: ([b[:6].view(2, 3)], [b[:6].view(2, 3)], 1.0, True, 1, g),
                                  r"tide\.reduce_scatter_params_: grads\[0\] overlaps shard_grads\[0\]"),
}


@pytest.mark.parametrize("case", sorted(OVERLAPS))
def test_overlapping_outputs_are_rejected(case, group_name):
    op, build, pattern = OVERLAPS[case]
    buf = torch.zeros(64)
    before = buf.clone()
    with pytest.raises(ValueError, match=pattern):
        op(*build(group_name, buf))
    assert torch.equal(buf, before), "nothing may be written before the check"


def test_the_in_place_all_gather_is_allowed(group_name):
    """A shard that is exactly its own rows of its output (NCCL's in-place all-gather) is the documented
    in-place case: accepted, and the result is the gather."""
    out = torch.randn(3, 2)
    want = out.clone()
    ops.all_gather_into_params_([out[0:3]], [out], 1, group_name)
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match=r"shards\[0\] overlaps outs\[0\]"):  # the same bytes in another dtype
        big = torch.zeros(4)
        ops.all_gather_into_params_([big[:2]], [big.view(torch.bfloat16)[:2]], 1, group_name)


def test_accumulate_reads_and_writes_its_own_shard_grads(group_name):
    """accumulate=True reads and writes shard_grads in place (the documented in-place case of the
    reduce-scatter): allowed."""
    grad, sg = _bf16(2, 3), torch.ones(2, 3)
    ops.reduce_scatter_params_([grad], [sg], 1.0, True, 1, group_name)
    assert torch.equal(sg, 1 + grad.float())


REQUIRES_GRAD = {
    "ag_out": (ops.all_gather_into_params_, lambda g: ([_f32(2, 3)], [_f32(2, 3).requires_grad_()], 1, g),
               r"tide\.all_gather_into_params_: outs\[0\] requires grad"),
    "ag_shard": (ops.all_gather_into_params_, lambda g: ([_f32(2, 3).requires_grad_()], [_f32(2, 3)], 1, g),
                 r"tide\.all_gather_into_params_: shards\[0\] requires grad"),
    "rs_grad": (ops.reduce_scatter_params_, lambda g: ([_f32(2, 3).requires_grad_()], [_f32(2, 3)], 1.0, False, 1, g),
                r"tide\.reduce_scatter_params_: grads\[0\] requires grad"),
    "rs_shard_grad": (ops.reduce_scatter_params_,
                      lambda g: ([_bf16(2, 3)], [_f32(2, 3).requires_grad_()], 1.0, False, 1, g),
                      r"tide\.reduce_scatter_params_: shard_grads\[0\] requires grad"),
}


@pytest.mark.parametrize("case", sorted(REQUIRES_GRAD))
def test_requires_grad_arguments_of_the_mutating_ops_are_rejected(case, group_name):
    op, build, pattern = REQUIRES_GRAD[case]
    with pytest.raises(ValueError, match=pattern):
        op(*build(group_name))
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(ValueError, match=pattern):
        op(*build("no-group-needed-for-shape-checks"))
    with torch.no_grad():  # no autograd record, nothing to refuse: an in-place write, as into a parameter
        op(*build(group_name))


def test_group_none_is_the_default_group(group_name):
    shard, out = _f32(3, 2), torch.empty(3, 2)
    tide.ops.all_gather_into_params([shard], [out])
    assert torch.equal(out, shard)
    (gathered,) = tide.ops.all_gather([shard])
    assert torch.equal(gathered, shard)
    sg = torch.empty(3, 2)
    tide.ops.reduce_scatter_params([shard], [sg], scale=2.0)
    assert torch.equal(sg, 2 * shard)
    (reduced,) = tide.ops.reduce_scatter([shard])
    assert torch.equal(reduced, shard)
    with pytest.raises(TypeError,
                       match=r"tide\.all_gather_into_params: group must be a torch\.distributed\.ProcessGroup"):
        tide.ops.all_gather_into_params([shard], [out], group_name)


def test_group_none_without_a_default_group_names_the_op():
    import subprocess
    import sys

    code = ("import torch, tide\n"
            "try:\n    tide.ops.all_gather([torch.ones(2)])\n"
            "except ValueError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "tide.all_gather: group=None means the default process group" in out, out


# One Tensor where a list of tensors is expected: list() of it would make each row a tensor.
ONE_TENSOR_CALLS = {
    ("all_gather_into_params", "shards"): lambda t: tide.ops.all_gather_into_params(t, [t]),
    ("all_gather_into_params", "outs"): lambda t: tide.ops.all_gather_into_params([t], t),
    ("reduce_scatter_params", "grads"): lambda t: tide.ops.reduce_scatter_params(t, [t]),
    ("reduce_scatter_params", "shard_grads"): lambda t: tide.ops.reduce_scatter_params([t], t),
    ("all_gather", "shards"): lambda t: tide.ops.all_gather(t),
    ("reduce_scatter", "inputs"): lambda t: tide.ops.reduce_scatter(t),
}


@pytest.mark.parametrize("op, arg", sorted(ONE_TENSOR_CALLS))
def test_one_tensor_for_a_list_names_the_op_and_the_argument(op, arg, group_name):
    with pytest.raises(TypeError,
                       match=rf"tide\.{op}: {arg} must be a list of tensors, got one Tensor of shape \(3, 2\)"):
        ONE_TENSOR_CALLS[op, arg](_f32(3, 2))


@pytest.mark.parametrize("op, args", [
    ("all_gather_into_params_", lambda t, g: (t, [t], 1, g)),
    ("reduce_scatter_params_", lambda t, g: ([t], t, 1.0, False, 1, g)),
    ("all_gather", lambda t, g: (t, 1, g)),
    ("reduce_scatter", lambda t, g: (t, 1.0, None, 1, g)),
])
def test_the_ops_refuse_one_tensor_for_a_list(op, args, group_name):
    """The dispatcher's schema check refuses it before any kernel (torch's RuntimeError, naming both)."""
    t = _f32(3, 2)
    with pytest.raises(RuntimeError, match=rf"tide::{op}\(\) Expected a value of type 'List\[Tensor\]' for argument"):
        getattr(ops, op)(*args(t, group_name))
