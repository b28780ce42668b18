"""The ``tide`` torch.library ops. Importing this package registers them; call them as
``torch.ops.tide.<name>`` (schemas and semantics: :mod:`tide.ops.schemas`)."""
from tide.ops import schemas  # noqa: F401  (defines the ops first)
from tide.meta import fake  # noqa: F401
from tide.ops import reference, autograd  # noqa: F401
from tide.ops import cuda  # noqa: F401  (CUDA kernels: the TIDE transport, after the reference's)

__all__ = ["schemas", "reference"]
