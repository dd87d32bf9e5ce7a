"""SGLang server arguments and model config -> ``qsa_hostcache.CacheNamespace``.

Which fields change a checkpoint's bytes, and why: ``docs/plugin.md`` ("Namespace").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from qsa_sglang_plugin._errors import AdapterError

if TYPE_CHECKING:  # qsa_hostcache imports torch; the entry point must stay cheap
    from qsa_hostcache import CacheNamespace

__all__ = (
    "DIGEST_SERVER_FIELDS",
    "IGNORED_CONFIG_KEYS",
    "cache_namespace_from_sglang",
    "config_digest_from_sglang",
    "kv_storage_dtype",
    "resolved_args",
)

#: ``ServerArgs`` fields (resolved values) that change the bytes a checkpoint holds for given
#: tokens: storage layout, the weights loaded, the state dtype, kernels whose rounding carries.
DIGEST_SERVER_FIELDS: Final = (
    "page_size",
    "kv_cache_dtype",
    "dtype",
    "quantization",
    "quantization_param_path",
    "load_format",
    "mamba_ssm_dtype",
    "attention_backend",
    "prefill_attention_backend",
    "decode_attention_backend",
    "linear_attn_backend",
    "enable_deterministic_inference",
)

#: Keys SGLang writes into the HF config from flags that do not change the bytes
#: (``--context-length`` is copied to ``context_len``); dropped from the digest.
IGNORED_CONFIG_KEYS: Final = frozenset({"context_len"})


def resolved_args(server_args: Any) -> Any:
    """SGLang's ``resolving_view`` of ``server_args`` (values resolution decided); others as is."""
    if type(server_args).__module__.startswith("sglang."):
        from sglang.srt.arg_groups.model_override_base import resolving_view

        return resolving_view(server_args)
    return server_args


def _hf_config(model_or_hf_config: Any) -> dict[str, Any]:
    """The HF config of an SGLang ``ModelConfig``, of an HF config object, or a dict, as a dict."""
    hf_config = getattr(model_or_hf_config, "hf_config", model_or_hf_config)
    if hasattr(hf_config, "to_dict"):
        return dict(hf_config.to_dict())
    if isinstance(hf_config, dict):
        return dict(hf_config)
    msg = f"expected an SGLang ModelConfig, an HF config or a dict, got {type(hf_config)!r}"
    raise AdapterError(msg)


def _model_dtype(model_or_hf_config: Any) -> str:
    """``ModelConfig.dtype`` (SGLang's resolved ``--dtype``), else the HF config's."""
    from qsa_hostcache import HostCacheError, model_dtype

    dtype = getattr(model_or_hf_config, "dtype", None)
    if dtype is not None and getattr(model_or_hf_config, "hf_config", None) is not None:
        return str(dtype).removeprefix("torch.")
    try:
        return model_dtype(_hf_config(model_or_hf_config))
    except HostCacheError as exc:
        raise AdapterError(str(exc)) from exc


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """:func:`qsa_hostcache.kv_storage_dtype`, refusing by :class:`AdapterError`."""
    from qsa_hostcache import HostCacheError
    from qsa_hostcache import kv_storage_dtype as storage_dtype

    try:
        return storage_dtype(kv_cache_dtype, model_dtype)
    except HostCacheError as exc:
        raise AdapterError(str(exc)) from exc


def config_digest_from_sglang(server_args: Any, model_config: Any) -> str:
    """:func:`qsa_hostcache.model_config_digest` of the resolved :data:`DIGEST_SERVER_FIELDS`.

    Less :data:`IGNORED_CONFIG_KEYS`; the model dtype is SGLang's.
    """
    from qsa_hostcache import model_config_digest

    view = resolved_args(server_args)
    return model_config_digest(
        _hf_config(model_config),
        _model_dtype(model_config),
        {name: getattr(view, name, None) for name in DIGEST_SERVER_FIELDS},
        ignored_keys=IGNORED_CONFIG_KEYS,
    )


def cache_namespace_from_sglang(
    server_args: Any,
    model_config: Any,
    tp_rank: int,
    *,
    cache_salt: str | None = None,
    lora_id: str | None = None,
    extra_key: str | None = None,
) -> CacheNamespace:
    """The namespace of one TP rank (with the keywords, of one request's salt).

    ``model`` of ``--model-path`` and ``--revision``, ``dtype`` the K/V storage dtype, the digest
    :func:`config_digest_from_sglang`'s (``model_config``: SGLang's ``ModelConfig`` or an HF
    config).

    Raises:
        AdapterError: no model path, an unknown KV dtype or a config without a dtype.
        qsa_hostcache.InvalidKeyError: ``tp_rank`` outside ``[0, tp_size)``.
    """
    from qsa_hostcache import CacheNamespace

    view = resolved_args(server_args)
    model_path = getattr(view, "model_path", None)
    if not model_path:
        raise AdapterError(f"--model-path={model_path!r} is not allowed; allowed: a path or name")
    dtype = kv_storage_dtype(str(view.kv_cache_dtype), _model_dtype(model_config))
    return CacheNamespace(
        model=CacheNamespace.model_identity(str(model_path), getattr(view, "revision", None)),
        dtype=dtype,
        tp_size=int(view.tp_size),
        tp_rank=tp_rank,
        config_digest=config_digest_from_sglang(server_args, model_config),
    ).for_request(cache_salt=cache_salt, lora_id=lora_id, extra_key=extra_key)
