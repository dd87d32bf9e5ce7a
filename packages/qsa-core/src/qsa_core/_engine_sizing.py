"""An engine's serving flags and model config as a capacity plan, and double sparsity's price.

What an engine adapter would otherwise compute itself: the plan's inputs resolved from the
operator's flags (defaults, required values, the profile at the page size), and double
sparsity's per-rank price from the attention geometry. The adapter reads its engine's objects
into the plain numbers here and adds what only a device library knows (the shard group's
transport bytes, the label element size).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

from qsa_core._capacity import CapacityPlan, index_ranks, plan_capacity
from qsa_core._checks import is_int
from qsa_core._errors import CapacityError, QSAConfigError
from qsa_core._offload_sizes import ds_offload_sizes, label_bytes_per_token
from qsa_core._pool_price import PoolPrice
from qsa_core._profile import KVDType, QSAProfile

__all__ = (
    "IndexBufferBytes",
    "LabelledCapacity",
    "PlanInputs",
    "TransportBytes",
    "labelled_capacity",
)

#: The flags :meth:`PlanInputs.from_args` reads by name (absent or None: the default).
_PLAN_FLAGS: Final = ("page_size", "context_length", "max_running_requests", "prefill_max_requests")


class TransportBytes(Protocol):
    """A shard group's fixed transport buffers on one rank, B (``ShardedKVStore.transport_bytes``).

    Called by :meth:`PlanInputs.plan` with the plan's own figures.
    """

    def __call__(
        self,
        *,
        world_size: int,
        max_rows: int,
        block_topk: int,
        q_heads: int,
        head_dim: int,
        index_sharded: bool,
    ) -> int: ...


class IndexBufferBytes(Protocol):
    """A sharded index's candidate buffers on one rank, B (``ShardedIndex.candidate_bytes``).

    Called by :meth:`PlanInputs.plan` with the plan's own figures (``max_running``: its
    requests).
    """

    def __call__(self, *, world_size: int, block_topk: int, max_running: int) -> int: ...


def _text_config_mapping(config: object) -> Mapping[str, object]:
    """A model's text config as a mapping: an HF config object's ``to_dict()``, or the mapping.

    Raises:
        QSAConfigError: ``config`` is neither.
    """
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    if isinstance(config, Mapping):
        return config
    msg = f"expected an HF text config or a mapping, got {type(config)!r}"
    raise QSAConfigError(msg)


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """The inputs of :func:`plan_capacity` that an operator's serving flags resolve to.

    Attributes:
        profile: the model's geometry at the engine's page size.
        tp_size: TP ranks (the plan's figures are per rank).
        kv_dtype: the raw K/V dtype.
        context_len: tokens per request.
        num_requests: requests to plan for.
        staged_prompts: prompts the offload stages at once.
    """

    profile: QSAProfile
    tp_size: int
    kv_dtype: KVDType
    context_len: int
    num_requests: int
    staged_prompts: int

    @classmethod
    def from_flags(
        cls,
        text_config: Mapping[str, object],
        *,
        tp_size: int,
        kv_cache_dtype: str = "auto",
        page_size: int | None = None,
        context_length: int | None = None,
        max_running_requests: int | None = None,
        prefill_max_requests: int | None = None,
    ) -> PlanInputs:
        """Resolve the flags against the model's text config.

        Args:
            text_config: the model's (HF-style) text config.
            tp_size: TP ranks.
            kv_cache_dtype: the K/V dtype's name (:meth:`KVDType.parse`; ``auto`` is bf16).
            page_size: tokens per page; None: the profile's default (64).
            context_length: tokens per request; None: the config's
                ``max_position_embeddings`` (:meth:`QSAProfile.config_context_len`).
            max_running_requests: requests to plan for; required.
            prefill_max_requests: prompts staged at once; None: 1.

        Raises:
            QSAConfigError: no usable QSA profile, an unknown K/V dtype, no context length
                (neither given nor in the config), or no request count; the message names the
                value.
        """
        profile = (
            QSAProfile.from_text_config(text_config)
            if page_size is None
            else QSAProfile.from_text_config(text_config, page_size=page_size)
        )
        kv_dtype = KVDType.parse(kv_cache_dtype)
        context: object = context_length
        named = f"context_length={context_length!r}"
        if context is None:
            context = QSAProfile.config_context_len(text_config)
            named += f" and the config's max_position_embeddings={context!r}"
        if not is_int(context):
            msg = f"{named}; the plan needs the tokens of a request (allowed: a positive integer)"
            raise QSAConfigError(msg)
        if max_running_requests is None:
            msg = (
                "max_running_requests=None; the plan needs the request count "
                "(allowed: a positive integer)"
            )
            raise QSAConfigError(msg)
        return cls(
            profile=profile,
            tp_size=tp_size,
            kv_dtype=kv_dtype,
            context_len=context,
            num_requests=max_running_requests,
            staged_prompts=prefill_max_requests or 1,
        )

    @classmethod
    def from_args(cls, text_config: object, args: Any) -> PlanInputs:
        """:meth:`from_flags` of the attributes of parsed serving flags (an engine's or argparse's).

        ``args.tp_size`` is required; ``kv_cache_dtype`` defaults to ``auto``, and
        ``page_size``, ``context_length``, ``max_running_requests`` and
        ``prefill_max_requests`` to :meth:`from_flags`' defaults when absent (or None).
        ``text_config`` is an HF config object (read through its ``to_dict()``) or a mapping.

        Raises:
            QSAConfigError: as :meth:`from_flags`, or a config that is neither.
        """
        flags = {name: getattr(args, name, None) for name in _PLAN_FLAGS}
        return cls.from_flags(
            _text_config_mapping(text_config),
            tp_size=int(args.tp_size),
            kv_cache_dtype=str(getattr(args, "kv_cache_dtype", "auto")),
            **flags,
        )

    @property
    def q_heads_per_rank(self) -> int:
        """Query heads of one TP rank (at least 1; attention context parallelism off)."""
        return max(self.profile.num_attention_heads // self.tp_size, 1)

    def plan(
        self,
        gpu_budget_bytes: int,
        host_budget_bytes: int,
        *,
        sharding_size: int = 1,
        hot_slots: int | None = None,
        index_sharded: bool = False,
        transport_bytes: int | TransportBytes = 0,
        verify: bool = False,
        index_buffer_bytes: int | IndexBufferBytes = 0,
    ) -> CapacityPlan:
        """:func:`plan_capacity` of these inputs; the keywords are its own (budgets per rank, B).

        ``transport_bytes`` may be a :class:`TransportBytes`: with ``sharding_size > 1`` it is
        called for this plan's requests, query heads per rank, ``block_topk`` and head dim
        (without sharding the plan has no transport buffers). ``index_buffer_bytes`` may be an
        :class:`IndexBufferBytes`: with ``index_sharded`` it is called for this plan's requests,
        ``block_topk`` and :func:`index_ranks` (the shard group's, or every TP rank without
        cache sharding; one rank shards nothing, so there are then none).

        Raises:
            CapacityError: a budget or size :func:`plan_capacity` refuses.
            QSAConfigError: ``tp_size`` does not split the KV heads.
            PlacementError: a ``sharding_size`` that does not fit ``tp_size``.
        """
        if callable(transport_bytes):
            transport_bytes = (
                transport_bytes(
                    world_size=sharding_size,
                    max_rows=self.num_requests,
                    block_topk=self.profile.block_topk,
                    q_heads=self.q_heads_per_rank,
                    head_dim=self.profile.head_dim,
                    index_sharded=index_sharded,
                )
                if sharding_size > 1
                else 0
            )
        if callable(index_buffer_bytes):
            ranks = index_ranks(sharding_size, self.tp_size)  # D2 alone: every TP rank
            index_buffer_bytes = (
                index_buffer_bytes(
                    world_size=ranks,
                    block_topk=self.profile.block_topk,
                    max_running=self.num_requests,
                )
                if index_sharded and ranks > 1
                else 0
            )
        return plan_capacity(
            self.profile,
            tp_size=self.tp_size,
            kv_dtype=self.kv_dtype,
            gpu_budget_bytes=gpu_budget_bytes,
            host_budget_bytes=host_budget_bytes,
            context_len=self.context_len,
            num_requests=self.num_requests,
            sharding_size=sharding_size,
            hot_slots=hot_slots,
            index_sharded=index_sharded,
            staged_prompts=self.staged_prompts,
            transport_bytes=transport_bytes,
            verify=verify,
            index_buffer_bytes=index_buffer_bytes,
        )


@dataclass(frozen=True, slots=True)
class LabelledCapacity:
    """Double sparsity's bytes of a token on one rank, and what pool sizing charges.

    Attributes:
        kv_heads: the rank's KV heads.
        kv_token_bytes: a token's K/V on the rank, B.
        label_token_bytes: its label rows, B.
        price: the pool price (:meth:`PoolPrice.labelled`); None for DS-Offload without a
            request count (its buffers are sized by it).
    """

    kv_heads: int
    kv_token_bytes: int
    label_token_bytes: int
    price: PoolPrice | None


def labelled_capacity(
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    heavy_channels: int,
    kv_element_bytes: int,
    label_element_bytes: int,
    kv_token_bytes: int | None = None,
    offload_hot_blocks: int | None = None,
    rows: int | None = None,
    context_len: int | None = None,
    verify: bool = False,
    windowed_staging: bool = True,
) -> LabelledCapacity:
    """Double sparsity's price on one rank, from the attention geometry.

    A token costs its K/V and its label rows (:func:`label_bytes_per_token`), or with DS-Offload
    its label rows alone, and the offload's buffers for ``rows`` requests of ``context_len``
    tokens (:func:`ds_offload_sizes`) are fixed.

    Args:
        layers: attention layers (each carries labels).
        kv_heads: the rank's KV heads.
        head_dim: ``D``.
        heavy_channels: label channels per KV head.
        kv_element_bytes: bytes of one K/V element (2 for bf16, 1 for FP8).
        label_element_bytes: bytes of one label element.
        kv_token_bytes: the engine's own price of a token's K/V, B; None:
            ``layers × 2 × kv_heads × head_dim × kv_element_bytes``.
        offload_hot_blocks: DS-Offload's hot blocks per KV head (``DSConfig.hot_blocks``);
            None: the K/V stays resident.
        rows: DS-Offload's request rows (an engine's running-request limit); None prices no
            offload (:attr:`LabelledCapacity.price` None).
        context_len: tokens of one request's context (read with DS-Offload and ``rows``).
        verify: DS-Offload keeps a resident copy of every row.
        windowed_staging: DS-Offload stages a window of layers of the prompt, not every layer
            (:attr:`OffloadSizes.windowed_staging`).

    Raises:
        CapacityError: a size that is not a positive integer, or DS-Offload with ``rows`` and
            no ``context_len``.
    """
    kv = layers * 2 * kv_heads * head_dim * kv_element_bytes
    kv = kv if kv_token_bytes is None else kv_token_bytes
    labels = label_bytes_per_token(layers, kv_heads, heavy_channels, label_element_bytes)
    if offload_hot_blocks is None:
        return LabelledCapacity(
            kv_heads, kv, labels, PoolPrice.labelled(kv_token_bytes=kv, label_token_bytes=labels)
        )
    if rows is None:
        return LabelledCapacity(kv_heads, kv, labels, None)
    if context_len is None:
        msg = f"context_len=None with DS-Offload of rows={rows!r}; its buffers need one"
        raise CapacityError(msg)
    sizes = ds_offload_sizes(
        layers=layers,
        rows=rows,
        context_len=context_len,
        hot_blocks=offload_hot_blocks,
        kv_heads=kv_heads,
        head_dim=head_dim,
        element_bytes=kv_element_bytes,
        windowed_staging=windowed_staging,
    )
    price = PoolPrice.labelled(
        kv_token_bytes=kv, label_token_bytes=labels, offload=sizes, verify=verify
    )
    return LabelledCapacity(kv_heads, kv, labels, price)
