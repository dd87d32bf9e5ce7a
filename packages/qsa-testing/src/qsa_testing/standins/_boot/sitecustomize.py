"""Installs the test stand-ins named in ``QSA_TESTING_STANDINS`` at interpreter start.

This directory is put on ``PYTHONPATH`` only for an engine started by qsa-testing, so every
process of that engine, spawned ones included, runs this before importing SGLang. It also
installs the selection probe, which records only for an engine started with
``EngineConfig(trace_selection=True)`` (``qsa_testing._selection_trace``). And ``SIGUSR1``
makes the process write where each of its threads is to its log (``faulthandler``): the GPU engine
session sends it to every engine process before it interrupts a run at its deadline.
"""

import faulthandler
import signal

from qsa_testing._selection_trace import install_selection_probe
from qsa_testing.standins import install_from_environment

install_from_environment()
install_selection_probe()
faulthandler.register(signal.SIGUSR1, all_threads=True)
