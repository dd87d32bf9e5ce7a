"""The host-side entry points succeed or refuse with KernelInputError naming the bad value, and a
refused call on the offloaded store changes no row, tail or arena byte.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from hypothesis import given, settings

from qsa_core import KVDType
from qsa_kernels import (
    BLOCK_TOKENS,
    KernelInputError,
    KernelPath,
    check_block_tokens,
    kv_torch_dtype,
)
from qsa_kernels.fetch import MAX_HOT_SLOTS
from qsa_kernels.offload import OffloadedKV, OffloadGeometry
from qsa_pytest.refusals import any_value, refusal, shows

GEOMETRY: Mapping[str, Any] = {
    "layers": 2,
    "rows": 3,
    "hot_slots": 4,
    "max_blocks": 3,
    "kv_heads": 1,
    "head_dim": 16,
    "dtype": torch.bfloat16,
}


@pytest.mark.parametrize("field", list(GEOMETRY))
@settings(deadline=None, max_examples=60)
@given(value=any_value(max_int=2**12, extra=[torch.float32, torch.int8]))
def test_a_geometry_is_built_or_refused_naming_the_field_value(field: str, value: object) -> None:
    refused = refusal(OffloadGeometry, {**GEOMETRY, field: value}, KernelInputError)
    assert refused is None or shows(str(refused), value), (field, value, str(refused))


def test_a_geometry_refuses_more_hot_slots_than_the_fetch_kernel_addresses() -> None:
    """One more slot than ``MAX_HOT_SLOTS`` is refused before any allocation, naming both."""
    assert OffloadGeometry(**{**GEOMETRY, "hot_slots": MAX_HOT_SLOTS}).hot_slots == MAX_HOT_SLOTS
    with pytest.raises(KernelInputError, match=rf"hot_slots={MAX_HOT_SLOTS + 1} .*{MAX_HOT_SLOTS}"):
        OffloadGeometry(**{**GEOMETRY, "hot_slots": MAX_HOT_SLOTS + 1})


def test_kv_dtypes_map_to_torch_in_one_place() -> None:
    """Each qsa-core KV dtype has its torch dtype; anything else is refused naming the value."""
    assert kv_torch_dtype(KVDType.BF16) is torch.bfloat16
    assert kv_torch_dtype(KVDType.FP8_E4M3) is torch.float8_e4m3fn
    with pytest.raises(KernelInputError, match="kv_dtype='bf16' is not allowed"):
        kv_torch_dtype("bf16")  # type: ignore[arg-type]


def _store() -> OffloadedKV:
    store = OffloadedKV(OffloadGeometry(**GEOMETRY), torch.device("cpu"), path=KernelPath.REFERENCE)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 5, 1, 16, generator=g).bfloat16()
    store.admit(0, k, k + 1)
    return store


def _snapshot(store: OffloadedKV) -> tuple[object, ...]:
    return (
        [store.length(r) for r in range(3)],
        [store.state(r) for r in range(3)],
        store.tail.clone(),
        store.host_arena[0, :, :1].clone(),
    )


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    return a[:2] == b[:2] and all(torch.equal(x, y) for x, y in zip(a[2:], b[2:], strict=True))  # type: ignore[arg-type]


@pytest.mark.parametrize("call", ["advance rows", "advance pad_to", "length", "release", "compare"])
@settings(deadline=None, max_examples=60)
@given(value=any_value(max_int=2**12, extra=[torch.float32, torch.int8]))
def test_a_refused_store_call_changes_nothing_and_names_the_value(call: str, value: object) -> None:
    store = _store()
    before = _snapshot(store)
    k = torch.zeros(2, 5, 1, 16, dtype=torch.bfloat16)
    calls: dict[str, Callable[[], object]] = {
        "advance rows": lambda: store.advance([value]),  # type: ignore[list-item]
        "advance pad_to": lambda: store.advance([0], pad_to=value),  # type: ignore[arg-type]
        "length": lambda: store.length(value),  # type: ignore[arg-type]
        "release": lambda: store.release(value),  # type: ignore[arg-type]
        "compare": lambda: store.compare(value, k, k),  # type: ignore[arg-type]
    }
    refused = refusal(calls[call], {}, KernelInputError)
    if refused is None:
        return
    assert _same(_snapshot(store), before), str(refused)
    assert shows(str(refused), value), str(refused)


def test_an_indexer_of_other_blocks_is_refused_naming_its_ratio() -> None:
    check_block_tokens(BLOCK_TOKENS)
    with pytest.raises(KernelInputError, match=r"indexer_compress_ratio=8; .* \(allowed: 4\)"):
        check_block_tokens(8)
