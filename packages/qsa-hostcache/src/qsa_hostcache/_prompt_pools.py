"""A prompt's checkpoint composed from an engine's pools, and put back into them.

:class:`PromptCheckpoints` moves named segments; :class:`PromptPools` says which segments a
prompt's checkpoint holds and where each lives in an engine's pools, as plain tensors: each
attention layer's K/V (the engine stages them ``[T, Hkv, D]`` a layer), every layer's compressed
index keys (one ``[S / ratio, Hi, Di]`` buffer a layer, addressed by token slot, stored as one
``[T / ratio, L, Hi, Di]`` segment) and, if the model has one, the request's recurrent state
(:class:`StateSegments`). The index is read and written through an :class:`IndexAccess`: by
default the buffers themselves (:class:`BufferIndex`); an engine that keeps the index elsewhere
(sharded over ranks) passes its own. The engine keeps its own requests, slots and allocator, and
passes what they hold to these calls. The rules of when a prompt is looked up, loaded and
published are here too (:meth:`PromptPools.publishes`, :func:`host_hit`,
:func:`admits_host_hit`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from qsa_hostcache._arena import CopyFence
from qsa_hostcache._cache import Lease
from qsa_hostcache._keys import PrefixKey
from qsa_hostcache._prompts import Claim, PromptCheckpoints
from qsa_hostcache._segments import INDEX_SEGMENT, StateSegments, compressed_slots, kv_segments

__all__ = (
    "BufferIndex",
    "IndexAccess",
    "PromptPools",
    "TokenSlots",
    "admits_host_hit",
    "host_hit",
)

#: ``(k_layers, v_layers)``: each attention layer's K/V, ``[T, Hkv, D]`` a layer.
KVLayers = tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]


def host_hit(found: int, device_tokens: int) -> int:
    """Tokens a host checkpoint of ``found`` tokens adds beyond the engine's device prefix hit.

    0 when the checkpoint is no longer than what the device cache already holds.
    """
    return found - device_tokens if found > device_tokens else 0


def admits_host_hit(pending_tokens: int, *, device_cache_disabled: bool) -> bool:
    """Whether a request must be admitted on the engine's path that loads its host hit.

    An engine whose device prefix cache is off may admit some requests on a path that skips
    prefix loading; a request with ``pending_tokens > 0`` of host hit must not take it.
    """
    return device_cache_disabled and pending_tokens > 0


@runtime_checkable
class IndexAccess(Protocol):
    """Every layer's compressed index rows, read for a checkpoint and written by a restore.

    A row is a logical compressed-index row (``token slot // ratio`` of its group's first
    token, :func:`compressed_slots`); a value is that row of every layer, ``[L, Hi, Di]``.

    :meth:`read` may be collective (an index sharded over ranks gathers the rows the other ranks
    hold): :meth:`PromptPools.gather` calls it first, before it reads anything else of the
    engine's, and every rank that serves the request calls ``gather`` (the decisions before it
    are the same on every rank; a rank-local refusal, such as a full arena, comes after it and
    is agreed). :meth:`write` is never collective: a restore happens under a rank-local claim.
    """

    @property
    def device(self) -> torch.device:
        """Where :meth:`read` returns the rows and :meth:`write` takes them."""
        ...

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """``[R, L, Hi, Di]`` the values of ``rows`` (``[R]`` int64 on :attr:`device`)."""
        ...

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values`` ``[R, L, Hi, Di]`` at ``rows`` (``[R]`` int64 on :attr:`device`)."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class BufferIndex:
    """:class:`IndexAccess` of every layer's whole index buffer, indexed directly.

    Attributes:
        buffers: each layer's ``[S / ratio, Hi, Di]`` compressed index rows, one per ``ratio``
            token slots (``S`` the slots the engine has), all on one device.
    """

    buffers: tuple[torch.Tensor, ...]

    @property
    def device(self) -> torch.device:
        """The first layer's buffer's device."""
        return self.buffers[0].device

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """``[R, L, Hi, Di]`` each layer's rows, stacked on dim 1 (a new tensor)."""
        return torch.stack([buf[rows] for buf in self.buffers], dim=1)

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Each layer's ``values[:, layer]`` into its buffer's ``rows``."""
        for layer, buf in enumerate(self.buffers):
            buf[rows] = values[:, layer]


@dataclasses.dataclass(frozen=True, slots=True)
class TokenSlots:
    """An engine's token-slot allocator.

    Attributes:
        alloc: ``n`` -> ``[n]`` token slots (an int tensor), or None when it has too few free.
        free: gives slots ``alloc`` returned back.
    """

    alloc: Callable[[int], torch.Tensor | None]
    free: Callable[[torch.Tensor], None]


class PromptPools:
    """The checkpoints of an engine's prompts, gathered from its pools and restored into them.

    Args:
        checkpoints: this rank's prompt checkpoints (a load claims token slots).
        index: every layer's compressed index keys, ``[S / ratio, Hi, Di]`` a layer, one row
            per ``ratio`` token slots (``S`` the slots the engine has; :class:`BufferIndex`),
            or an :class:`IndexAccess` to them.
        ratio: tokens a compressed index row covers; a page is a whole number of rows.
        state: the engine's recurrent state as segments (None: the model keeps none).
    """

    def __init__(
        self,
        checkpoints: PromptCheckpoints[torch.Tensor],
        index: Sequence[torch.Tensor] | IndexAccess,
        ratio: int,
        *,
        state: StateSegments | None = None,
    ) -> None:
        self.checkpoints = checkpoints
        self.index = index if isinstance(index, IndexAccess) else BufferIndex(tuple(index))
        self._ratio = ratio
        self._state = state

    @property
    def page_size(self) -> int:
        """Tokens a page; checkpoints hold whole pages."""
        return self.checkpoints.cache.page_size

    def lookup(self, tokens: int, key: Callable[[], PrefixKey] | None) -> int:
        """Tokens of the longest checkpoint of a prompt's first ``tokens`` tokens, agreed.

        ``key``: the key of those tokens, asked only for a page or more; None: the prompt is not
        keyed (the ranks still agree).
        """
        keyed = key is not None and tokens >= self.page_size
        return self.checkpoints.lookup(key() if key is not None and keyed else None)

    def publishes(self, up_to: int, *, prompt_tokens: int, finished: bool) -> bool:
        """Whether a request's first ``up_to`` written tokens are checkpointed.

        Only a live request's prompt (``up_to <= prompt_tokens``) is, at a whole number of pages.
        """
        page = self.page_size
        return not finished and up_to <= prompt_tokens and up_to >= page and up_to % page == 0

    def gather(
        self,
        kv: Callable[[], KVLayers],
        token_slots: torch.Tensor,
        state: Callable[[], Any] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The segments of a checkpoint of ``T`` tokens.

        The index rows are read first (:meth:`IndexAccess.read`, which may be collective), then
        the K/V, then the state.

        Args:
            kv: reads each layer's K/V of those tokens, ``[T, Hkv, D]`` (views are fine); called
                after the index rows are read.
            token_slots: ``[T]`` the tokens' slots, whose index rows are read.
            state: reads the request's recurrent state (called last, only when the model keeps
                one).

        Returns:
            ``k.<i>``/``v.<i>``, ``index`` (``[T / ratio, L, Hi, Di]``) and ``state.<j>``.
        """
        rows = compressed_slots(token_slots.to(self.index.device), self._ratio)
        index = self.index.read(rows)
        sources = kv_segments(*kv())
        sources[INDEX_SEGMENT] = index
        if self._state is not None and state is not None:
            sources.update(self._state.segments(state()))
        return sources

    def load(self, holder: Hashable, key: PrefixKey, slots: TokenSlots) -> torch.Tensor | None:
        """Pin ``key``'s checkpoint for ``holder``, take token slots for it, restore its index.

        Returns:
            ``[T]`` the slots, held until ``holder`` is restored or forgotten (they are then the
            request's); None when any rank could not (nothing is held).
        """
        tokens = key.num_tokens

        def claim(lease: Lease) -> Claim[torch.Tensor] | None:
            taken = slots.alloc(tokens)
            if taken is None:
                return None
            try:
                self._restore_index(lease, taken)
            except BaseException:
                slots.free(taken)
                raise
            return Claim(taken, lambda: slots.free(taken))

        return self.checkpoints.load(holder, key, claim)

    def restore(
        self,
        holder: Hashable,
        stage: Callable[[int], KVLayers],
        filled: Callable[[int, CopyFence], None],
        *,
        put_state: Callable[[Any], None] | None = None,
        state_device: torch.device | str = "cpu",
    ) -> int | None:
        """Restore ``holder``'s loaded checkpoint; the tokens it held (None: none was loaded).

        The recurrent state first, in its pool's structure, into ``put_state`` (from
        ``state_device``), so that a synchronizing state write never waits for the K/V; then
        each layer's K/V into ``stage(tokens)``'s tensors (:meth:`PromptCheckpoints.restore_kv`,
        ``filled(layer, fence)``). The pin is released once the copies are issued.
        """
        lease = self.checkpoints.take(holder)
        if lease is None:
            return None
        with lease:  # released at once: the arena orders a later write after these reads
            tokens = lease.match.num_tokens
            if self._state is not None and put_state is not None:
                state = self.checkpoints.restore_new(lease, self._state.names, state_device)
                put_state(self._state.rebuild(state))
            k_layers, v_layers = stage(tokens)
            self.checkpoints.restore_kv(lease, k_layers, v_layers, filled)
        return tokens

    def _restore_index(self, lease: Lease, slots: torch.Tensor) -> None:
        """The checkpoint's ``[T / ratio, L, Hi, Di]`` index keys into the rows of ``slots``."""
        device = self.index.device
        rows = self.checkpoints.restore_new(lease, [INDEX_SEGMENT], device)[INDEX_SEGMENT]
        self.index.write(compressed_slots(slots.to(device), self._ratio), rows)
