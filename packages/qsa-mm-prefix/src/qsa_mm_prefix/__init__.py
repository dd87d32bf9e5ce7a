"""qsa-mm-prefix: placeholder surface, filled by its issue."""

from importlib.metadata import version as _version

__version__: str = _version("qsa-mm-prefix")

__all__ = ("__version__",)
