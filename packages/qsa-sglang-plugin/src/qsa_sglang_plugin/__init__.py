"""qsa-sglang-plugin: placeholder surface, filled by its issue."""

from importlib.metadata import version as _version

__version__: str = _version("qsa-sglang-plugin")

__all__ = ("__version__",)
