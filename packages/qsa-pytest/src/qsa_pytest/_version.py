"""The version of qsa-pytest; the single source read by the build and by ``__version__``."""

__version__ = "0.1.0"
