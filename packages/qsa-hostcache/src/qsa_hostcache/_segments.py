"""What a prompt checkpoint is made of besides its K/V: named segments and their tensors.

A checkpoint of a prompt's first ``T`` tokens holds the model's whole state at that boundary:

=================  ==================================================  =======================
segment            contents                                            built by
=================  ==================================================  =======================
``k.<i>, v.<i>``   attention layer ``i``'s raw K/V, ``[T, Hkv, D]``     :func:`kv_segments`
``index``          every layer's compressed index keys,                :func:`compressed_slots`
                   ``[L, T / ratio, Hi, Di]``, one row per group of      names the rows
                   ``ratio`` tokens
``state.<j>``      the request's recurrent state, flattened to its     :class:`StateSegments`
                   tensors (e.g. conv and temporal states)
=================  ==================================================  =======================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import torch
from torch.utils import _pytree as pytree

from qsa_hostcache._errors import SegmentError
from qsa_hostcache._layout import SegmentSpec

__all__ = ("INDEX_SEGMENT", "StateSegments", "compressed_slots", "segment_buffer")

INDEX_SEGMENT: Final = "index"
"""The segment of every layer's compressed index keys, ``[L, T / ratio, Hi, Di]``."""


def segment_buffer(spec: SegmentSpec, device: torch.device | str) -> torch.Tensor:
    """An empty tensor on ``device`` with the dtype and shape ``spec`` was published with.

    Raises:
        SegmentError: ``spec`` has no dtype or no shape, or a dtype torch does not name.
    """
    if spec.shape is None or spec.dtype is None:
        msg = f"segment {spec.name!r} was published without a shape or dtype ({spec!r})"
        raise SegmentError(msg)
    dtype = getattr(torch, spec.dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        msg = f"segment {spec.name!r} has dtype {spec.dtype!r}, which torch does not name"
        raise SegmentError(msg)
    return torch.empty(spec.shape, dtype=dtype, device=device)


def compressed_slots(token_slots: torch.Tensor, ratio: int) -> torch.Tensor:
    """``[T / ratio]`` int64 compressed-index rows of ``[T]`` token slots.

    A compressed index keeps one row per ``ratio`` tokens, at ``slot // ratio`` of the group's
    first token; ``T`` is a multiple of ``ratio`` (a page boundary), so no group is partial.
    """
    return token_slots[::ratio].long() // ratio


class StateSegments:
    """A recurrent state as segments ``state.<j>``, and back, in the structure its pool uses.

    The state is any nest of lists, tuples and dicts whose leaves are tensors or ``None``
    (``torch.utils._pytree``); ``state.<j>`` is its ``j``-th tensor leaf. The structure is read
    once from ``sample``, one state of the pool.
    """

    def __init__(self, sample: Any) -> None:
        leaves, self._spec = pytree.tree_flatten(sample)
        self._present = tuple(isinstance(x, torch.Tensor) for x in leaves)
        self.names: tuple[str, ...] = tuple(f"state.{j}" for j in range(sum(self._present)))
        """The segment names, one per tensor leaf."""

    def segments(self, state: Any) -> dict[str, torch.Tensor]:
        """``state.<j>`` -> the state's ``j``-th tensor leaf (contiguous)."""
        tensors = [x for x in pytree.tree_leaves(state) if isinstance(x, torch.Tensor)]
        return {f"state.{j}": t.contiguous() for j, t in enumerate(tensors)}

    def rebuild(self, segments: Mapping[str, torch.Tensor]) -> Any:
        """The state of ``segments`` (:meth:`segments`' names), in the sample's structure."""
        tensors = iter(segments[name] for name in self.names)
        leaves = [next(tensors) if present else None for present in self._present]
        return pytree.tree_unflatten(leaves, self._spec)
