"""Shared fixtures: a tiny QSA checkpoint config SGLang can resolve on CPU, and real engines.

``engines`` (from :mod:`qsa_testing.pytest_plugin`) shares one SGLang server per configuration
across the session; see docs/testing.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

from qsa_testing import tiny_qwen4_exp

# Wall-clock deadlines are meaningless on a shared 2-core CI machine; examples must still pass.
settings.register_profile("qsa", deadline=None)
settings.load_profile("qsa")

pytest_plugins = ["qsa_testing.pytest_plugin"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``config.json`` of a tiny Qwen4Exp with the real QSA layer geometry and 262,144 positions."""
    model = tiny_qwen4_exp(model_shaped=True, max_position_embeddings=262_144)
    return model.write(tmp_path_factory.mktemp("tiny-qwen4-exp"))
