"""Real resolved ServerArgs -> host prefix cache namespaces and capacity plans."""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from qsa_core import (
    QWEN38_FLASH_NEXT,
    QWEN38_FLASH_NEXT_TEXT_CONFIG,
    CapacityPlan,
    KVDType,
    MemoryPartKind,
    plan_capacity,
)
from qsa_sglang_plugin import (
    AdapterError,
    cache_namespace_from_sglang,
    capacity_plan_from_sglang,
    config_digest_from_sglang,
)

GIB = 1 << 30
MIB = 1 << 20


def _tp2_fp8_plan() -> CapacityPlan:
    """qsa-core's plan for the flags the capacity tests pass: TP2, FP8, 8 x 262,144 tokens."""
    return plan_capacity(
        QWEN38_FLASH_NEXT,
        tp_size=2,
        kv_dtype=KVDType.FP8_E4M3,
        gpu_budget_bytes=9 * GIB,
        host_budget_bytes=12 * GIB,
        context_len=262144,
        num_requests=8,
    )


Resolve = Callable[..., tuple[Any, Any]]


@pytest.fixture(scope="module")
def resolve(tiny_model_dir: Path) -> Resolve:
    """Resolve real ``ServerArgs`` for the tiny QSA checkpoint on CPU; returns (args, config)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.arg_groups.model_override_base import model_config_of
        from sglang.srt.server_args import prepare_server_args

    def run(*extra: str, model_dir: Path = tiny_model_dir) -> tuple[Any, Any]:
        argv = ["--model-path", str(model_dir), "--device", "cpu", "--disable-radix-cache"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server_args = prepare_server_args([*argv, *extra])
            server_args.resolve_once()
            return server_args, model_config_of(server_args)

    return run


def test_namespace_names_model_dtype_and_rank(resolve: Resolve, tiny_model_dir: Path) -> None:
    """fp8 K/V at TP2 rank 1: model path, float8_e4m3fn, sizes, no salt."""
    args, cfg = resolve("--kv-cache-dtype", "fp8_e4m3", "--tp-size", "2")
    ns = cache_namespace_from_sglang(args, cfg, 1)
    assert (ns.model, ns.dtype, ns.tp_size, ns.tp_rank, ns.salt) == (
        str(tiny_model_dir),
        "float8_e4m3fn",
        2,
        1,
        None,
    )
    assert len(ns.config_digest) == 64


def test_auto_kv_dtype_is_the_model_dtype_and_revision_joins_the_model(resolve: Resolve) -> None:
    """``auto`` stores the checkpoint's bfloat16; ``--revision`` is appended to the model."""
    args, cfg = resolve("--revision", "abc123")
    ns = cache_namespace_from_sglang(args, cfg, 0)
    assert ns.dtype == "bfloat16"
    assert ns.model.endswith("@abc123")


@pytest.fixture(scope="module")
def base_digest(resolve: Resolve) -> str:
    """The config digest of the default flags."""
    return config_digest_from_sglang(*resolve())


@pytest.mark.parametrize(
    "flags",
    [
        ("--kv-cache-dtype", "fp8_e4m3"),
        ("--load-format", "dummy"),
        ("--mamba-ssm-dtype", "bfloat16"),
        ("--attention-backend", "triton"),
        ("--dtype", "float16"),
        ("--json-model-override-args", json.dumps({"rms_norm_eps": 1e-5})),
    ],
    ids=lambda f: f[0],
)
def test_digest_changes_with_each_setting_that_changes_bytes(
    resolve: Resolve, base_digest: str, flags: tuple[str, str]
) -> None:
    """A flag that changes the cached bytes changes the digest."""
    assert config_digest_from_sglang(*resolve(*flags)) != base_digest


@pytest.mark.parametrize(
    "flags",
    [
        ("--context-length", "4096"),
        ("--chunked-prefill-size", "1024"),
        ("--max-running-requests", "3"),
        ("--mem-fraction-static", "0.5"),
        ("--random-seed", "7"),
        ("--port", "31001"),
        ("--tp-size", "2"),
    ],
    ids=lambda f: f[0],
)
def test_digest_ignores_settings_that_do_not_change_bytes(
    resolve: Resolve, base_digest: str, flags: tuple[str, str]
) -> None:
    """Limits, scheduling and ports leave the digest alone (TP size is a namespace field)."""
    assert config_digest_from_sglang(*resolve(*flags)) == base_digest


def test_page_size_and_quantization_change_the_digest(resolve: Resolve) -> None:
    """Page size (forced to 64 for QSA by SGLang) and quantization, through plain objects."""
    args, cfg = resolve()
    from qsa_sglang_plugin._adapters._namespace import DIGEST_SERVER_FIELDS, resolved_args

    view = resolved_args(args)
    fields = {name: getattr(view, name) for name in DIGEST_SERVER_FIELDS}
    plain = argparse.Namespace(**fields)
    base = config_digest_from_sglang(plain, cfg)
    assert base == config_digest_from_sglang(args, cfg)
    assert fields["page_size"] == 64
    for name, value in (("page_size", 128), ("quantization", "fp8")):
        changed = argparse.Namespace(**{**fields, name: value})
        assert config_digest_from_sglang(changed, cfg) != base, name


def test_request_salt_lora_and_extra_key_separate_namespaces(resolve: Resolve) -> None:
    """Each request-level key yields its own namespace; an empty salt is not an absent one."""
    args, cfg = resolve()
    variants = [
        cache_namespace_from_sglang(args, cfg, 0),
        cache_namespace_from_sglang(args, cfg, 0, cache_salt=""),
        cache_namespace_from_sglang(args, cfg, 0, cache_salt="tenant-a"),
        cache_namespace_from_sglang(args, cfg, 0, lora_id="tenant-a"),
        cache_namespace_from_sglang(args, cfg, 0, extra_key="tenant-a"),
        cache_namespace_from_sglang(args, cfg, 0, cache_salt="a", lora_id="b"),
    ]
    assert len({ns.material() for ns in variants}) == len(variants)
    assert variants[0] == cache_namespace_from_sglang(args, cfg, 0)


def test_rank_outside_tp_size_is_refused(resolve: Resolve) -> None:
    """Rank 2 of TP2 is refused by qsa-hostcache with both values."""
    from qsa_hostcache import InvalidKeyError

    args, cfg = resolve("--tp-size", "2")
    with pytest.raises(InvalidKeyError, match="tp_rank"):
        cache_namespace_from_sglang(args, cfg, 2)


def test_unknown_kv_dtype_is_refused_with_allowed_values() -> None:
    """A KV dtype spelling the adapter does not know names the allowed ones."""
    args = argparse.Namespace(model_path="m", revision=None, kv_cache_dtype="int4", tp_size=1)
    with pytest.raises(AdapterError, match=r"--kv-cache-dtype='int4'.*'fp8_e4m3'"):
        cache_namespace_from_sglang(args, {"torch_dtype": "bfloat16"}, 0)


def test_plan_at_the_originals_flags_matches_qsa_core(resolve: Resolve) -> None:
    """TP2, fp8, 8 x 262,144 tokens, 9 GiB GPU / 12 GiB host: qsa-core's documented figures."""
    args, _ = resolve(
        "--tp-size",
        "2",
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--context-length",
        "262144",
        "--max-running-requests",
        "8",
    )
    plan = capacity_plan_from_sglang(args, QWEN38_FLASH_NEXT_TEXT_CONFIG, 9 * GIB, 12 * GIB)
    assert plan == _tp2_fp8_plan()
    off = plan.offloaded
    assert (plan.raw_bytes_per_token, plan.index_bytes_per_token) == (6144, 768)
    assert plan.host_bytes_per_request == 1536 * MIB
    # Staging: 12 layers x 65,536 blocks x 2 KiB; hot caches: 8 x 12 x (2,048 slots + 1 tail).
    assert off.part(MemoryPartKind.PREFILL_AREA).nbytes == 12 * 65_536 * 2048 == 1536 * MIB
    assert off.part(MemoryPartKind.COMPRESSED_INDEX).nbytes == 1_610_661_888
    assert off.part(MemoryPartKind.HOT_CACHE).nbytes == 8 * 12 * 2049 * 2048
    assert (plan.max_requests_offloaded, plan.max_requests_resident) == (8, 5)


def test_plan_needs_a_request_count_and_a_qsa_config(resolve: Resolve) -> None:
    """Without --max-running-requests or a QSA profile the plan names what is missing."""
    args, cfg = resolve()
    with pytest.raises(AdapterError, match="max_running_requests=None"):
        capacity_plan_from_sglang(args, cfg.hf_text_config, GIB, GIB)
    plain = argparse.Namespace(
        tp_size=1,
        kv_cache_dtype="auto",
        page_size=None,
        context_length=None,
        max_running_requests=1,
    )
    with pytest.raises(AdapterError, match="no capacity plan"):
        capacity_plan_from_sglang(plain, {"num_attention_heads": 8}, GIB, GIB)
    plan = capacity_plan_from_sglang(plain, cfg.hf_text_config, GIB, GIB)
    assert plan.context_len == 262144
    assert plan.kv_dtype is KVDType.BF16


def test_doctor_prints_the_plan_of_the_operators_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With a readable config.json the doctor adds a plan line and qsa-core's rendered table."""
    from qsa_core import render_plan
    from qsa_sglang_plugin import doctor

    (tmp_path / "config.json").write_text(json.dumps(dict(QWEN38_FLASH_NEXT_TEXT_CONFIG)))
    flags = ["--tp-size", "2", "--kv-cache-dtype", "fp8_e4m3", "--context-length", "262144"]
    budgets = ["--gpu-budget-gib", "9", "--host-budget-gib", "12", "--max-running-requests", "8"]
    doctor.main(["--model-path", str(tmp_path), *flags, *budgets])
    out = capsys.readouterr().out
    assert "[  OK] capacity plan: 8 x 262144 tokens at TP2 fp8_e4m3: offload fits 8" in out
    expected = _tp2_fp8_plan()
    assert render_plan(expected).rstrip("\n") in out
    doctor.main(["--model-path", str(tmp_path / "absent"), *flags, *budgets])
    assert "[WARN] capacity plan:" in capsys.readouterr().out
    doctor.main(["--model-path", str(tmp_path), *flags])
    assert "give --gpu-budget-gib, --host-budget-gib, --max-running-requests" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize("text", ["inf", "nan", "1e300"])
def test_doctor_refuses_a_budget_that_is_not_a_finite_gib_count_naming_the_flag(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from qsa_sglang_plugin import doctor

    with pytest.raises(SystemExit) as exited:
        doctor.main(["--model-path", "m", "--host-budget-gib", text])
    assert exited.value.code == 2
    assert f"argument --host-budget-gib: {text!r} is not allowed" in capsys.readouterr().err
