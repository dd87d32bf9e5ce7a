"""The one declaration of every SGLang hook this plugin installs.

Registration (:mod:`qsa_sglang_plugin._activation`) and the fingerprint manifest
(:mod:`qsa_sglang_plugin._fingerprints`) are both derived from :data:`HOOKS`; adding a feature's
hook is one :class:`HookSpec` entry here plus a regenerated manifest. This module imports nothing
from SGLang.

Order of preference when a feature needs SGLang to behave differently: an SGLang registry
(``register_attention_backend``, ``register_radix_cache_backend``), then a BEFORE/AFTER/AROUND hook,
and a whole-definition REPLACE only where nothing narrower exists.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from qsa_sglang_plugin._switches import DS_ATTENTION_BACKEND, RADIX_CACHE_BACKEND, Feature

__all__ = (
    "HOOKS",
    "REGISTRATIONS",
    "HookKind",
    "HookSpec",
    "Registry",
    "RegistrySpec",
    "registrations_for",
    "specs_for",
)


class HookKind(enum.StrEnum):
    """Hook type; the values equal the values of SGLang's ``HookType``."""

    BEFORE = "before"
    AFTER = "after"
    AROUND = "around"
    REPLACE = "replace"


@dataclass(frozen=True, slots=True)
class HookSpec:
    """One hook: where it goes, what it is, which feature needs it, and why.

    Attributes:
        module: dotted name of the SGLang module that defines the target.
        qualname: attribute path of the target inside ``module`` (``Class.method`` or ``func``).
        kind: hook type.
        feature: the feature that registers this hook.
        hook: ``"package.module:function"`` of the hook callable in this package.
        reason: why the hook exists and why nothing narrower fits.
        relies_on: other SGLang modules whose definitions the hook's code subclasses or reads;
            the fingerprint manifest pins them like the target's module.
    """

    module: str
    qualname: str
    kind: HookKind
    feature: Feature
    hook: str
    reason: str
    relies_on: tuple[str, ...] = ()

    @property
    def target(self) -> str:
        """The dotted path SGLang's ``HookRegistry`` takes."""
        return f"{self.module}.{self.qualname}"

    def load_hook(self) -> Callable[..., Any]:
        """Import and return the hook callable."""
        module_name, _, attr = self.hook.partition(":")
        fn: Callable[..., Any] = getattr(importlib.import_module(module_name), attr)
        return fn


HOOKS: tuple[HookSpec, ...] = (
    HookSpec(
        module="sglang.srt.server_args",
        qualname="ServerArgs.resolve_once",
        kind=HookKind.AFTER,
        feature=Feature.FRAMEWORK,
        hook="qsa_sglang_plugin._config_check:after_resolve_once",
        reason=(
            "Reject an unsupported configuration once SGLang has resolved it (page size, KV "
            "dtype and architecture are decided during resolution, so __post_init__ is too "
            "early), and re-verify this plugin's hooks in the front-end process."
        ),
    ),
    HookSpec(
        module="sglang.srt.managers.tokenizer_manager",
        qualname="TokenizerManager._validate_one_request",
        kind=HookKind.BEFORE,
        feature=Feature.FRAMEWORK,
        hook="qsa_sglang_plugin._adapters._prompts:before_validate_one_request",
        reason=(
            "Refuse with HTTP 400 a prompt the model cannot serve (no token, or an id outside "
            "the vocabulary), which SGLang passes to the scheduler, where its forward pass fails "
            "and stops the server. No registry validates requests."
        ),
    ),
    HookSpec(
        module="sglang.srt.managers.scheduler",
        qualname="configure_scheduler_process",
        kind=HookKind.AFTER,
        feature=Feature.FRAMEWORK,
        hook="qsa_sglang_plugin._activation:after_configure_scheduler_process",
        reason=(
            "Runs in every scheduler process after load_plugins() and publish(): re-verify "
            "hooks and fingerprints with every plugin loaded, and write this rank's activation "
            "record for the launcher."
        ),
    ),
    HookSpec(
        module="sglang.srt.layers.attention.attention_registry",
        qualname="attn_backend_wrapper",
        kind=HookKind.AFTER,
        feature=Feature.QSA_BACKEND,
        hook="qsa_sglang_plugin._adapters._qsa_backend:after_attn_backend_wrapper",
        reason=(
            "With p2-offload the offload backend, with cache sharding and no offload the sharded "
            "backend (QwenSparseAttnBackend subclasses), in the hybrid GDN backend's "
            "full-attention place. The attention-backend registry cannot "
            "reach it: for hybrid GDN+QSA models the wrapper builds QwenSparseAttnBackend itself, "
            "whatever --attention-backend says."
        ),
        relies_on=(
            "sglang.srt.layers.attention.qwen_sparse_attn_backend",
            "sglang.srt.mem_cache.qsa_kv_pool",
            # prefill CP: the strategy, its metadata's fields, the row gather and sharding
            "sglang.srt.layers.cp.utils",
            "sglang.srt.layers.cp.zigzag",
        ),
    ),
    HookSpec(
        module="sglang.srt.mem_cache.kv_cache_configurator",
        qualname="KVCacheConfigurator._resolve_kv_pool_class",
        kind=HookKind.AFTER,
        feature=Feature.KV_POOL,
        hook="qsa_sglang_plugin._adapters._kv_pool:after_resolve_kv_pool_class",
        reason=(
            "With an offload (p2-offload, DS-Offload) or cache sharding, the attention layers' "
            "MHA pool class (also the full-KV leaf of the QSA pool) becomes a one-page pool: the "
            "K/V lives in staging, hot caches, tails and the host arena, or in each rank's share "
            "of the sharded store. The platform seam for pool classes "
            "(get_kv_pool_cls) is open to out-of-tree platforms only."
        ),
        relies_on=("sglang.srt.mem_cache.memory_pool",),
    ),
    HookSpec(
        module="sglang.srt.model_executor.pool_configurator",
        qualname="DefaultPoolConfigurator.__init__",
        kind=HookKind.AFTER,
        feature=Feature.FRAMEWORK,
        hook="qsa_sglang_plugin._adapters._pool_sizing:after_pool_configurator_init",
        reason=(
            "The price of a token in pool sizing, per feature: with p2-offload its compressed "
            "index only (staging, hot caches, tails and tables as fixed overhead, so "
            "max_total_num_tokens grows by the K/V bytes the GPU no longer holds); with qsa_ds "
            "also its label rows. No registry sizes pools."
        ),
    ),
    HookSpec(
        module="sglang.srt.mem_cache.qsa_kv_pool",
        qualname="QSATokenToKVPool.__init__",
        kind=HookKind.AROUND,
        feature=Feature.INDEX_SHARDING,
        hook="qsa_sglang_plugin._adapters._sharded_index:around_qsa_pool_init",
        reason=(
            "Index sharding: each QSA layer's compressed-key buffer holds this rank's pages only "
            "(1/N), and the whole buffer is never allocated (built on the meta device). The "
            "configurator builds QSATokenToKVPool by name and sizes the buffer from the token "
            "count inside __init__; no argument or registry shapes it."
        ),
    ),
    HookSpec(
        module="sglang.srt.mem_cache.qsa_kv_pool",
        qualname="QSATokenToKVPool.set_qsa_compressed_k_buffer",
        kind=HookKind.AROUND,
        feature=Feature.INDEX_SHARDING,
        hook="qsa_sglang_plugin._adapters._sharded_index:around_set_qsa_compressed_k_buffer",
        reason=(
            "Index sharding: a closed block is stored at its local slot by its page's owner "
            "only; upstream stores every block at its logical slot."
        ),
    ),
    HookSpec(
        module="sglang.srt.layers.attention.qsa.qsa_indexer",
        qualname="QSAIndexer._use_fused_compress",
        kind=HookKind.AFTER,
        feature=Feature.INDEX_SHARDING,
        hook="qsa_sglang_plugin._adapters._sharded_index:after_use_fused_compress",
        reason=(
            "Index sharding: the fused JIT compress stores into the buffer at logical slots "
            "itself, bypassing set_qsa_compressed_k_buffer; the unfused path goes through it."
        ),
    ),
    HookSpec(
        module="sglang.srt.layers.attention.qsa.metadata",
        qualname="QSAIndexerMetadata.get_prefill_mqa_inputs",
        kind=HookKind.AROUND,
        feature=Feature.INDEX_SHARDING,
        hook="qsa_sglang_plugin._adapters._sharded_index:around_get_prefill_mqa_inputs",
        reason=(
            "Index sharding: upstream gathers the batch's compressed keys by logical slot, out "
            "of range of a rank-local buffer; the prefill selection needs each row's page table "
            "instead, which select_prefill_tokens is not given."
        ),
    ),
    HookSpec(
        module="sglang.srt.layers.attention.qsa.qsa_indexer",
        qualname="QSAIndexer.select_prefill_tokens",
        kind=HookKind.AROUND,
        feature=Feature.INDEX_SHARDING,
        hook="qsa_sglang_plugin._adapters._sharded_index:around_select_prefill_tokens",
        reason=(
            "Index sharding: each rank scores its own pages, one candidate all-gather, the "
            "exact merge; the indexer has no extension point for its selection."
        ),
        relies_on=("sglang.srt.layers.attention.qsa.kernel",),
    ),
    HookSpec(
        module="sglang.srt.layers.attention.qsa.qsa_indexer",
        qualname="QSAIndexer.select_decode_tokens",
        kind=HookKind.AROUND,
        feature=Feature.INDEX_SHARDING,
        hook="qsa_sglang_plugin._adapters._sharded_index:around_select_decode_tokens",
        reason=(
            "Index sharding: each rank scores its own pages, one candidate all-gather, the "
            "exact merge; the indexer has no extension point for its selection."
        ),
        relies_on=("sglang.srt.layers.attention.qsa.kernel",),
    ),
    HookSpec(
        module="sglang.srt.managers.schedule_policy",
        qualname="PrefillAdder.add_one_req",
        kind=HookKind.AROUND,
        feature=Feature.PREFIX_CACHE,
        hook="qsa_sglang_plugin._adapters._tree_cache:around_add_one_req",
        reason=(
            "With the radix cache disabled (as the offload requires) add_one_req hands an "
            "ignore_eos request to add_one_req_ignore_eos, which never loads a host hit. A "
            "request with a pending host hit takes the admission every other request takes, "
            "which loads it (and budgets ignore_eos requests at their full output). The tree "
            "cache's calls cannot reach this gate."
        ),
    ),
    HookSpec(
        module="sglang.srt.models.qwen4_exp",
        qualname="Qwen4ExpNGramEmbedding.__init__",
        kind=HookKind.AROUND,
        feature=Feature.MODEL_COMPAT,
        hook="qsa_sglang_plugin._adapters._model_compat:around_ngram_embedding_init",
        reason=(
            'ple_embedding_dtype="int8_row": SGLang builds its PLE table module from a config '
            "copy that says offloaded (its table on the meta device) while the host-table "
            "allocator hook is on, and the result becomes an INT8-row table of the same "
            "vocabulary shard, gathered by qsa_kernels.int8_rows: the INT8 table is the only "
            "allocation of its size. The constructor is where the table's module is chosen; no "
            "registry or argument selects its class or its dtype."
        ),
    ),
    HookSpec(
        module="sglang.srt.models.qwen4_exp_ple_table",
        qualname="allocate_ple_host_table",
        kind=HookKind.AROUND,
        feature=Feature.MODEL_COMPAT,
        hook="qsa_sglang_plugin._adapters._model_compat:around_allocate_ple_host_table",
        reason=(
            "While an INT8-row PLE table's module is being built, Qwen4ExpPinnedHostEmbedding "
            "asks for its bf16 pinned host table (about 102 GB for the production table, before "
            "the INT8-row one replaces it); it gets a meta tensor of that shape instead. The "
            "backend names are a fixed tuple, not a registry; every other call is SGLang's."
        ),
    ),
    HookSpec(
        module="sglang.srt.models.qwen4_exp",
        qualname="Qwen4ExpForConditionalGeneration.load_weights",
        kind=HookKind.BEFORE,
        feature=Feature.MODEL_COMPAT,
        hook="qsa_sglang_plugin._adapters._model_compat:before_load_weights",
        reason=(
            "An INT8-row PLE table's checkpoint shards (int8 values and their per-row scales, or "
            "a bf16 table to quantize) are taken from the weights the loader hands the model and "
            "read into the table; the scales have no SGLang parameter to load into, and SGLang's "
            "shard loader casts int8 values to the table's dtype."
        ),
    ),
    HookSpec(
        module="sglang.srt.layers.quantization.gptq.schemes.gptq_moe",
        qualname="GPTQMarlinMoEScheme.create_weights",
        kind=HookKind.AFTER,
        feature=Feature.MODEL_COMPAT,
        hook="qsa_sglang_plugin._adapters._gptq_moe:after_gptq_marlin_moe_create_weights",
        reason=(
            "GPTQ/AutoRound routed experts on Marlin: upstream makes w13_scales and w2_scales "
            "fp16 whatever the model's dtype, and its Marlin MoE GEMM refuses scales of another "
            "dtype than the activations' (a bf16 model stops at its first request). Both are "
            "registered again in the model's dtype with the same attributes, so the loader's "
            "copy converts the checkpoint's fp16 scales (as the GPTQ Marlin linear method "
            "does). The scheme is built by GPTQMarlinConfig, not chosen from a registry."
        ),
        relies_on=(
            # the loader's copy into the scales, Marlin's dtype-keeping scale permutation
            "sglang.srt.layers.moe.fused_moe_triton.layer",
            "sglang.srt.hardware_backend.gpu.quantization.gptq_kernels",
            "sglang.srt.layers.quantization.marlin_utils",
        ),
    ),
)


def specs_for(features: Iterable[Feature]) -> tuple[HookSpec, ...]:
    """The declared hooks of the given features, in declaration order."""
    wanted = frozenset(features)
    return tuple(spec for spec in HOOKS if spec.feature in wanted)


class Registry(enum.StrEnum):
    """An SGLang registry this plugin adds to, by its registering function."""

    RADIX_CACHE_BACKEND = "sglang.srt.mem_cache.registry:register_radix_cache_backend"
    ATTENTION_BACKEND = "sglang.srt.layers.attention.attention_registry:register_attention_backend"


@dataclass(frozen=True, slots=True)
class RegistrySpec:
    """One entry this plugin adds to an SGLang registry.

    Attributes:
        registry: which registry.
        name: the name the entry is registered under (what a flag selects).
        feature: the feature that registers it.
        factory: ``"package.module:function"`` of the factory in this package.
        reason: what the entry does.
        relies_on: SGLang modules whose definitions the entry subclasses or whose calls into it
            it depends on; the fingerprint manifest pins them like hook targets' modules.
    """

    registry: Registry
    name: str
    feature: Feature
    factory: str
    reason: str
    relies_on: tuple[str, ...] = ()

    def load_factory(self) -> Callable[..., Any]:
        """Import and return the factory."""
        module_name, _, attr = self.factory.partition(":")
        fn: Callable[..., Any] = getattr(importlib.import_module(module_name), attr)
        return fn


REGISTRATIONS: tuple[RegistrySpec, ...] = (
    RegistrySpec(
        registry=Registry.RADIX_CACHE_BACKEND,
        name=RADIX_CACHE_BACKEND,
        feature=Feature.LIFECYCLE,
        factory="qsa_sglang_plugin._adapters._lifecycle:radix_cache_factory",
        reason=(
            "Sees every request's row allocation, chunk and prompt ends, and release (finish, "
            "abort, retraction): one lease per request that holds a KV row."
        ),
        relies_on=(
            "sglang.srt.mem_cache.registry",
            "sglang.srt.mem_cache.unified_radix_cache",
            "sglang.srt.mem_cache.base_prefix_cache",
            "sglang.srt.mem_cache.common",
            "sglang.srt.mem_cache.allocation",
        ),
    ),
    RegistrySpec(
        registry=Registry.ATTENTION_BACKEND,
        name=DS_ATTENTION_BACKEND,
        feature=Feature.DOUBLE_SPARSITY,
        factory="qsa_sglang_plugin._adapters._double_sparsity:create_backend",
        reason=(
            "--attention-backend qsa_ds: the platform's dense backend for prefill and dense "
            "rows, label-cache writes, double-sparsity decode of long rows."
        ),
        relies_on=(
            "sglang.srt.layers.attention.attention_registry",
            "sglang.srt.layers.attention.base_attn_backend",
            "sglang.srt.layers.attention.torch_native_backend",
            "sglang.srt.layers.attention.triton_backend",
            "sglang.srt.arg_groups.choices",
        ),
    ),
)


def registrations_for(features: Iterable[Feature]) -> tuple[RegistrySpec, ...]:
    """The declared registry entries of the given features, in declaration order."""
    wanted = frozenset(features)
    return tuple(spec for spec in REGISTRATIONS if spec.feature in wanted)
