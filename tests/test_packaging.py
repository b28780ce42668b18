"""Packaging: a wheel ships ``csrc/`` so the JIT build finds its sources from an installed package; the
default install is pure Python; ``TIDE_BUILD_CUDA=1`` builds the CUDA extension at install time from the
JIT build's own sources and flags; the loader takes a prebuilt module only for the sources it was built
from; a JIT build prints one line; the loader's load hooks (the ops' hand-over) run once it loads. No
compiler runs here (tests/cuda builds for real)."""
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import tide
from tide import extension

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel of a copy of the checkout (the build writes build/ and egg-info where it runs)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("tide", "csrc"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    env = {k: v for k, v in os.environ.items() if k != "TIDE_BUILD_CUDA"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, env=env, timeout=300)
    [whl] = out.glob("*.whl")
    return whl


def test_the_wheel_is_pure_python_and_ships_every_source(wheel):
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    headers = {f"tide/csrc/{p.relative_to(ROOT / 'csrc').as_posix()}" for p in (ROOT / "csrc").rglob("*.h")}
    assert {f"tide/csrc/{s}" for s in extension.SOURCES} | headers <= names, sorted(names)
    assert not [n for n in names if n.endswith(".so")], names


def test_the_installed_package_finds_its_sources(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, timeout=300)
    code = ("import tide; from tide import extension; csrc = extension.csrc_dir(); "
            "print(tide.__file__); print(csrc); print(all((csrc / s).is_file() for s in extension.SOURCES)); "
            "print(extension.sources_digest(csrc))")
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    where, csrc, complete, digest = out.stdout.split()
    assert Path(where).is_relative_to(target) and Path(csrc) == target / "tide" / "csrc", out.stdout
    assert complete == "True" and digest == extension.sources_digest(ROOT / "csrc"), out.stdout


def test_a_checkout_finds_its_sources():
    assert extension.csrc_dir() == ROOT / "csrc"


def _setup_module():
    spec = importlib.util.spec_from_file_location("tide_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_default_install_builds_no_extension(monkeypatch):
    monkeypatch.delenv("TIDE_BUILD_CUDA", raising=False)
    assert _setup_module().cuda_build() == {}


@pytest.mark.parametrize("arch_list, arch_flags", [(None, extension.DEFAULT_ARCH_FLAGS), ("9.0a;10.0", [])])
def test_tide_build_cuda_builds_the_jit_builds_sources_and_flags(monkeypatch, arch_list, arch_flags):
    from torch.utils import cpp_extension

    monkeypatch.setenv("TIDE_BUILD_CUDA", "1")
    if arch_list is None:
        monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    else:  # torch's BuildExtension turns the list into its flags
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")  # a CPU torch has none: config only
    built = _setup_module().cuda_build()
    [ext] = built["ext_modules"]
    assert ext.name == f"tide.{extension.EXTENSION_NAME}"
    assert ext.sources == [f"csrc/{s}" for s in extension.SOURCES]
    assert ext.extra_compile_args == {"cxx": extension.CXX_FLAGS, "nvcc": extension.CUDA_FLAGS + arch_flags}
    assert ext.extra_link_args == extension.LD_FLAGS
    assert issubclass(built["cmdclass"]["build_ext"], cpp_extension.BuildExtension)


def test_tide_build_cuda_without_a_cuda_toolkit_names_the_variable(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setenv("TIDE_BUILD_CUDA", "1")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    with pytest.raises(RuntimeError, match="TIDE_BUILD_CUDA=1 needs a CUDA build of torch"):
        _setup_module().cuda_build()


def test_a_bad_tide_build_cuda_names_the_variable(monkeypatch):
    monkeypatch.setenv("TIDE_BUILD_CUDA", "yes")
    with pytest.raises(ValueError, match="tide: TIDE_BUILD_CUDA must be 0 or 1, got 'yes'"):
        _setup_module().cuda_build()


@pytest.fixture
def prebuilt(tmp_path, monkeypatch):
    """A stand-in prebuilt module in a folder of the ``tide`` package; yields the digest file beside it."""
    (tmp_path / f"{extension.EXTENSION_NAME}.py").write_text("PREBUILT = True\n")
    monkeypatch.setattr(tide, "__path__", [*tide.__path__, str(tmp_path)])
    yield tmp_path / extension.DIGEST_NAME
    sys.modules.pop(f"tide.{extension.EXTENSION_NAME}", None)


def test_the_prebuilt_module_is_used_for_the_sources_it_was_built_from(prebuilt):
    csrc = extension.csrc_dir()
    assert extension._prebuilt(csrc) is None  # no digest: not known to match
    prebuilt.write_text("0" * 64 + "\n")
    assert extension._prebuilt(csrc) is None  # other sources: JIT-built instead
    prebuilt.write_text(extension.sources_digest(csrc) + "\n")
    assert extension._prebuilt(csrc).PREBUILT


def test_a_jit_build_prints_one_line_with_what_and_how_long(monkeypatch, capsys):
    from torch.utils import cpp_extension

    seen = {}
    monkeypatch.setattr(extension, "_cached", lambda *_: False)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.update(kw) or "module")
    assert extension._jit(extension.csrc_dir(), verbose=False) == "module"
    lines = capsys.readouterr().err.splitlines()
    what = f"{extension.EXTENSION_NAME} ({len(extension.SOURCES)} sources under "
    assert len(lines) == 1 and lines[0].startswith(f"tide.transport: JIT-building the CUDA extension {what}"), lines
    assert " built in " in lines[0] and lines[0].endswith(" s"), lines
    assert seen["extra_cuda_cflags"] == extension.CUDA_FLAGS + extension.DEFAULT_ARCH_FLAGS
    assert seen["sources"] == [str(extension.csrc_dir() / s) for s in extension.SOURCES]


def test_the_ops_take_the_cuda_kernels_over_through_the_extensions_load_hook():
    from tide import registry
    from tide.ops import cuda

    assert registry.extension_load_hooks == [cuda.hand_over]  # registered by import tide


def test_a_load_hook_runs_once_when_the_extension_loads_or_at_once_after(monkeypatch):
    import torch

    from tide import registry

    loaded, seen = object(), []
    monkeypatch.setattr(registry, "extension_load_hooks", [])  # not the ops' hand_over: nothing is built here
    monkeypatch.setattr(extension, "_ext", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(extension, "_prebuilt", lambda csrc: loaded)  # as if setup.py had built it
    extension.on_load(lambda ext: seen.append(("before", ext)))
    assert not seen
    assert extension.load() is loaded and extension.load() is loaded
    assert seen == [("before", loaded)]
    extension.on_load(lambda ext: seen.append(("after", ext)))
    assert seen == [("before", loaded), ("after", loaded)] and len(registry.extension_load_hooks) == 1
