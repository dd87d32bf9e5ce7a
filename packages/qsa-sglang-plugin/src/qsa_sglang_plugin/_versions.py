"""The supported set of installed distributions, and what is installed."""

from __future__ import annotations

import importlib.metadata
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

__all__ = (
    "SUPPORTED_VERSIONS",
    "VersionMismatch",
    "installed_versions",
    "version_mismatches",
)

#: Distributions whose native code or Python sources the plugin relies on, and the exact version
#: supported: the pins of the sglang 0.5.23 wheel.
SUPPORTED_VERSIONS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "sglang": "0.5.23",
        "torch": "2.14.1",
        "triton": "3.8.0",
        "sglang-kernel": "0.4.10",
        "flashinfer-python": "0.7.2",
    }
)


@dataclass(frozen=True, slots=True)
class VersionMismatch:
    """One distribution whose installed version (None = not installed) is not the supported one."""

    distribution: str
    installed: str | None
    supported: str

    def __str__(self) -> str:
        found = "not installed" if self.installed is None else f"{self.installed!r} installed"
        return f"{self.distribution}: {found}, supported {self.supported!r}"


def installed_versions() -> dict[str, str | None]:
    """Installed version of each supported distribution (None when absent), plus ``python``."""
    out: dict[str, str | None] = {}
    for dist in SUPPORTED_VERSIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    out["python"] = platform.python_version()
    for own in ("qsa-sglang-plugin", "qsa-core"):
        try:
            out[own] = importlib.metadata.version(own)
        except importlib.metadata.PackageNotFoundError:
            out[own] = None
    return out


def version_mismatches(installed: Mapping[str, str | None] | None = None) -> list[VersionMismatch]:
    """Every supported distribution whose installed version differs; empty when all match."""
    found = installed_versions() if installed is None else installed
    return [
        VersionMismatch(dist, found.get(dist), want)
        for dist, want in SUPPORTED_VERSIONS.items()
        if found.get(dist) != want
    ]
