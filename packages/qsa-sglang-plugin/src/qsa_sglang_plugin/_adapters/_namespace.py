"""SGLang server arguments and model config -> ``qsa_hostcache.CacheNamespace``.

Which fields change a checkpoint's bytes, and why: ``docs/plugin.md`` ("Namespace").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

from qsa_sglang_plugin._errors import AdapterError

if TYPE_CHECKING:  # qsa_hostcache imports torch; the entry point must stay cheap
    from qsa_hostcache import CacheNamespace

__all__ = (
    "DIGEST_SERVER_FIELDS",
    "IGNORED_CONFIG_KEYS",
    "cache_namespace_from_sglang",
    "config_digest_from_sglang",
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


def _server(server_args: Any) -> dict[str, Any]:
    """The resolved :data:`DIGEST_SERVER_FIELDS` of ``server_args`` (absent: None)."""
    view = resolved_args(server_args)
    return {name: getattr(view, name, None) for name in DIGEST_SERVER_FIELDS}


def _engine_dtype(model_config: Any) -> str | None:
    """``ModelConfig.dtype`` (SGLang's resolved ``--dtype``); None for an HF config or a dict."""
    dtype = getattr(model_config, "dtype", None)
    if dtype is None or getattr(model_config, "hf_config", None) is None:
        return None
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def _refusing() -> Iterator[None]:
    """A ``qsa_hostcache.CacheConfigError`` inside raised as :class:`AdapterError`."""
    from qsa_hostcache import CacheConfigError

    try:
        yield
    except CacheConfigError as exc:
        raise AdapterError(str(exc)) from exc


def config_digest_from_sglang(server_args: Any, model_config: Any) -> str:
    """:func:`qsa_hostcache.model_config_digest` of the resolved :data:`DIGEST_SERVER_FIELDS`.

    Less :data:`IGNORED_CONFIG_KEYS`; the model dtype is SGLang's.
    """
    from qsa_hostcache import model_config_digest

    hf_config, dtype = _hf_config(model_config), _engine_dtype(model_config)
    with _refusing():
        return model_config_digest(
            hf_config, dtype, _server(server_args), ignored_keys=IGNORED_CONFIG_KEYS
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
    """:func:`qsa_hostcache.model_namespace` of one TP rank (with the keywords, of one request).

    ``model`` of ``--model-path`` and ``--revision``, ``dtype`` the K/V storage dtype, the digest
    :func:`config_digest_from_sglang`'s (``model_config``: SGLang's ``ModelConfig`` or an HF
    config).

    Raises:
        AdapterError: no model path, an unknown KV dtype or a config without a dtype.
        qsa_hostcache.InvalidKeyError: ``tp_rank`` outside ``[0, tp_size)``.
    """
    from qsa_hostcache import model_namespace

    view = resolved_args(server_args)
    with _refusing():
        namespace = model_namespace(
            _hf_config(model_config),
            _server(view),
            model_path=getattr(view, "model_path", None),
            revision=getattr(view, "revision", None),
            tp_size=int(view.tp_size),
            tp_rank=tp_rank,
            dtype=_engine_dtype(model_config),
            ignored_keys=IGNORED_CONFIG_KEYS,
        )
    return namespace.for_request(cache_salt=cache_salt, lora_id=lora_id, extra_key=extra_key)
