"""qsa-hisparse: placeholder surface, filled by its issue."""

from importlib.metadata import version as _version

__version__: str = _version("qsa-hisparse")

__all__ = ("__version__",)
