"""Capacity plan: each part against its formula computed here, what the engine allocates, and the
fit search."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qsa_core import (
    HOT_SLOTS_PER_TOPK,
    QWEN38_FLASH_NEXT,
    QWEN38_FLASH_NEXT_TEXT_CONFIG,
    CapacityError,
    CapacityPlan,
    KVDType,
    MemoryPartKind,
    MemoryTier,
    PlacementError,
    hot_cache_slots,
    plan_capacity,
    render_plan,
)
from qsa_core.cli import main
from qsa_pytest.refusals import malformed_json, refusal

GIB = 1 << 30
MIB = 1 << 20
CTX = 262144


def _plan(n: int = 8, **kwargs: Any) -> CapacityPlan:
    args: dict[str, Any] = {
        "tp_size": 2,
        "kv_dtype": KVDType.FP8_E4M3,
        "gpu_budget_bytes": 9 * GIB,
        "host_budget_bytes": 12 * GIB,
        "context_len": CTX,
        "num_requests": n,
    }
    args.update(kwargs)
    return plan_capacity(QWEN38_FLASH_NEXT, **args)


def test_host_kv_is_one_and_a_half_gib_per_request() -> None:
    """262,144 tokens at TP2 FP8: 1.5 GiB host K/V per request per rank, 12 GiB for eight."""
    plan = _plan()
    assert plan.raw_bytes_per_token == 6144
    assert plan.index_bytes_per_token == 768
    assert plan.host_bytes_per_request == 1536 * MIB
    assert plan.offloaded.part(MemoryPartKind.HOST_ARENA).nbytes == 12 * GIB
    assert plan.offloaded.host_bytes == 8 * 12 * 65536 * 2048


#: One record at TP2 FP8: 4 tokens x (K and V) x 1 KV head per rank x 256 x 1 B.
RECORD = 4 * 2 * 1 * 256 * 1
#: 4-token blocks of a 262,144-token context.
NB = CTX // 4


def test_staging_is_one_prompt_of_every_qsa_layer_in_whole_blocks() -> None:
    """12 layers x 65,536 blocks x 2 KiB = 1.5 GiB whatever the request count; a context that
    ends inside a block stages that block whole. The index pool is unchanged."""
    for n in (1, 8):
        off = _plan(n).offloaded
        assert off.part(MemoryPartKind.PREFILL_AREA).nbytes == 12 * NB * RECORD == 1536 * MIB
    odd = _plan(context_len=100_003).offloaded
    assert odd.part(MemoryPartKind.PREFILL_AREA).nbytes == 12 * 25_001 * RECORD
    assert _plan().offloaded.part(MemoryPartKind.COMPRESSED_INDEX).nbytes == 1_610_661_888


def test_each_staged_prompt_adds_one_prompt_of_staging_and_fits_fewer_requests() -> None:
    """Two prompts per prefill batch stage 3 GiB; the rest of the layout is unchanged."""
    one, two = _plan(), _plan(staged_prompts=2)
    area = MemoryPartKind.PREFILL_AREA
    assert two.offloaded.part(area).nbytes == 2 * one.offloaded.part(area).nbytes == 3072 * MIB
    assert two.offloaded.gpu_bytes - one.offloaded.gpu_bytes == 1536 * MIB
    assert two.resident == one.resident
    assert "2 prompts × 12 layers" in two.offloaded.part(area).formula
    with pytest.raises(CapacityError, match="staged_prompts=0"):
        _plan(staged_prompts=0)


def test_hot_caches_hold_their_slots_and_one_tail_record_per_layer_and_request() -> None:
    """2,048 slots + 1 tail per (layer, request): 12 x 8 x 2,049 records = 384.1875 MiB."""
    plan = _plan()
    assert plan.hot_slots == 2048
    hot = plan.offloaded.part(MemoryPartKind.HOT_CACHE).nbytes
    assert hot == 12 * 8 * 2049 * RECORD == 402_849_792
    assert _plan(1).offloaded.part(MemoryPartKind.HOT_CACHE).nbytes == 12 * 2049 * RECORD
    assert _plan(hot_slots=512).offloaded.part(MemoryPartKind.HOT_CACHE).nbytes == (
        12 * 8 * 513 * RECORD
    )


def test_residency_tables_hold_a_block_id_and_stamp_per_slot_and_a_slot_per_block() -> None:
    """12 x 8 x (2,048 x (4 + 8) + 65,536 x 4) B = 26.25 MiB."""
    tables = _plan().offloaded.part(MemoryPartKind.RESIDENCY_TABLES).nbytes
    assert tables == 12 * 8 * (2048 * 12 + NB * 4) == 27_525_120


def test_the_fixed_bytes_are_staging_hot_caches_tails_and_tables() -> None:
    """What pool sizing charges with offload: 2,040,987,648 B at 8 requests; a token then costs
    its 768 B of index alone, without offload its 6,144 B of raw K/V too."""
    plan = _plan()
    off = plan.offloaded
    parts = (
        MemoryPartKind.PREFILL_AREA,
        MemoryPartKind.HOT_CACHE,
        MemoryPartKind.RESIDENCY_TABLES,
    )
    fixed = 12 * NB * RECORD + 12 * 8 * 2049 * RECORD + 12 * 8 * (2048 * 12 + NB * 4)
    assert sum(off.part(k).nbytes for k in parts) == fixed == 2_040_987_648
    assert plan.offload.fixed_device_bytes() == fixed
    assert plan.offload.fixed_device_bytes(verify=True) == fixed + 8 * 12 * NB * RECORD
    assert plan.index_bytes_per_token == 768
    assert plan.resident_token_bytes == 768 + 6144


def test_hot_slots_are_capped_at_a_contexts_blocks_but_never_below_the_topk() -> None:
    """A 4,096-token context has 1,024 blocks: 1,024 hot slots; a 1,000-token one 250 blocks,
    but one step's 512 must fit."""
    assert _plan(context_len=4096).hot_slots == 1024
    assert _plan(context_len=1000).hot_slots == 512
    assert _plan(context_len=4096, hot_slots=4096).hot_slots == 1024
    assert _plan(context_len=CTX, hot_slots=4096).hot_slots == 4096
    assert hot_cache_slots(512, context_len=4096) == 1024
    assert hot_cache_slots(512, 600, context_len=1000) == 512


def test_hot_cache_slots_default_to_four_selections_and_refuse_less_than_one() -> None:
    """The one default the plan and the offload runtime share, and what it refuses."""
    assert hot_cache_slots(512) == HOT_SLOTS_PER_TOPK * 512 == 2048
    assert hot_cache_slots(512, 512) == 512
    assert hot_cache_slots(255, 4096) == 4096
    for topk, slots, pattern in (
        (512, 511, r"hot_slots=511 .*block_topk=512"),
        (512, 1024.0, r"hot_slots=1024.0 "),
        (512, True, r"hot_slots=True "),
        (0, None, r"block_topk=0 "),
    ):
        with pytest.raises(CapacityError, match=pattern):
            hot_cache_slots(topk, slots)  # type: ignore[arg-type]


def test_recurrent_state_pool_of_40_slots_is_about_2_2_gib() -> None:
    """GDN + conv + PLE state for 40 slots at TP2 is the reported ~2.2 GiB per rank."""
    off = _plan(state_slots=40).offloaded
    total = sum(
        off.part(k).nbytes
        for k in (MemoryPartKind.GDN_STATE, MemoryPartKind.CONV_STATE, MemoryPartKind.PLE_STATE)
    )
    assert total == 40 * (113_246_208 // 2 + 2_211_840 // 2 + 184_320)
    assert 2.1 * GIB < total < 2.2 * GIB


def test_resident_raw_kv_of_eight_requests_is_twelve_gib() -> None:
    """Without offload the eight requests need 12 GiB of raw K/V on each GPU (plus a page)."""
    res = _plan().resident
    assert res.part(MemoryPartKind.RAW_KV).nbytes == (8 * CTX + 64) * 6144
    assert res.host_bytes == 0
    assert res.part(MemoryPartKind.HOT_CACHE).nbytes == 0
    assert res.part(MemoryPartKind.RESIDENCY_TABLES).nbytes == 0
    assert res.part(MemoryPartKind.PREFILL_AREA).nbytes == 0


def test_tiers_are_gpu_except_the_host_arena() -> None:
    """Only the host arena lives in host memory."""
    for part in _plan().offloaded.parts:
        expected = MemoryTier.HOST if part.kind is MemoryPartKind.HOST_ARENA else MemoryTier.GPU
        assert part.tier is expected


@settings(max_examples=60, deadline=None)
@given(
    gpu_gib=st.floats(0, 64),
    host_gib=st.floats(0, 64),
    ctx=st.sampled_from([4096, 32768, 100_003, CTX]),
    tp=st.sampled_from([1, 2, 4]),
)
def test_max_requests_is_the_largest_count_that_fits(
    gpu_gib: float, host_gib: float, ctx: int, tp: int
) -> None:
    """The reported maximum fits both budgets and one more request does not (both modes)."""
    gpu, host = int(gpu_gib * GIB), int(host_gib * GIB)
    plan = _plan(tp_size=tp, gpu_budget_bytes=gpu, host_budget_bytes=host, context_len=ctx)
    for offloaded, best in (
        (True, plan.max_requests_offloaded),
        (False, plan.max_requests_resident),
    ):
        if best > 0:
            at = _plan(best, tp_size=tp, context_len=ctx)
            layout = at.offloaded if offloaded else at.resident
            assert layout.fits(gpu, host)
        above = _plan(best + 1, tp_size=tp, context_len=ctx)
        layout = above.offloaded if offloaded else above.resident
        assert not layout.fits(gpu, host)


def test_default_setup_fits_eight_offloaded_and_five_resident() -> None:
    """With 9 GiB GPU and 12 GiB host per rank, offload fits 8 requests; resident fits 5."""
    plan = _plan()
    assert plan.max_requests_offloaded == 8
    assert plan.max_requests_resident == 5


def test_cache_sharding_divides_the_host_arena_and_multiplies_what_it_fits() -> None:
    """TP8 (four ranks per K/V head), groups of 4: a 262,144-token request's 65,536 blocks are
    4,096 pages, 1,024 per rank; the 12 GiB of host a rank had for 8 requests holds 32. Without
    offload each rank stores a quarter of the raw K/V (6,144 / 4 = 1,536 B per token)."""
    plain = _plan(tp_size=8, gpu_budget_bytes=64 * GIB)
    sharded = _plan(tp_size=8, gpu_budget_bytes=64 * GIB, sharding_size=4)
    assert sharded.host_bytes_per_request * 4 == plain.host_bytes_per_request
    assert sharded.offloaded.part(MemoryPartKind.HOST_ARENA).nbytes == 8 * 12 * 16384 * 2048
    assert plain.max_requests_offloaded == 8
    assert sharded.max_requests_offloaded == 32
    assert sharded.resident_token_bytes == 768 + 6144 // 4
    raw = sharded.resident.part(MemoryPartKind.RAW_KV).nbytes
    assert raw == (8 * CTX + 64) * 1536
    assert sharded.max_requests_resident > plain.max_requests_resident
    assert "offloaded K/V sharded over 4 ranks" in render_plan(sharded)
    with pytest.raises(PlacementError, match=r"sharding_size=4 .*allowed: \[1\]"):
        _plan(sharding_size=4)  # TP2: one rank per K/V head


def test_an_index_sharded_by_page_divides_the_compressed_index_per_rank() -> None:
    """D2 at TP8, groups of 4: each rank holds a quarter of the compressed index (768 / 4 B per
    token), resident or offloaded, so either layout fits at least as many requests as D1
    alone; with the offload the index's candidate buffers are fixed bytes of their own."""
    d1 = _plan(tp_size=8, gpu_budget_bytes=64 * GIB, sharding_size=4)
    d2 = _plan(
        tp_size=8,
        gpu_budget_bytes=64 * GIB,
        sharding_size=4,
        index_sharded=True,
        index_buffer_bytes=3 * MIB,
    )
    assert d2.index_bytes_per_token_per_rank == 768 // 4
    assert d2.resident_token_bytes == 768 // 4 + 6144 // 4
    assert d2.resident.part(MemoryPartKind.COMPRESSED_INDEX).nbytes == (8 * CTX + 64) * 192
    assert d2.offloaded.part(MemoryPartKind.COMPRESSED_INDEX).nbytes == (8 * CTX + 64) * 192
    assert d2.offloaded_price.token_bytes == 192
    assert d2.offloaded_price.fixed_bytes == d1.offloaded_price.fixed_bytes + 3 * MIB
    assert d2.offloaded.part(MemoryPartKind.SHARD_TRANSPORT).nbytes == 3 * MIB
    assert d1.offloaded.part(MemoryPartKind.SHARD_TRANSPORT).nbytes == 0
    assert d1.offloaded.part(MemoryPartKind.COMPRESSED_INDEX).nbytes == (8 * CTX + 64) * 768
    assert d1.resident.part(MemoryPartKind.COMPRESSED_INDEX).nbytes == (8 * CTX + 64) * 768
    assert d2.max_requests_offloaded >= d1.max_requests_offloaded
    assert d2.max_requests_resident >= d1.max_requests_resident
    text = render_plan(d2)
    assert "compressed index sharded over 4 ranks" in text
    assert "index 768 B (192 B on this rank)" in text
    assert "compressed index sharded" not in render_plan(d1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"staged_prompts": 3},
        {"verify": True},
        {"tp_size": 8, "sharding_size": 4, "transport_bytes": 5 * MIB},
        {"tp_size": 8, "sharding_size": 4, "index_sharded": True, "transport_bytes": 7 * MIB},
        {
            "tp_size": 8,
            "sharding_size": 4,
            "index_sharded": True,
            "transport_bytes": 7 * MIB,
            "index_buffer_bytes": 2 * MIB,
        },
    ],
)
def test_each_layout_is_the_pool_price_the_engine_charges(kwargs: dict[str, Any]) -> None:
    """Per token and fixed: a layout's parts are its PoolPrice, the one the plugin's pool sizing
    writes into SGLang (offloaded: the index per token, the offload's buffers fixed; resident:
    raw K/V and index per token, sharded over the group, its transport buffers fixed)."""
    plan = _plan(**kwargs)
    tokens = 8 * CTX + 64
    per_token = (MemoryPartKind.RAW_KV, MemoryPartKind.COMPRESSED_INDEX)
    fixed = (
        MemoryPartKind.PREFILL_AREA,
        MemoryPartKind.HOT_CACHE,
        MemoryPartKind.RESIDENCY_TABLES,
        MemoryPartKind.VERIFICATION,
        MemoryPartKind.SHARD_TRANSPORT,
    )
    for layout, price in (
        (plan.offloaded, plan.offloaded_price),
        (plan.resident, plan.resident_price),
    ):
        assert sum(layout.part(k).nbytes for k in per_token) == tokens * price.token_bytes
        assert sum(layout.part(k).nbytes for k in fixed) == price.fixed_bytes
    verify, candidates = kwargs.get("verify", False), kwargs.get("index_buffer_bytes", 0)
    offload_fixed = plan.offload.fixed_device_bytes(verify=verify)
    assert plan.offloaded_price.fixed_bytes == offload_fixed + candidates
    copy = plan.offloaded.part(MemoryPartKind.VERIFICATION).nbytes
    assert copy == (plan.offload.verification_bytes if verify else 0)
    assert plan.resident_price.fixed_bytes == kwargs.get("transport_bytes", 0)
    assert plan.resident.part(MemoryPartKind.SHARD_TRANSPORT).nbytes == plan.transport_bytes


def test_pool_tokens_are_what_is_left_after_the_fixed_bytes_in_whole_pages() -> None:
    """SGLang's sizing: ``(available - fixed) // token_bytes``, rounded down to whole pages."""
    price = _plan().offloaded_price
    assert price.token_bytes == 768
    available = price.fixed_bytes + 768 * 1000 + 767
    assert price.pool_tokens(available) == 1000
    assert price.pool_tokens(available, page_size=64) == 960
    assert price.pool_tokens(price.fixed_bytes - 1) == 0


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"transport_bytes": 1}, "transport_bytes=1 .*sharding_size=1"),
        ({"verify": 1}, "verify=1 is not allowed"),
        ({"tp_size": 8, "sharding_size": 4, "transport_bytes": -1}, "transport_bytes=-1"),
        (
            {"tp_size": 8, "sharding_size": 4, "index_buffer_bytes": 1},
            "index_buffer_bytes=1 .*index_sharded=False",
        ),
        (
            {"tp_size": 1, "index_sharded": True, "index_buffer_bytes": 1},
            "index_buffer_bytes=1 .*sharding_size=1, tp_size=1",
        ),
        ({"hot_slots": 511}, r"hot_slots=511 .*block_topk=512"),
        ({"context_len": 0}, "context_len=0"),
        ({"gpu_budget_bytes": -1}, "gpu_budget_bytes=-1"),
        ({"tp_size": 32}, "linear_num_value_heads=48 does not split over tp_size=32"),
    ],
)
def test_bad_inputs_are_rejected(kwargs: dict[str, Any], pattern: str) -> None:
    """Out-of-range inputs raise an error naming the value."""
    with pytest.raises(CapacityError, match=pattern):
        _plan(**kwargs)


def test_rendered_table_names_every_part_and_the_fit() -> None:
    """The table lists every part, both totals and the largest request counts."""
    text = render_plan(_plan())
    for kind in MemoryPartKind:
        assert kind.value in text
    assert "12.000 GiB" in text
    assert "384.188 MiB" in text
    assert "offloaded 8, resident 5" in text
    assert (
        "pool sizing charges: offloaded 768 B per token + 1.901 GiB fixed; "
        "resident 6,912 B per token + 0 B fixed"
    ) in text


def test_cli_plan_prints_the_default_table(capsys: pytest.CaptureFixture[str]) -> None:
    """``qsa-plan`` with no arguments prints the default plan; ``plan`` is the same command."""
    assert main([]) == 0
    default = capsys.readouterr().out
    assert main(["plan"]) == 0
    assert capsys.readouterr().out == default
    assert default == render_plan(_plan())


def test_cli_flags_and_config_file(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Flags reach the plan and a JSON config replaces the preset."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"text_config": dict(QWEN38_FLASH_NEXT_TEXT_CONFIG)}))
    argv = ["plan", "--config", str(cfg), "--tp", "1", "--kv-dtype", "bf16", "--requests", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    expected = _plan(
        2, tp_size=1, kv_dtype=KVDType.BF16, gpu_budget_bytes=9 * GIB, host_budget_bytes=12 * GIB
    )
    assert out == render_plan(expected)


def test_cli_reports_bad_input_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    """An invalid TP size is reported on stderr with exit status 2."""
    assert main(["--tp", "3"]) == 2
    assert "tp_size=3" in capsys.readouterr().err


@pytest.mark.parametrize("field", ["kv_dtype", "index_dtype"])
def test_a_dtype_spelled_as_a_string_is_refused_by_name(field: str) -> None:
    """A flag string where a KVDType belongs used to fail with an AttributeError."""
    with pytest.raises(CapacityError, match=rf"{field}='fp8_e4m3' is not allowed.*KVDType.parse"):
        _plan(**{field: "fp8_e4m3"})  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["inf", "nan", "1e300", "-1", "1048577", "lots"])
def test_plan_refuses_a_budget_that_is_not_a_finite_gib_count_naming_the_flag(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A budget outside [0, 1 PiB] (inf and 1e300 overflowed int(), nan was a float error)."""
    from qsa_core import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["plan", "--gpu-budget-gib", text])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --gpu-budget-gib: {text!r} is" in err
    assert "allowed: a number of GiB from 0 to 1048576" in err


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=malformed_json())
def test_plan_refuses_a_malformed_config_file_naming_the_flag_and_file(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], content: bytes
) -> None:
    """Non-UTF-8 bytes, huge integers and deep nesting (a traceback each) exit 2 with one line."""
    cfg = tmp_path / "config.json"
    cfg.write_bytes(content)
    assert main(["plan", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"qsa-plan plan: error: --config {str(cfg)!r}")
    assert err.count("\n") == 1


@settings(max_examples=200)
@given(
    text=st.integers(min_value=-(10**30), max_value=10**30).map(str)
    | st.text(max_size=12)
    | st.integers(min_value=4300, max_value=6000).map(lambda n: "7" * n)
)
def test_an_integer_argument_is_in_its_range_or_refused_naming_the_text_and_range(
    text: str,
) -> None:
    """Thousands of digits, floats, signs and words: refused with the argparse error that shows
    the text (shortened) and the range, never CPython's conversion error."""
    import argparse

    from qsa_core.cli import int_in

    parse = int_in(2048, 1 << 24)
    refused = refusal(parse, {"text": text}, argparse.ArgumentTypeError)
    if refused is not None:
        assert "allowed: an integer from 2,048 to 16,777,216" in str(refused)
        assert repr(text[:40])[:-1] in str(refused)
    else:
        assert 2048 <= parse(text) <= 1 << 24
        assert parse(text) == int(text)


def test_the_index_sharded_alone_divides_the_index_over_every_tp_rank_in_both_layouts() -> None:
    """D2 without D1 at TP8: both layouts hold an eighth of the compressed index (768 / 8 B per
    token) plus the candidate buffers as fixed bytes; the resident one keeps the raw K/V whole,
    and the offloaded one adds the candidates to its own buffers."""
    plain = _plan(tp_size=8, gpu_budget_bytes=64 * GIB)
    alone = _plan(
        tp_size=8, gpu_budget_bytes=64 * GIB, index_sharded=True, index_buffer_bytes=3 * MIB
    )
    raw = plain.raw_bytes_per_token
    assert alone.index_bytes_per_token_per_rank == 768 // 8
    assert alone.resident_token_bytes == raw + 768 // 8
    assert alone.resident_price.fixed_bytes == 3 * MIB
    assert alone.resident.part(MemoryPartKind.COMPRESSED_INDEX).nbytes == (8 * CTX + 64) * 96
    assert alone.resident.part(MemoryPartKind.RAW_KV).nbytes == (8 * CTX + 64) * raw
    assert alone.resident.part(MemoryPartKind.SHARD_TRANSPORT).nbytes == 3 * MIB
    offloaded, unsharded = alone.offloaded_price, plain.offloaded_price
    assert (unsharded.token_bytes, offloaded.token_bytes) == (768, 768 // 8)
    assert offloaded.fixed_bytes == unsharded.fixed_bytes + 3 * MIB
    assert alone.offloaded.part(MemoryPartKind.SHARD_TRANSPORT).nbytes == 3 * MIB
    assert alone.max_requests_offloaded >= plain.max_requests_offloaded
    assert alone.max_requests_resident >= plain.max_requests_resident
    assert "compressed index sharded over 8 ranks" in render_plan(alone)
    assert "index 768 B (96 B on this rank)" in render_plan(alone)
