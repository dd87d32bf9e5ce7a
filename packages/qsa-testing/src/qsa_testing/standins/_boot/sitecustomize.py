"""Installs the test stand-ins named in ``QSA_TESTING_STANDINS`` at interpreter start.

This directory is put on ``PYTHONPATH`` only for an engine started by qsa-testing, so every
process of that engine, spawned ones included, runs this before importing SGLang.
"""

from qsa_testing.standins import install_from_environment

install_from_environment()
