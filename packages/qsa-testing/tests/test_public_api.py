"""The package's declared surface imports, each public name has one import path, and its version
matches the installed metadata.
"""

import importlib.metadata

import qsa_testing
from qsa_pytest.public_api import exported_twice, missing_names


def test_every_name_in_all_is_importable() -> None:
    for module_name in ("qsa_testing", "qsa_testing.standins"):
        assert missing_names(module_name) == [], module_name


def test_each_public_name_has_one_import_path() -> None:
    """No object is listed in the ``__all__`` of two public packages (root and subpackages)."""
    assert exported_twice("qsa_testing") == {}


def test_version_matches_distribution_metadata() -> None:
    assert qsa_testing.__version__ == importlib.metadata.version("qsa-testing")
