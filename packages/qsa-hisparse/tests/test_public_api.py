"""The package's declared surface imports, each public name has one import path, and its version
matches the installed metadata.
"""

import importlib.metadata

import qsa_hisparse
from qsa_pytest.public_api import exported_twice, missing_names


def test_every_name_in_all_is_importable() -> None:
    """Each name listed in ``__all__`` resolves on the package."""
    assert missing_names("qsa_hisparse") == []


def test_each_public_name_has_one_import_path() -> None:
    """No object is listed in the ``__all__`` of two public packages (root and subpackages)."""
    assert exported_twice("qsa_hisparse") == {}


def test_version_matches_distribution_metadata() -> None:
    """``__version__`` is the installed distribution's version, not a copy that can drift."""
    assert qsa_hisparse.__version__ == importlib.metadata.version("qsa-hisparse")
