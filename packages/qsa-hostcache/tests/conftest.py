"""Test setup of this package: hypothesis without deadlines, and the GPU gate.

Tests marked ``@pytest.mark.gpu`` are gated by :mod:`qsa_pytest.gpu`: skipped where CUDA is
absent, failed instead under ``QSA_REQUIRE_GPU=1`` (set by ``nox -s gpu-tests``).
"""

from __future__ import annotations

from hypothesis import settings

pytest_plugins = ("qsa_pytest.gpu",)

# Wall-clock deadlines are meaningless on a shared 2-core CI machine; examples must still pass.
settings.register_profile("qsa", deadline=None)
settings.load_profile("qsa")
