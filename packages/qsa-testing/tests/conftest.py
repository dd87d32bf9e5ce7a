"""Triton's interpreter and the shared fixtures for this package's tests.

The stand-ins are checked against the upstream kernels whose semantics they keep; without CUDA
those Triton kernels run on CPU tensors through Triton's interpreter, which Triton reads from
``TRITON_INTERPRET`` when it is first imported, so it is set here before any test module loads.

GPU gating (``@pytest.mark.gpu``) comes with :mod:`qsa_testing.pytest_plugin`.
"""

from __future__ import annotations

import os

import torch
from hypothesis import settings

settings.register_profile("qsa", deadline=None)
settings.load_profile("qsa")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["qsa_testing.pytest_plugin"]
