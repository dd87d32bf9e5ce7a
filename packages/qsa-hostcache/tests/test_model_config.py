"""A model's configuration as a namespace's parts: model dtype, K/V storage dtype, digest."""

from __future__ import annotations

import pytest

from qsa_core import KVDType
from qsa_hostcache import (
    CacheConfigError,
    CacheNamespace,
    InvalidKeyError,
    config_digest,
    kv_storage_dtype,
    model_config_digest,
    model_dtype,
    model_namespace,
)


@pytest.mark.parametrize(
    ("config", "dtype"),
    [
        ({"torch_dtype": "torch.bfloat16"}, "bfloat16"),
        ({"dtype": "float16"}, "float16"),
        ({"torch_dtype": "float32", "text_config": {"torch_dtype": "bfloat16"}}, "float32"),
        ({"text_config": {"dtype": "bfloat16"}}, "bfloat16"),
    ],
)
def test_model_dtype_reads_the_config_then_its_text_config(
    config: dict[str, object], dtype: str
) -> None:
    """``torch_dtype`` or ``dtype``, the text config's when the top level names none."""
    assert model_dtype(config) == dtype


def test_a_config_without_a_dtype_is_refused() -> None:
    with pytest.raises(CacheConfigError, match=r"names no dtype \(torch_dtype\)"):
        model_dtype({"text_config": {"hidden_size": 8}})


def test_auto_is_the_model_dtype_and_names_are_torch_names() -> None:
    assert kv_storage_dtype("auto", "float16") == "float16"
    assert kv_storage_dtype(" FP8_E4M3 ", "bfloat16") == "float8_e4m3fn"
    assert kv_storage_dtype("BFloat16", "float16") == "bfloat16"
    for dtype in KVDType:
        for name in dtype.sglang_names:
            assert kv_storage_dtype(name, "float16") == dtype.torch_name


@pytest.mark.parametrize("name", ["int4", "fp8_e5m2"])
def test_an_unknown_kv_dtype_is_refused_naming_the_allowed_values(name: str) -> None:
    """Unknown, or known to SGLang but not stored by the QSA kernels (fp8 e5m2)."""
    with pytest.raises(CacheConfigError, match=rf"'{name}' is not known; allowed: 'auto', 'bf16'"):
        kv_storage_dtype(name, "bfloat16")


def test_digest_is_the_config_digest_of_the_payload_less_ignored_keys() -> None:
    """The payload's three parts; an ignored key changes nothing, any other key the digest."""
    hf = {"hidden_size": 8, "context_len": 4096}
    server = {"page_size": 64}
    digest = model_config_digest(hf, "bfloat16", server, ignored_keys=frozenset({"context_len"}))
    payload = {"hf_config": {"hidden_size": 8}, "model_dtype": "bfloat16", "server": server}
    assert digest == config_digest(payload)
    ignored = frozenset({"context_len"})
    assert digest == model_config_digest(
        {**hf, "context_len": 8}, "bfloat16", server, ignored_keys=ignored
    )
    assert digest != model_config_digest(hf, "float16", server, ignored_keys=ignored)
    assert digest != model_config_digest(hf, "bfloat16", {"page_size": 1}, ignored_keys=ignored)


def test_a_model_identity_joins_path_and_revision() -> None:
    from qsa_hostcache import CacheNamespace

    assert CacheNamespace.model_identity("org/model", "abc123") == "org/model@abc123"
    assert CacheNamespace.model_identity("org/model", None) == "org/model"
    assert CacheNamespace.model_identity("org/model", "") == "org/model"


_CONFIG = {"torch_dtype": "bfloat16", "hidden_size": 8, "context_len": 4096}


def test_model_namespace_composes_model_dtype_and_digest() -> None:
    """Model and revision, the K/V storage dtype, the digest of the config less ignored keys."""
    server = {"kv_cache_dtype": "fp8_e4m3", "page_size": 64}
    ns = model_namespace(
        _CONFIG,
        server,
        model_path="org/m",
        revision="abc",
        tp_size=2,
        tp_rank=1,
        ignored_keys=frozenset({"context_len"}),
    )
    assert ns == CacheNamespace(
        model="org/m@abc",
        dtype="float8_e4m3fn",
        tp_size=2,
        tp_rank=1,
        config_digest=model_config_digest(
            {"torch_dtype": "bfloat16", "hidden_size": 8}, "bfloat16", server
        ),
    )


def test_model_namespace_auto_kv_is_the_engine_dtype_over_the_config() -> None:
    """No ``kv_cache_dtype``: ``auto``; the engine's resolved dtype wins and joins the digest."""
    plain = model_namespace(_CONFIG, {}, model_path="m", revision=None, tp_size=1, tp_rank=0)
    forced = model_namespace(
        _CONFIG, {}, model_path="m", revision=None, tp_size=1, tp_rank=0, dtype="float16"
    )
    assert (plain.model, plain.dtype, forced.dtype) == ("m", "bfloat16", "float16")
    assert plain.config_digest != forced.config_digest
    assert plain.config_digest == model_config_digest(_CONFIG, None, {})


def test_model_namespace_refuses_no_model_path_unknown_kv_and_a_bad_rank() -> None:
    with pytest.raises(CacheConfigError, match=r"--model-path=None is not allowed"):
        model_namespace(_CONFIG, {}, model_path=None, revision=None, tp_size=1, tp_rank=0)
    with pytest.raises(CacheConfigError, match=r"--kv-cache-dtype='int4' is not known"):
        model_namespace(
            _CONFIG, {"kv_cache_dtype": "int4"}, model_path="m", revision=None, tp_size=1, tp_rank=0
        )
    with pytest.raises(InvalidKeyError, match="tp_rank"):
        model_namespace(_CONFIG, {}, model_path="m", revision=None, tp_size=2, tp_rank=2)
