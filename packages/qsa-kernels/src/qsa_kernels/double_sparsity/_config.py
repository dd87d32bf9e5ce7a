"""Double-sparsity options and the heavy-channel calibration file.

The calibration file is the JSON the original SGLang integration read with
``--ds-channel-config-path``: an object whose keys are
``model.layers.{i}.self_attn.{q,k,qk}_proj`` and whose values are ``[heads][n]`` lists of channel
indices into the head dim, most important first (the offline calibration of arXiv 2408.07092 ranks
every channel, so ``n`` is usually ``D``). The original sliced ``[:, :heavy_channel_num]`` of the
key chosen by ``--ds-heavy-channel-type`` and gathered K with it; that broke on GQA models whose
files list one row per *query* head. Here a file may list one row per KV head (used as is) or one
row per query head (reduced to its KV head, see :func:`reduce_group_channels`).
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from qsa_core import JSONFileError, read_json_file
from qsa_kernels._geometry import BLOCK_TOKENS
from qsa_kernels.double_sparsity._errors import ChannelConfigError, DSConfigError

__all__ = (
    "CHANNEL_CONFIG_MAX_BYTES",
    "ChannelConfig",
    "DSConfig",
    "HeavyChannelType",
    "layer_key",
    "reduce_group_channels",
)

logger = logging.getLogger(__name__)

#: Most bytes of a channel file: a full ranking of 256 channels for 128 query heads of 96 layers
#: (3.1 M integers) written with one space of indent per level takes about 25 MiB.
CHANNEL_CONFIG_MAX_BYTES = 64 << 20


class HeavyChannelType(enum.Enum):
    """Which calibration ranks the heavy channels (``--ds-heavy-channel-type``)."""

    Q = "q"
    K = "k"
    QK = "qk"

    @classmethod
    def parse(cls, value: str | HeavyChannelType) -> HeavyChannelType:
        """The member named by ``value`` (``"q"``, ``"k"`` or ``"qk"``); raises DSConfigError."""
        if isinstance(value, HeavyChannelType):
            return value
        for member in cls:
            if member.value == value:
                return member
        msg = (
            f"heavy_channel_type={value!r} is not allowed; allowed: {tuple(m.value for m in cls)!r}"
        )
        raise DSConfigError(msg)


def _positive_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        msg = f"{name}={value!r} is not allowed; it must be an int >= {minimum!r}"
        raise DSConfigError(msg)


def check_attention_shape(num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Refuse an attention shape a channel config cannot describe.

    Raises:
        DSConfigError: a count that is not a positive int, or ``num_kv_heads`` not dividing
            ``num_q_heads``.
    """
    for name, value in (
        ("num_q_heads", num_q_heads),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        _positive_int(name, value, minimum=1)
    if num_q_heads % num_kv_heads:
        msg = f"num_q_heads={num_q_heads!r} must be a multiple of num_kv_heads={num_kv_heads!r}"
        raise DSConfigError(msg)


@dataclass(frozen=True, slots=True)
class DSConfig:
    """Double-sparsity options, validated once at construction.

    The defaults are those of the original SGLang integration's server arguments.

    Attributes:
        heavy_channel_num: heavy channels ``C`` per KV head kept in the label cache
            (``--ds-heavy-channel-num``, default 32).
        heavy_token_num: tokens attended per (request, KV head) (``--ds-heavy-token-num``,
            default 256).
        heavy_channel_type: calibration used to rank channels (``--ds-heavy-channel-type``,
            default ``qk``); a string is parsed.
        sparse_decode_threshold: a request whose context is shorter than this many tokens attends
            densely (``--ds-sparse-decode-threshold``, default 4096; 0 = always sparse).
        staging_window: DS-Offload stages a prompt by a window of layers (each chunk written
            through to the host arena, a layer's prefix read back from there) instead of the
            whole prompt of every layer on the device (default True;
            :attr:`qsa_core.OffloadSizes.windowed_staging`). Not read without DS-Offload.
    """

    heavy_channel_num: int = 32
    heavy_token_num: int = 256
    heavy_channel_type: HeavyChannelType = HeavyChannelType.QK
    sparse_decode_threshold: int = 4096
    staging_window: bool = True

    def __post_init__(self) -> None:
        _positive_int("heavy_channel_num", self.heavy_channel_num, minimum=1)
        _positive_int("heavy_token_num", self.heavy_token_num, minimum=1)
        _positive_int("sparse_decode_threshold", self.sparse_decode_threshold, minimum=0)
        window: object = self.staging_window
        if not isinstance(window, bool):
            msg = f"staging_window={window!r} is not allowed; allowed: True or False"
            raise DSConfigError(msg)
        parsed = HeavyChannelType.parse(self.heavy_channel_type)
        object.__setattr__(self, "heavy_channel_type", parsed)

    def is_dense(self, seq_len: int) -> bool:
        """Whether a request of ``seq_len`` tokens attends to all of them.

        True below ``sparse_decode_threshold`` and when the context fits in ``heavy_token_num``
        (then the selection is every token anyway).
        """
        return seq_len < self.sparse_decode_threshold or seq_len <= self.heavy_token_num

    def hot_blocks(self) -> int:
        """Hot-cache slots one KV head's decode step of one layer and row may fill (DS-Offload).

        DS-Offload's records hold one head each.
        A dense row reads every complete block of its context (at most ``max(threshold - 1,
        heavy_token_num)`` tokens), a sparse row the blocks that hold the head's heavy tokens (at
        most ``heavy_token_num``); a hot cache of this many slots (or of a row's whole context,
        if smaller) never runs short.
        """
        return max(self.heavy_token_num, self.fixed_width() // BLOCK_TOKENS)

    def fixed_width(self) -> int:
        """Positions per (row, KV head) that a step of fixed shapes lists (CUDA graphs).

        The longest list any row may need: a dense row's whole context (below the threshold, or
        within ``heavy_token_num``) or a sparse row's heavy tokens, ``max(threshold - 1,
        heavy_token_num)``.
        """
        return max(self.sparse_decode_threshold - 1, self.heavy_token_num)

    def sparse_rows(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """:meth:`is_dense`'s negation element-wise, on the device: no host read.

        Args:
            seq_lens: ``[B]`` integer context lengths.

        Returns:
            ``[B]`` bool on ``seq_lens``' device, True for the rows that attend heavy tokens.
        """
        return (seq_lens >= self.sparse_decode_threshold) & (seq_lens > self.heavy_token_num)


def layer_key(layer: int, channel_type: HeavyChannelType) -> str:
    """The calibration key of one layer: ``model.layers.{layer}.self_attn.{type}_proj``."""
    return f"model.layers.{layer}.self_attn.{channel_type.value}_proj"


def reduce_group_channels(ranked: Sequence[Sequence[int]], count: int) -> list[int]:
    """Heavy channels of one KV head from the ranked channels of its query heads.

    Each query head votes for its first ``count`` channels with weight ``count - rank`` (its top
    channel scores ``count``); the ``count`` channels with the largest total win, ties broken by
    the best rank any head gave the channel, then by the smaller index. The result is in that
    order (most important first). With one query head this is its first ``count`` channels.

    Args:
        ranked: ``G`` lists of distinct channel indices, most important first, each of length
            ``>= count``.
        count: channels to keep ``C``.

    Returns:
        ``count`` distinct channel indices.
    """
    votes: dict[int, int] = {}
    best: dict[int, int] = {}
    for channels in ranked:
        for rank, ch in enumerate(channels[:count]):
            votes[ch] = votes.get(ch, 0) + (count - rank)
            best[ch] = min(best.get(ch, rank), rank)
    order = sorted(votes, key=lambda ch: (-votes[ch], best[ch], ch))
    if len(order) < count:  # only with one head shorter than count; the loader rules that out
        msg = f"{len(order)!r} distinct channels cannot fill {count!r} heavy channels"
        raise DSConfigError(msg)
    return order[:count]


@dataclass(frozen=True, slots=True)
class ChannelConfig:
    """Heavy channels of every attention layer, per KV head, as the label kernel expects.

    Attributes:
        source: the file (or ``"<mapping>"``) the channels came from, for messages.
        channel_type: the calibration used.
        layers: the model layer indices, in the order of ``channels``' first dim.
        channels: ``[L, Hkv, C]`` int32 (CPU) heavy channel indices into ``[0, D)``, distinct per
            KV head, most important first.
    """

    source: str
    channel_type: HeavyChannelType
    layers: tuple[int, ...]
    channels: torch.Tensor

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        config: DSConfig,
        layers: Sequence[int],
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> ChannelConfig:
        """Read and validate a calibration file (see :meth:`from_mapping`).

        The file is read with :func:`qsa_core.read_json_file`'s bounds: at most
        :data:`CHANNEL_CONFIG_MAX_BYTES`, UTF-8, integers of at most 19 digits, nesting of at most
        64 levels.

        Raises:
            ChannelConfigError: the file cannot be read, is not bounded JSON, or fails validation.
        """
        source = os.fspath(path)
        try:
            data = read_json_file(source, what="channel config", max_bytes=CHANNEL_CONFIG_MAX_BYTES)
        except JSONFileError as exc:
            raise ChannelConfigError(str(exc)) from None
        return cls.from_mapping(
            data,
            source=source,
            config=config,
            layers=layers,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )

    @classmethod
    def from_mapping(
        cls,
        data: object,
        *,
        source: str = "<mapping>",
        config: DSConfig,
        layers: Sequence[int],
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> ChannelConfig:
        """Validate parsed calibration data and select ``config.heavy_channel_num`` per KV head.

        For each layer ``i`` in ``layers`` the key ``model.layers.{i}.self_attn.{type}_proj``
        must hold ``num_kv_heads`` or ``num_q_heads`` rows; each row a list of distinct ints in
        ``[0, head_dim)`` with at least ``heavy_channel_num`` entries. Rows per query head are
        reduced per KV group with :func:`reduce_group_channels`; rows per KV head are cut to
        their first ``heavy_channel_num``. Other keys are ignored.

        Raises:
            ChannelConfigError: naming ``source``, the key, the head, the bad value and what is
                allowed.
        """
        check_attention_shape(num_q_heads, num_kv_heads, head_dim)
        count = config.heavy_channel_num
        if count > head_dim:
            msg = f"heavy_channel_num={count!r} is not allowed; allowed: 1..head_dim={head_dim!r}"
            raise DSConfigError(msg)
        if not layers:
            msg = "layers is empty; name at least one attention layer"
            raise DSConfigError(msg)
        if not isinstance(data, Mapping):
            msg = (
                f"{source!r}: top level is {type(data).__name__!r}; expected a JSON object "
                f"mapping keys like {layer_key(0, config.heavy_channel_type)!r} to [heads][n] lists"
            )
            raise ChannelConfigError(msg)
        group = num_q_heads // num_kv_heads
        per_layer = []
        for layer in layers:
            key = layer_key(layer, config.heavy_channel_type)
            rows = _layer_rows(data, key, source, num_q_heads, num_kv_heads)
            checked = [
                _checked_row(row, source=source, key=key, head=h, head_dim=head_dim, count=count)
                for h, row in enumerate(rows)
            ]
            if len(checked) == num_kv_heads:
                per_layer.append([row[:count] for row in checked])
            else:
                per_layer.append(
                    [
                        reduce_group_channels(checked[g * group : (g + 1) * group], count)
                        for g in range(num_kv_heads)
                    ]
                )
        channels = torch.tensor(per_layer, dtype=torch.int32)
        logger.info(
            "loaded %d heavy channels per KV head for %d layers from %s (%s)",
            count,
            len(per_layer),
            source,
            config.heavy_channel_type.value,
        )
        return cls(source, config.heavy_channel_type, tuple(int(x) for x in layers), channels)

    def for_tp_rank(self, tp_size: int, tp_rank: int) -> ChannelConfig:
        """The channels of the K/V heads one tensor-parallel rank holds, in SGLang's order.

        With ``Hkv >= tp_size`` the heads split into runs: rank ``r`` holds heads
        ``[r * Hkv / tp_size, (r + 1) * Hkv / tp_size)``. With fewer heads than ranks each head
        is replicated on ``tp_size / Hkv`` consecutive ranks: rank ``r`` holds head
        ``r // (tp_size / Hkv)`` (how SGLang's QKV projection assigns them).

        Returns:
            A config whose ``channels`` are ``[L, Hkv_rank, C]``; itself at ``tp_size`` 1.

        Raises:
            DSConfigError: ``tp_size`` < 1, ``tp_rank`` outside ``[0, tp_size)``, or heads and
                ranks that divide neither way (the message names the sizes that do).
        """
        _positive_int("tp_size", tp_size, minimum=1)
        if not 0 <= tp_rank < tp_size:
            msg = f"tp_rank={tp_rank!r} is not allowed; allowed: 0 to {tp_size - 1}"
            raise DSConfigError(msg)
        heads = int(self.channels.shape[1])
        if tp_size == 1:
            return self
        if heads % tp_size and tp_size % heads:
            divisors = [n for n in range(1, heads + 1) if heads % n == 0]
            msg = (
                f"tp_size={tp_size!r} does not split {heads!r} K/V heads (each rank needs whole "
                f"heads, or one head replicated on a whole run of ranks); allowed: a divisor "
                f"{divisors!r} or a multiple of {heads!r}"
            )
            raise DSConfigError(msg)
        if heads >= tp_size:
            per_rank = heads // tp_size
            chosen = slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)
        else:
            head = tp_rank // (tp_size // heads)
            chosen = slice(head, head + 1)
        return replace(self, channels=self.channels[:, chosen].contiguous())

    def layer_channels(self, layer: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``[Hkv, C]`` int32 heavy channels of model layer ``layer`` on ``device``."""
        try:
            index = self.layers.index(layer)
        except ValueError:
            msg = f"layer={layer!r} is not in the channel config; allowed: {self.layers!r}"
            raise DSConfigError(msg) from None
        return self.channels[index].to(device) if device is not None else self.channels[index]


def _layer_rows(
    data: Mapping[Any, Any], key: str, source: str, num_q_heads: int, num_kv_heads: int
) -> list[Any]:
    if key not in data:
        sample = sorted(str(k) for k in data)[:4]
        msg = (
            f"{source!r}: layer key {key!r} is missing; the file has {len(data)!r} keys, e.g. "
            f"{sample!r} (a 'q'/'k' file and a 'qk' file may need merging)"
        )
        raise ChannelConfigError(msg)
    rows = data[key]
    allowed = sorted({num_kv_heads, num_q_heads})
    if not isinstance(rows, list) or len(rows) not in allowed:
        got = f"{len(rows)!r} rows" if isinstance(rows, list) else f"a {type(rows).__name__!r}"
        msg = (
            f"{source!r}: {key!r} has {got}; expected a list of one row per KV head or per query "
            f"head, i.e. {' or '.join(str(n) for n in allowed)} rows"
        )
        raise ChannelConfigError(msg)
    return rows


def _checked_row(
    row: object, *, source: str, key: str, head: int, head_dim: int, count: int
) -> list[int]:
    where = f"{source!r}: {key!r} head {head!r}"
    if not isinstance(row, list):
        msg = f"{where}: row is a {type(row).__name__!r}; expected a list of channel indices"
        raise ChannelConfigError(msg)
    seen: set[int] = set()
    for rank, ch in enumerate(row):
        if isinstance(ch, bool) or not isinstance(ch, int):
            msg = f"{where}: entry {rank!r} is {ch!r}; channel indices must be ints"
            raise ChannelConfigError(msg)
        if not 0 <= ch < head_dim:
            msg = (
                f"{where}: channel {ch!r} at rank {rank!r} is out of range; "
                f"allowed: [0, {head_dim!r})"
            )
            raise ChannelConfigError(msg)
        if ch in seen:
            msg = (
                f"{where}: channel {ch!r} repeats at rank {rank!r}; "
                "a ranking lists each channel once"
            )
            raise ChannelConfigError(msg)
        seen.add(ch)
    if len(row) < count:
        msg = (
            f"{where}: {len(row)!r} channels listed; heavy_channel_num={count!r} needs at least "
            f"{count!r}"
        )
        raise ChannelConfigError(msg)
    return row
