"""The supported configuration: each rejection names the flag, the value and what is allowed."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qsa_core import QWEN38_FLASH_NEXT_TEXT_CONFIG
from qsa_pytest.refusals import any_value, refusal
from qsa_sglang_plugin import ConfigurationError, parse_switches
from qsa_sglang_plugin._config_check import ConfigFacts, _prefill_graph_backend, check_configuration

COMPAT = parse_switches({"SGLANG_QSA_MODEL_COMPAT": "1"})
OFFLOAD_ENV = {"SGLANG_QSA_MODEL_COMPAT": "1", "SGLANG_QSA_HISPARSE_V3": "p2-offload"}
OFFLOAD = parse_switches(OFFLOAD_ENV)

GOOD = ConfigFacts(
    architectures=("Qwen4ExpForConditionalGeneration",),
    text_config=dict(QWEN38_FLASH_NEXT_TEXT_CONFIG),
    model_dtype="bfloat16",
    page_size=64,
    kv_cache_dtype="fp8_e4m3",
)


def test_supported_configuration_passes_and_returns_profile() -> None:
    """The Qwen3.8-Flash-Next geometry at page 64 with fp8 KV passes every rule."""
    profile = check_configuration(GOOD, OFFLOAD)
    assert profile is not None
    assert profile.block_topk == 512


@pytest.mark.parametrize("prompts", [1, 2, 8])
def test_the_offload_stages_as_many_prompts_as_a_prefill_batch_holds(prompts: int) -> None:
    facts = dataclasses.replace(GOOD, prefill_max_requests=prompts)
    assert check_configuration(facts, OFFLOAD) is not None


def test_nothing_is_checked_with_switches_off() -> None:
    """With every switch off the plugin has no opinion, even on another model."""
    other = dataclasses.replace(GOOD, architectures=("LlamaForCausalLM",), page_size=1)
    assert check_configuration(other, parse_switches({})) is None


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        (
            {"architectures": ("Qwen3NextForCausalLM",)},
            [
                "--model-path architectures=['Qwen3NextForCausalLM']",
                "Qwen4ExpForConditionalGeneration",
            ],
        ),
        (
            {"architectures": ()},
            ["--model-path architectures=[]"],
        ),
        ({"page_size": 1}, ["--page-size=1", "supported: 64"]),
        ({"page_size": 128}, ["--page-size=128", "supported: 64"]),
        (
            {"kv_cache_dtype": "fp8_e5m2"},
            ["--kv-cache-dtype='fp8_e5m2'", "'bf16', 'bfloat16', 'fp8_e4m3'"],
        ),
        (
            {"kv_cache_dtype": "auto", "model_dtype": "float16"},
            ["--kv-cache-dtype='auto (model dtype float16)'", "'auto' with a bfloat16 model"],
        ),
    ],
)
def test_every_feature_rejects_unsupported_model_or_kv(
    change: dict[str, Any], fragments: list[str]
) -> None:
    """Architecture, page size and KV dtype are checked whenever any switch is on."""
    with pytest.raises(ConfigurationError) as info:
        check_configuration(dataclasses.replace(GOOD, **change), COMPAT)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_checkpoint_without_qsa_profile_is_rejected() -> None:
    """A Qwen4-Exp config whose indexer geometry fails qsa-core is refused, naming the field."""
    text = dict(QWEN38_FLASH_NEXT_TEXT_CONFIG)
    text["indexer_kv_heads"] = 2
    with pytest.raises(ConfigurationError, match=r"--model-path.*index_kv_heads=2"):
        check_configuration(dataclasses.replace(GOOD, text_config=text), COMPAT)


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        ({"pp_size": 2}, ["--pp-size=2", "supported: 1"]),
        ({"dp_size": 2}, ["--dp-size=2", "supported: 1"]),
        ({"attn_dp_size": 2}, ["--attn-dp-size=2", "supported: 1"]),
        ({"speculative_algorithm": "EAGLE"}, ["--speculative-algorithm='EAGLE'", "unset"]),
        ({"disaggregation_mode": "decode"}, ["--disaggregation-mode='decode'", "'null'"]),
        ({"enable_hisparse": True}, ["--enable-hisparse=True", "supported: off"]),
        ({"enable_mixed_chunk": True}, ["--enable-mixed-chunk=True", "supported: off"]),
        ({"disable_radix_cache": False}, ["--disable-radix-cache=False", "set"]),
        (
            {"radix_cache_backend": None},
            ["--radix-cache-backend=None", "supported: 'qsa_hisparse'"],
        ),
        ({"radix_cache_backend": "lmcache"}, ["--radix-cache-backend='lmcache'", "'qsa_hisparse'"]),
        (
            {"max_running_requests": None},
            ["--max-running-requests=None", "a positive integer", "host arena"],
        ),
        (
            {"prefill_graph_backend": "full"},
            [
                "--cuda-graph-backend-prefill='full'",
                "supported: 'breakable' or 'disabled'",
                "must run eagerly",
            ],
        ),
        (
            {"prefill_graph_backend": "breakable", "enable_prefill_cp": True, "tp_size": 2},
            [
                "--cuda-graph-backend-prefill='breakable'",
                "supported: 'disabled' (decode CUDA graphs stay on)",
                "context-parallel prefill runs eagerly",
            ],
        ),
        (
            {"prefill_max_requests": None},
            ["--prefill-max-requests=None", "supported: a positive integer", "staging area"],
        ),
        ({"prefill_max_requests": 0}, ["--prefill-max-requests=0", "a positive integer"]),
        (
            {"prefill_max_requests": 2, "enable_prefill_cp": True},
            ["--prefill-max-requests=2", "supported: 1", "context-parallel prefill"],
        ),
        (
            {"enable_prefill_cp": True, "device": "cpu"},
            ["--enable-prefill-cp=True", "supported: off on --device='cpu'", "CUDA side stream"],
        ),
    ],
)
def test_hisparse_rejects_scheduler_flags_it_cannot_run(
    change: dict[str, Any], fragments: list[str]
) -> None:
    """Each scheduler flag outside the offload runtime's envelope is refused under V3."""
    facts = dataclasses.replace(GOOD, **change)
    with pytest.raises(ConfigurationError) as info:
        check_configuration(facts, OFFLOAD)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert check_configuration(facts, COMPAT) is not None  # model_compat alone allows it


@pytest.mark.parametrize("backend", ["breakable", "disabled"])
def test_the_offload_serves_breakable_prefill_graphs_or_none(backend: str) -> None:
    """SGLang's default prefill graphs on CUDA (breakable: attention runs eagerly between the
    captured segments) start with p2-offload, as does an eager prefill."""
    facts = dataclasses.replace(GOOD, prefill_graph_backend=backend)
    assert check_configuration(facts, OFFLOAD) is not None


def test_the_offload_serves_context_parallel_prefill_on_cuda() -> None:
    """SGLang's QSA prefill CP (zigzag over the TP group) composes with p2-offload: every rank
    stages the gathered chunk."""
    facts = dataclasses.replace(GOOD, enable_prefill_cp=True, tp_size=2)
    assert check_configuration(facts, OFFLOAD) is not None


@pytest.mark.parametrize("dtype", ["auto", "bf16", "bfloat16", "fp8_e4m3"])
def test_supported_kv_dtypes_pass(dtype: str) -> None:
    """Every supported KV dtype spelling passes with a bfloat16 checkpoint."""
    assert check_configuration(dataclasses.replace(GOOD, kv_cache_dtype=dtype), OFFLOAD)


PREFIX = parse_switches(
    {
        "SGLANG_QSA_MODEL_COMPAT": "1",
        "SGLANG_QSA_HISPARSE_V3": "p2-offload",
        "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "64",
    }
)


@pytest.mark.parametrize("chunk", [None, -1, 64, 1024, 8192])
def test_the_prefix_cache_takes_chunks_of_whole_pages_or_none(chunk: int | None) -> None:
    assert check_configuration(dataclasses.replace(GOOD, chunked_prefill_size=chunk), PREFIX)


@pytest.mark.parametrize("chunk", [1000, 63, 8200])
def test_the_prefix_cache_refuses_chunks_that_end_inside_a_page(chunk: int) -> None:
    facts = dataclasses.replace(GOOD, chunked_prefill_size=chunk)
    with pytest.raises(ConfigurationError) as info:
        check_configuration(facts, PREFIX)
    assert f"--chunked-prefill-size={chunk}" in str(info.value)
    assert "a multiple of the page size (64), or -1" in str(info.value)
    assert check_configuration(facts, OFFLOAD) is not None  # offload alone takes any chunk


OVERLAPPED = dataclasses.replace(GOOD, disable_overlap_schedule=False)


@pytest.mark.parametrize(
    "env",
    [
        OFFLOAD_ENV,
        {**OFFLOAD_ENV, "SGLANG_QSA_HISPARSE_V3": "p2-resident"},
        {**OFFLOAD_ENV, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "64"},
    ],
)
def test_the_offload_and_the_prefix_cache_serve_overlap_scheduling(env: dict[str, str]) -> None:
    """Their state follows the forward, so SGLang's overlap scheduling serves them."""
    assert check_configuration(OVERLAPPED, parse_switches(env)) is not None


def test_an_overlapped_context_parallel_offloaded_prefill_is_refused() -> None:
    """A context-parallel offloaded prefill is verified without overlap only."""
    facts = dataclasses.replace(OVERLAPPED, enable_prefill_cp=True, tp_size=2)
    with pytest.raises(ConfigurationError) as info:
        check_configuration(facts, OFFLOAD)
    message = str(info.value)
    assert "--disable-overlap-schedule=False is not supported" in message
    assert "supported: set (overlap scheduling off) with a context-parallel prefill" in message
    serial = dataclasses.replace(facts, disable_overlap_schedule=True)
    assert check_configuration(serial, OFFLOAD) is not None


def test_resident_mode_does_not_need_the_offload_flags() -> None:
    """p2-resident keeps the history on the GPU: no arena to size, no prompt to stage."""
    resident = parse_switches(
        {"SGLANG_QSA_MODEL_COMPAT": "1", "SGLANG_QSA_HISPARSE_V3": "p2-resident"}
    )
    facts = dataclasses.replace(GOOD, max_running_requests=None, prefill_max_requests=None)
    assert check_configuration(facts, resident) is not None


@pytest.mark.parametrize(
    ("flags", "backend"),
    [
        ({"cuda_graph_backend_prefill": "breakable"}, "breakable"),
        ({"cuda_graph_backend_prefill": "full"}, "full"),
        ({"cuda_graph_backend_prefill": "breakable", "disable_cuda_graph": True}, "disabled"),
        ({"disable_prefill_cuda_graph": True}, "disabled"),
    ],
)
def test_the_prefill_graph_backend_is_read_as_sglang_resolves_the_flags(
    flags: dict[str, Any], backend: str
) -> None:
    """The fact behind the prefill-graph refusal, from a real ServerArgs."""
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", device="cpu", **flags)
    assert _prefill_graph_backend(resolving_view(args)) == backend


LLAMA = ConfigFacts(
    architectures=("LlamaForCausalLM",),
    text_config={
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 64,
        "head_dim": 16,
    },
    model_dtype="bfloat16",
    page_size=1,
    kv_cache_dtype="auto",
    attention_backend="qsa_ds",
)


def _ds(tmp_path: Any, rows: object) -> Any:
    import json

    path = tmp_path / "channels.json"
    path.write_text(
        json.dumps({f"model.layers.{i}.self_attn.qk_proj": rows for i in range(2)}),
        encoding="utf-8",
    )
    env = {"SGLANG_QSA_DS_CHANNEL_CONFIG": str(path), "SGLANG_QSA_DS_HEAVY_CHANNELS": "4"}
    return parse_switches(env), path


def test_double_sparsity_passes_on_a_gqa_model_with_a_fitting_channel_file(tmp_path: Any) -> None:
    switches, _ = _ds(tmp_path, [list(range(16)), list(range(15, -1, -1))])
    assert check_configuration(LLAMA, switches) is None
    # Tensor parallelism: each rank takes its K/V heads' channels (one or two heads per rank,
    # or one head replicated on two ranks on GPUs).
    for tp_size, device in ((2, "cpu"), (2, "cuda"), (4, "cuda")):
        facts = dataclasses.replace(LLAMA, tp_size=tp_size, device=device)
        assert check_configuration(facts, switches) is None
    # A Qwen2-style config names a window it does not use.
    unused = {**LLAMA.text_config, "sliding_window": 4096, "use_sliding_window": False}
    assert check_configuration(dataclasses.replace(LLAMA, text_config=unused), switches) is None


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        ({"attention_backend": "triton"}, ["--attention-backend='triton'", "'qsa_ds'"]),
        (
            {"architectures": ("Qwen4ExpForConditionalGeneration",)},
            ["--model-path architectures", "a model without QSA layers"],
        ),
        ({"tp_size": 3}, ["tp_size=3 does not split 2 K/V heads", "a divisor [1, 2]"]),
        (
            {"tp_size": 4, "device": "cpu"},
            ["--tp-size=4", "a divisor of the model's 2 K/V heads on the CPU", "pads"],
        ),
        (
            {"text_config": {**LLAMA.text_config, "sliding_window": 4096}},
            ["--model-path sliding_window=4096", "without sliding-window attention"],
        ),
        (
            {"text_config": {**LLAMA.text_config, "attn_logit_softcapping": 50.0}},
            ["--model-path attn_logit_softcapping=50.0", "supported: none"],
        ),
        (
            {"speculative_algorithm": "EAGLE"},
            ["--speculative-algorithm='EAGLE'", "supported: unset"],
        ),
        (
            {"enable_prefill_cp": True, "tp_size": 2, "attn_cp_size": 2},
            ["--enable-prefill-cp=True", "no context-parallel path", "supported: off"],
        ),
    ],
)
def test_double_sparsity_refuses_what_it_cannot_serve(
    tmp_path: Any, change: dict[str, Any], fragments: list[str]
) -> None:
    switches, _ = _ds(tmp_path, [list(range(16)), list(range(16))])
    with pytest.raises(ConfigurationError) as caught:
        check_configuration(dataclasses.replace(LLAMA, **change), switches)
    for fragment in fragments:
        assert fragment in str(caught.value)


GEOMETRY = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
)
#: Double sparsity over a channel file that fits ``LLAMA`` (2 layers, 2 KV heads, head dim 16).
DS_SWITCHES = parse_switches(
    {
        "SGLANG_QSA_DS_CHANNEL_CONFIG": str(
            Path(__file__).with_name("data") / "tiny-llama-channels.json"
        ),
        "SGLANG_QSA_DS_HEAVY_CHANNELS": "4",
    }
)
DROP = object()  # the field left out of the config


@settings(max_examples=80)
@given(
    field=st.sampled_from(GEOMETRY),
    value=any_value(extra=[{"n": 1}, [4], "4", 4.0]) | st.just(DROP),
)
def test_a_model_config_without_usable_head_counts_is_refused_naming_the_field(
    field: str, value: object
) -> None:
    """Missing, null, zero, negative, float, string or nested head counts (a bare KeyError or
    ValueError escaped the check): refused naming the field, or served when the value is one
    the geometry accepts (a positive int; null for the optional two)."""
    text = {k: v for k, v in LLAMA.text_config.items() if k != field}
    if field == "hidden_size":
        del text["head_dim"]  # else hidden_size is not read
    if value is not DROP:
        text[field] = value
    facts = dataclasses.replace(LLAMA, text_config=text)
    usable = (isinstance(value, int) and not isinstance(value, bool) and value >= 1) or (
        field in {"num_key_value_heads", "head_dim"} and value in (DROP, None)
    )
    refused = refusal(
        check_configuration, {"facts": facts, "switches": DS_SWITCHES}, ConfigurationError
    )
    if not usable:
        assert refused is not None, f"{field}={value!r} was accepted"
        assert f"--model-path {field}" in str(refused), str(refused)


def test_a_model_config_whose_heads_do_not_divide_is_refused_naming_both_fields() -> None:
    for change, fragments in (
        (
            {"num_key_value_heads": 3},
            ["num_key_value_heads=3", "a divisor of num_attention_heads=4"],
        ),
        (
            {"head_dim": None, "hidden_size": 66},
            ["hidden_size=66", "a multiple of num_attention_heads=4"],
        ),
    ):
        facts = dataclasses.replace(LLAMA, text_config={**LLAMA.text_config, **change})
        with pytest.raises(ConfigurationError) as caught:
            check_configuration(facts, DS_SWITCHES)
        for fragment in fragments:
            assert fragment in str(caught.value)


def test_a_malformed_channel_file_is_refused_with_its_path_and_field(tmp_path: Any) -> None:
    switches, path = _ds(tmp_path, [list(range(16)), [0, 1, 2, 99]])
    with pytest.raises(ConfigurationError) as caught:
        check_configuration(LLAMA, switches)
    text = str(caught.value)
    for fragment in (str(path), "model.layers.0.self_attn.qk_proj", "head 1", "channel 99"):
        assert fragment in text


def _ds_offload(tmp_path: Any) -> Any:
    switches, _ = _ds(tmp_path, [list(range(16)), list(range(16))])
    assert switches.double_sparsity is not None
    ds = dataclasses.replace(switches.double_sparsity, offload=True)
    return dataclasses.replace(switches, double_sparsity=ds)


def test_ds_offload_passes_with_the_offload_flags(tmp_path: Any) -> None:
    """ConfigFacts' defaults are the offload flags; DS-Offload adds none (decode graphs too)."""
    assert check_configuration(LLAMA, _ds_offload(tmp_path)) is None


def test_ds_offload_serves_overlap_scheduling(tmp_path: Any) -> None:
    facts = dataclasses.replace(LLAMA, disable_overlap_schedule=False)
    assert check_configuration(facts, _ds_offload(tmp_path)) is None


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        (
            {"radix_cache_backend": None},
            ["--radix-cache-backend=None", "'qsa_hisparse'", "one lease per request"],
        ),
        ({"max_running_requests": None}, ["--max-running-requests=None", "host arena"]),
        ({"max_running_requests": 0}, ["--max-running-requests=0", "a positive integer"]),
        ({"max_running_requests": -1}, ["--max-running-requests=-1", "a positive integer"]),
        ({"prefill_max_requests": 4}, ["--prefill-max-requests=4", "supported: 1"]),
        ({"prefill_graph_backend": "full"}, ["--cuda-graph-backend-prefill='full'"]),
        (
            {"prefill_graph_backend": "breakable"},
            ["--cuda-graph-backend-prefill='breakable'", "'disabled'", "no host-arena row"],
        ),
    ],
)
def test_ds_offload_refuses_flags_its_runtime_cannot_serve(
    tmp_path: Any, change: dict[str, Any], fragments: list[str]
) -> None:
    switches = _ds_offload(tmp_path)
    with pytest.raises(ConfigurationError) as caught:
        check_configuration(dataclasses.replace(LLAMA, **change), switches)
    for fragment in fragments:
        assert fragment in str(caught.value)
    # The same flags serve resident double sparsity.
    assert (
        check_configuration(
            dataclasses.replace(LLAMA, **change),
            _ds(tmp_path, [list(range(16)), list(range(16))])[0],
        )
        is None
    )


@pytest.mark.parametrize(("tp_size", "sharding"), [(4, 2), (8, 2), (8, 4)])
def test_cache_sharding_passes_inside_one_kv_heads_replica_group(
    tp_size: int, sharding: int
) -> None:
    """Two K/V heads: at TP4 two ranks hold each head, at TP8 four."""
    switches = parse_switches({**OFFLOAD_ENV, "SGLANG_QSA_CACHE_SHARDING": str(sharding)})
    assert check_configuration(dataclasses.replace(GOOD, tp_size=tp_size), switches) is not None


@pytest.mark.parametrize(
    ("tp_size", "sharding", "allowed"), [(1, 2, "[1]"), (2, 2, "[1]"), (4, 4, "[1, 2]")]
)
def test_cache_sharding_beyond_the_replica_group_is_refused_by_name(
    tp_size: int, sharding: int, allowed: str
) -> None:
    switches = parse_switches({**OFFLOAD_ENV, "SGLANG_QSA_CACHE_SHARDING": str(sharding)})
    with pytest.raises(ConfigurationError) as info:
        check_configuration(dataclasses.replace(GOOD, tp_size=tp_size), switches)
    message = str(info.value)
    assert f"SGLANG_QSA_CACHE_SHARDING={sharding} does not fit --tp-size={tp_size}" in message
    assert f"allowed: {allowed}" in message


RESIDENT_SHARDING = parse_switches({"SGLANG_QSA_CACHE_SHARDING": "2"})
#: Upstream's own scheduling: the offload's flags are not needed without an offload.
UPSTREAM_SCHEDULING = dataclasses.replace(
    GOOD,
    tp_size=4,
    disable_overlap_schedule=False,
    disable_radix_cache=False,
    radix_cache_backend=None,
    max_running_requests=None,
    prefill_max_requests=None,
)


def test_resident_cache_sharding_passes_with_upstreams_scheduling() -> None:
    """Without an offload the sharded store needs none of the offload's flags."""
    assert check_configuration(UPSTREAM_SCHEDULING, RESIDENT_SHARDING) is not None


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        ({"speculative_algorithm": "EAGLE"}, ["--speculative-algorithm='EAGLE'", "unset"]),
        ({"attn_dp_size": 2}, ["--attn-dp-size=2", "same batch"]),
        (
            {"enable_prefill_cp": True, "attn_cp_size": 4, "device": "cpu"},
            ["--enable-prefill-cp=True", "off on --device='cpu'", "CUDA side stream"],
        ),
        (
            {"enable_prefill_cp": True, "attn_cp_size": 4, "enable_cp_decode_attn_tp": True},
            ["--enable-cp-decode-attn-tp=True", "supported: off", "every head's K/V"],
        ),
        ({"disaggregation_mode": "prefill"}, ["--disaggregation-mode='prefill'", "'null'"]),
        ({"enable_hisparse": True}, ["--enable-hisparse=True", "off"]),
        ({"enable_mixed_chunk": True}, ["--enable-mixed-chunk=True", "not verified"]),
        ({"prefill_graph_backend": "full"}, ["--cuda-graph-backend-prefill='full'", "host"]),
        ({"tp_size": 2}, ["SGLANG_QSA_CACHE_SHARDING=2 does not fit --tp-size=2", "[1]"]),
    ],
)
def test_resident_cache_sharding_refuses_what_its_backend_cannot_serve(
    change: dict[str, Any], fragments: list[str]
) -> None:
    with pytest.raises(ConfigurationError) as info:
        check_configuration(dataclasses.replace(UPSTREAM_SCHEDULING, **change), RESIDENT_SHARDING)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize("offloaded", [True, False], ids=["offloaded", "resident"])
def test_prefill_cp_over_the_tp_group_lets_every_rank_share_the_kv_heads(offloaded: bool) -> None:
    """Under SGLang's QSA prefill CP (attention CP over all 4 TP ranks, attention TP 1) every
    rank holds both K/V heads: a group of 4 fits, which the head split alone does not allow."""
    env = {"SGLANG_QSA_CACHE_SHARDING": "4", **(OFFLOAD_ENV if offloaded else {})}
    base = GOOD if offloaded else UPSTREAM_SCHEDULING
    facts = dataclasses.replace(base, tp_size=4, enable_prefill_cp=True, attn_cp_size=4)
    assert check_configuration(facts, parse_switches(env)) is not None
    with pytest.raises(ConfigurationError, match=r"SHARDING=4 .*allowed: \[1, 2\]"):
        check_configuration(
            dataclasses.replace(facts, enable_prefill_cp=False, attn_cp_size=1),
            parse_switches(env),
        )


@pytest.mark.parametrize("offloaded", [True, False], ids=["offloaded", "resident"])
def test_cache_sharding_on_the_cpu_is_refused_where_sglang_pads_the_kv_heads(
    offloaded: bool,
) -> None:
    """One K/V head at TP2: two ranks share it on CUDA, but SGLang's CPU engine pads it to two
    heads, one per rank (``adjust_config_with_unaligned_cpu_tp``), so there is no shard group."""
    base, switches = (
        (GOOD, parse_switches({**OFFLOAD_ENV, "SGLANG_QSA_CACHE_SHARDING": "2"}))
        if offloaded
        else (UPSTREAM_SCHEDULING, RESIDENT_SHARDING)
    )
    one_head = dataclasses.replace(
        base, tp_size=2, text_config={**base.text_config, "num_key_value_heads": 1}
    )
    assert check_configuration(one_head, switches) is not None
    with pytest.raises(ConfigurationError) as info:
        check_configuration(dataclasses.replace(one_head, device="cpu"), switches)
    message = str(info.value)
    for fragment in (
        "SGLANG_QSA_CACHE_SHARDING=2 does not fit --tp-size=2 on the CPU",
        "pads the model's 1 K/V heads to 2",
        "allowed: [1]",
    ):
        assert fragment in message, message


@pytest.mark.parametrize("blocks", [512, 2048, 1 << 16])
def test_hot_blocks_from_one_selection_to_the_fetch_kernels_limit_pass(blocks: int) -> None:
    switches = parse_switches({**OFFLOAD_ENV, "SGLANG_QSA_HISPARSE_HOT_BLOCKS": str(blocks)})
    assert check_configuration(GOOD, switches) is not None


@pytest.mark.parametrize("blocks", [1, 511, (1 << 16) + 1])
def test_hot_blocks_outside_one_selection_to_the_kernels_limit_are_refused_by_name(
    blocks: int,
) -> None:
    """Qwen3.8-Flash-Next selects 512 blocks a step; the fetch kernel addresses 65,536 slots."""
    switches = parse_switches({**OFFLOAD_ENV, "SGLANG_QSA_HISPARSE_HOT_BLOCKS": str(blocks)})
    with pytest.raises(ConfigurationError) as info:
        check_configuration(GOOD, switches)
    message = str(info.value)
    assert f"SGLANG_QSA_HISPARSE_HOT_BLOCKS={blocks}" in message
    assert "allowed: 512 (the indexer's block top-k) to 65536" in message


@pytest.mark.parametrize(
    ("switch", "context_len", "slots"),
    [
        (None, 262_144, 2048),  # qsa-core's default: 4 x the top-k
        (None, 4_096, 1024),  # clipped to the context's blocks
        (None, 1_000, 512),  # never below one selection
        (4096, 262_144, 4096),
        (4096, 8_192, 2048),
    ],
)
def test_the_runtime_sizes_hot_caches_from_the_switch_clipped_to_a_contexts_blocks(
    monkeypatch: pytest.MonkeyPatch, switch: int | None, context_len: int, slots: int
) -> None:
    from qsa_sglang_plugin._adapters import _offload

    env = dict(OFFLOAD_ENV)
    if switch is not None:
        env["SGLANG_QSA_HISPARSE_HOT_BLOCKS"] = str(switch)
    monkeypatch.setattr(_offload, "current_switches", lambda: parse_switches(env))
    monkeypatch.setattr(_offload, "qsa_profile_of", lambda config: SimpleNamespace(block_topk=512))
    layout = _offload.qsa_layout(
        SimpleNamespace(context_len=context_len),
        SimpleNamespace(prefill_max_requests=1),
        [0],
        rows=1,
        kv_heads=1,
        head_dim=64,
        dtype=torch.bfloat16,
    )
    assert layout.geometry.hot_slots == slots


def test_index_sharding_passes_prefill_cp_and_refuses_hicache_by_name() -> None:
    """D2 with SGLang's QSA prefill CP passes: the index group selects for the union of its CP
    ranks' zigzag rows (``test_cp_index_sharding.py``), with cache sharding over the CP group
    and without it. HiCache is refused naming the flag."""
    env = {"SGLANG_QSA_CACHE_SHARDING": "4", "SGLANG_QSA_INDEX_SHARDING": "1"}
    facts = dataclasses.replace(
        UPSTREAM_SCHEDULING, tp_size=4, enable_prefill_cp=True, attn_cp_size=4
    )
    assert check_configuration(facts, parse_switches(env)) is not None
    alone = {"SGLANG_QSA_INDEX_SHARDING": "1"}
    assert check_configuration(facts, parse_switches(alone)) is not None
    two = {"SGLANG_QSA_CACHE_SHARDING": "2", "SGLANG_QSA_INDEX_SHARDING": "1"}
    assert check_configuration(UPSTREAM_SCHEDULING, parse_switches(two)) is not None
    hicache = dataclasses.replace(UPSTREAM_SCHEDULING, enable_hierarchical_cache=True)
    with pytest.raises(ConfigurationError, match=r"--enable-hierarchical-cache=True .*own pages"):
        check_configuration(hicache, parse_switches(two))


def test_index_sharding_with_the_offload_passes_with_and_without_prefill_cp() -> None:
    """D2 over the host arenas' groups (``p2-offload``, TP4, groups of 2) passes, and with
    SGLang's prefill CP over the TP group too (two index groups inside the CP group)."""
    env = {**OFFLOAD_ENV, "SGLANG_QSA_CACHE_SHARDING": "2", "SGLANG_QSA_INDEX_SHARDING": "1"}
    facts = dataclasses.replace(GOOD, tp_size=4)
    assert check_configuration(facts, parse_switches(env)) is not None
    cp = dataclasses.replace(facts, enable_prefill_cp=True, attn_cp_size=4)
    assert check_configuration(cp, parse_switches(env)) is not None


def test_index_sharding_on_the_cpu_is_refused_with_the_cache_sharding_it_rides_on() -> None:
    """One K/V head at TP2 on the CPU: SGLang pads the heads, so D1 has no shard group, and D2,
    which uses D1's groups, is refused with it (the message names the cache-sharding switch)."""
    env = {"SGLANG_QSA_CACHE_SHARDING": "2", "SGLANG_QSA_INDEX_SHARDING": "1"}
    one_head = dataclasses.replace(
        UPSTREAM_SCHEDULING,
        tp_size=2,
        device="cpu",
        text_config={**UPSTREAM_SCHEDULING.text_config, "num_key_value_heads": 1},
    )
    with pytest.raises(ConfigurationError, match=r"SGLANG_QSA_CACHE_SHARDING=2 .* on the CPU"):
        check_configuration(one_head, parse_switches(env))


INDEX_ALONE = {"SGLANG_QSA_MODEL_COMPAT": "1", "SGLANG_QSA_INDEX_SHARDING": "1"}


def test_index_sharding_alone_with_the_offload_passes_at_two_ranks_and_names_its_limits() -> None:
    """``p2-offload`` with D2 and no cache sharding (one K/V head per rank at TP2, the case D1
    cannot shard) passes, also on the CPU's padded heads; the group's rules still hold: one rank
    shards nothing, and SGLang's breakable prefill graphs (the offload's default on CUDA) are
    refused naming the value that serves."""
    env = {**OFFLOAD_ENV, "SGLANG_QSA_INDEX_SHARDING": "1"}
    two = dataclasses.replace(GOOD, tp_size=2)
    assert check_configuration(two, parse_switches(env)) is not None
    cpu = dataclasses.replace(two, device="cpu")
    assert check_configuration(cpu, parse_switches(env)) is not None
    for change, fragment in (
        ({"tp_size": 1}, "--tp-size=1"),
        ({"prefill_graph_backend": "breakable"}, "'disabled' (decode CUDA graphs stay on)"),
    ):
        with pytest.raises(ConfigurationError) as info:
            check_configuration(dataclasses.replace(two, **change), parse_switches(env))
        assert fragment in str(info.value)
        assert "SGLANG_QSA_INDEX_SHARDING='1'" in str(info.value)


def test_index_sharding_alone_passes_on_the_cpus_padded_heads_with_upstreams_scheduling() -> None:
    """D2 without D1 shards the index over every TP rank: the K/V heads do not matter (one head
    at TP2 on the CPU, padded to two), nor does upstream's scheduling (radix cache, overlap)."""
    one_head = dataclasses.replace(
        UPSTREAM_SCHEDULING,
        tp_size=2,
        device="cpu",
        text_config={**UPSTREAM_SCHEDULING.text_config, "num_key_value_heads": 1},
    )
    assert check_configuration(one_head, parse_switches(INDEX_ALONE)) is not None
    assert check_configuration(UPSTREAM_SCHEDULING, parse_switches(INDEX_ALONE)) is not None


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        ({"tp_size": 1}, ["--tp-size=1", "2 or more with SGLANG_QSA_INDEX_SHARDING='1'"]),
        ({"speculative_algorithm": "EAGLE"}, ["--speculative-algorithm='EAGLE'", "unset"]),
        ({"attn_dp_size": 2}, ["--attn-dp-size=2", "supported: 1 with"]),
        ({"disaggregation_mode": "prefill"}, ["--disaggregation-mode='prefill'", "'null'"]),
        ({"enable_hisparse": True}, ["--enable-hisparse=True", "off with"]),
        ({"enable_mixed_chunk": True}, ["--enable-mixed-chunk=True", "off with"]),
        (
            {"prefill_graph_backend": "breakable"},
            ["--cuda-graph-backend-prefill='breakable'", "'disabled'"],
        ),
        ({"enable_hierarchical_cache": True}, ["--enable-hierarchical-cache=True", "own pages"]),
    ],
)
def test_index_sharding_alone_refuses_what_it_does_not_serve_by_name(
    change: dict[str, Any], fragments: list[str]
) -> None:
    facts = dataclasses.replace(UPSTREAM_SCHEDULING, **change)
    with pytest.raises(ConfigurationError) as info:
        check_configuration(facts, parse_switches(INDEX_ALONE))
    message = str(info.value)
    for fragment in (*fragments, "SGLANG_QSA_INDEX_SHARDING='1'"):
        assert fragment in message, message
