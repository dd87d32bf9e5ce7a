"""Named stand-ins for what a test machine cannot run as is, installed in an engine's processes.

An engine started by :mod:`qsa_testing` lists the stand-ins it needs in ``QSA_TESTING_STANDINS``
and puts :func:`boot_directory` on ``PYTHONPATH``; the ``sitecustomize`` there calls
:func:`install_from_environment` in every process of the engine (the server, the scheduler, the
detokenizer), before any SGLang module is imported.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from qsa_testing._errors import StandInError
from qsa_testing.standins._patches import (
    APPLIED_MARKER,
    DEFAULT_DUMMY_WEIGHT_RANGE,
    ENV_DUMMY_WEIGHT_RANGE,
    STANDINS,
    StandIn,
    StandInSpec,
    install,
)
from qsa_testing.standins._spec import announced

__all__ = (
    "APPLIED_MARKER",
    "CPU_STANDINS",
    "CUDA_STANDINS",
    "DEFAULT_DUMMY_WEIGHT_RANGE",
    "ENV_DUMMY_WEIGHT_RANGE",
    "ENV_STANDINS",
    "STANDINS",
    "StandIn",
    "StandInSpec",
    "announced",
    "boot_directory",
    "install_cpu_engine_standins",
    "install_from_environment",
    "parse_standins",
)

#: Comma-separated stand-in names to install in every process that has :func:`boot_directory`
#: on its path.
ENV_STANDINS: Final = "QSA_TESTING_STANDINS"

#: What a CPU-only machine needs to run a tiny Qwen4Exp or Llama through SGLang 0.5.23.
CPU_STANDINS: Final[frozenset[StandIn]] = frozenset(
    {
        StandIn.CPU_SGL_KERNEL,
        StandIn.GATED_RMSNORM_CPU_OP,
        StandIn.SHARED_EXPERT_GATE_TORCH,
        StandIn.QSA_INDEXER_CPU,
        StandIn.COMPRESSED_KEY_GATHER_TORCH,
        StandIn.HOST_REGISTER_CPU,
    }
)


#: What the CUDA machine needs beyond its own torch and the real sglang-kernel 0.4.5: upstream's
#: optional attention and GEMM dependencies it lacks, and a fixed order for QSA's block top-k so
#: that fresh engines agree bit for bit.
CUDA_STANDINS: Final[frozenset[StandIn]] = frozenset(
    {
        StandIn.CUTEDSL_DUAL_GEMM_UNAVAILABLE,
        StandIn.FLASH_ATTN_VARLEN_TORCH,
        StandIn.QSA_TOPK_SORTED,
    }
)


def boot_directory() -> Path:
    """The directory whose ``sitecustomize`` installs the stand-ins named in the environment."""
    return Path(__file__).parent / "_boot"


def parse_standins(text: str) -> frozenset[StandIn]:
    """Stand-in names from a comma-separated list; empty entries are ignored.

    Raises:
        StandInError: a name that is not a stand-in (the message lists the allowed ones).
    """
    names = [part.strip() for part in text.split(",") if part.strip()]
    allowed = sorted(s.value for s in StandIn)
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        msg = f"{ENV_STANDINS}={text!r}: unknown stand-ins {unknown!r}; allowed: {allowed!r}"
        raise StandInError(msg)
    return frozenset(StandIn(name) for name in names)


def install_from_environment() -> frozenset[StandIn]:
    """Install the stand-ins that ``QSA_TESTING_STANDINS`` names; return them."""
    names = parse_standins(os.environ.get(ENV_STANDINS, ""))
    install(names)
    return names


def install_cpu_engine_standins() -> frozenset[StandIn]:
    """This process as a CPU engine's: ``SGLANG_USE_CPU_ENGINE=1`` and every CPU stand-in.

    What a process that drives SGLang's classes by hand on the CPU (a gloo rank, a scenario)
    does before importing them; the environment names the stand-ins for its children too.
    """
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    os.environ[ENV_STANDINS] = ",".join(sorted(s.value for s in CPU_STANDINS))
    return install_from_environment()
