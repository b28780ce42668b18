"""Imported at start-up by every Python process of an upstream FSDP2 run (``scripts/upstream_fsdp.sh`` puts
this folder on ``PYTHONPATH``), so the rank processes PyTorch's tests spawn get the harness's hooks before
they import the test module. Without ``TIDE_UPSTREAM_MODE`` in the environment it does nothing."""
import os

if os.environ.get("TIDE_UPSTREAM_MODE"):
    from tests.upstream import ranks

    ranks.install_from_env()
