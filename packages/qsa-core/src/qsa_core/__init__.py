"""qsa-core: placeholder surface, filled by its issue."""

from importlib.metadata import version as _version

__version__: str = _version("qsa-core")

__all__ = ("__version__",)
