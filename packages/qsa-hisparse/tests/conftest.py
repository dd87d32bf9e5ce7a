"""Test setup for the end-to-end checks that compose several packages.

Without CUDA the Triton kernels run on CPU tensors through Triton's interpreter; Triton reads
``TRITON_INTERPRET`` once, at its first import, so it is set here before any test imports it.
Tests marked ``@pytest.mark.gpu`` skip cleanly where CUDA is absent and fail under
``QSA_REQUIRE_GPU=1`` (set by ``nox -s gpu-tests``), so a GPU run never passes by skipping.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The same GPU gating stands in every package that has GPU tests: each package's tests run in an
# environment holding only that package and its dependencies, so there is no shared test module.
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    del config
    if torch.cuda.is_available():
        return
    required = os.environ.get("QSA_REQUIRE_GPU") == "1"
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        item.add_marker(pytest.mark.usefixtures("_fail_without_gpu") if required else skip)


@pytest.fixture
def _fail_without_gpu() -> None:
    pytest.fail("QSA_REQUIRE_GPU=1 but torch.cuda.is_available() is False")
