"""A model's configuration as a namespace's parts: model dtype, K/V storage dtype, digest."""

from __future__ import annotations

import pytest

from qsa_core import KVDType
from qsa_hostcache import (
    CacheConfigError,
    config_digest,
    kv_storage_dtype,
    model_config_digest,
    model_dtype,
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
    for dtype in KVDType:
        for name in dtype.sglang_names:
            assert kv_storage_dtype(name, "float16") == dtype.torch_name


def test_an_unknown_kv_dtype_is_refused_naming_the_allowed_values() -> None:
    with pytest.raises(CacheConfigError, match=r"'int4' is not known; allowed: 'auto', "):
        kv_storage_dtype("int4", "bfloat16")


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
