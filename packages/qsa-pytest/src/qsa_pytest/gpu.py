"""The pytest plugin that gates ``@pytest.mark.gpu`` tests on a CUDA device.

Load it from a package's top-level ``conftest.py`` with ``pytest_plugins = ("qsa_pytest.gpu",)``.
Where CUDA is absent a ``gpu`` test is skipped at its setup, with the reason; under
``QSA_REQUIRE_GPU=1`` its setup fails instead, so that a run meant for the GPU cannot pass by
skipping. torch is imported only when a ``gpu`` test is set up.
"""

from __future__ import annotations

import os
from typing import Final

import pytest

__all__ = ("ENV_REQUIRE_GPU", "MARKER")

#: The marker of a test that needs a CUDA device.
MARKER: Final = "gpu"
#: ``1``: a ``gpu`` test fails where CUDA is absent instead of being skipped.
ENV_REQUIRE_GPU: Final = "QSA_REQUIRE_GPU"

_SKIP_REASON: Final = "needs a CUDA device (torch.cuda.is_available() is False)"


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``gpu`` marker (``--strict-markers`` refuses unregistered ones)."""
    config.addinivalue_line(
        "markers",
        f"{MARKER}: needs a CUDA device; skipped without one, and required under "
        f"{ENV_REQUIRE_GPU}=1",
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before a ``gpu`` test runs where CUDA is absent: skip it, or fail it when required."""
    if item.get_closest_marker(MARKER) is None:
        return
    import torch

    if torch.cuda.is_available():
        return
    if os.environ.get(ENV_REQUIRE_GPU) == "1":
        pytest.fail(f"{ENV_REQUIRE_GPU}=1 but torch.cuda.is_available() is False")
    pytest.skip(_SKIP_REASON)
