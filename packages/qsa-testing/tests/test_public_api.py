"""The package's declared surface imports and its version matches the installed metadata."""

import importlib
import importlib.metadata

import qsa_testing


def test_every_name_in_all_is_importable() -> None:
    for module_name in ("qsa_testing", "qsa_testing.standins"):
        module = importlib.import_module(module_name)
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert missing == [], module_name


def test_version_matches_distribution_metadata() -> None:
    assert qsa_testing.__version__ == importlib.metadata.version("qsa-testing")
