"""Every public call either succeeds or refuses with this package's error, naming the bad value.

Each case calls one public entry point with valid arguments except one, which hypothesis draws
from any kind of Python value. A refusal must be one of qsa-core's exceptions (never a bare
``TypeError`` or ``AttributeError`` from deep inside), its message must show the value it refused,
and a refused call on a stateful object must leave that object as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hypothesis import given, settings

import qsa_core
from qsa_core import (
    QWEN38_FLASH_NEXT,
    QWEN38_FLASH_NEXT_TEXT_CONFIG,
    HotCacheState,
    KVDType,
    LeaseTable,
    OffloadSizes,
    QSAProfile,
    ShardPlacement,
    ZigzagLayout,
    candidate_sort_key,
    check_prompt,
    ds_offload_sizes,
    hot_cache_slots,
    label_bytes_per_token,
    merge_topk,
    plan_capacity,
    plan_residency_step,
    sharded_token_bytes,
    topk_reference,
)
from qsa_pytest.refusals import Case, any_value, check_refusal, each_argument, refusal, shows

#: Every exception class qsa-core exports.
PACKAGE_ERRORS: tuple[type[Exception], ...] = tuple(
    getattr(qsa_core, name) for name in qsa_core.__all__ if name.endswith("Error")
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
    "state_slots": None,
}

#: ``(name, call taking keyword arguments, valid keyword arguments)``.
CASES: tuple[Case, ...] = (
    (
        "plan_capacity",
        lambda **kw: plan_capacity(QWEN38_FLASH_NEXT, **kw),
        CAPACITY_ARGS,
    ),
    (
        "hot_cache_slots",
        hot_cache_slots,
        {"block_topk": 512, "hot_slots": 2048, "context_len": 262_144},
    ),
    (
        "OffloadSizes",
        OffloadSizes,
        {
            "layers": 12,
            "rows": 8,
            "hot_slots": 2048,
            "max_blocks": 65_536,
            "kv_heads": 1,
            "head_dim": 256,
            "element_bytes": 1,
            "per_head": False,
            "block_tokens": 4,
        },
    ),
    (
        "OffloadSizes.for_context",
        OffloadSizes.for_context,
        {
            "layers": 12,
            "rows": 8,
            "context_len": 262_144,
            "hot_slots": 2048,
            "kv_heads": 1,
            "head_dim": 256,
            "element_bytes": 1,
        },
    ),
    (
        "ds_offload_sizes",
        ds_offload_sizes,
        {
            "layers": 2,
            "rows": 4,
            "context_len": 4096,
            "hot_blocks": 64,
            "kv_heads": 2,
            "head_dim": 64,
            "element_bytes": 2,
        },
    ),
    (
        "label_bytes_per_token",
        label_bytes_per_token,
        {"layers": 2, "kv_heads": 2, "heavy_channels": 16, "label_element_bytes": 2},
    ),
    (
        "sharded_token_bytes",
        sharded_token_bytes,
        {"raw_bytes": 6144, "index_bytes": 768, "sharding_size": 4},
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
    ("check_prompt", check_prompt, {"input_ids": [0, 9], "vocab_size": 10}),
    (
        "check_prompt's token",
        lambda **kw: check_prompt([5, kw["token"]], kw["vocab_size"]),
        {"token": 9, "vocab_size": 10},
    ),
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


@each_argument(CASES)
@settings(deadline=None)  # a refusal of a huge size must be fast; an accepted one may build it
@given(value=any_value(extra=[KVDType.BF16]))
def test_a_call_succeeds_or_refuses_with_the_package_error_naming_the_value(
    call: Callable[..., object], valid: Mapping[str, Any], arg: str, value: object
) -> None:
    check_refusal(call, valid, arg, value, PACKAGE_ERRORS)


@settings(deadline=None)
@given(request_id=any_value())
def test_a_refused_lease_call_leaves_the_table_as_it_was(request_id: object) -> None:
    table = LeaseTable(2)
    held = table.acquire("a")
    before = (table.num_free, table.live_handles, table.state(held))
    refused = refusal(table.acquire, {"request_id": request_id}, PACKAGE_ERRORS)
    if refused is not None:
        assert (table.num_free, table.live_handles, table.state(held)) == before
        assert shows(str(refused), request_id), str(refused)
    table.check_invariants()
