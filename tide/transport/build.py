"""JIT build of the CUDA extension in ``csrc/`` (``torch.utils.cpp_extension.load``), once per process.

The sources are read from the source checkout (``<repo>/csrc``): the CUDA backend needs a git
checkout or an editable install (``pip install -e .``). The build is cached by torch in
``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) and rebuilt only when a source changes;
a build prints one line first (it takes about 30 s). ``python -m tide.transport.build`` builds ahead of
time. Code for ``sm_90a`` (Hopper) is embedded, plus ``compute_90`` PTX for the driver to compile
elsewhere.
"""
from __future__ import annotations

import os
import shutil
import sys
import threading
from pathlib import Path

import torch

import tide

EXTENSION_NAME = "tide_cuda_ext"
CSRC = Path(tide.__file__).resolve().parents[1] / "csrc"
SOURCES = (
    "ops/sum_contributions.cu",
    "ops/cast_segments.cu",
    "transport/driver.cpp",
    "transport/copies.cpp",
    "transport/completions.cpp",
    "transport/ipc.cpp",
    "transport/nccl_p2p.cpp",
    "transport/arena.cpp",
    "transport/all_gather.cpp",
    "transport/reduce_scatter.cpp",
    "transport/node_leg.cpp",
    "transport/bindings.cpp",
)
CUDA_FLAGS = [
    "-O3",
    "-std=c++17",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_90,code=compute_90",
    "-Xptxas=-warn-spills",
]

_lock = threading.Lock()
_ext = None


def _nvcc() -> str | None:
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _cached(cpp_extension) -> bool:
    """Whether torch's build folder holds a module newer than every source (then load only loads it)."""
    folder = Path(cpp_extension._get_build_directory(EXTENSION_NAME, verbose=False))
    built = [p.stat().st_mtime for p in folder.glob(f"{EXTENSION_NAME}*.so")]
    newest_source = max(p.stat().st_mtime for p in CSRC.rglob("*") if p.suffix in (".cu", ".cpp", ".h"))
    return bool(built) and max(built) >= newest_source


def load(verbose: bool | None = None):
    """The compiled extension module (built on first use). Raises ``RuntimeError`` with the reason
    when it cannot be built: no CUDA device, no ``csrc/`` checkout, or no CUDA toolchain."""
    global _ext
    if _ext is not None:
        return _ext
    with _lock:
        if _ext is not None:
            return _ext
        if not torch.cuda.is_available():
            raise RuntimeError("tide.transport: the CUDA extension needs a CUDA device; none is available")
        missing = [s for s in SOURCES if not (CSRC / s).is_file()]
        if missing:
            raise RuntimeError(
                f"tide.transport: CUDA sources {missing} not found under {CSRC}; the CUDA backend needs a "
                "source checkout or an editable install (pip install -e .)")
        if _nvcc() is None:
            raise RuntimeError(
                "tide.transport: cannot build the CUDA extension: no CUDA toolchain (nvcc) found; install the "
                "CUDA toolkit matching torch.version.cuda and set CUDA_HOME, or put nvcc on PATH")
        from torch.utils import cpp_extension

        if verbose is None:
            verbose = os.environ.get("TIDE_BUILD_VERBOSE", "0") == "1"
        if not _cached(cpp_extension):
            print(f"tide.transport: building the CUDA extension from {CSRC} (about 30 s, once per source change)",
                  file=sys.stderr, flush=True)
        _ext = cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[str(CSRC / s) for s in SOURCES],
            extra_include_paths=[str(CSRC)],
            extra_cflags=["-O3", "-std=c++17"],
            extra_cuda_cflags=CUDA_FLAGS,
            extra_ldflags=["-ldl"],  # dlsym of NCCL (csrc/transport/nccl_p2p.cpp)
            verbose=verbose,
        )
        return _ext


if __name__ == "__main__":
    try:
        load(verbose=True)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    print("tide.transport: the CUDA extension is built", file=sys.stderr)
