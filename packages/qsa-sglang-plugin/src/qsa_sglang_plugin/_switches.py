"""The operator's switches: ``SGLANG_QSA_*`` environment variables, parsed once.

This module imports nothing from SGLang, so a process with every switch unset pays nothing.
"""

from __future__ import annotations

import enum
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from qsa_sglang_plugin._errors import SwitchError

if TYPE_CHECKING:
    from qsa_hostcache import Admission, StoreAddress

__all__ = (
    "DS_ATTENTION_BACKEND",
    "ENV_ACTIVATION_DIR",
    "ENV_CACHE_SHARDING",
    "ENV_DS_CHANNEL_CONFIG",
    "ENV_DS_CHANNEL_TYPE",
    "ENV_DS_HEAVY_CHANNELS",
    "ENV_DS_HEAVY_TOKENS",
    "ENV_DS_OFFLOAD",
    "ENV_DS_OFFLOAD_STAGING",
    "ENV_DS_THRESHOLD",
    "ENV_HISPARSE_HOT_BLOCKS",
    "ENV_HISPARSE_V3",
    "ENV_HISPARSE_VERIFY",
    "ENV_INDEX_SHARDING",
    "ENV_MODEL_COMPAT",
    "ENV_PREFIX_CACHE_ADMIT",
    "ENV_PREFIX_CACHE_MAX_ENTRIES",
    "ENV_PREFIX_CACHE_MB",
    "ENV_PREFIX_CACHE_STORE",
    "ENV_SGLANG_PLUGINS",
    "PLUGIN_NAME",
    "RADIX_CACHE_BACKEND",
    "SWITCH_PREFIX",
    "DoubleSparsitySwitches",
    "Feature",
    "HiSparseMode",
    "Switches",
    "current_switches",
    "parse_switches",
)

#: What every switch's name starts with.
SWITCH_PREFIX: Final = "SGLANG_QSA_"
ENV_MODEL_COMPAT: Final = "SGLANG_QSA_MODEL_COMPAT"
ENV_HISPARSE_V3: Final = "SGLANG_QSA_HISPARSE_V3"
#: ``1``: keep a resident copy of the offloaded K/V and check the host arena against it (tests).
ENV_HISPARSE_VERIFY: Final = "SGLANG_QSA_HISPARSE_VERIFY"
ENV_PREFIX_CACHE_MB: Final = "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB"
ENV_PREFIX_CACHE_MAX_ENTRIES: Final = "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MAX_ENTRIES"
#: ``mooncake://HOST:PORT[?segment_mb=N]``: the host prefix cache's shared tier, Mooncake Store
#: with its master at ``HOST:PORT`` (checkpoints written through, and found there on a miss).
ENV_PREFIX_CACHE_STORE: Final = "SGLANG_QSA_HISPARSE_PREFIX_CACHE_STORE"
#: ``always`` (default) or ``second``: which prefixes the host prefix cache checkpoints
#: (``qsa_hostcache.Admission``: every one, or one the second time a request reaches it).
ENV_PREFIX_CACHE_ADMIT: Final = "SGLANG_QSA_HISPARSE_PREFIX_CACHE_ADMIT"
#: Hot-cache blocks per request and QSA layer with ``p2-offload`` (default: qsa-core's
#: ``hot_cache_slots``, four times the indexer's block top-k; at least the top-k).
ENV_HISPARSE_HOT_BLOCKS: Final = "SGLANG_QSA_HISPARSE_HOT_BLOCKS"
#: ``N`` > 1: the TP ranks holding copies of one K/V head store its offloaded K/V once, in shard
#: groups of ``N`` ranks (each rank's host arena holds every ``N``-th 16-block page).
ENV_CACHE_SHARDING: Final = "SGLANG_QSA_CACHE_SHARDING"
#: ``1``: the compressed QSA index sharded by 16-block page (D2), each rank storing and scoring
#: its pages: with ``SGLANG_QSA_CACHE_SHARDING=N`` over the same shard groups (resident or
#: offloaded), without it over every TP rank beside upstream's resident QSA backend.
ENV_INDEX_SHARDING: Final = "SGLANG_QSA_INDEX_SHARDING"
#: Double sparsity: the channel file (``qsa-hisparse calibrate`` writes it); setting it turns the
#: ``qsa_ds`` attention backend on. The others override the defaults of the library's
#: :class:`qsa_kernels.double_sparsity.DSConfig`.
ENV_DS_CHANNEL_CONFIG: Final = "SGLANG_QSA_DS_CHANNEL_CONFIG"
ENV_DS_HEAVY_CHANNELS: Final = "SGLANG_QSA_DS_HEAVY_CHANNELS"
ENV_DS_HEAVY_TOKENS: Final = "SGLANG_QSA_DS_HEAVY_TOKENS"
ENV_DS_CHANNEL_TYPE: Final = "SGLANG_QSA_DS_CHANNEL_TYPE"
ENV_DS_THRESHOLD: Final = "SGLANG_QSA_DS_THRESHOLD"
#: ``1``: DS-Offload, the attention layers' K/V history in pinned host memory (labels and hot
#: caches on the GPU), as ``p2-offload`` does for QSA layers.
ENV_DS_OFFLOAD: Final = "SGLANG_QSA_DS_OFFLOAD"
#: DS-Offload's prefill staging area: ``window`` (the default) holds a window of layers of the
#: prompt on the GPU (each chunk written through to the host arena, a layer's prefix read back
#: from there), ``whole`` the whole prompt of every layer.
ENV_DS_OFFLOAD_STAGING: Final = "SGLANG_QSA_DS_OFFLOAD_STAGING"
#: The attention backend double sparsity registers, the value ``--attention-backend`` takes.
DS_ATTENTION_BACKEND: Final = "qsa_ds"
#: Directory for per-process activation records; the launcher sets it.
ENV_ACTIVATION_DIR: Final = "SGLANG_QSA_HISPARSE_ACTIVATION_DIR"
#: SGLang's allow-list of general plugins (entry-point names, comma separated; empty = all).
ENV_SGLANG_PLUGINS: Final = "SGLANG_PLUGINS"
#: This plugin's entry-point name in the ``sglang.srt.plugins`` group.
PLUGIN_NAME: Final = "qsa_hisparse"
#: This plugin's radix-cache backend, the value ``--radix-cache-backend`` takes with offload.
RADIX_CACHE_BACKEND: Final = "qsa_hisparse"

#: Default retained-plus-pending checkpoint count per TP rank when the prefix cache is on.
DEFAULT_PREFIX_CACHE_MAX_ENTRIES: Final = 256
#: Largest prefix-cache budget per TP rank the parser accepts, in MiB (16 TiB): anything larger
#: is a typo (a byte count given as MiB), refused at start-up rather than by the allocator.
MAX_PREFIX_CACHE_MB: Final = 1 << 24
#: Largest prefix-cache entry count per TP rank the parser accepts.
MAX_PREFIX_CACHE_ENTRIES: Final = 1 << 20
#: Largest hot-cache block count the parser accepts (start-up then checks it against the model's
#: block top-k and the fetch kernel's limit).
MAX_HOT_BLOCKS_PARSED: Final = 1 << 24
#: Largest shard group the parser accepts (the start-up check then requires one that divides
#: the TP ranks holding one K/V head).
MAX_CACHE_SHARDING: Final = 64


class HiSparseMode(enum.StrEnum):
    """Values of ``SGLANG_QSA_HISPARSE_V3``."""

    P2_OFFLOAD = "p2-offload"
    """Raw K/V history of QSA layers in pinned host memory, a per-request GPU hot cache."""
    P2_RESIDENT = "p2-resident"
    """The same runtime with the history kept on the GPU (the comparison arm)."""


class Feature(enum.StrEnum):
    """A unit of hooks that is registered together; ``FRAMEWORK`` is on whenever any switch is."""

    FRAMEWORK = "framework"
    MODEL_COMPAT = "model_compat"
    HISPARSE = "hisparse"
    LIFECYCLE = "lifecycle"
    """The plugin's request lifecycle, on with any ``SGLANG_QSA_HISPARSE_V3`` mode or DS-Offload:
    the ``qsa_hisparse`` radix-cache backend (one lease per request), and with an offload the
    attention layers' one-page K/V pool."""
    PREFIX_CACHE = "prefix_cache"
    DOUBLE_SPARSITY = "double_sparsity"
    CACHE_SHARDING = "cache_sharding"
    """``SGLANG_QSA_CACHE_SHARDING`` > 1: the QSA layers' raw K/V sharded over the TP ranks of
    one K/V head, the offload's host arenas or, without an offload, a store on each rank (no
    hooks of its own: the backend of :attr:`QSA_BACKEND` shards)."""
    QSA_BACKEND = "qsa_backend"
    """The QSA layers attend through the plugin's subclass of upstream's QSA backend: the
    offload backend (``p2-offload``) or the sharded one (cache sharding without an offload)."""
    INDEX_SHARDING = "index_sharding"
    """``SGLANG_QSA_INDEX_SHARDING=1``: the compressed index sharded by page (D2): the indexer
    selects through the shard group's exact distributed top-k, compressed blocks are written by
    their page's owner only, and the index pool holds ``1 / N`` of its pages."""
    KV_POOL = "kv_pool"
    """The attention layers' raw K/V is held by the plugin, not SGLang's K/V pool (an offload,
    or cache sharding): that pool keeps its slots and one page of storage."""


@dataclass(frozen=True, slots=True)
class DoubleSparsitySwitches:
    """The ``SGLANG_QSA_DS_*`` switches, validated (the values the library's ``DSConfig`` takes).

    Attributes:
        channel_config: the channel file's path, as given.
        heavy_channel_num: heavy channels per KV head.
        heavy_token_num: tokens attended per (request, KV head).
        heavy_channel_type: ``q``, ``k`` or ``qk``.
        sparse_decode_threshold: contexts shorter than this decode densely.
        offload: DS-Offload (``SGLANG_QSA_DS_OFFLOAD=1``): the K/V history in pinned host memory.
        staging_window: DS-Offload stages a prompt by a window of layers
            (``SGLANG_QSA_DS_OFFLOAD_STAGING``, ``window`` by default; ``whole``: every layer).
    """

    channel_config: str
    heavy_channel_num: int
    heavy_token_num: int
    heavy_channel_type: str
    sparse_decode_threshold: int
    offload: bool = False
    staging_window: bool = True


@dataclass(frozen=True, slots=True)
class Switches:
    """Every switch, validated.

    Attributes:
        model_compat: ``SGLANG_QSA_MODEL_COMPAT=1``.
        hisparse: the ``SGLANG_QSA_HISPARSE_V3`` mode, or None when unset.
        prefix_cache_mb: host prefix-cache budget per TP rank in MiB (2**20 bytes); 0 = off.
        prefix_cache_max_entries: retained plus pending checkpoints per TP rank.
        verify_offload: ``SGLANG_QSA_HISPARSE_VERIFY=1`` (with an offload only): a resident copy
            of every offloaded token's K/V on the GPU, compared byte for byte with the host arena
            and tail when the request gives its row back. A diagnostic that costs the GPU
            memory offload saves.
        cache_sharding: ``SGLANG_QSA_CACHE_SHARDING``: ranks per shard group (1 = off; with
            ``p2-offload`` or with no ``SGLANG_QSA_HISPARSE_V3`` mode, resident).
        hot_blocks: ``SGLANG_QSA_HISPARSE_HOT_BLOCKS``: hot-cache blocks per request and QSA
            layer, or None for the default (with ``p2-offload`` only).
        index_sharding: ``SGLANG_QSA_INDEX_SHARDING=1``: the compressed index sharded by page
            (D2) over the cache-sharding groups (resident or with ``p2-offload``), or without
            cache sharding over every TP rank beside upstream's resident QSA backend (with the
            prefix cache too).
        prefix_cache_store: ``SGLANG_QSA_HISPARSE_PREFIX_CACHE_STORE``: the prefix cache's
            shared tier, or None (with the prefix cache only).
        prefix_cache_admission: ``SGLANG_QSA_HISPARSE_PREFIX_CACHE_ADMIT``: which prefixes the
            prefix cache checkpoints, or None for ``Admission.ALWAYS`` (with the prefix cache
            only).
    """

    model_compat: bool = False
    hisparse: HiSparseMode | None = None
    verify_offload: bool = False
    prefix_cache_mb: int = 0
    prefix_cache_max_entries: int = DEFAULT_PREFIX_CACHE_MAX_ENTRIES
    double_sparsity: DoubleSparsitySwitches | None = None
    cache_sharding: int = 1
    hot_blocks: int | None = None
    index_sharding: bool = False
    prefix_cache_store: StoreAddress | None = None
    prefix_cache_admission: Admission | None = None

    @property
    def any_on(self) -> bool:
        """True when at least one feature is requested."""
        return (
            self.model_compat
            or self.hisparse is not None
            or self.prefix_cache_mb > 0
            or self.double_sparsity is not None
            or self.cache_sharding > 1
            or self.index_sharding
        )

    @property
    def offload(self) -> bool:
        """The K/V history lives in host memory: ``p2-offload`` (QSA) or DS-Offload."""
        return self.hisparse is HiSparseMode.P2_OFFLOAD or (
            self.double_sparsity is not None and self.double_sparsity.offload
        )

    @property
    def resident_sharding(self) -> bool:
        """Cache sharding without an offload: each rank stores its share of the raw K/V."""
        return self.cache_sharding > 1 and self.hisparse is None

    @property
    def index_sharding_alone(self) -> bool:
        """D2 without D1: the index sharded by page over every TP rank, the raw K/V unsharded."""
        return self.index_sharding and self.cache_sharding == 1

    @property
    def plugin_holds_raw_kv(self) -> bool:
        """The attention layers' raw K/V is outside SGLang's pool: an offload, or sharded."""
        return self.offload or self.resident_sharding

    @property
    def prefix_cache_bytes(self) -> int:
        """Prefix-cache budget per TP rank in bytes (0 when off)."""
        return self.prefix_cache_mb * (1 << 20)

    @property
    def features(self) -> tuple[Feature, ...]:
        """Requested features in declaration order; empty when every switch is off."""
        if not self.any_on:
            return ()
        out = [Feature.FRAMEWORK]
        if self.model_compat:
            out.append(Feature.MODEL_COMPAT)
        if self.hisparse is not None:
            out.append(Feature.HISPARSE)
        if self.hisparse is not None or self.offload:
            out.append(Feature.LIFECYCLE)
        if self.prefix_cache_mb > 0:
            out.append(Feature.PREFIX_CACHE)
        if self.double_sparsity is not None:
            out.append(Feature.DOUBLE_SPARSITY)
        if self.cache_sharding > 1:
            out.append(Feature.CACHE_SHARDING)
        if self.index_sharding:
            out.append(Feature.INDEX_SHARDING)
        if self.hisparse is HiSparseMode.P2_OFFLOAD or self.resident_sharding:
            out.append(Feature.QSA_BACKEND)
        if self.plugin_holds_raw_kv:
            out.append(Feature.KV_POOL)
        return tuple(out)


def _positive_int(name: str, raw: str, *, zero_allowed: bool, maximum: int) -> int:
    text = raw.strip()
    allowed = (
        f"0 (off) or a positive integer up to {maximum}"
        if zero_allowed
        else f"a positive integer up to {maximum}"
    )
    # Leading zeros stripped and the digits counted before int(): CPython refuses to convert
    # more than 4,300 digits with a ValueError, which would not name the switch.
    digits = text.lstrip("0") if text.isascii() and text.isdigit() else None
    value = int(digits or "0") if digits is not None and len(digits) <= len(str(maximum)) else -1
    if value < 0 or (value == 0 and not zero_allowed) or value > maximum:
        shown = raw if len(raw) <= 40 else f"{raw[:20]}...{raw[-10:]} ({len(raw)} characters)"
        msg = f"{name}={shown!r} is not allowed; allowed: unset, or {allowed}"
        raise SwitchError(msg)
    return value


def _require_offload(what: str, hisparse: HiSparseMode | None, raw_mode: str) -> None:
    """Refuse ``what`` (a switch and its value) unless ``SGLANG_QSA_HISPARSE_V3=p2-offload``."""
    if hisparse is not HiSparseMode.P2_OFFLOAD:
        msg = (
            f"{what} requires {ENV_HISPARSE_V3}={HiSparseMode.P2_OFFLOAD.value!r}, "
            f"got {ENV_HISPARSE_V3}={raw_mode!r}"
        )
        raise SwitchError(msg)


def parse_switches(environ: Mapping[str, str]) -> Switches:
    """Parse and cross-check every switch from ``environ``.

    An empty string counts as unset.

    Raises:
        SwitchError: a value is malformed, or ``SGLANG_QSA_HISPARSE_V3`` is set without
            ``SGLANG_QSA_MODEL_COMPAT=1``, or the prefix cache, cache sharding or a hot-cache
            size is set without ``SGLANG_QSA_HISPARSE_V3=p2-offload``, or a shared tier without
            the prefix cache. The message names the
            variable, its value and what is allowed.
    """
    raw_compat = environ.get(ENV_MODEL_COMPAT, "")
    if raw_compat not in ("", "0", "1"):
        msg = f"{ENV_MODEL_COMPAT}={raw_compat!r} is not allowed; allowed: unset, '0', '1'"
        raise SwitchError(msg)
    model_compat = raw_compat == "1"

    raw_mode = environ.get(ENV_HISPARSE_V3, "")
    hisparse: HiSparseMode | None = None
    if raw_mode:
        try:
            hisparse = HiSparseMode(raw_mode)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in HiSparseMode)
            msg = f"{ENV_HISPARSE_V3}={raw_mode!r} is not allowed; allowed: unset, {allowed}"
            raise SwitchError(msg) from None
        if not model_compat:
            msg = (
                f"{ENV_HISPARSE_V3}={raw_mode!r} requires {ENV_MODEL_COMPAT}='1', "
                f"got {ENV_MODEL_COMPAT}={raw_compat!r}"
            )
            raise SwitchError(msg)

    raw_mb = environ.get(ENV_PREFIX_CACHE_MB, "")
    prefix_cache_mb = (
        _positive_int(ENV_PREFIX_CACHE_MB, raw_mb, zero_allowed=True, maximum=MAX_PREFIX_CACHE_MB)
        if raw_mb
        else 0
    )
    raw_entries = environ.get(ENV_PREFIX_CACHE_MAX_ENTRIES, "")
    max_entries = (
        _positive_int(
            ENV_PREFIX_CACHE_MAX_ENTRIES,
            raw_entries,
            zero_allowed=False,
            maximum=MAX_PREFIX_CACHE_ENTRIES,
        )
        if raw_entries
        else DEFAULT_PREFIX_CACHE_MAX_ENTRIES
    )
    raw_verify = environ.get(ENV_HISPARSE_VERIFY, "")
    if raw_verify not in ("", "0", "1"):
        msg = f"{ENV_HISPARSE_VERIFY}={raw_verify!r} is not allowed; allowed: unset, '0', '1'"
        raise SwitchError(msg)
    verify_offload = raw_verify == "1"
    if prefix_cache_mb > 0:
        # Resident QSA has upstream's HiCache for host prefix caching; this one checkpoints
        # the offload staging area.
        _require_offload(f"{ENV_PREFIX_CACHE_MB}={raw_mb!r}", hisparse, raw_mode)
    double_sparsity = _parse_double_sparsity(environ)
    if double_sparsity is not None and (model_compat or hisparse is not None):
        # Double sparsity serves models without QSA layers; the QSA switches serve QSA models.
        msg = (
            f"{ENV_DS_CHANNEL_CONFIG}={double_sparsity.channel_config!r} serves models without "
            f"QSA layers and cannot be combined with {ENV_MODEL_COMPAT}={raw_compat!r} or "
            f"{ENV_HISPARSE_V3}={raw_mode!r}; unset one side"
        )
        raise SwitchError(msg)
    ds_offload = double_sparsity is not None and double_sparsity.offload
    if verify_offload and not (hisparse is HiSparseMode.P2_OFFLOAD or ds_offload):
        msg = (
            f"{ENV_HISPARSE_VERIFY}='1' checks the offload and requires "
            f"{ENV_HISPARSE_V3}={HiSparseMode.P2_OFFLOAD.value!r} or {ENV_DS_OFFLOAD}='1', "
            f"got {ENV_HISPARSE_V3}={raw_mode!r}"
        )
        raise SwitchError(msg)
    raw_sharding = environ.get(ENV_CACHE_SHARDING, "")
    cache_sharding = (
        _positive_int(
            ENV_CACHE_SHARDING, raw_sharding, zero_allowed=False, maximum=MAX_CACHE_SHARDING
        )
        if raw_sharding
        else 1
    )
    if cache_sharding > 1 and hisparse not in (None, HiSparseMode.P2_OFFLOAD):
        # Shards are the offload's host arenas, or each rank's store of the resident K/V.
        msg = (
            f"{ENV_CACHE_SHARDING}={raw_sharding!r} shards the offloaded or the resident QSA K/V "
            f"and requires {ENV_HISPARSE_V3} unset or {HiSparseMode.P2_OFFLOAD.value!r}, got "
            f"{ENV_HISPARSE_V3}={raw_mode!r}"
        )
        raise SwitchError(msg)
    if cache_sharding > 1 and double_sparsity is not None:
        msg = (
            f"{ENV_CACHE_SHARDING}={raw_sharding!r} shards QSA layers; {ENV_DS_CHANNEL_CONFIG}="
            f"{double_sparsity.channel_config!r} serves models without them; unset one side"
        )
        raise SwitchError(msg)
    index_sharding = _parse_index_sharding(environ, cache_sharding, hisparse)
    if index_sharding and double_sparsity is not None:
        msg = (
            f"{ENV_INDEX_SHARDING}='1' shards the QSA index; {ENV_DS_CHANNEL_CONFIG}="
            f"{double_sparsity.channel_config!r} serves models without one; unset one side"
        )
        raise SwitchError(msg)
    raw_hot = environ.get(ENV_HISPARSE_HOT_BLOCKS, "")
    hot_blocks = None
    if raw_hot:
        hot_blocks = _positive_int(
            ENV_HISPARSE_HOT_BLOCKS, raw_hot, zero_allowed=False, maximum=MAX_HOT_BLOCKS_PARSED
        )
        _require_offload(f"{ENV_HISPARSE_HOT_BLOCKS}={raw_hot!r}", hisparse, raw_mode)
    store = _parse_store(environ, prefix_cache_mb, raw_mb)
    admission = _parse_admission(environ, prefix_cache_mb, raw_mb)
    # Last: it makes the directory, and a refused call changes nothing.
    _check_store_usable(store, environ.get(ENV_PREFIX_CACHE_STORE, ""))
    return Switches(
        model_compat=model_compat,
        hisparse=hisparse,
        verify_offload=verify_offload,
        prefix_cache_mb=prefix_cache_mb,
        prefix_cache_max_entries=max_entries,
        double_sparsity=double_sparsity,
        cache_sharding=cache_sharding,
        hot_blocks=hot_blocks,
        index_sharding=index_sharding,
        prefix_cache_store=store,
        prefix_cache_admission=admission,
    )


def _require_prefix_cache(switch: str, raw: str, prefix_cache_mb: int, raw_mb: str) -> None:
    """Refuse ``switch`` (set to ``raw``), a part of the prefix cache, without the prefix cache."""
    if prefix_cache_mb == 0:
        msg = (
            f"{switch}={raw!r} is a part of the prefix cache and requires "
            f"{ENV_PREFIX_CACHE_MB} > 0, got {ENV_PREFIX_CACHE_MB}={raw_mb!r}"
        )
        raise SwitchError(msg)


def _parse_store(
    environ: Mapping[str, str], prefix_cache_mb: int, raw_mb: str
) -> StoreAddress | None:
    """``SGLANG_QSA_HISPARSE_PREFIX_CACHE_STORE``: the prefix cache's shared tier (parsed only)."""
    raw = environ.get(ENV_PREFIX_CACHE_STORE, "")
    if not raw:
        return None
    from qsa_hostcache import CacheConfigError, parse_store_address

    try:
        store = parse_store_address(raw)
    except CacheConfigError as exc:
        msg = f"{ENV_PREFIX_CACHE_STORE}={raw!r} is not allowed: {exc}"
        raise SwitchError(msg) from None
    _require_prefix_cache(ENV_PREFIX_CACHE_STORE, raw, prefix_cache_mb, raw_mb)
    return store


def _check_store_usable(store: StoreAddress | None, raw: str) -> None:
    """A disk tier's directory made and written once (:meth:`DiskAddress.check_usable`).

    Raises:
        SwitchError: it cannot be; the message names the switch, the directory and the error.
    """
    from qsa_hostcache import CacheConfigError, DiskAddress

    if not isinstance(store, DiskAddress):
        return
    try:
        store.check_usable()
    except CacheConfigError as exc:
        raise SwitchError(f"{ENV_PREFIX_CACHE_STORE}={raw!r} is not allowed: {exc}") from None


def _parse_admission(
    environ: Mapping[str, str], prefix_cache_mb: int, raw_mb: str
) -> Admission | None:
    """``SGLANG_QSA_HISPARSE_PREFIX_CACHE_ADMIT``: a policy of the prefix cache, which it needs."""
    raw = environ.get(ENV_PREFIX_CACHE_ADMIT, "")
    if not raw:
        return None
    from qsa_hostcache import Admission

    try:
        admission = Admission(raw)
    except ValueError:
        allowed = ", ".join(repr(a.value) for a in Admission)
        msg = f"{ENV_PREFIX_CACHE_ADMIT}={raw!r} is not allowed; allowed: unset, {allowed}"
        raise SwitchError(msg) from None
    _require_prefix_cache(ENV_PREFIX_CACHE_ADMIT, raw, prefix_cache_mb, raw_mb)
    return admission


def _parse_index_sharding(
    environ: Mapping[str, str], cache_sharding: int, hisparse: HiSparseMode | None
) -> bool:
    """``SGLANG_QSA_INDEX_SHARDING``: D2 on D1's groups, or alone over every TP rank.

    With cache sharding (D1, resident or offloaded) D2 uses its shard groups; without it, every
    TP rank, beside upstream's resident QSA backend or the offload's (``p2-offload``; not
    ``p2-resident``, the comparison arm). The host prefix cache (``p2-offload``) composes with
    it: a checkpoint reads the whole index through the rank's shard and a restore writes back
    the rank's pages (``qsa_kernels.sharded.ShardedIndexAccess``).
    """
    raw = environ.get(ENV_INDEX_SHARDING, "")
    if raw not in ("", "0", "1"):
        msg = f"{ENV_INDEX_SHARDING}={raw!r} is not allowed; allowed: unset, '0', '1'"
        raise SwitchError(msg)
    if raw != "1":
        return False
    if cache_sharding < 2 and hisparse is HiSparseMode.P2_RESIDENT:
        msg = (
            f"{ENV_INDEX_SHARDING}='1' without cache sharding ({ENV_CACHE_SHARDING}="
            f"{environ.get(ENV_CACHE_SHARDING, '')!r}) shards the index beside upstream's "
            f"resident QSA backend or the offload's, not {ENV_HISPARSE_V3}="
            f"{hisparse.value!r}; allowed: {ENV_HISPARSE_V3} unset or "
            f"{HiSparseMode.P2_OFFLOAD.value!r}, or {ENV_CACHE_SHARDING} of 2 or more"
        )
        raise SwitchError(msg)
    return True


#: Largest heavy channel / token count and threshold the parser accepts.
_MAX_DS_VALUE: Final = 1 << 24


def _parse_double_sparsity(environ: Mapping[str, str]) -> DoubleSparsitySwitches | None:
    """The ``SGLANG_QSA_DS_*`` switches, or None when the channel file is not set.

    The defaults and the allowed channel types are the library's (imported only when a
    ``SGLANG_QSA_DS_*`` variable is set).
    """
    names = (
        ENV_DS_HEAVY_CHANNELS,
        ENV_DS_HEAVY_TOKENS,
        ENV_DS_CHANNEL_TYPE,
        ENV_DS_THRESHOLD,
        ENV_DS_OFFLOAD,
        ENV_DS_OFFLOAD_STAGING,
    )
    path = environ.get(ENV_DS_CHANNEL_CONFIG, "")
    if not path:
        stray = [n for n in names if environ.get(n, "")]
        if stray:
            msg = (
                f"{', '.join(stray)} set without {ENV_DS_CHANNEL_CONFIG}; set the channel file too"
            )
            raise SwitchError(msg)
        return None
    from qsa_kernels.double_sparsity import DSConfig, HeavyChannelType

    defaults = DSConfig()

    def number(name: str, default: int, *, zero_allowed: bool) -> int:
        raw = environ.get(name, "")
        if not raw:
            return default
        return _positive_int(name, raw, zero_allowed=zero_allowed, maximum=_MAX_DS_VALUE)

    raw_type = environ.get(ENV_DS_CHANNEL_TYPE, "") or defaults.heavy_channel_type.value
    allowed_types = [t.value for t in HeavyChannelType]
    if raw_type not in allowed_types:
        msg = (
            f"{ENV_DS_CHANNEL_TYPE}={raw_type!r} is not allowed; allowed: unset, "
            f"{', '.join(repr(t) for t in allowed_types)}"
        )
        raise SwitchError(msg)
    raw_offload = environ.get(ENV_DS_OFFLOAD, "")
    if raw_offload not in ("", "0", "1"):
        msg = f"{ENV_DS_OFFLOAD}={raw_offload!r} is not allowed; allowed: unset, '0', '1'"
        raise SwitchError(msg)
    raw_staging = environ.get(ENV_DS_OFFLOAD_STAGING, "")
    if raw_staging not in ("", "window", "whole"):
        msg = (
            f"{ENV_DS_OFFLOAD_STAGING}={raw_staging!r} is not allowed; allowed: unset, 'window', "
            "'whole'"
        )
        raise SwitchError(msg)
    if raw_staging and raw_offload != "1":
        msg = f"{ENV_DS_OFFLOAD_STAGING} set without {ENV_DS_OFFLOAD}='1'; it stages DS-Offload's"
        raise SwitchError(msg + " prompts")
    return DoubleSparsitySwitches(
        channel_config=path,
        heavy_channel_num=number(
            ENV_DS_HEAVY_CHANNELS, defaults.heavy_channel_num, zero_allowed=False
        ),
        heavy_token_num=number(ENV_DS_HEAVY_TOKENS, defaults.heavy_token_num, zero_allowed=False),
        heavy_channel_type=raw_type,
        sparse_decode_threshold=number(
            ENV_DS_THRESHOLD, defaults.sparse_decode_threshold, zero_allowed=True
        ),
        offload=raw_offload == "1",
        staging_window=raw_staging != "whole",
    )


@functools.cache
def current_switches() -> Switches:
    """The switches of this process, parsed from ``os.environ`` on first call and then fixed."""
    return parse_switches(os.environ)
