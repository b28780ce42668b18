"""The CUDA extension in ``csrc/``: what it is built from, and its loading, once per process.

One list of sources and flags serves both builds: ``setup.py`` compiles it at install time with
``TIDE_BUILD_CUDA=1`` (into ``tide/tide_cuda_ext*.so``, beside a digest of the sources it was built
from), and :func:`load` JIT-builds it (``torch.utils.cpp_extension.load``) when no prebuilt module
matches the sources. ``csrc/`` is found inside the installed package (``tide/csrc``, the wheel's
package data) or in the source checkout (``<repo>/csrc``, an editable install). The JIT build is cached
by torch in ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) and rebuilt only when a
source changes; a build prints one line saying what it built and how long it took (about 30 s).
``python -m tide.extension`` builds ahead of time. Code for ``sm_90a`` (Hopper) is embedded, plus
``compute_90`` PTX for the driver to compile elsewhere; the install-time build takes
``TORCH_CUDA_ARCH_LIST`` instead when it is set.

It sits below every layer that uses the extension (``tide.ops``, ``tide.sums``, ``tide.multinode``,
``tide.transport``) and calls none of them: a layer that takes something over when the extension loads
registers a hook with :func:`on_load` (``tide.ops.cuda`` hands the ops' CUDA dispatch key to its C++
kernels). This module imports only the standard library at import time: ``setup.py`` loads it on its
own. ``__main__.py`` is the ahead-of-time build.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import shutil
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("tide.transport")

EXTENSION_NAME = "tide_cuda_ext"
DIGEST_NAME = f"{EXTENSION_NAME}.sources.sha256"  # beside the prebuilt module: the sources it was built from
PACKAGE = Path(__file__).resolve().parents[1]  # tide/
SOURCES = (
    "ops/sum_contributions.cu",
    "ops/cast_segments.cu",
    "transport/driver.cpp",
    "transport/replays.cu",
    "transport/ipc.cpp",
    "transport/nccl_p2p.cpp",
    "transport/arena.cpp",
    "transport/all_gather.cpp",
    "transport/reduce_scatter.cpp",
    "transport/node_leg.cpp",
    "transport/dispatch.cpp",
    "transport/bindings.cpp",
)
CXX_FLAGS = ["-O3", "-std=c++17"]
CUDA_FLAGS = ["-O3", "-std=c++17", "-Xptxas=-warn-spills"]
DEFAULT_ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_90,code=compute_90"]
LD_FLAGS = ["-ldl"]  # dlsym of NCCL (csrc/transport/nccl_p2p.cpp)

_lock = threading.Lock()
_ext = None


def csrc_dir() -> Path:
    """The CUDA sources: ``tide/csrc`` in an installed package, else ``<repo>/csrc`` of the checkout."""
    installed, checkout = PACKAGE / "csrc", PACKAGE.parent / "csrc"
    return installed if installed.is_dir() else checkout


def nvcc_flags(arch_list: str | None = None) -> list[str]:
    """nvcc's flags; the architectures are :data:`DEFAULT_ARCH_FLAGS` unless ``arch_list`` (a
    ``TORCH_CUDA_ARCH_LIST``) is given, which torch's build then turns into its own flags."""
    return CUDA_FLAGS + ([] if arch_list else DEFAULT_ARCH_FLAGS)


def sources_digest(csrc: Path) -> str:
    """sha256 of the sources and every header under ``csrc``: the prebuilt module is used only for these."""
    h = hashlib.sha256()
    for rel in sorted({*SOURCES, *(p.relative_to(csrc).as_posix() for p in csrc.rglob("*.h"))}):
        h.update(rel.encode() + b"\0" + (csrc / rel).read_bytes() + b"\0")
    return h.hexdigest()


def _nvcc() -> str | None:
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _prebuilt(csrc: Path):
    """The module setup.py built (``TIDE_BUILD_CUDA=1``), or None: absent, built from other sources than
    ``csrc`` holds, or not loadable by this torch (then the JIT build takes over, logged)."""
    spec = importlib.util.find_spec(f"tide.{EXTENSION_NAME}")
    if spec is None or spec.origin is None:
        return None
    digest = Path(spec.origin).with_name(DIGEST_NAME)
    if not digest.is_file() or digest.read_text().strip() != sources_digest(csrc):
        log.warning("tide.transport: the prebuilt %s was built from other sources than %s; JIT-building instead",
                    spec.origin, csrc)
        return None
    try:
        return importlib.import_module(f"tide.{EXTENSION_NAME}")
    except ImportError as e:  # built against another torch, say
        log.warning("tide.transport: cannot load the prebuilt %s (%s); JIT-building instead", spec.origin, e)
        return None


def _cached(cpp_extension, csrc: Path) -> bool:
    """Whether torch's build folder holds a module newer than every source (then load only loads it)."""
    folder = Path(cpp_extension._get_build_directory(EXTENSION_NAME, verbose=False))
    built = [p.stat().st_mtime for p in folder.glob(f"{EXTENSION_NAME}*.so")]
    newest_source = max(p.stat().st_mtime for p in csrc.rglob("*") if p.suffix in (".cu", ".cpp", ".h"))
    return bool(built) and max(built) >= newest_source


def _jit(csrc: Path, verbose: bool):
    from torch.utils import cpp_extension

    cached = _cached(cpp_extension, csrc)
    if not cached:  # one line: what it builds now, how long it took at the end
        print(f"tide.transport: JIT-building the CUDA extension {EXTENSION_NAME} ({len(SOURCES)} sources under "
              f"{csrc}, sm_90a) ...", end="\n" if verbose else "", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    outcome = "failed after"
    try:
        ext = cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[str(csrc / s) for s in SOURCES],
            extra_include_paths=[str(csrc)],
            extra_cflags=CXX_FLAGS,
            extra_cuda_cflags=nvcc_flags(),
            extra_ldflags=LD_FLAGS,
            verbose=verbose,
        )
        outcome = "built in"
        return ext
    finally:
        if not cached:
            print(f" {outcome} {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)


def on_load(hook) -> None:
    """Call ``hook(ext)`` with the extension module when it loads, or now when it has loaded already."""
    from tide import registry

    with _lock:
        if _ext is None:
            registry.extension_load_hooks.append(hook)
            return
    hook(_ext)


def load(verbose: bool | None = None):
    """The compiled extension module: the prebuilt one when it matches the sources, else JIT-built on
    first use; the :func:`on_load` hooks run before it is returned (its C++ kernels then serve the
    ``tide`` ops on CUDA: :func:`tide.ops.cuda.hand_over`). Raises ``RuntimeError`` with the reason when
    it cannot be had: no CUDA device, no ``csrc/`` sources, or no CUDA toolchain."""
    global _ext
    if _ext is not None:
        return _ext
    with _lock:
        if _ext is not None:
            return _ext
        import torch

        from tide import knobs, registry

        if not torch.cuda.is_available():
            raise RuntimeError("tide.transport: the CUDA extension needs a CUDA device; none is available")
        csrc = csrc_dir()
        missing = [s for s in SOURCES if not (csrc / s).is_file()]
        if missing:
            raise RuntimeError(
                f"tide.transport: CUDA sources {missing} not found under {csrc}; the package is incomplete "
                "(reinstall it, or install from a source checkout)")
        ext = _prebuilt(csrc)
        if ext is None:
            if _nvcc() is None:
                raise RuntimeError(
                    "tide.transport: cannot build the CUDA extension: no CUDA toolchain (nvcc) found; install the "
                    "CUDA toolkit matching torch.version.cuda and set CUDA_HOME, or put nvcc on PATH")
            ext = _jit(csrc, knobs.get("TIDE_BUILD_VERBOSE") if verbose is None else verbose)
        for hook in registry.extension_load_hooks:
            hook(ext)
        _ext = ext
        return _ext
