"""TIDE's collectives inside compile-first FSDP graphs (SimpleFSDP: DTensor ``Shard(0)`` parameters gathered to
``Replicate`` at each read; docs/compile.md).

- ``enable()`` / ``disable()``: the rewrite as an Inductor post-grad pass for ``torch.compile``;
- ``rewrite(gm)`` / ``rewrite_graph(graph)``: the rewrite of one FX graph (make_fx, aot_autograd compilers),
  returning its :class:`Report`;
- ``report()`` / ``reset_report()``: every rewrite of the process, counted like ``tide.stats()``;
- ``prepare(model)`` / ``release()``: the CUDA arenas the graph ops run on, and their regions between steps.
"""
from tide.compile.arenas import prepare, release  # noqa: F401
from tide.compile.inductor import TidePass, disable, enable, enabled  # noqa: F401
from tide.compile.report import Report, report, reset_report  # noqa: F401
from tide.compile.rewriter import rewrite, rewrite_graph  # noqa: F401
