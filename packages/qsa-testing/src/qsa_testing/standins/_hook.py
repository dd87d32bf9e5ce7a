"""Run a function on a module right after it executes: the mechanism behind every stand-in.

A stand-in never edits SGLang's files. It changes one attribute of one module once that module has
run, whether the module is imported later (a finder on ``sys.meta_path`` wraps its loader) or was
imported already (the change is made at once).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

__all__ = ("after_import", "spec_from_other_finders")

ModuleEdit = Callable[[ModuleType], None]


def spec_from_other_finders(
    me: object,
    fullname: str,
    path: Sequence[str] | None,
    target: ModuleType | None,
) -> importlib.machinery.ModuleSpec | None:
    """The spec the rest of ``sys.meta_path`` (every finder but ``me``) finds for ``fullname``."""
    for finder in sys.meta_path:
        if finder is me:
            continue
        find = getattr(finder, "find_spec", None)
        spec: importlib.machinery.ModuleSpec | None = (
            find(fullname, path, target) if find is not None else None
        )
        if spec is not None:
            return spec
    return None


class _EditingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, edits: Sequence[ModuleEdit]) -> None:
        self._inner = inner
        self._edits = tuple(edits)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        for edit in self._edits:
            edit(module)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.edits: dict[str, list[ModuleEdit]] = {}

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        edits = self.edits.get(fullname)
        if not edits:
            return None
        spec = spec_from_other_finders(self, fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _EditingLoader(spec.loader, edits)
        return spec


_FINDER = _AfterImportFinder()


def after_import(module: str, edit: ModuleEdit) -> None:
    """Run ``edit(module)`` once ``module`` has executed (now, if it already has)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    loaded = sys.modules.get(module)
    if loaded is not None:
        edit(loaded)
        return
    _FINDER.edits.setdefault(module, []).append(edit)
