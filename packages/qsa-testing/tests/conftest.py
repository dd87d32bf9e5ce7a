"""GPU gating and Triton's interpreter for this package's tests.

The stand-ins are checked against the upstream kernels whose semantics they keep; without CUDA
those Triton kernels run on CPU tensors through Triton's interpreter, which Triton reads from
``TRITON_INTERPRET`` when it is first imported, so it is set here before any test module loads.

Tests marked ``@pytest.mark.gpu`` skip cleanly where CUDA is absent; under ``QSA_REQUIRE_GPU=1``
(``nox -s gpu-tests``) a missing device fails them instead.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("qsa", deadline=None)
settings.load_profile("qsa")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["qsa_testing.pytest_plugin"]


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
