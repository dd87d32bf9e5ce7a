"""A model's configuration as a namespace's parts: its dtype, the K/V dtype, the config digest.

An engine reads its own objects (server arguments, model config) into plain values and calls
these; which engine settings change a checkpoint's bytes is the engine adapter's list.
"""

from __future__ import annotations

from collections.abc import Mapping

from qsa_core import KVDType
from qsa_hostcache._errors import CacheConfigError
from qsa_hostcache._keys import CacheNamespace, config_digest

__all__ = ("kv_storage_dtype", "model_config_digest", "model_dtype", "model_namespace")


def model_dtype(hf_config: Mapping[str, object]) -> str:
    """The dtype an HF config names, as torch names it (``torch.`` dropped): ``"bfloat16"``.

    ``torch_dtype`` (or ``dtype``) of the config, else of its ``text_config`` (a multimodal
    model's).

    Raises:
        CacheConfigError: neither names one (``auto`` has nothing to resolve to).
    """
    dtype = hf_config.get("torch_dtype") or hf_config.get("dtype")
    text = hf_config.get("text_config")
    if dtype is None and isinstance(text, Mapping):
        dtype = text.get("torch_dtype") or text.get("dtype")
    if dtype is None:
        msg = "the model config names no dtype (torch_dtype); cannot resolve --kv-cache-dtype auto"
        raise CacheConfigError(msg)
    return str(dtype).removeprefix("torch.")


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The K/V storage dtype as torch names it (``auto``: ``model_dtype``).

    Any other ``kv_cache_dtype`` (case and spaces ignored) names a :class:`qsa_core.KVDType`.

    Raises:
        CacheConfigError: a value not in :meth:`qsa_core.KVDType.sglang_flag_values`.
    """
    key = str(kv_cache_dtype).strip().lower()
    if key == "auto":
        return model_dtype
    for dtype in KVDType:
        if key in dtype.sglang_names:
            return dtype.torch_name
    allowed = ", ".join(repr(k) for k in KVDType.sglang_flag_values())
    msg = f"--kv-cache-dtype={kv_cache_dtype!r} is not known; allowed: {allowed}"
    raise CacheConfigError(msg)


def model_config_digest(
    hf_config: Mapping[str, object],
    dtype: str | None,
    server: Mapping[str, object],
    *,
    ignored_keys: frozenset[str] = frozenset(),
) -> str:
    """:func:`config_digest` of a model's HF config, the dtype it runs in and engine settings.

    The payload is ``{"hf_config": hf_config less ignored_keys, "model_dtype": dtype, "server":
    server}``: ``dtype`` the model dtype the engine resolved (None: :func:`model_dtype` of the
    config), ``server`` the settings that change the bytes computed for given tokens (storage
    layout, weights, kernels), ``ignored_keys`` config keys an engine writes that do not.

    Raises:
        CacheConfigError: ``dtype`` is None and the config names none.
    """
    payload = {
        "hf_config": {k: v for k, v in hf_config.items() if k not in ignored_keys},
        "model_dtype": model_dtype(hf_config) if dtype is None else dtype,
        "server": dict(server),
    }
    return config_digest(payload)


def model_namespace(
    hf_config: Mapping[str, object],
    server: Mapping[str, object],
    *,
    model_path: str | None,
    revision: str | None,
    tp_size: int,
    tp_rank: int,
    dtype: str | None = None,
    ignored_keys: frozenset[str] = frozenset(),
) -> CacheNamespace:
    """The namespace of one tensor-parallel rank of a model the engine serves.

    ``model`` is :meth:`CacheNamespace.model_identity` of ``model_path`` and ``revision``;
    ``dtype`` the K/V storage dtype (:func:`kv_storage_dtype` of ``server["kv_cache_dtype"]``,
    ``auto`` when absent); the digest :func:`model_config_digest` of ``hf_config`` (less
    ``ignored_keys``), the model dtype and ``server``.

    Args:
        hf_config: the model's HF config as a dict.
        server: the engine settings that change a checkpoint's bytes, by name (resolved values).
        model_path: the model's path or hub name.
        revision: the hub revision, if any.
        tp_size: tensor-parallel ranks.
        tp_rank: this rank, in ``[0, tp_size)``.
        dtype: the model dtype the engine resolved (None: :func:`model_dtype` of ``hf_config``).
        ignored_keys: config keys the engine writes that do not change the bytes.

    Raises:
        CacheConfigError: no model path, an unknown K/V dtype, or no dtype to resolve.
        InvalidKeyError: ``tp_rank`` outside ``[0, tp_size)``.
    """
    if not model_path:
        raise CacheConfigError(
            f"--model-path={model_path!r} is not allowed; allowed: a path or name"
        )
    resolved = model_dtype(hf_config) if dtype is None else dtype
    return CacheNamespace(
        model=CacheNamespace.model_identity(str(model_path), revision),
        dtype=kv_storage_dtype(str(server.get("kv_cache_dtype", "auto")), resolved),
        tp_size=tp_size,
        tp_rank=tp_rank,
        config_digest=model_config_digest(hf_config, resolved, server, ignored_keys=ignored_keys),
    )
