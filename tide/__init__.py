"""TIDE: layout-aware zero-copy collectives for PyTorch FSDP2.

``import tide`` registers the ``torch.ops.tide`` ops (``tide.ops``); ``tide.fsdp`` (the FSDP2 seam) and
``tide.transport`` (the CUDA transport) are imported on first use, so neither FSDP2's private modules
nor anything CUDA is needed to import the package. ``tide.stats()`` reports what every layer did
(``tide.counters``), ``tide.reset_stats()`` clears it. ``tide.call_identity(...)`` declares what the TIDE
calls inside a block are in the program (``tide.meta.call_site``), so that ranks that issue different
ones raise instead of pairing them.
"""
import importlib

__version__ = "0.1.0"

from tide import ops  # noqa: F401,E402  (registers torch.ops.tide.*)
from tide.counters import reset_stats, stats  # noqa: F401,E402
from tide.meta.call_site import call_identity  # noqa: F401,E402

_LAZY = ("fsdp", "transport", "meta", "train", "models", "launch", "compile")


def __getattr__(name: str):
    if name in _LAZY:
        return importlib.import_module(f"tide.{name}")
    raise AttributeError(f"module 'tide' has no attribute {name!r}")
