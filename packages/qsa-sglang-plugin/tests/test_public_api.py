"""The package's declared surface imports and its version matches the installed metadata."""

import importlib
import importlib.metadata

import qsa_sglang_plugin


def test_every_name_in_all_is_importable() -> None:
    """Each name listed in ``__all__`` resolves on the package."""
    module = importlib.import_module("qsa_sglang_plugin")
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert missing == []


def test_version_matches_distribution_metadata() -> None:
    """``__version__`` is the installed distribution's version, not a copy that can drift."""
    assert qsa_sglang_plugin.__version__ == importlib.metadata.version("qsa-sglang-plugin")
