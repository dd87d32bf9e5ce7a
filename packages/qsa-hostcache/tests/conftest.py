"""GPU gating shared by this package's tests.

Tests marked ``@pytest.mark.gpu`` skip cleanly where CUDA is absent. Under ``QSA_REQUIRE_GPU=1``
(set by ``nox -s gpu-tests``) a missing device fails them instead, so a GPU run can never pass by
skipping.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

# Wall-clock deadlines are meaningless on a shared 2-core CI machine; examples must still pass.
settings.register_profile("qsa", deadline=None)
settings.load_profile("qsa")


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
