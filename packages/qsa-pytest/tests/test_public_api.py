"""The public-surface helpers: subpackages walked, missing names and names exported twice found."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from qsa_pytest.public_api import exported_twice, missing_names, public_packages


@pytest.fixture
def fake_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A package ``fake_api`` whose root re-exports one name of its subpackage ``op``."""
    files = {
        "fake_api/__init__.py": """
            from fake_api._shared import SHARED
            from fake_api.op import run
            __all__ = ("SHARED", "run", "gone")
        """,
        "fake_api/_shared.py": "SHARED = object()\n",
        "fake_api/op/__init__.py": """
            from fake_api.op.impl import other, run
            __all__ = ("other", "run")
        """,
        "fake_api/op/impl.py": """
            __all__ = ("other", "run")
            def run() -> None: ...
            def other() -> None: ...
        """,
        "fake_api/_private/__init__.py": """
            from fake_api.op import run
            __all__ = ("run",)
        """,
    }
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fake_api"
    for name in [m for m in sys.modules if m == "fake_api" or m.startswith("fake_api.")]:
        del sys.modules[name]


def test_public_packages_skip_private_ones_and_plain_modules(fake_root: str) -> None:
    """Only the root and subpackages without a ``_`` part are the surface."""
    assert sorted(public_packages(fake_root)) == ["fake_api", "fake_api.op"]


def test_a_name_on_the_root_and_a_subpackage_is_exported_twice(fake_root: str) -> None:
    """The same object in two packages' ``__all__`` is reported with both paths."""
    assert exported_twice(fake_root) == {"run": ["fake_api", "fake_api.op"]}


def test_missing_names_lists_what_does_not_resolve(fake_root: str) -> None:
    """A name listed in ``__all__`` but not defined is reported."""
    assert missing_names(fake_root) == ["gone"]
