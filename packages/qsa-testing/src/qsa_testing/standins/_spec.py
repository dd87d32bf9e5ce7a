"""What a stand-in is: its name, the modules it edits, the edit, and why; and how it is logged."""

from __future__ import annotations

import enum
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Final

__all__ = ("APPLIED_MARKER", "StandIn", "StandInSpec", "announce", "announced", "logger")

#: Prefix of the log line each applied stand-in writes; :mod:`qsa_testing._engine` reads it back.
APPLIED_MARKER: Final = "[qsa-testing] stand-in applied:"
logger = logging.getLogger("qsa_testing.standins")
if not logger.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


class StandIn(enum.StrEnum):
    """Every stand-in, by the name an engine configuration uses."""

    CPU_SGL_KERNEL = "cpu_sgl_kernel"
    GATED_RMSNORM_CPU_OP = "gated_rmsnorm_cpu_op"
    SHARED_EXPERT_GATE_TORCH = "shared_expert_gate_torch"
    QSA_INDEXER_CPU = "qsa_indexer_cpu"
    COMPRESSED_KEY_GATHER_TORCH = "compressed_key_gather_torch"
    HOST_REGISTER_CPU = "host_register_cpu"
    DUMMY_WEIGHT_RANGE = "dummy_weight_range"
    PERTURB_DECODE_SELECTION = "perturb_decode_selection"
    CUTEDSL_DUAL_GEMM_UNAVAILABLE = "cutedsl_dual_gemm_unavailable"
    FLASH_ATTN_VARLEN_TORCH = "flash_attn_varlen_torch"
    QSA_TOPK_SORTED = "qsa_topk_sorted"


@dataclass(frozen=True, slots=True)
class StandInSpec:
    """One stand-in: the modules it edits, the edit, and why it exists.

    Attributes:
        name: the stand-in.
        modules: dotted names of the modules it edits, each edited right after it executes.
        edit: ``edit(module)``, called once per module of ``modules``.
        reason: what upstream does that the test machine cannot run, and what replaces it.
    """

    name: StandIn
    modules: tuple[str, ...]
    edit: Callable[[ModuleType], None]
    reason: str


_ANNOUNCED: list[str] = []


def announce(spec: StandInSpec, module: ModuleType) -> None:
    """Log that ``spec`` edited ``module`` (one line starting with :data:`APPLIED_MARKER`)."""
    line = f"{APPLIED_MARKER} {spec.name.value} on {module.__name__} ({spec.reason})"
    _ANNOUNCED.append(line)
    logger.info("%s", line)


def announced() -> tuple[str, ...]:
    """Every line :func:`announce` logged in this process, in order."""
    return tuple(_ANNOUNCED)
