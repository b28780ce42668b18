"""TIDE: layout-aware zero-copy collectives for PyTorch FSDP2."""
__version__ = "0.1.0"

from tide import ops  # noqa: F401  (registers torch.ops.tide.*)
