"""Packaging beyond pyproject.toml: ``csrc/`` ships as package data (``tide/csrc``), so the JIT build
works from an installed wheel; with ``TIDE_BUILD_CUDA=1`` the CUDA extension is compiled here, at
install time, from the same sources and flags as the JIT build (``tide/extension/``). That needs
torch (with CUDA) and nvcc in the build environment: ``pip install --no-build-isolation``. Without it
the install is pure Python and needs neither."""
import importlib.util
import os
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def _module(name: str, relative: str):
    """A standard-library-only file of the package, loaded alone (importing ``tide`` would import torch)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


knobs = _module("tide_knobs", "tide/knobs.py")
extension = _module("tide_extension", "tide/extension/__init__.py")


def cuda_build() -> dict:
    """``setup()``'s extension arguments: the CUDA extension under ``TIDE_BUILD_CUDA=1``, else none."""
    if not knobs.get("TIDE_BUILD_CUDA"):
        return {}
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

    if CUDA_HOME is None:
        raise RuntimeError("TIDE_BUILD_CUDA=1 needs a CUDA build of torch and the CUDA toolkit (nvcc), found by "
                           "torch through CUDA_HOME or PATH; this torch or machine has none")

    class BuildWithDigest(BuildExtension):
        """Writes the digest of the sources beside the module: the loader uses it only for these sources."""

        def run(self):
            super().run()
            for ext in self.extensions:
                digest = Path(self.get_ext_fullpath(ext.name)).with_name(extension.DIGEST_NAME)
                digest.write_text(extension.sources_digest(ROOT / "csrc") + "\n")

    cuda_extension = CUDAExtension(
        name=f"tide.{extension.EXTENSION_NAME}",
        sources=[f"csrc/{s}" for s in extension.SOURCES],
        include_dirs=[str(ROOT / "csrc")],
        extra_compile_args={"cxx": extension.CXX_FLAGS,
                            "nvcc": extension.nvcc_flags(os.environ.get("TORCH_CUDA_ARCH_LIST"))},
        extra_link_args=extension.LD_FLAGS,
    )
    return {"ext_modules": [cuda_extension], "cmdclass": {"build_ext": BuildWithDigest}}


if __name__ == "__main__":  # as setuptools runs it; tests import cuda_build alone
    setup(
        packages=[*find_packages(include=["tide*"]), "tide.csrc"],
        package_dir={"tide.csrc": "csrc"},
        package_data={"tide.csrc": ["**/*.cu", "**/*.cpp", "**/*.h"]},
        **cuda_build(),
    )
