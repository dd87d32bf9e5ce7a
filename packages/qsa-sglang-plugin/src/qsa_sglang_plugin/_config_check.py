"""The supported configuration: a thin adapter from SGLang's resolved ServerArgs to the rules.

Model geometry rules live in ``qsa_core`` (:meth:`qsa_core.QSAProfile.from_text_config`); this
module only gathers the facts from SGLang (:class:`ConfigFacts`) and applies the serving rules
that the requested features need (:func:`check_configuration`). Each rejection names the flag,
the value found and the supported values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from qsa_core import (
    QWEN38_FLASH_NEXT,
    CapacityError,
    KVDType,
    LabelledCapacity,
    PlacementError,
    QSAConfigError,
    QSAProfile,
    ShardPlacement,
    hot_cache_slots,
)
from qsa_sglang_plugin._errors import AdapterError, ConfigurationError

if TYPE_CHECKING:
    from qsa_kernels.double_sparsity import AttentionGeometry
from qsa_sglang_plugin._switches import (
    DS_ATTENTION_BACKEND,
    ENV_CACHE_SHARDING,
    ENV_DS_CHANNEL_CONFIG,
    ENV_HISPARSE_HOT_BLOCKS,
    ENV_INDEX_SHARDING,
    RADIX_CACHE_BACKEND,
    DoubleSparsitySwitches,
    Feature,
    HiSparseMode,
    Switches,
    current_switches,
)

__all__ = (
    "SUPPORTED_ARCHITECTURE",
    "SUPPORTED_KV_CACHE_DTYPES",
    "SUPPORTED_PAGE_SIZE",
    "ConfigFacts",
    "after_resolve_once",
    "check_configuration",
    "ds_capacity",
    "facts_from_server_args",
)

SUPPORTED_ARCHITECTURE: Final = "Qwen4ExpForConditionalGeneration"
#: The page size of the compressed-index pages the kernels address (qsa-core's, 64 tokens).
SUPPORTED_PAGE_SIZE: Final = QWEN38_FLASH_NEXT.page_size
#: ``--kv-cache-dtype`` values the QSA kernels take (qsa-core's :class:`~qsa_core.KVDType`);
#: ``auto`` only with a bfloat16 checkpoint.
SUPPORTED_KV_CACHE_DTYPES: Final = KVDType.sglang_flag_values()


@dataclass(frozen=True, slots=True)
class ConfigFacts:
    """The resolved settings the rules read, copied out of SGLang's ServerArgs.

    Attributes:
        architectures: ``architectures`` of the checkpoint config.
        text_config: the checkpoint's text config as a plain mapping.
        model_dtype: the model dtype as torch spells it without the prefix (``"bfloat16"``).
        page_size: ``--page-size`` after resolution, in tokens.
        kv_cache_dtype: ``--kv-cache-dtype``.
        pp_size: ``--pp-size``.
        dp_size: ``--dp-size``.
        attn_dp_size: ``--attn-dp-size``.
        speculative_algorithm: ``--speculative-algorithm`` (None = off).
        disaggregation_mode: ``--disaggregation-mode``.
        enable_hisparse: ``--enable-hisparse`` (upstream HiSparse).
        enable_hierarchical_cache: ``--enable-hierarchical-cache`` (upstream HiCache).
        disable_overlap_schedule: ``--disable-overlap-schedule``.
        enable_mixed_chunk: ``--enable-mixed-chunk``.
        disable_radix_cache: ``--disable-radix-cache``.
        radix_cache_backend: ``--radix-cache-backend`` (None = SGLang's default tree cache).
        prefill_graph_backend: the prefill CUDA graph backend SGLang resolved (``disabled``,
            ``breakable``, ``full``); ``disabled`` off CUDA.
        max_running_requests: ``--max-running-requests`` (None = SGLang sizes it).
        prefill_max_requests: ``--prefill-max-requests`` (None = no limit).
        chunked_prefill_size: ``--chunked-prefill-size`` after resolution (None or <= 0 = no
            chunking).
        attention_backend: ``--attention-backend`` after resolution (None = SGLang chooses).
        tp_size: ``--tp-size``.
        enable_prefill_cp: ``--enable-prefill-cp`` (context-parallel prefill).
        attn_cp_size: ``--attn-cp-size`` after resolution (attention CP ranks; SGLang's QSA
            prefill CP takes the whole TP group).
        enable_cp_decode_attn_tp: ``--enable-cp-decode-attn-tp`` (decode slices the attention
            heads over the CP ranks).
        device: ``--device`` after resolution (``cuda``, ``cpu``...).
    """

    architectures: tuple[str, ...]
    text_config: Mapping[str, Any] = field(repr=False)
    model_dtype: str
    page_size: int
    kv_cache_dtype: str
    pp_size: int = 1
    dp_size: int = 1
    attn_dp_size: int = 1
    speculative_algorithm: str | None = None
    disaggregation_mode: str = "null"
    enable_hisparse: bool = False
    enable_hierarchical_cache: bool = False
    disable_overlap_schedule: bool = True
    enable_mixed_chunk: bool = False
    disable_radix_cache: bool = True
    radix_cache_backend: str | None = RADIX_CACHE_BACKEND
    prefill_graph_backend: str = "disabled"
    max_running_requests: int | None = 8
    prefill_max_requests: int | None = 1
    chunked_prefill_size: int | None = None
    attention_backend: str | None = None
    tp_size: int = 1
    enable_prefill_cp: bool = False
    attn_cp_size: int = 1
    enable_cp_decode_attn_tp: bool = False
    device: str = "cuda"


#: The features that serve a QSA checkpoint (double sparsity serves models without QSA layers).
_QSA_FEATURES: Final = frozenset(
    {
        Feature.MODEL_COMPAT,
        Feature.HISPARSE,
        Feature.PREFIX_CACHE,
        Feature.CACHE_SHARDING,
        Feature.INDEX_SHARDING,
    }
)


def _reject(flag: str, value: object, supported: str, why: str) -> ConfigurationError:
    return ConfigurationError(f"{flag}={value!r} is not supported ({why}); supported: {supported}")


def check_configuration(facts: ConfigFacts, switches: Switches) -> QSAProfile | None:
    """Apply every rule of the requested features; the first violation raises.

    Rules for every feature: the architecture is ``Qwen4ExpForConditionalGeneration``; page
    size 64; a valid QSA profile (parsed by qsa-core); KV dtype bf16 or fp8_e4m3. Extra rules
    when ``SGLANG_QSA_HISPARSE_V3`` is set: one pipeline stage, no data-parallel replicas or
    attention DP, no speculative decoding, no PD disaggregation, no upstream HiSparse, mixed
    chunks off, radix cache off, the plugin's radix-cache backend; overlap scheduling off with
    a context-parallel prefill of the offload; with
    ``p2-offload`` also ``--max-running-requests`` (it sizes the host arena),
    ``--prefill-max-requests N`` (the staging area holds N prompts; 1 with double sparsity or
    prefill CP) and, on CUDA, prefill CUDA graphs breakable or off
    (``--cuda-graph-backend-prefill breakable``, SGLang's default, or ``disabled``; off with
    double sparsity or prefill CP; decode graphs are supported); with the host
    prefix cache, a ``--chunked-prefill-size`` that is a multiple of the page size; with cache
    sharding, a shard group that divides the TP ranks holding one K/V head (every TP rank under
    SGLang's prefill CP over the TP group), and without an offload also no speculative decoding,
    attention DP, PD disaggregation, upstream HiSparse, mixed chunks or prefill CUDA graphs; with
    prefill CP and the offload or sharding, CUDA and decode with every head on every rank
    (``--enable-cp-decode-attn-tp`` off). With double sparsity: ``--attention-backend
    qsa_ds`` on a GQA model without QSA layers that the channel file fits; with DS-Offload also
    the serving and offload rules above.

    Returns:
        The model's QSA profile, or None when every switch is off (nothing is checked).

    Raises:
        ConfigurationError: naming the flag, the value and the supported values.
    """
    features = switches.features
    if switches.double_sparsity is not None:
        _check_double_sparsity(facts, switches.double_sparsity)
        if switches.double_sparsity.offload:
            _check_serving(facts)
            _check_offload(
                facts,
                one_prompt="DS-Offload's prefill reads one staged prompt",
                eager_prefill="DS-Offload's prefill stages prompts that prefill graph capture "
                "runs for requests holding no host-arena row",
            )
    if not _QSA_FEATURES.intersection(features):
        return None
    if facts.architectures != (SUPPORTED_ARCHITECTURE,):
        raise _reject(
            "--model-path architectures",
            list(facts.architectures),
            f"[{SUPPORTED_ARCHITECTURE!r}]",
            "QSA HiSparse serves only Qwen Sparse Attention checkpoints",
        )
    if facts.page_size != SUPPORTED_PAGE_SIZE:
        raise _reject(
            "--page-size",
            facts.page_size,
            str(SUPPORTED_PAGE_SIZE),
            "QSA addresses the compressed index as full slot // compress ratio in 64-token pages",
        )
    try:
        profile = QSAProfile.from_text_config(facts.text_config, page_size=facts.page_size)
    except QSAConfigError as exc:
        msg = f"--model-path: the checkpoint has no usable QSA profile: {exc}"
        raise ConfigurationError(msg) from exc
    if facts.kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        raise _reject(
            "--kv-cache-dtype",
            facts.kv_cache_dtype,
            ", ".join(repr(d) for d in SUPPORTED_KV_CACHE_DTYPES),
            "the QSA kernels store K/V as bf16 or unscaled fp8 e4m3",
        )
    bf16 = KVDType.BF16.torch_name
    if facts.kv_cache_dtype == "auto" and facts.model_dtype != bf16:
        explicit = ", ".join(repr(d) for d in SUPPORTED_KV_CACHE_DTYPES if d != "auto")
        raise _reject(
            "--kv-cache-dtype",
            f"auto (model dtype {facts.model_dtype})",
            f"'auto' with a {bf16} model, {explicit}",
            "'auto' takes the model dtype, and the QSA kernels store K/V as bf16 or fp8 e4m3",
        )
    if Feature.HISPARSE in features:
        _check_serving(facts)
    if switches.hisparse is HiSparseMode.P2_OFFLOAD:
        cp = "a context-parallel prefill stages one prompt" if facts.enable_prefill_cp else None
        eager = "a context-parallel prefill runs eagerly" if cp is not None else None
        _check_offload(facts, one_prompt=cp, eager_prefill=eager)
    if switches.prefix_cache_mb > 0:
        _check_prefix_cache(facts)
    _check_overlap(facts, switches)
    if facts.enable_prefill_cp and (
        switches.hisparse is HiSparseMode.P2_OFFLOAD or switches.cache_sharding > 1
    ):
        _check_context_parallel(facts)
    if switches.cache_sharding > 1:
        _check_cache_sharding(facts, profile, switches.cache_sharding)
    if switches.resident_sharding:
        _check_resident_sharding(facts)
    if switches.index_sharding_alone:
        _check_index_sharding_alone(facts)
    if switches.index_sharding and facts.enable_hierarchical_cache:
        raise _reject(
            "--enable-hierarchical-cache",
            True,
            f"off with {ENV_INDEX_SHARDING}='1'",
            "HiCache copies the compressed-index pages by logical page id, while each rank "
            "holds only its own pages",
        )
    if switches.hot_blocks is not None:
        _check_hot_blocks(profile, switches.hot_blocks)
    return profile


def _check_double_sparsity(facts: ConfigFacts, ds: DoubleSparsitySwitches) -> None:
    """``--attention-backend qsa_ds`` on an ordinary GQA model, and a channel file that fits it."""
    if facts.attention_backend != DS_ATTENTION_BACKEND:
        raise _reject(
            "--attention-backend",
            facts.attention_backend,
            repr(DS_ATTENTION_BACKEND),
            f"{ENV_DS_CHANNEL_CONFIG} turns double sparsity on, and it decodes in the "
            f"{DS_ATTENTION_BACKEND!r} backend",
        )
    if SUPPORTED_ARCHITECTURE in facts.architectures:
        raise _reject(
            "--model-path architectures",
            list(facts.architectures),
            "a model without QSA layers (Llama, Qwen2/3, Mistral, ...)",
            "a QSA model selects its blocks with its own indexer; SGLang builds its attention "
            "backend whatever --attention-backend says",
        )
    if facts.speculative_algorithm is not None:
        raise _reject(
            "--speculative-algorithm",
            facts.speculative_algorithm,
            "unset",
            "the double-sparsity backend decodes one token per request and step",
        )
    if facts.enable_prefill_cp:
        raise _reject(
            "--enable-prefill-cp",
            True,
            "off",
            "the double-sparsity backend writes the labels of the prompt's keys where its dense "
            "prefill writes them, and has no context-parallel path",
        )
    kv_heads = ds_geometry(facts.text_config).kv_heads
    if facts.device == "cpu" and kv_heads % facts.tp_size:
        raise _reject(
            "--tp-size",
            facts.tp_size,
            f"a divisor of the model's {kv_heads} K/V heads on the CPU",
            "SGLang's CPU engine pads the K/V heads to a multiple of the TP size, and the "
            "channel file has no channels for the padding heads",
        )
    window = facts.text_config.get("sliding_window")
    if window is not None and facts.text_config.get("use_sliding_window", True):
        raise _reject(
            "--model-path sliding_window",
            window,
            "a model without sliding-window attention (null, or use_sliding_window false)",
            "the double-sparsity decode attends heavy tokens of the whole context",
        )
    for cap in ("attn_logit_softcapping", "attn_logit_softcap"):
        if facts.text_config.get(cap):
            raise _reject(
                f"--model-path {cap}",
                facts.text_config[cap],
                "none",
                "the double-sparsity decode does not cap attention logits",
            )
    from qsa_kernels.double_sparsity import DSConfigError

    try:
        ds_channels(ds, facts.text_config).for_tp_rank(facts.tp_size, 0)  # the heads split
    except DSConfigError as exc:
        msg = f"{ENV_DS_CHANNEL_CONFIG}={ds.channel_config!r} is refused: {exc}"
        raise ConfigurationError(msg) from exc


def ds_config(ds: DoubleSparsitySwitches) -> Any:
    """The library's ``DSConfig`` of the switches."""
    from qsa_kernels.double_sparsity import DSConfig, HeavyChannelType

    return DSConfig(
        heavy_channel_num=ds.heavy_channel_num,
        heavy_token_num=ds.heavy_token_num,
        heavy_channel_type=HeavyChannelType.parse(ds.heavy_channel_type),
        sparse_decode_threshold=ds.sparse_decode_threshold,
        staging_window=ds.staging_window,
    )


def ds_channels(ds: DoubleSparsitySwitches, text_config: Mapping[str, Any]) -> Any:
    """The channel file loaded against the model's layers, heads and head dim (``ChannelConfig``).

    One load for the start-up check, the doctor and the backend.

    Raises:
        DSConfigError: the file does not fit the model or the options (naming the field).
        ConfigurationError: the model config has no GQA geometry (see :func:`ds_geometry`).
    """
    from qsa_kernels.double_sparsity import ChannelConfig

    geometry = ds_geometry(text_config)
    return ChannelConfig.load(
        ds.channel_config,
        config=ds_config(ds),
        layers=range(geometry.layers),
        num_q_heads=geometry.q_heads,
        num_kv_heads=geometry.kv_heads,
        head_dim=geometry.head_dim,
    )


def ds_geometry(text_config: Mapping[str, Any]) -> AttentionGeometry:
    """The attention geometry of an ordinary GQA model, refused as a start-up error.

    The library's :meth:`qsa_kernels.double_sparsity.AttentionGeometry.from_text_config`
    (``num_hidden_layers`` and ``num_attention_heads`` required; ``num_key_value_heads``
    defaulting to and dividing the query heads; ``head_dim`` defaulting to ``hidden_size`` over
    the query heads, which must divide it).

    Raises:
        ConfigurationError: a field missing, not a positive integer, or not dividing as above
            (naming ``--model-path`` and the field, its value and what is supported).
    """
    from qsa_kernels.double_sparsity import AttentionGeometry, DSConfigError

    try:
        return AttentionGeometry.from_text_config(text_config)
    except DSConfigError as exc:
        raise ConfigurationError(f"--model-path {exc}") from exc


def ds_capacity(
    text_config: Mapping[str, Any],
    switches: DoubleSparsitySwitches,
    *,
    tp_size: int = 1,
    rows: int | None = None,
    context_len: int | None = None,
    verify: bool = False,
) -> LabelledCapacity:
    """Double sparsity's price on TP rank 0 of ``tp_size``, from the model config (bf16 K/V).

    The doctor's line: :func:`qsa_kernels.double_sparsity.model_label_capacity` of the switches'
    options and channel file (:func:`ds_channels`). ``rows`` is ``--max-running-requests`` and
    ``context_len`` ``--context-length`` (None: the config's ``max_position_embeddings``);
    DS-Offload's buffers need both. ``verify`` is ``SGLANG_QSA_HISPARSE_VERIFY=1``.

    Raises:
        qsa_kernels.double_sparsity.DSConfigError: the channel file is refused at ``tp_size``.
        ConfigurationError: the config has no GQA geometry.
        AdapterError: a size qsa-core refuses (DS-Offload with rows but no context length).
    """
    from qsa_kernels.double_sparsity import model_label_capacity

    channels = ds_channels(switches, text_config)
    try:
        return model_label_capacity(
            text_config,
            ds_config(switches),
            channels,
            tp_size=tp_size,
            offload=switches.offload,
            rows=rows,
            context_len=context_len,
            verify=verify,
        )
    except CapacityError as exc:
        raise AdapterError(f"{exc} (--context-length, --max-running-requests)") from exc


def _check_serving(facts: ConfigFacts) -> None:
    """The scheduling an offload runtime needs.

    One scheduler group, one token per request and step, the plugin's tree cache. Overlap
    scheduling serves (:func:`_check_overlap` names where it does not).
    """
    why_ranks = "the offload runtime keeps one set of leases per TP rank of one scheduler group"
    if facts.pp_size != 1:
        raise _reject("--pp-size", facts.pp_size, "1", why_ranks)
    if facts.dp_size != 1:
        raise _reject("--dp-size", facts.dp_size, "1", why_ranks)
    if facts.attn_dp_size != 1:
        raise _reject("--attn-dp-size", facts.attn_dp_size, "1", why_ranks)
    if facts.speculative_algorithm is not None:
        raise _reject(
            "--speculative-algorithm",
            facts.speculative_algorithm,
            "unset",
            "the hot cache admits one new token per request per decode step",
        )
    if facts.disaggregation_mode != "null":
        raise _reject(
            "--disaggregation-mode",
            facts.disaggregation_mode,
            "'null'",
            "host K/V history is not transferred between prefill and decode instances",
        )
    if facts.enable_hisparse:
        raise _reject(
            "--enable-hisparse",
            True,
            "off",
            "upstream HiSparse and QSA HiSparse would both own the KV pools",
        )
    if facts.enable_mixed_chunk:
        raise _reject(
            "--enable-mixed-chunk",
            True,
            "off",
            "prefill writes through the staging arena and decode through the hot cache",
        )
    if not facts.disable_radix_cache:
        raise _reject(
            "--disable-radix-cache",
            False,
            "set (GPU radix cache off)",
            "offloaded K/V history is not on the GPU for the radix cache to share; prefix reuse "
            "comes from the host prefix cache",
        )
    if facts.radix_cache_backend != RADIX_CACHE_BACKEND:
        raise _reject(
            "--radix-cache-backend",
            facts.radix_cache_backend,
            repr(RADIX_CACHE_BACKEND),
            "the plugin's tree cache holds one lease per request that has a KV row",
        )


def _check_offload(
    facts: ConfigFacts, *, one_prompt: str | None = None, eager_prefill: str | None = None
) -> None:
    """What the offload serves.

    ``one_prompt`` says why only one prompt may be staged, if so; ``eager_prefill`` why prefill
    CUDA graphs are refused, if so (otherwise breakable ones serve: the attention between their
    captured segments runs eagerly over the real batch, and the capture stages nothing).
    """
    if facts.max_running_requests is None or facts.max_running_requests < 1:
        raise _reject(
            "--max-running-requests",
            facts.max_running_requests,
            "a positive integer",
            "each running request holds one row of the pinned host arena, allocated at start-up",
        )
    staged = facts.prefill_max_requests
    if one_prompt is not None and staged != 1:
        raise _reject("--prefill-max-requests", staged, "1", one_prompt)
    if staged is None or isinstance(staged, bool) or staged < 1:
        raise _reject(
            "--prefill-max-requests",
            staged,
            "a positive integer",
            "each prompt of a prefill batch is staged on the GPU, in a staging area of the "
            "context length sized at start-up, before its K/V moves to the host",
        )
    graphs = facts.prefill_graph_backend
    if eager_prefill is not None and graphs != "disabled":
        raise _reject(
            "--cuda-graph-backend-prefill", graphs, "'disabled' (decode CUDA graphs stay on)",
            eager_prefill,
        )  # fmt: skip
    if graphs not in {"disabled", "breakable"}:
        raise _reject(
            "--cuda-graph-backend-prefill",
            graphs,
            "'breakable' or 'disabled'",
            "a full prefill graph captures the attention, which stages each prompt's chunk in "
            "the request's own staging area and so must run eagerly, as a breakable graph runs it",
        )


def _check_resident_sharding(facts: ConfigFacts) -> None:
    """What the sharded store's backend serves.

    One decode token per request and step, every rank of a shard group in the same batch, eager
    prefill.
    """
    _check_shard_group_batches(facts, "", (
        "the sharded decode attends one new token per request and step",
        "the ranks of a shard group must run the same batch through every collective",
        "the K/V transfer reads SGLang's pool, which holds no raw K/V under sharding",
        "upstream HiSparse and the sharded store would both own the QSA K/V",
        "mixed prefill-and-decode batches are not verified against the sharded store",
        "a prefill after a prefix reads its owned widths on the host",
    ))  # fmt: skip


def _check_index_sharding_alone(facts: ConfigFacts) -> None:
    """D2 without D1: every TP rank one shard group of the index, beside upstream's backend.

    Every rank of the group selects for the same rows in every collective; prefill eager.
    """
    alone = f" with {ENV_INDEX_SHARDING}='1' and no {ENV_CACHE_SHARDING}"
    if facts.tp_size < 2:  # a group of one shards nothing
        raise _reject(
            "--tp-size",
            facts.tp_size,
            f"2 or more{alone}",
            "the index is sharded by page over the TP ranks, and one rank shards nothing",
        )
    _check_shard_group_batches(facts, alone, (
        "the hooked selection is verified for one new token per request and step",
        "every rank of the TP group must select for the same batch in each collective",
        "a transfer of the QSA pool by logical page would read a rank's own pages as global",
        "upstream HiSparse's QSA cache handling is not verified with the sharded index",
        "mixed prefill-and-decode batches are not verified with the sharded index",
        "the hooked prefill selection holds each row's page table between two calls",
    ))  # fmt: skip


def _check_shard_group_batches(facts: ConfigFacts, context: str, why: Sequence[str]) -> None:
    """Refuse what a shard group's collectives cannot serve, ``why`` each in this order.

    One new token a request and step, one batch on every rank, no other owner of the QSA cache,
    eager prefill; ``context`` follows each supported value in the message.
    """
    rules = (
        ("--speculative-algorithm", facts.speculative_algorithm, None, "unset"),
        ("--attn-dp-size", facts.attn_dp_size, 1, "1"),
        ("--disaggregation-mode", facts.disaggregation_mode, "null", "'null'"),
        ("--enable-hisparse", facts.enable_hisparse, False, "off"),
        ("--enable-mixed-chunk", facts.enable_mixed_chunk, False, "off"),
        ("--cuda-graph-backend-prefill", facts.prefill_graph_backend, "disabled",
         "'disabled' (decode CUDA graphs stay on)"),
    )  # fmt: skip
    for (flag, value, allowed, supported), reason in zip(rules, why, strict=True):
        if value != allowed:
            raise _reject(flag, value, f"{supported}{context}", reason)


def _check_context_parallel(facts: ConfigFacts) -> None:
    """SGLang's QSA prefill CP, as the offload and the sharded store serve it."""
    if facts.device != "cuda":
        raise _reject(
            "--enable-prefill-cp",
            True,
            f"off on --device={facts.device!r}; on with CUDA",
            "SGLang's QSA prefill CP overlaps its K/V gather on a CUDA side stream",
        )
    if facts.enable_cp_decode_attn_tp:
        raise _reject(
            "--enable-cp-decode-attn-tp",
            True,
            "off",
            "decode would slice the attention heads over the CP ranks, while the plugin's store "
            "holds every head's K/V from prefill",
        )


def _check_cache_sharding(facts: ConfigFacts, profile: QSAProfile, sharding: int) -> None:
    kv_heads, tp = profile.num_kv_heads, facts.tp_size
    if facts.device == "cpu" and sharding != 1 and kv_heads % tp:
        # adjust_config_with_unaligned_cpu_tp: the CPU engine pads the heads, never replicates.
        padded = -(-kv_heads // tp) * tp
        msg = (
            f"{ENV_CACHE_SHARDING}={sharding!r} does not fit --tp-size={tp!r} on the CPU: "
            f"SGLang's CPU engine pads the model's {kv_heads!r} K/V heads to {padded!r}, so no "
            "two TP ranks hold the same K/V head; allowed: [1]"
        )
        raise ConfigurationError(msg)
    try:
        ShardPlacement.for_tp(profile, facts.tp_size, sharding, attn_cp_size=facts.attn_cp_size)
    except (PlacementError, QSAConfigError) as exc:
        msg = (
            f"{ENV_CACHE_SHARDING}={sharding!r} does not fit --tp-size={facts.tp_size!r} with "
            f"{profile.num_kv_heads!r} K/V heads: {exc}"
        )
        raise ConfigurationError(msg) from exc


def _check_hot_blocks(profile: QSAProfile, blocks: int) -> None:
    """Refuse hot caches smaller than one step's selection or larger than the fetch addresses."""
    from qsa_kernels.fetch import MAX_HOT_SLOTS

    allowed = f"allowed: {profile.block_topk} (the indexer's block top-k) to {MAX_HOT_SLOTS}"
    try:
        hot_cache_slots(profile.block_topk, blocks)
    except CapacityError as exc:
        raise ConfigurationError(f"{ENV_HISPARSE_HOT_BLOCKS}={blocks!r}: {exc}; {allowed}") from exc
    if blocks > MAX_HOT_SLOTS:
        raise ConfigurationError(f"{ENV_HISPARSE_HOT_BLOCKS}={blocks!r} is not allowed; {allowed}")


def _check_overlap(facts: ConfigFacts, switches: Switches) -> None:
    """Overlap scheduling, which the offload and the prefix cache serve, where it is refused.

    Under overlap scheduling SGLang launches batch ``N + 1`` before it processes batch ``N``'s
    result. The offload's own state follows the forward (a prompt moves to the host when its
    first decode step is planned, inside ``N + 1``'s launch, and the prefix cache checkpoints the
    prompt's end there, before ``N + 1`` advances its recurrent state), and its backends declare
    their reads to last the whole forward, so SGLang's write-after-read barrier orders a
    released row's reuse after them.
    """
    if (
        not facts.disable_overlap_schedule
        and facts.enable_prefill_cp
        and switches.hisparse is HiSparseMode.P2_OFFLOAD
    ):
        raise _reject(
            "--disable-overlap-schedule",
            False,
            "set (overlap scheduling off) with a context-parallel prefill with the offload",
            "verified only without overlap scheduling",
        )


def _check_prefix_cache(facts: ConfigFacts) -> None:
    chunk = facts.chunked_prefill_size
    if chunk is not None and chunk > 0 and chunk % facts.page_size:
        raise _reject(
            "--chunked-prefill-size",
            chunk,
            f"a multiple of the page size ({facts.page_size}), or -1 (no chunking)",
            "the host prefix cache checkpoints a prompt where a prefill chunk ends on a page "
            "boundary; other chunk ends hold no whole page of recurrent state",
        )


def _as_str(value: object) -> str:
    return str(value).removeprefix("torch.")


def facts_from_server_args(server_args: Any) -> ConfigFacts:
    """Read :class:`ConfigFacts` from a resolved SGLang ``ServerArgs``."""
    from sglang.srt.arg_groups.model_override_base import (
        model_config_of,
        resolving_view,
    )

    cfg = resolving_view(server_args)
    model_path = str(cfg.model_path)
    if model_path.lower() in ("dummy", "none"):
        architectures: tuple[str, ...] = ()
        text: Mapping[str, Any] = {}
        dtype = "unknown"
    else:
        model_config = model_config_of(server_args)
        hf_config = model_config.hf_config
        architectures = tuple(getattr(hf_config, "architectures", None) or ())
        text_config = getattr(hf_config, "text_config", None) or hf_config
        text = text_config.to_dict()
        dtype = _as_str(model_config.dtype)
    return ConfigFacts(
        architectures=architectures,
        text_config=text,
        model_dtype=dtype,
        page_size=int(cfg.page_size),
        kv_cache_dtype=str(cfg.kv_cache_dtype),
        pp_size=int(cfg.pp_size),
        dp_size=int(cfg.dp_size),
        attn_dp_size=int(cfg.attn_dp_size),
        speculative_algorithm=None
        if cfg.speculative_algorithm is None
        else str(cfg.speculative_algorithm),
        disaggregation_mode=str(cfg.disaggregation_mode),
        enable_hisparse=bool(cfg.enable_hisparse),
        enable_hierarchical_cache=bool(cfg.enable_hierarchical_cache),
        disable_overlap_schedule=bool(cfg.disable_overlap_schedule),
        enable_mixed_chunk=bool(cfg.enable_mixed_chunk),
        disable_radix_cache=bool(cfg.disable_radix_cache),
        radix_cache_backend=None
        if cfg.radix_cache_backend is None
        else str(cfg.radix_cache_backend),
        prefill_graph_backend=_prefill_graph_backend(cfg)
        if str(cfg.device) == "cuda"
        else "disabled",
        max_running_requests=None
        if cfg.max_running_requests is None
        else int(cfg.max_running_requests),
        prefill_max_requests=None
        if cfg.prefill_max_requests is None
        else int(cfg.prefill_max_requests),
        chunked_prefill_size=None
        if cfg.chunked_prefill_size is None
        else int(cfg.chunked_prefill_size),
        attention_backend=None if cfg.attention_backend is None else str(cfg.attention_backend),
        tp_size=int(cfg.tp_size),
        enable_prefill_cp=bool(cfg.enable_prefill_cp),
        attn_cp_size=int(getattr(cfg, "attn_cp_size", 1) or 1),
        enable_cp_decode_attn_tp=bool(getattr(cfg, "enable_cp_decode_attn_tp", False)),
        device=str(cfg.device),
    )


def _prefill_graph_backend(cfg: Any) -> str:
    """The prefill CUDA graph backend SGLang resolved (``disabled``, ``breakable``, ``full``)."""
    phase = getattr(getattr(cfg, "cuda_graph_config", None), "prefill", None)
    backend = getattr(phase, "backend", None)
    if backend is not None:
        return str(backend)
    # Not resolved into a config object: the flags that decide it, then SGLang's own default.
    if cfg.disable_cuda_graph or getattr(cfg, "disable_prefill_cuda_graph", False):
        return "disabled"
    chosen = getattr(cfg, "cuda_graph_backend_prefill", None)
    if chosen is None:
        from sglang.srt.model_executor.cuda_graph_config import default_prefill_backend

        chosen = default_prefill_backend()
    return str(chosen)


def after_resolve_once(result: object, server_args: Any, *args: object, **kwargs: object) -> None:
    """AFTER hook on ``sglang.srt.server_args.ServerArgs.resolve_once``.

    Re-verifies this plugin's hooks, then checks the resolved configuration.

    Raises:
        ActivationError: a hook was displaced, or the configuration is unsupported.
    """
    del result, args, kwargs
    from qsa_sglang_plugin._activation import verify_active

    verify_active()
    check_configuration(facts_from_server_args(server_args), current_switches())
