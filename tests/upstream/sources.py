"""The upstream FSDP2 test files the harness runs, checked against ``sources.json``: for the installed torch
release, the pytorch/pytorch commit each file was read at and its sha256. The files themselves stay outside
the repository. ``python -m tests.upstream.sources FOLDER`` prints the release and exits 0 when FOLDER holds
exactly those files, else names each difference and exits 1."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

SOURCES = Path(__file__).with_name("sources.json")


def release_files(release: str) -> dict[str, dict]:
    releases = json.loads(SOURCES.read_text())["releases"]
    if release not in releases:
        raise KeyError(f"tests.upstream.sources: no upstream files are recorded for torch {release} "
                       f"(recorded: {', '.join(sorted(releases))})")
    return releases[release]["files"]


def differences(folder: Path, release: str) -> list[str]:
    """One line per file of ``release`` that ``folder`` lacks or holds with another sha256."""
    problems = []
    for name, source in sorted(release_files(release).items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{name}: missing (read it at pytorch/pytorch@{source['commit']})")
            continue
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != source["sha256"]:
            problems.append(f"{name}: sha256 {digest}, expected {source['sha256']} "
                            f"(pytorch/pytorch@{source['commit']})")
    return problems


def main(argv: list[str]) -> int:
    import torch

    if len(argv) != 1:
        print("usage: python -m tests.upstream.sources FOLDER", file=sys.stderr)
        return 2
    release = torch.__version__.split("+")[0]
    try:
        problems = differences(Path(argv[0]), release)
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 1
    for line in problems:
        print(f"tests.upstream.sources: {argv[0]}: {line}", file=sys.stderr)
    if not problems:
        print(release)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
