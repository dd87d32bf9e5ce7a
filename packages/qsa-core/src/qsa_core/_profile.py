"""Model geometry of a Qwen Sparse Attention (QSA) checkpoint, validated once.

A :class:`QSAProfile` is parsed from an HF-style text config (a mapping) and frozen. It carries the
indexer geometry, the attention geometry of the QSA layers, and the recurrent-state geometry of the
other (Gated DeltaNet) layers that the capacity plan prices. Every derived figure (blocks per page,
KV heads per rank, bytes per block) is a method, so no caller recomputes it by hand.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from qsa_core._checks import is_int
from qsa_core._errors import QSAConfigError

__all__ = (
    "ALLOWED_BLOCK_TOPK",
    "QSA_LAYER_TYPES",
    "QWEN38_FLASH_NEXT",
    "QWEN38_FLASH_NEXT_TEXT_CONFIG",
    "KVDType",
    "QSAProfile",
)

#: Block top-k widths the upstream fast top-k kernels support (``budget // compress_ratio``).
ALLOWED_BLOCK_TOPK: Final[frozenset[int]] = frozenset({512, 2048})

#: ``layer_types`` entries that denote a QSA (sparse full-attention) layer.
QSA_LAYER_TYPES: Final[frozenset[str]] = frozenset(
    {"full_attention", "qwen_sparse_attention", "indexed_attention", "attention"}
)

#: The page size SGLang forces for every model with a QSA profile (tokens).
DEFAULT_PAGE_SIZE: Final[int] = 64


class KVDType(enum.Enum):
    """Storage dtype of the raw K/V cache (and of the compressed index).

    The one definition of the K/V dtypes QSA serves and their spellings: the value is the
    ``--kv-cache-dtype`` name, :attr:`sglang_names` every ``--kv-cache-dtype`` value that selects
    it, :attr:`torch_name` the name torch gives it. qsa-core does not import torch;
    ``qsa_kernels.kv_torch_dtype`` maps a member to its ``torch.dtype``.
    """

    BF16 = "bf16"
    FP8_E4M3 = "fp8_e4m3"

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return 2 if self is KVDType.BF16 else 1

    @property
    def sglang_names(self) -> tuple[str, ...]:
        """The ``--kv-cache-dtype`` values that select this dtype (``auto`` aside)."""
        return ("bf16", "bfloat16") if self is KVDType.BF16 else ("fp8_e4m3",)

    @property
    def torch_name(self) -> str:
        """The dtype's name in torch, without the ``torch.`` prefix (``"float8_e4m3fn"``)."""
        return "bfloat16" if self is KVDType.BF16 else "float8_e4m3fn"

    @classmethod
    def sglang_flag_values(cls) -> tuple[str, ...]:
        """Every ``--kv-cache-dtype`` value QSA serves: ``auto``, then each member's names."""
        return ("auto", *(name for dtype in cls for name in dtype.sglang_names))

    def _parse_names(self) -> tuple[str, ...]:
        # Also taken by parse: ``auto`` (planned as bf16) and the short fp8 spellings.
        extra = ("auto",) if self is KVDType.BF16 else ("fp8", "fp8_e4m3fn")
        names = (*self.sglang_names, *extra, self.torch_name)
        return tuple(dict.fromkeys(names))

    @classmethod
    def parse(cls, name: str) -> KVDType:
        """Parse a dtype name as SGLang flags spell it.

        Accepted (case-insensitive): ``bf16``, ``bfloat16``, ``auto`` (BF16); ``fp8_e4m3``,
        ``fp8``, ``fp8_e4m3fn``, ``float8_e4m3fn`` (FP8 E4M3).

        Raises:
            QSAConfigError: for any other name.
        """
        key = name.strip().lower()
        for dtype in cls:
            if key in dtype._parse_names():
                return dtype
        allowed = ", ".join(repr(n) for dtype in cls for n in dtype._parse_names())
        msg = f"kv dtype {name!r} is not supported; allowed: {allowed}"
        raise QSAConfigError(msg)


def _positive(name: str, value: int) -> None:
    if not is_int(value) or value < 1:
        msg = f"{name}={value!r} is not allowed; it must be a positive integer"
        raise QSAConfigError(msg)


@dataclass(frozen=True, slots=True)
class QSAProfile:
    """Frozen geometry of one QSA model, validated at construction.

    Units: heads are counts, dims are elements, ``budget`` and ``page_size`` are tokens, a *block*
    is ``compress_ratio`` consecutive tokens (the unit the indexer scores and top-k selects).

    Validation (the checks upstream ``parse_qsa_profile`` and the QSA pool make), each raising
    :class:`QSAConfigError` naming the field, its value and what is allowed:
    ``index_kv_heads == 1``; ``compress_ratio >= 2``; ``budget % compress_ratio == 0``;
    ``budget // compress_ratio`` in ``{512, 2048}``; ``page_size > 1`` and
    ``page_size % compress_ratio == 0``; ``num_attention_heads % num_kv_heads == 0``; QSA layer
    ids distinct, ascending and in ``[0, num_hidden_layers)``.

    Attributes:
        index_n_heads: indexer query heads (``indexer_n_heads``).
        index_kv_heads: indexer key heads (``indexer_kv_heads``); must be 1 (MQA scoring).
        index_head_dim: indexer head dim (``indexer_head_dim``).
        budget: selected tokens per query (``indexer_budget``).
        compress_ratio: tokens per block (``indexer_compress_ratio``).
        num_attention_heads: query heads of a QSA layer.
        num_kv_heads: K/V heads of a QSA layer.
        head_dim: K/V head dim.
        num_hidden_layers: all decoder layers (QSA plus linear).
        qsa_layer_ids: 0-based ids of the QSA layers, ascending.
        page_size: KV page size in tokens (SGLang forces 64).
        hidden_size: model width (used for PLE state sizing).
        linear_num_key_heads: Gated DeltaNet key heads (0 when the model has no linear layers).
        linear_num_value_heads: Gated DeltaNet value heads.
        linear_key_head_dim: Gated DeltaNet key head dim.
        linear_value_head_dim: Gated DeltaNet value head dim.
        linear_conv_kernel_dim: Gated DeltaNet short-conv kernel width.
        hc_count: hyper-connection streams (PLE conv channels = ``hidden_size * hc_count``).
        ple_layer_ids: 0-based ids of layers with a per-layer embedding (PLE).
        ple_conv_kernel_size: PLE causal conv kernel width.
        ngram_size: PLE n-gram order (also the PLE conv dilation).
    """

    index_n_heads: int
    index_kv_heads: int
    index_head_dim: int
    budget: int
    compress_ratio: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    num_hidden_layers: int
    qsa_layer_ids: tuple[int, ...]
    page_size: int = DEFAULT_PAGE_SIZE
    hidden_size: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    hc_count: int = 1
    ple_layer_ids: tuple[int, ...] = field(default=())
    ple_conv_kernel_size: int = 0
    ngram_size: int = 0

    def __post_init__(self) -> None:
        for name in (
            "index_n_heads",
            "index_kv_heads",
            "index_head_dim",
            "budget",
            "compress_ratio",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "num_hidden_layers",
            "page_size",
            "hc_count",
        ):
            _positive(name, getattr(self, name))
        for name in (
            "hidden_size",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
            "ple_conv_kernel_size",
            "ngram_size",
        ):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                msg = f"{name}={value!r} is not allowed; it must be a non-negative integer"
                raise QSAConfigError(msg)
        if self.index_kv_heads != 1:
            msg = (
                f"index_kv_heads={self.index_kv_heads!r} is not supported; allowed: 1 "
                "(the QSA scoring operators are MQA)"
            )
            raise QSAConfigError(msg)
        if self.compress_ratio < 2:
            msg = f"compress_ratio={self.compress_ratio!r} is not allowed; it must be >= 2"
            raise QSAConfigError(msg)
        if self.budget % self.compress_ratio != 0:
            msg = (
                f"budget={self.budget!r} is not divisible by compress_ratio="
                f"{self.compress_ratio!r}; the budget must be a whole number of blocks"
            )
            raise QSAConfigError(msg)
        block_topk = self.budget // self.compress_ratio
        if block_topk not in ALLOWED_BLOCK_TOPK:
            msg = (
                f"block_topk=budget//compress_ratio={block_topk!r} (budget={self.budget!r}, "
                f"compress_ratio={self.compress_ratio!r}) is not supported; allowed: "
                f"{sorted(ALLOWED_BLOCK_TOPK)!r}"
            )
            raise QSAConfigError(msg)
        if self.page_size < 2 or self.page_size % self.compress_ratio != 0:
            msg = (
                f"page_size={self.page_size!r} is not allowed; it must be > 1 and a multiple "
                f"of compress_ratio={self.compress_ratio!r}"
            )
            raise QSAConfigError(msg)
        if self.num_attention_heads % self.num_kv_heads != 0:
            msg = (
                f"num_attention_heads={self.num_attention_heads!r} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads!r}"
            )
            raise QSAConfigError(msg)
        _check_layer_ids("qsa_layer_ids", self.qsa_layer_ids, self.num_hidden_layers)
        if not self.qsa_layer_ids:
            msg = "qsa_layer_ids=() is not allowed; a QSA model has at least one QSA layer"
            raise QSAConfigError(msg)
        _check_layer_ids("ple_layer_ids", self.ple_layer_ids, self.num_hidden_layers)

    # ----------------------------------------------------------------- parsing

    @staticmethod
    def config_context_len(cfg: Mapping[str, object]) -> object:
        """The context a config allows: ``max_position_embeddings`` (None where it names none).

        Read from ``cfg["text_config"]`` when ``cfg`` has one (a multimodal model's config),
        else from ``cfg``; the value as the config holds it.
        """
        text = cfg.get("text_config", cfg)
        return text.get("max_position_embeddings") if isinstance(text, Mapping) else None

    @classmethod
    def from_text_config(
        cls, cfg: Mapping[str, object], *, page_size: int = DEFAULT_PAGE_SIZE
    ) -> QSAProfile:
        """Parse and validate a profile from an HF-style text config.

        A top-level config whose QSA fields sit under ``text_config`` is accepted too. QSA layers
        come from ``layer_types`` (entries in :data:`QSA_LAYER_TYPES`), else from
        ``full_attention_interval`` (layer ``i`` is QSA when ``i % interval == interval - 1``),
        else every layer is QSA. ``ple_layer_ids`` in the config are one-indexed, as upstream.

        Args:
            cfg: the text config.
            page_size: KV page size in tokens (SGLang forces 64 for QSA models).

        Raises:
            QSAConfigError: a required field is missing or any value fails validation.
        """
        inner = cfg.get("text_config")
        if "indexer_n_heads" not in cfg and isinstance(inner, Mapping):
            return cls.from_text_config(inner, page_size=page_size)
        num_layers = _int_field(cfg, "num_hidden_layers")
        num_heads = _int_field(cfg, "num_attention_heads")
        hidden = _int_field(cfg, "hidden_size", default=0)
        head_dim_default = hidden // num_heads if hidden else None
        ple_one_indexed = _int_list_field(cfg, "ple_layer_ids")
        for position, layer in enumerate(ple_one_indexed):
            if layer < 1:
                msg = (
                    f"ple_layer_ids[{position}]={layer!r} is not allowed; PLE layer ids are "
                    "one-indexed (>= 1)"
                )
                raise QSAConfigError(msg)
        return cls(
            index_n_heads=_int_field(cfg, "indexer_n_heads"),
            index_kv_heads=_int_field(cfg, "indexer_kv_heads"),
            index_head_dim=_int_field(cfg, "indexer_head_dim"),
            budget=_int_field(cfg, "indexer_budget"),
            compress_ratio=_int_field(cfg, "indexer_compress_ratio"),
            num_attention_heads=num_heads,
            num_kv_heads=_int_field(cfg, "num_key_value_heads"),
            head_dim=_int_field(cfg, "head_dim", default=head_dim_default),
            num_hidden_layers=num_layers,
            qsa_layer_ids=_qsa_layers(cfg, num_layers),
            page_size=page_size,
            hidden_size=hidden,
            linear_num_key_heads=_int_field(cfg, "linear_num_key_heads", default=0),
            linear_num_value_heads=_int_field(cfg, "linear_num_value_heads", default=0),
            linear_key_head_dim=_int_field(cfg, "linear_key_head_dim", default=0),
            linear_value_head_dim=_int_field(cfg, "linear_value_head_dim", default=0),
            linear_conv_kernel_dim=_int_field(cfg, "linear_conv_kernel_dim", default=0),
            hc_count=_int_field(cfg, "hc_count", default=1),
            ple_layer_ids=tuple(layer - 1 for layer in ple_one_indexed),
            ple_conv_kernel_size=_int_field(cfg, "ple_conv_kernel_size", default=4)
            if ple_one_indexed
            else 0,
            ngram_size=_int_field(cfg, "ngram_size", default=3) if ple_one_indexed else 0,
        )

    # ----------------------------------------------------------------- derived figures

    @property
    def block_topk(self) -> int:
        """Blocks selected per query: ``budget // compress_ratio``."""
        return self.budget // self.compress_ratio

    @property
    def token_topk(self) -> int:
        """Tokens selected per query from complete blocks (``budget``)."""
        return self.budget

    @property
    def selection_width(self) -> int:
        """Token positions per query row: ``budget + compress_ratio - 1`` (with the open tail)."""
        return self.budget + self.compress_ratio - 1

    @property
    def blocks_per_page(self) -> int:
        """Blocks per KV page (the compressed page size): ``page_size // compress_ratio``."""
        return self.page_size // self.compress_ratio

    @property
    def num_qsa_layers(self) -> int:
        """Number of QSA layers."""
        return len(self.qsa_layer_ids)

    @property
    def num_linear_layers(self) -> int:
        """Number of non-QSA (Gated DeltaNet) layers."""
        return self.num_hidden_layers - self.num_qsa_layers

    @property
    def query_heads_per_kv_head(self) -> int:
        """GQA group size."""
        return self.num_attention_heads // self.num_kv_heads

    def kv_heads_per_rank(self, tp_size: int) -> int:
        """K/V heads each TP rank stores; replicated (1 per rank) when ``tp_size > num_kv_heads``.

        Raises:
            QSAConfigError: ``tp_size < 1``, or the heads do not split evenly
                (``num_kv_heads % tp_size`` when TP is smaller, ``tp_size % num_kv_heads`` when
                larger).
        """
        _positive("tp_size", tp_size)
        if tp_size <= self.num_kv_heads:
            if self.num_kv_heads % tp_size != 0:
                msg = (
                    f"tp_size={tp_size!r} does not divide num_kv_heads={self.num_kv_heads!r}; "
                    f"allowed: divisors of {self.num_kv_heads} or multiples of it"
                )
                raise QSAConfigError(msg)
            return self.num_kv_heads // tp_size
        if tp_size % self.num_kv_heads != 0:
            msg = (
                f"tp_size={tp_size!r} is not a multiple of num_kv_heads={self.num_kv_heads!r}; "
                f"allowed: divisors of {self.num_kv_heads} or multiples of it"
            )
            raise QSAConfigError(msg)
        return 1

    def kv_replicas(self, tp_size: int) -> int:
        """TP ranks that hold a copy of the same K/V head: ``max(1, tp_size // num_kv_heads)``."""
        self.kv_heads_per_rank(tp_size)
        return max(1, tp_size // self.num_kv_heads)

    def bytes_per_block(self, kv_dtype: KVDType, tp_size: int) -> int:
        """Raw K/V bytes of one block of one QSA layer on one TP rank.

        ``compress_ratio × kv_heads_per_rank × head_dim × 2 (K and V) × itemsize``; 2048 B for
        Qwen3.8-Flash-Next at TP2 FP8.
        """
        heads = self.kv_heads_per_rank(tp_size)
        return self.compress_ratio * heads * self.head_dim * 2 * kv_dtype.itemsize

    def raw_kv_bytes_per_token(self, kv_dtype: KVDType, tp_size: int) -> int:
        """Raw K/V bytes of one token over all QSA layers on one TP rank."""
        heads = self.kv_heads_per_rank(tp_size)
        return self.num_qsa_layers * 2 * heads * self.head_dim * kv_dtype.itemsize

    def index_bytes_per_token(self, index_dtype: KVDType = KVDType.BF16) -> int:
        """Compressed index-K bytes per token over all QSA layers (replicated on every rank).

        ``num_qsa_layers × index_kv_heads × index_head_dim × itemsize // compress_ratio``.
        """
        per_block = self.index_kv_heads * self.index_head_dim * index_dtype.itemsize
        return self.num_qsa_layers * per_block // self.compress_ratio

    def compressed_slot(self, full_slot: int) -> int:
        """Compressed (block) slot of a raw token slot: ``full_slot // compress_ratio``.

        Raises:
            QSAConfigError: ``full_slot`` is negative.
        """
        if not is_int(full_slot) or full_slot < 0:
            msg = f"full_slot={full_slot!r} is not allowed; it must be a non-negative integer"
            raise QSAConfigError(msg)
        return full_slot // self.compress_ratio

    def complete_blocks(self, seq_len: int) -> int:
        """Complete blocks of a sequence of ``seq_len`` tokens (the top-k candidates)."""
        if seq_len < 0:
            msg = f"seq_len={seq_len!r} is not allowed; it must be >= 0"
            raise QSAConfigError(msg)
        return seq_len // self.compress_ratio


def _check_layer_ids(name: str, ids: Sequence[int], num_layers: int) -> None:
    for position, layer in enumerate(ids):
        if not is_int(layer) or not 0 <= layer < num_layers:
            msg = (
                f"{name}[{position}]={layer!r} is not allowed; layer ids must lie in "
                f"[0, {num_layers})"
            )
            raise QSAConfigError(msg)
    if list(ids) != sorted(set(ids)):
        msg = f"{name}={tuple(ids)!r} is not allowed; layer ids must be distinct and ascending"
        raise QSAConfigError(msg)


_MISSING: Final = object()


def _int_field(cfg: Mapping[str, object], name: str, default: object = _MISSING) -> int:
    value = cfg.get(name, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING or default is None:
            msg = f"config field {name!r} is missing; a QSA text config must define it"
            raise QSAConfigError(msg)
        value = default
    if not is_int(value):
        msg = f"config field {name}={value!r} is not allowed; it must be an integer"
        raise QSAConfigError(msg)
    return value


def _int_list_field(cfg: Mapping[str, object], name: str) -> tuple[int, ...]:
    value = cfg.get(name)
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        msg = f"config field {name}={value!r} is not allowed; it must be a list of integers"
        raise QSAConfigError(msg)
    out: list[int] = []
    for position, item in enumerate(value):
        if not is_int(item):
            msg = f"config field {name}[{position}]={item!r} is not allowed; it must be an integer"
            raise QSAConfigError(msg)
        out.append(item)
    return tuple(out)


def _qsa_layers(cfg: Mapping[str, object], num_layers: int) -> tuple[int, ...]:
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_layers:
            msg = (
                f"config field layer_types={layer_types!r} is not allowed; it must be a list "
                f"of {num_layers} layer type names"
            )
            raise QSAConfigError(msg)
        return tuple(i for i, kind in enumerate(layer_types) if kind in QSA_LAYER_TYPES)
    interval = cfg.get("full_attention_interval")
    if interval is not None:
        if not is_int(interval) or interval < 1:
            msg = (
                f"config field full_attention_interval={interval!r} is not allowed; it must "
                "be a positive integer"
            )
            raise QSAConfigError(msg)
        return tuple(i for i in range(num_layers) if i % interval == interval - 1)
    return tuple(range(num_layers))


#: The text config of the Qwen3.8-Flash-Next checkpoint, as far as geometry is concerned.
QWEN38_FLASH_NEXT_TEXT_CONFIG: Final[Mapping[str, object]] = types.MappingProxyType(
    {
        "hidden_size": 2560,
        "num_hidden_layers": 48,
        "full_attention_interval": 4,
        "num_attention_heads": 24,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 128,
        "indexer_budget": 2048,
        "indexer_compress_ratio": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "hc_count": 4,
        "ple_layer_ids": (2,),
        "ple_conv_kernel_size": 4,
        "ngram_size": 3,
        "max_position_embeddings": 262144,
    }
)

#: Qwen3.8-Flash-Next (``Qwen4ExpForConditionalGeneration``): 12 QSA layers (3, 7, …, 47) of 48,
#: 24 query / 2 KV heads of dim 256, indexer 4 × 128 with one key head, budget 2048 tokens =
#: 512 blocks of 4, page size 64 (16 blocks per page).
QWEN38_FLASH_NEXT: Final[QSAProfile] = QSAProfile.from_text_config(QWEN38_FLASH_NEXT_TEXT_CONFIG)
