"""Double sparsity's decode steps on one rank: which rows are dense, and what each layer runs.

:class:`DSDecodeRuntime` is what an engine's attention backend calls around its own dense
attention; it knows nothing of the engine. The engine gives it host lengths, its token table
(request slot -> token slots), the batch's request slots, one layer's K/V buffers and queries:

- **Labels.** Wherever the engine writes a key, :meth:`~DSDecodeRuntime.write_labels` writes its
  label (its heavy channels) to the label cache (:class:`LabelCache`, ``[L, N, Hkv, C]`` over the
  engine's ``N`` token slots, one cache row), so the engine's token table addresses the labels,
  the keys and the values alike.
- **Eager decode.** :meth:`~DSDecodeRuntime.plan_step` takes the step's host lengths. When every
  row is dense by :meth:`DSConfig.is_dense` (its context is below ``sparse_decode_threshold`` or
  fits in the heavy tokens), the engine's dense attention decodes the step
  (:attr:`StepKind.DENSE`); otherwise every row goes through :meth:`~DSDecodeRuntime.decode`:
  :func:`ds_decode_split` (label scores, the heavy tokens per KV head, attention over them read
  in place from the engine's own K and V buffers; dense rows there attend every token; the torch
  references off CUDA).
- **Decode under CUDA graphs.** The captured step runs both paths over the whole batch, with no
  host input. The engine's dense attention decodes every row, but before each replay
  (:meth:`~DSDecodeRuntime.plan_graph_step`) it is given a length of 1 for the sparse rows, so
  they cost it one token; :func:`ds_heavy_decode_split` gives every row its heavy tokens (lengths
  on the device, the slot table gathered once per step inside the graph:
  :meth:`~DSDecodeRuntime.capture_tables`), and a device mask of the sparse rows, refreshed before
  each replay, picks each row's output (:meth:`~DSDecodeRuntime.decode_captured`). A batch whose
  rows are all dense answers as the dense attention's own graph, bit for bit.
- **DS-Offload** (with a :class:`qsa_kernels.offload.OffloadRuntime`): the K/V history lives in
  the offload's host arena and the engine plans each decode step in the offload runtime first.
  Every decode row, dense or sparse, chooses its tokens per KV head (:func:`ds_positions`: all of
  them for a dense row) and attends them through :meth:`OffloadRuntime.decode_tokens`, which
  fetches each head's own records of the blocks that hold them
  (:meth:`~DSDecodeRuntime.decode_offloaded`). Eagerly, each step's token lists are as wide as
  its longest list (from the host lengths); in a captured step the layers choose their tokens
  with the offload plan's lengths on the device and lists of a fixed width
  (:func:`ds_positions_fixed`, :meth:`DSConfig.fixed_width`), whose blocks the hot caches always
  hold (:meth:`DSConfig.hot_blocks` slots), so nothing is counted on the host.

The runtime counts the decode steps by how they ran and their rows by how they attended
(:class:`DSCounts`, padding rows of a captured batch left out) and hands every change to
``on_counts``, so an engine can export the numbers its own way.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from qsa_core import CountSeries
from qsa_kernels._errors import KernelInputError
from qsa_kernels.double_sparsity._config import DSConfig
from qsa_kernels.double_sparsity._decode import (
    ds_decode_split,
    ds_decode_split_reference,
    ds_heavy_decode_split,
    ds_heavy_decode_split_reference,
    ds_positions,
    ds_positions_fixed,
)
from qsa_kernels.double_sparsity._errors import DSStateError
from qsa_kernels.double_sparsity._label_cache import LabelCache

if TYPE_CHECKING:
    from qsa_kernels.offload import OffloadRuntime

__all__ = (
    "DSCounts",
    "DSDecodeRuntime",
    "DecodePath",
    "DenseLayer",
    "DenseLengths",
    "StepKind",
    "StepMode",
    "staging_slots",
    "staging_token_table",
)


class DecodePath(enum.StrEnum):
    """How a decode row attended."""

    DENSE = "dense"
    """Every token of its context."""
    SPARSE = "sparse"
    """Its heavy tokens per KV head."""


class StepMode(enum.StrEnum):
    """How a decode step ran."""

    EAGER = "eager"
    """Launched from the host (:meth:`DSDecodeRuntime.plan_step`)."""
    GRAPH = "graph"
    """Replayed from a captured CUDA graph (:meth:`DSDecodeRuntime.plan_graph_step`)."""


class StepKind(enum.StrEnum):
    """What the planned decode step asks of each layer (:attr:`DSDecodeRuntime.step_kind`)."""

    DENSE = "dense"
    """Every row dense, K/V resident: the engine's dense attention decodes the layer."""
    SPARSE = "sparse"
    """An eager step with a sparse row: :meth:`DSDecodeRuntime.decode` decodes every row."""
    CAPTURED = "captured"
    """A captured step: the engine's dense attention decodes every row, then
    :meth:`DSDecodeRuntime.decode_captured` picks each row's output."""
    OFFLOADED = "offloaded"
    """DS-Offload: :meth:`DSDecodeRuntime.decode_offloaded` decodes every row."""


@dataclasses.dataclass(frozen=True, slots=True)
class DSCounts:
    """What one runtime has decoded since it was built.

    Attributes:
        eager_steps: decode steps with at least one real row launched from the host.
        graph_steps: decode steps with at least one real row replayed from a captured graph.
        dense_rows: decode rows, once per step, that attended every token of their context.
        sparse_rows: decode rows, once per step, that attended their heavy tokens.
    """

    eager_steps: int = 0
    graph_steps: int = 0
    dense_rows: int = 0
    sparse_rows: int = 0

    @staticmethod
    def series() -> tuple[CountSeries, ...]:
        """Every field as a counter: ``decode_steps`` by ``mode``, ``decode_rows`` by ``path``."""
        steps_help = "Decode steps with at least one real row, by how they ran."
        rows_help = "Decode rows, once per step, by how they attended."
        return (
            *(
                CountSeries(f"{m.value}_steps", "decode_steps", True, steps_help, ("mode", m.value))
                for m in StepMode
            ),
            *(
                CountSeries(f"{p.value}_rows", "decode_rows", True, rows_help, ("path", p.value))
                for p in DecodePath
            ),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class DenseLengths:
    """The lengths a replayed step's dense attention is given: a sparse row's is 1.

    Attributes:
        seq_lens: ``[B]`` device lengths, the engine's ``seq_lens`` dtype.
        host: the same ``B`` lengths on the host.
    """

    seq_lens: torch.Tensor
    host: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class DenseLayer:
    """What the engine does for one decode layer that the runtime asks of it.

    :meth:`DSDecodeRuntime.decode_layer` calls each as the step's :class:`StepKind` needs.

    Attributes:
        attend: the engine's dense attention of the layer over every row, writing the step's new
            K/V as it always does; returns ``B`` rows of ``Hq * D`` values in the engine's shape.
        write_kv: writes the step's new K/V into the engine's buffers (where the dense attention
            does not run; the engine may skip it, e.g. when told not to save the K/V).
        buffers: the layer's key and value buffers, ``[N, Hkv, D]`` each over the engine's ``N``
            token slots, read after ``attend`` or ``write_kv``.
    """

    attend: Callable[[], torch.Tensor]
    write_kv: Callable[[], None]
    buffers: Callable[[], tuple[torch.Tensor, torch.Tensor]]


def staging_token_table(max_tokens: int, device: torch.device | str) -> torch.Tensor:
    """DS-Offload's prefill: a one-row token table over the staged prompt.

    The offload stages the prompt being prefilled with its token ``t`` at staging row ``t``; an
    engine's dense attention that reads its K/V through a token table (request slot -> token
    slots) reads the staging area through this one (every request at row 0).

    Returns:
        ``[1, max_tokens]`` int32 on ``device``: position ``t`` maps to staging row ``t``.
    """
    return torch.arange(max_tokens, dtype=torch.int32, device=device).unsqueeze(0)


def staging_slots(prefix: int, like: torch.Tensor) -> torch.Tensor:
    """DS-Offload's prefill: the staging rows of a chunk's ``prefix`` earlier tokens.

    For a dense attention that reads an extend's prefix through a flat list of token slots (one
    request a batch: DS-Offload stages one prompt at a time).

    Returns:
        ``[prefix]`` ``0 .. prefix - 1`` in ``like``'s dtype, on its device.
    """
    return torch.arange(prefix, dtype=like.dtype, device=like.device)


@dataclasses.dataclass(frozen=True, slots=True)
class _EagerStep:
    """An eager decode step: what every layer reads.

    Attributes:
        lengths: ``B`` host context lengths.
        slot_table: ``[B, max(lengths)]`` token slots of the batch's rows; None when every row is
            dense and the K/V resident (no layer reads it).
    """

    lengths: list[int]
    slot_table: torch.Tensor | None


@dataclasses.dataclass(slots=True)
class _CapturedStep:
    """The decode step being captured: what its layers read, all device tensors of fixed address.

    Attributes:
        sparse_rows: ``[B]`` bool, the rows that attend their heavy tokens (refreshed before each
            replay; DS-Offload decides per row on the device instead).
        offloaded: the offload runtime planned the step (DS-Offload, not an idle step).
        slot_table: ``[B, S]`` the batch's token slots, gathered inside the captured step.
        lengths: ``[B]`` int32, DS-Offload's planned row lengths after the new token (padding rows
            at 1), computed inside the captured step once for every layer.
    """

    sparse_rows: torch.Tensor
    offloaded: bool
    slot_table: torch.Tensor | None = None
    lengths: torch.Tensor | None = None


class DSDecodeRuntime:
    """Double sparsity's decode steps of one rank over an engine's token slots (module docstring).

    Args:
        labels: the slot-indexed label cache (``rows=1``, ``max_tokens`` the engine's token
            slots), one layer per attention layer, indexed by the engine's layer id.
        config: the double-sparsity options.
        offload: DS-Offload's runtime (the K/V in its host arena), or None for resident K/V.
        on_counts: called with the runtime's :class:`DSCounts` whenever they change.
    """

    def __init__(
        self,
        labels: LabelCache,
        config: DSConfig,
        *,
        offload: OffloadRuntime | None = None,
        on_counts: Callable[[DSCounts], None] | None = None,
    ) -> None:
        self.labels = labels
        self.config = config
        self.offload = offload
        self._reference = labels.device.type != "cuda"  # the torch references off CUDA
        self._step: _EagerStep | None = None
        self._captured: _CapturedStep | None = None  # set while a captured step is built
        self._sparse_rows: torch.Tensor | None = None  # [max_rows] bool, from init_graph_state
        self._counts = DSCounts()
        self._on_counts = on_counts
        self._report()

    @classmethod
    def over_slots(
        cls,
        channels: torch.Tensor,
        config: DSConfig,
        *,
        slots: int,
        kv_dtype: torch.dtype,
        device: torch.device | str,
        offload: OffloadRuntime | None = None,
        on_counts: Callable[[DSCounts], None] | None = None,
    ) -> DSDecodeRuntime:
        """A runtime over an engine's ``slots`` token slots (one label row per slot).

        Args:
            channels: ``[L, Hkv, C]`` this rank's heavy channels (:attr:`ChannelConfig.channels`).
            config: the double-sparsity options.
            slots: the engine's token slots, its padding slots included.
            kv_dtype: the dtype the engine stores keys in (labels: :meth:`LabelCache.dtype_for`).
            device: where the label cache lives.
            offload: as the constructor's.
            on_counts: as the constructor's.
        """
        labels = LabelCache(
            channels, rows=1, max_tokens=slots, dtype=LabelCache.dtype_for(kv_dtype), device=device
        )
        return cls(labels, config, offload=offload, on_counts=on_counts)

    def describe(self, head_dim: int) -> str:
        """One line of the options and the label cache, for an engine's start-up log."""
        c, labels = self.config, self.labels
        mib = labels.buffer.numel() * labels.buffer.element_size() / (1 << 20)
        return (
            f"{c.heavy_channel_num} heavy channels of {head_dim}, {c.heavy_token_num} heavy "
            f"tokens, dense below {c.sparse_decode_threshold} tokens; label cache "
            f"{labels.layers} layers x {labels.max_tokens} slots ({mib:.1f} MiB)"
        )

    @property
    def counts(self) -> DSCounts:
        """What the runtime has decoded so far."""
        return self._counts

    def write_labels(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor | None) -> None:
        """The labels of the keys the engine writes at ``slots`` (prefill and decode).

        Args:
            layer_id: the engine's layer id.
            slots: ``[N]`` int32/int64 token slots, on the label cache's device.
            k: ``[N, Hkv * D]`` (or ``[N, Hkv, D]``) the keys written there; None when the layer
                gave none (nothing is written).
        """
        if k is None:
            return
        keys = k if k.dim() == 3 else k.reshape(k.shape[0], self.labels.channels.shape[1], -1)
        self.labels.write_slots(layer_id, slots, keys)

    # ---- planning a step -------------------------------------------------------------------------

    def clear_step(self) -> None:
        """No decode step is planned (the engine prefills): every decode call is refused."""
        self._step = None
        self._captured = None

    def plan_step(
        self, lengths: Sequence[int], token_table: torch.Tensor, slots: torch.Tensor
    ) -> StepKind:
        """Plan an eager decode step; count it and its rows by path.

        Args:
            lengths: ``B`` host context lengths, the new token included.
            token_table: ``[R, S]`` int32/int64 token slots of each request slot's positions.
            slots: ``[B]`` the batch's request slots (rows of ``token_table``).

        Returns:
            What each layer of the step runs (:attr:`step_kind`). The step's slot table
            (``token_table[slots, :max(lengths)]``) is gathered only for a layer that reads it.
        """
        self._captured = None
        lengths = [int(n) for n in lengths]
        all_dense = self._count(lengths, StepMode.EAGER) == len(lengths)
        table = None
        if not all_dense or self.offload is not None:
            table = token_table[slots, : max(lengths)]
        self._step = _EagerStep(lengths, table)
        return self.step_kind

    def init_graph_state(self, max_rows: int) -> None:
        """Allocate the captured steps' mask of sparse rows, ``[max_rows]`` bool on the device."""
        self._sparse_rows = torch.zeros(max_rows, dtype=torch.bool, device=self.labels.device)

    def plan_graph_step(
        self,
        seq_lens: torch.Tensor,
        lengths: Sequence[int] | None = None,
        *,
        capture: bool = False,
        padding: int = 0,
        idle: bool = False,
    ) -> DenseLengths | None:
        """Before a CUDA graph's capture or replay: the mask of sparse rows, and the step counted.

        At a capture every layer of the step is built (:attr:`StepKind.CAPTURED`, or
        ``OFFLOADED``); its tables come inside the captured step (:meth:`capture_tables`). A
        replay refreshes the mask the captured step reads and counts the step's real rows.

        Args:
            seq_lens: ``[B]`` int device lengths of the padded batch, the new token included.
            lengths: the same on the host; None at a capture (no host read there).
            capture: the step is being captured.
            padding: the last rows of the batch that are padding (not counted).
            idle: a step without rows to attend (an engine's empty batch): the offload runtime
                did not plan it.

        Returns:
            At a replay, the lengths to give the dense attention's metadata (the sparse rows at
            1; with DS-Offload, which the dense attention decodes no row of, every row at 1);
            None when it takes the batch's own (at a capture, and for an all-dense resident
            batch, which answers as the dense attention's graph).

        Raises:
            DSStateError: :meth:`init_graph_state` has not run.
            KernelInputError: a replay without host lengths.
        """
        self._step = None
        if self._sparse_rows is None:
            msg = "plan_graph_step before init_graph_state: a CUDA graph step before its buffers"
            raise DSStateError(msg)
        sparse = self.config.sparse_rows(seq_lens)
        mask = self._sparse_rows[: sparse.shape[0]]
        mask.copy_(sparse)
        offloaded = self.offload is not None and not idle
        if offloaded:
            sparse = torch.ones_like(sparse)  # the dense attention decodes no row
        if capture:
            self._captured = _CapturedStep(mask, offloaded)
            return None
        if lengths is None:
            msg = "plan_graph_step of a replay needs the step's host lengths; got None"
            raise KernelInputError(msg)
        lengths = [int(n) for n in lengths]
        real = len(lengths) - padding
        all_dense = self._count(lengths[:real], StepMode.GRAPH) == real
        if all_dense and self.offload is None:  # the dense attention's own metadata
            return None
        host = tuple(n if self.offload is None and self.config.is_dense(n) else 1 for n in lengths)
        return DenseLengths(torch.where(sparse, torch.ones_like(seq_lens), seq_lens), host)

    def capture_tables(self, token_table: torch.Tensor, slots: torch.Tensor) -> None:
        """Inside the captured step: what every layer reads, once per step.

        The batch's slot table (``token_table[slots]``, ``[B, S]``) and, with DS-Offload, the
        offload plan's row lengths. Nothing without a captured decode step (an extend batch's
        graph).

        Args:
            token_table: ``[R, S]`` int32/int64 token slots of each request slot's positions.
            slots: ``[B]`` the batch's request slots.
        """
        captured = self._captured
        if captured is None:
            return
        captured.slot_table = token_table[slots]
        if captured.offloaded and self.offload is not None:
            captured.lengths = self.offload.kv.step_lengths

    @property
    def step_kind(self) -> StepKind:
        """What each layer of the planned step runs.

        Raises:
            DSStateError: no decode step is planned (:meth:`plan_step`, :meth:`plan_graph_step`).
        """
        if self._captured is not None:
            return StepKind.CAPTURED if self.offload is None else StepKind.OFFLOADED
        step = self._step
        if step is None:
            msg = "a decode layer before its step's plan (plan_step or plan_graph_step)"
            raise DSStateError(msg)
        if self.offload is not None:
            return StepKind.OFFLOADED
        return StepKind.DENSE if step.slot_table is None else StepKind.SPARSE

    # ---- one layer of the step -------------------------------------------------------------------

    def extend_layer(
        self,
        layer_id: int,
        slots: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        attend: Callable[[], torch.Tensor],
    ) -> torch.Tensor:
        """One prefill layer: the engine's dense prefill, and the labels of the keys it writes.

        With DS-Offload ``attend`` stages the chunk and attends over the staged prompt
        (:func:`staging_token_table`, :func:`staging_slots`); the labels are written first.

        Args:
            layer_id: the engine's layer id.
            slots: ``[N]`` token slots the chunk's keys are written at.
            k: ``[N, Hkv * D]`` the chunk's keys, or None when the layer gave none.
            v: ``[N, Hkv * D]`` its values, or None.
            attend: the engine's dense prefill of the layer; its output is returned as is.

        Raises:
            KernelInputError: DS-Offload, and the layer gave no K/V (every chunk is staged).
        """
        if self.offload is not None:
            if k is None or v is None:
                msg = f"DS-Offload stages every prefill chunk's K/V; layer {layer_id} gave none"
                raise KernelInputError(msg)
            self.write_labels(layer_id, slots, k)
            return attend()
        out = attend()
        self.write_labels(layer_id, slots, k)
        return out

    def decode_layer(  # noqa: PLR0917 (decode's order, then the engine's side)
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        slots: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        engine: DenseLayer,
    ) -> torch.Tensor:
        """One layer of the planned decode step, as its :attr:`step_kind` asks.

        The new keys' labels first; then :attr:`StepKind.DENSE`: the engine's dense attention;
        ``CAPTURED``: the dense attention, then :meth:`decode_captured` over the buffers;
        ``OFFLOADED``: :meth:`decode_offloaded`; ``SPARSE``: the engine writes the new K/V (when
        it gave one), then :meth:`decode` over the buffers.

        Args:
            layer_id: the engine's layer id.
            q: ``[B, Hq, D]`` queries.
            k: ``[B, Hkv * D]`` the new token's keys, or None when the layer gave none.
            v: ``[B, Hkv * D]`` its values, or None.
            slots: ``[B]`` token slots the new keys are written at.
            seq_lens: ``[B]`` int device lengths, the new token included (a captured step's).
            scale: softmax scale.
            engine: the engine's side of the layer (:class:`DenseLayer`).

        Returns:
            ``B`` rows of ``Hq * D`` values: the dense attention's output as it gave it (``DENSE``,
            ``CAPTURED``: its shape), else ``[B, Hq * D]`` in ``q``'s dtype.

        Raises:
            KernelInputError: an offloaded step, and the layer gave no K/V.
            DSStateError: no decode step is planned.
        """
        self.write_labels(layer_id, slots, k)
        kind = self.step_kind
        if kind is StepKind.DENSE:
            return engine.attend()
        if kind is StepKind.CAPTURED:
            dense = engine.attend()  # writes this step's K/V
            k_buffer, v_buffer = engine.buffers()
            return self.decode_captured(layer_id, q, k_buffer, v_buffer, seq_lens, dense, scale)
        if kind is StepKind.OFFLOADED:
            if k is None or v is None:
                msg = f"an offloaded decode needs the new token's K/V; layer {layer_id} gave none"
                raise KernelInputError(msg)
            out = self.decode_offloaded(layer_id, q, k, v, scale)
        else:
            if k is not None and v is not None:
                engine.write_kv()
            k_buffer, v_buffer = engine.buffers()
            out = self.decode(layer_id, q, k_buffer, v_buffer, scale)
        return out.reshape(q.shape[0], -1)

    def decode(
        self,
        layer_id: int,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One layer of an eager step with a sparse row (:attr:`StepKind.SPARSE`).

        Every row through :func:`ds_decode_split` (its reference off CUDA) over the engine's
        buffers, which already hold the step's new token.

        Args:
            layer_id: the engine's layer id.
            q: ``[B, Hq, D]`` queries (attended in bf16).
            k_buffer: ``[N, Hkv, D]`` keys of every token slot of the layer.
            v_buffer: ``[N, Hkv, D]`` values, same shape and dtype.
            scale: softmax scale.

        Returns:
            ``[B, Hq, D]`` attention output, in ``q``'s dtype.

        Raises:
            DSStateError: the planned step is not :attr:`StepKind.SPARSE`.
        """
        step = self._step
        if self.offload is not None or step is None or step.slot_table is None:
            msg = (
                f"decode needs an eager resident step with a sparse row; the step is {self._kind()}"
            )
            raise DSStateError(msg)
        decode = ds_decode_split_reference if self._reference else ds_decode_split
        result = decode(
            q.to(torch.bfloat16),
            k_buffer,
            v_buffer,
            self.labels.layer(layer_id),
            self.labels.channels[layer_id],
            step.slot_table,
            step.lengths,
            config=self.config,
            scale=float(scale),
        )
        return result.out.to(q.dtype)

    def decode_captured(  # noqa: PLR0917 (decode's order, then the captured step's inputs)
        self,
        layer_id: int,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        seq_lens: torch.Tensor,
        dense_out: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One layer of a captured step (:attr:`StepKind.CAPTURED`): no host input.

        Every row's heavy tokens through :func:`ds_heavy_decode_split` (its reference off CUDA);
        the step's mask picks each row's output from them or from the dense attention's.

        Args:
            layer_id: the engine's layer id.
            q: ``[B, Hq, D]`` queries (attended in bf16).
            k_buffer: ``[N, Hkv, D]`` keys of every token slot of the layer, with the new token.
            v_buffer: ``[N, Hkv, D]`` values, same shape and dtype.
            seq_lens: ``[B]`` int device lengths, the new token included.
            dense_out: the dense attention's output of every row, ``B`` rows of ``Hq * D``
                values in any shape.
            scale: softmax scale.

        Returns:
            ``dense_out``'s shape and dtype: each sparse row's heavy-token output, each other
            row's ``dense_out``.

        Raises:
            DSStateError: no resident step is being captured, or :meth:`capture_tables` has not
                run.
        """
        captured = self._captured
        if captured is None or self.offload is not None:
            msg = f"decode_captured outside a captured resident step; the step is {self._kind()}"
            raise DSStateError(msg)
        if captured.slot_table is None:
            msg = "decode_captured before capture_tables (the captured step's slot table)"
            raise DSStateError(msg)
        rows = captured.sparse_rows.shape[0]
        heavy = ds_heavy_decode_split_reference if self._reference else ds_heavy_decode_split
        sparse = heavy(
            q[:rows].to(torch.bfloat16),
            k_buffer,
            v_buffer,
            self.labels.layer(layer_id),
            self.labels.channels[layer_id],
            captured.slot_table,
            seq_lens[:rows],
            heavy_token_num=self.config.heavy_token_num,
            scale=float(scale),
        ).out.reshape(rows, -1)
        pick = captured.sparse_rows[:, None]
        dense = dense_out.view(rows, -1)
        return torch.where(pick, sparse.to(dense_out.dtype), dense).view_as(dense_out)

    def decode_offloaded(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """One layer of a DS-Offload step (:attr:`StepKind.OFFLOADED`): tokens per KV head.

        Eagerly the token lists are as wide as the step's longest (:func:`ds_positions`); in a
        captured step they have the fixed width and the lengths come from the offload plan on the
        device (:func:`ds_positions_fixed`, no host input). Then
        :meth:`OffloadRuntime.decode_tokens` writes the new token and attends the chosen ones.

        Args:
            layer_id: the engine's layer id.
            q: ``[B, Hq, D]`` queries (attended in bf16).
            k: ``[B, Hkv * D]`` the new token's keys.
            v: ``[B, Hkv * D]`` its values.
            scale: softmax scale.

        Returns:
            ``[B, Hq, D]`` attention output, in ``q``'s dtype.

        Raises:
            DSStateError: the runtime has no offload, or its step is not planned (or a captured
                step's tables are not set).
        """
        offload, step, captured = self.offload, self._step, self._captured
        if offload is None:
            msg = "decode_offloaded needs DS-Offload's runtime; this runtime's K/V is resident"
            raise DSStateError(msg)
        queries = q.to(torch.bfloat16)
        labels = (self.labels.layer(layer_id), self.labels.channels[layer_id])
        if (
            captured is not None
            and captured.slot_table is not None
            and captured.lengths is not None
        ):
            positions = ds_positions_fixed(
                queries,
                *labels,
                captured.slot_table,
                captured.lengths,
                config=self.config,
                reference=self._reference,
            )
        elif captured is None and step is not None and step.slot_table is not None:
            positions = ds_positions(
                queries,
                *labels,
                step.slot_table,
                step.lengths,
                config=self.config,
                reference=self._reference,
            )
        else:
            msg = (
                "decode_offloaded before its step's plan (plan_step, or plan_graph_step and "
                "capture_tables)"
            )
            raise DSStateError(msg)
        out = offload.decode_tokens(
            layer_id, queries, k, v, positions, float(scale), checked=captured is None
        )
        return out.reshape(*q.shape[:2], -1).to(q.dtype)

    # ---- internals -------------------------------------------------------------------------------

    def _kind(self) -> str:
        """The planned step's kind for a message ("not planned" when none)."""
        try:
            return repr(self.step_kind.value)
        except DSStateError:
            return "not planned"

    def _count(self, lengths: list[int], mode: StepMode) -> int:
        """Count a step and its rows by path; return how many rows are dense."""
        dense = sum(bool(self.config.is_dense(n)) for n in lengths)
        if lengths:
            c, eager = self._counts, int(mode is StepMode.EAGER)
            self._counts = DSCounts(
                eager_steps=c.eager_steps + eager,
                graph_steps=c.graph_steps + 1 - eager,
                dense_rows=c.dense_rows + dense,
                sparse_rows=c.sparse_rows + len(lengths) - dense,
            )
            self._report()
        return dense

    def _report(self) -> None:
        if self._on_counts is not None:
            self._on_counts(self._counts)
