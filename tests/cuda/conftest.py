"""CUDA transport tests: skipped without a CUDA device; the extension is built once, up front."""
import os

import pytest
import torch

from tests.cuda.ranks import ENV

for _k, _v in ENV.items():
    os.environ.setdefault(_k, _v)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/cuda/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ext():
    from tide import extension

    return extension.load()
