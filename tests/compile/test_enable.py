"""``tide.compile.enable()`` / ``disable()``: TIDE's pass joins Inductor's post-grad passes without replacing a
user's, ``disable()`` restores exactly what was set, and the pass has no uuid (Inductor bypasses its FX graph cache)."""

import pytest
import torch
from torch._inductor import config
from torch._inductor.custom_graph_pass import CustomGraphPass

import tide.compile
from tests.compile import workers
from tide.launch import run_ranks


class UserPass(CustomGraphPass):
    def __call__(self, graph):
        pass

    def uuid(self):
        return b"user"


@pytest.mark.parametrize("previous", [None, UserPass(), [UserPass(), UserPass()]], ids=["none", "one", "list"])
def test_enable_appends_and_disable_restores(previous):
    with config.patch(post_grad_custom_post_pass=previous):
        tide_pass = tide.compile.enable()
        try:
            now = config.post_grad_custom_post_pass
            assert tide.compile.enabled()
            if previous is None:
                assert now is tide_pass
            else:
                assert now.passes == (list(previous) if isinstance(previous, list) else [previous]) + [tide_pass]
        finally:
            tide.compile.disable()
        assert config.post_grad_custom_post_pass is previous and not tide.compile.enabled()


def test_enable_twice_keeps_one_pass():
    with config.patch(post_grad_custom_post_pass=UserPass()):
        first = tide.compile.enable()
        try:
            assert tide.compile.enable() is first
            assert sum(isinstance(p, tide.compile.TidePass) for p in config.post_grad_custom_post_pass.passes) == 1
        finally:
            tide.compile.disable()
        assert not tide.compile.enabled()


def test_enable_warns_of_frames_compiled_before_and_not_after_a_reset():
    import warnings

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x.sin() + 1, backend="eager")
    compiled(torch.randn(3))
    with config.patch(post_grad_custom_post_pass=None):
        with pytest.warns(UserWarning, match="1 frame\\(s\\) were compiled before TIDE's pass was enabled"):
            tide.compile.enable()
        tide.compile.disable()
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            tide.compile.enable()
        tide.compile.disable()


def test_a_chain_of_passes_runs_each_and_has_a_key_only_when_each_has_one():
    from tide.compile.inductor import PassChain

    ran = []

    class Named(UserPass):
        def __call__(self, graph):
            ran.append(graph)

    assert PassChain([Named(), UserPass()]).uuid() is not None
    assert PassChain([Named(), tide.compile.TidePass()]).uuid() is None
    PassChain([Named(), Named()])("g")
    assert ran == ["g", "g"]


def test_disable_without_enable_raises():
    with pytest.raises(RuntimeError, match="tide.compile.disable"):
        tide.compile.disable()


def test_the_pass_has_no_cache_key():
    """Inductor bypasses its FX graph cache for a pass without a uuid: every rank runs the pass, and so the
    plan's exchange, on every compile."""
    assert tide.compile.TidePass().uuid() is None


def test_inductor_never_reuses_a_gathered_output():
    """Inductor would take over the dead output for a later buffer of its size (``buf3 = buf1; del buf1  # reuse``):
    on CUDA that output lies in an arena slot, which would stay held as long as the later buffer lives."""
    for reuses in run_ranks(workers.gathered_buffer_reuse, 2, timeout=300):
        assert reuses == [], reuses
