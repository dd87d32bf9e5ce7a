"""Every public call either succeeds or refuses with this package's error, naming the bad value.

Each case calls one public entry point with valid arguments except one, which hypothesis draws
from any kind of Python value. A refusal must be one of qsa-core's exceptions (never a bare
``TypeError`` or ``AttributeError`` from deep inside), its message must show the value it refused,
and a refused call on a stateful object must leave that object as it was.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qsa_core
from qsa_core import (
    QWEN38_FLASH_NEXT,
    QWEN38_FLASH_NEXT_TEXT_CONFIG,
    HotCacheState,
    KVDType,
    LeaseTable,
    QSAProfile,
    ShardPlacement,
    ZigzagLayout,
    candidate_sort_key,
    merge_topk,
    plan_capacity,
    plan_residency_step,
    topk_reference,
)

#: Every exception class qsa-core exports.
PACKAGE_ERRORS: tuple[type[Exception], ...] = tuple(
    getattr(qsa_core, name) for name in qsa_core.__all__ if name.endswith("Error")
)

#: Any kind of value a caller might pass where an argument belongs.
ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**20), max_value=2**20),
    st.sampled_from([2**31, 2**32, 2**63, 2**64, 2**70, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.sampled_from([KVDType.BF16, (), [], object()]),
)

CAPACITY_ARGS: Mapping[str, Any] = {
    "tp_size": 2,
    "kv_dtype": KVDType.FP8_E4M3,
    "gpu_budget_bytes": 9 << 30,
    "host_budget_bytes": 12 << 30,
    "context_len": 262_144,
    "num_requests": 8,
    "index_dtype": KVDType.BF16,
    "hot_slots": None,
    "reserved_hot_slots": 64,
    "state_slots": None,
}

#: ``(name, call taking keyword arguments, valid keyword arguments)``.
CASES: tuple[tuple[str, Callable[..., object], Mapping[str, Any]], ...] = (
    (
        "plan_capacity",
        lambda **kw: plan_capacity(QWEN38_FLASH_NEXT, **kw),
        CAPACITY_ARGS,
    ),
    (
        "QSAProfile.from_text_config",
        lambda **kw: QSAProfile.from_text_config(QWEN38_FLASH_NEXT_TEXT_CONFIG, **kw),
        {"page_size": 64},
    ),
    (
        "ShardPlacement",
        ShardPlacement,
        {"world_size": 2, "blocks_per_page": 16, "compress_ratio": 4},
    ),
    (
        "ZigzagLayout",
        lambda **kw: ZigzagLayout(kw["cp_size"], (kw["seq_len"],)),
        {"cp_size": 2, "seq_len": 9},
    ),
    ("HotCacheState.empty", HotCacheState.empty, {"num_slots": 4}),
    ("LeaseTable", LeaseTable, {"num_slots": 4}),
    (
        "plan_residency_step",
        lambda **kw: plan_residency_step(
            HotCacheState.empty(4), [kw["block"]], kw["step"], num_blocks=kw["num_blocks"]
        ),
        {"block": 1, "step": 0, "num_blocks": 10},
    ),
    ("candidate_sort_key", candidate_sort_key, {"score": 0.5, "global_id": 3}),
    (
        "merge_topk",
        lambda **kw: merge_topk([[(kw["score"], kw["gid"])]], kw["k"]),
        {"score": 1.0, "gid": 0, "k": 1},
    ),
    (
        "topk_reference",
        lambda **kw: topk_reference([kw["score"]], [kw["gid"]], k=kw["k"]),
        {"score": 1.0, "gid": 0, "k": 1},
    ),
)

PARAMETERS = [(name, call, valid, arg) for name, call, valid in CASES for arg in valid]


def _shows(message: str, value: object) -> bool:
    """Whether ``message`` shows ``value`` (its repr, or its str for text and objects)."""
    if isinstance(value, float) and math.isnan(value):
        return "nan" in message.lower()
    shown = (repr(value), reprlib.repr(value))  # a long value may be shown shortened
    return any(r in message for r in shown) or (isinstance(value, str) and value in message)


def _refusal(call: Callable[..., object], kwargs: Mapping[str, Any]) -> Exception | None:
    """The package error ``call(**kwargs)`` raised, or None when it succeeded."""
    try:
        call(**kwargs)
    except PACKAGE_ERRORS as exc:
        return exc
    return None


@pytest.mark.parametrize(
    ("call", "valid", "arg"),
    [(call, valid, arg) for _, call, valid, arg in PARAMETERS],
    ids=[f"{name}-{arg}" for name, _, _, arg in PARAMETERS],
)
@settings(deadline=None)  # a refusal of a huge size must be fast; an accepted one may build it
@given(value=ANY_VALUE)
def test_a_call_succeeds_or_refuses_with_the_package_error_naming_the_value(
    call: Callable[..., object], valid: Mapping[str, Any], arg: str, value: object
) -> None:
    assert _refusal(call, valid) is None  # the valid call itself succeeds
    refused = _refusal(call, {**valid, arg: value})
    assert refused is None or _shows(str(refused), value), (arg, value, str(refused))


@settings(deadline=None)
@given(request_id=ANY_VALUE)
def test_a_refused_lease_call_leaves_the_table_as_it_was(request_id: object) -> None:
    table = LeaseTable(2)
    held = table.acquire("a")
    before = (table.num_free, table.live_handles, table.state(held))
    refused = _refusal(table.acquire, {"request_id": request_id})
    if refused is not None:
        assert (table.num_free, table.live_handles, table.state(held)) == before
        assert _shows(str(refused), request_id), str(refused)
    table.check_invariants()
