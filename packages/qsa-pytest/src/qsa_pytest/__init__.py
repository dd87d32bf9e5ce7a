"""qsa-pytest: the workspace's own pytest support (never installed for serving).

- :mod:`qsa_pytest.gpu`: the pytest plugin that gates ``@pytest.mark.gpu`` tests on a CUDA
  device; load it with ``pytest_plugins = ("qsa_pytest.gpu",)`` in a top-level ``conftest.py``
  (needs the ``gpu`` extra, torch).
- :mod:`qsa_pytest.refusals`: what the packages' property tests of refused calls share: any kind
  of value as a hypothesis strategy, whether a message shows a value, and a call's refusal.
- :mod:`qsa_pytest.mooncake`: a real Mooncake Store master on free localhost ports, for the
  shared tier's tests (needs the ``mooncake`` package installed).
- :mod:`qsa_pytest.public_api`: what the packages' ``test_public_api.py`` check: every name in
  ``__all__`` resolves, and each public name has one import path.
"""

from qsa_pytest._version import __version__

__all__ = ("__version__",)
