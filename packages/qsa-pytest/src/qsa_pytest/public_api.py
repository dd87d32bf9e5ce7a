"""What each package's ``tests/test_public_api.py`` checks of its declared surface.

The surface is the ``__all__`` of the package and of each public subpackage (no part of its
dotted name starts with ``_``). Each public name has one import path: the same object listed in
the ``__all__`` of two of these packages (the root and a subpackage, or two subpackages) is
exported twice. A subpackage's implementation modules (``triton.py`` beside ``reference.py``)
define names; only packages export them.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

__all__ = ("exported_twice", "missing_names", "public_packages")


def public_packages(root: str) -> dict[str, ModuleType]:
    """The package ``root`` and each of its public subpackages, by dotted name."""
    package = importlib.import_module(root)
    found = {root: package}
    for info in pkgutil.walk_packages(package.__path__, f"{root}."):
        private = any(part.startswith("_") for part in info.name.split(".")[1:])
        if info.ispkg and not private:
            found[info.name] = importlib.import_module(info.name)
    return found


def missing_names(module_name: str) -> list[str]:
    """Names listed in ``module_name``'s ``__all__`` that do not resolve on it."""
    module = importlib.import_module(module_name)
    return [name for name in module.__all__ if not hasattr(module, name)]


def exported_twice(root: str) -> dict[str, list[str]]:
    """Public names of ``root`` that two of its public packages export: name -> the packages."""
    where: dict[str, list[tuple[object, str]]] = {}
    for dotted, package in public_packages(root).items():
        for name in getattr(package, "__all__", ()):
            where.setdefault(name, []).append((getattr(package, name, None), dotted))
    twice: dict[str, list[str]] = {}
    for name, places in where.items():
        for obj, _ in places:
            same = sorted(dotted for other, dotted in places if other is obj)
            if len(same) > 1:
                twice[name] = same
                break
    return twice
