"""Test setup for the end-to-end checks that compose several packages.

Without CUDA the Triton kernels run on CPU tensors through Triton's interpreter; Triton reads
``TRITON_INTERPRET`` once, at its first import, so it is set here before any test imports it.
Tests marked ``@pytest.mark.gpu`` are gated by :mod:`qsa_pytest.gpu`: skipped where CUDA is
absent, failed instead under ``QSA_REQUIRE_GPU=1`` (set by ``nox -s gpu-tests``).
"""

from __future__ import annotations

import os

import torch

pytest_plugins = ("qsa_pytest.gpu",)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
