"""The ``tide`` torch.library ops, every piece in this package: ``schemas`` (the contract), ``fake`` (one
fake kernel per op), ``autograd`` (the functional pair's backward), ``reference`` (CPU kernels over
``torch.distributed``, their fp32 sum in ``tide.sums``; groups that span nodes run ``tide.multinode``'s
schedule), ``calls`` (every CPU call agreed by its ranks), ``works`` (the graph ops' completion by
``wait_tensor``), ``cuda`` (CUDA kernels: the TIDE transport, else the reference), ``api`` (typed
Python entry points). Importing this package registers them; call ``torch.ops.tide.<name>`` or the
functions below.
"""
from tide.ops import schemas  # noqa: F401  (defines the ops first)
from tide.ops import autograd, cuda, fake, reference  # noqa: F401
from tide.ops.api import all_gather, all_gather_into_params, reduce_scatter, reduce_scatter_params

__all__ = ["all_gather_into_params", "reduce_scatter_params", "all_gather", "reduce_scatter"]
