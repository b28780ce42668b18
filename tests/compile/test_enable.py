"""``tide.compile.enable()`` / ``disable()``: TIDE's pass joins Inductor's post-grad passes without replacing a
user's, ``disable()`` restores exactly what was set, and the pass's uuid hashes its sources (FX graph cache)."""
from pathlib import Path

import pytest
from torch._inductor import config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

import tide.compile


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
                assert now == (list(previous) if isinstance(previous, list) else [previous]) + [tide_pass]
        finally:
            tide.compile.disable()
        assert config.post_grad_custom_post_pass is previous and not tide.compile.enabled()


def test_disable_without_enable_raises():
    with pytest.raises(RuntimeError, match="tide.compile.disable"):
        tide.compile.disable()


def test_uuid_hashes_every_source_of_the_pass():
    sources = tuple(sorted(str(p) for p in Path(tide.compile.__file__).parent.glob("*.py")))
    assert {Path(s).name for s in sources} >= {"patterns.py", "plan.py", "rewriter.py", "inductor.py"}
    assert tide.compile.TidePass().uuid() == get_hash_for_files(sources)
