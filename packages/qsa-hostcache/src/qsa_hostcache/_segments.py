"""What a prompt checkpoint is made of besides its K/V: named segments and their tensors.

A checkpoint of a prompt's first ``T`` tokens holds the model's whole state at that boundary:

=================  ==================================================  =======================
segment            contents                                            built by
=================  ==================================================  =======================
``k.<i>, v.<i>``   attention layer ``i``'s raw K/V, ``[T, Hkv, D]``     :func:`kv_segments`
``index``          every layer's compressed index keys,                :func:`compressed_slots`
                   ``[T / ratio, L, Hi, Di]``, one row per group of      names the rows
                   ``ratio`` tokens
``state.<j>``      the request's recurrent state, flattened to its     :class:`StateSegments`
                   tensors (e.g. conv and temporal states)
=================  ==================================================  =======================

The K/V and the index run over the prompt's tokens along their first dimension
(:func:`prompt_segment_spec` marks them ``token_rows``), so a checkpoint of a longer prompt stores
only the rows beyond the checkpoint it extends; the recurrent state is stored whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import torch
from torch.utils import _pytree as pytree

from qsa_hostcache._errors import SegmentError
from qsa_hostcache._layout import SegmentSpec

__all__ = (
    "INDEX_SEGMENT",
    "StateSegments",
    "compressed_slots",
    "kv_segments",
    "prompt_segment_spec",
    "segment_buffer",
)

INDEX_SEGMENT: Final = "index"
"""The segment of every layer's compressed index keys, ``[T / ratio, L, Hi, Di]``."""

_KV_PREFIXES: Final = ("k.", "v.")


def kv_segments(
    k_layers: Sequence[torch.Tensor], v_layers: Sequence[torch.Tensor], *, first: int = 0
) -> dict[str, torch.Tensor]:
    """The K/V segments of a checkpoint: ``k.<i>`` and ``v.<i>`` per attention layer ``i``.

    ``k_layers[j]`` (``[T, Hkv, D]``) is layer ``first + j``: a run of layers, e.g. one.
    """
    segments = {f"{_KV_PREFIXES[0]}{i}": t for i, t in enumerate(k_layers, start=first)}
    segments.update({f"{_KV_PREFIXES[1]}{i}": t for i, t in enumerate(v_layers, start=first)})
    return segments


def prompt_segment_spec(name: str, tensor: torch.Tensor) -> SegmentSpec:
    """The spec of a prompt checkpoint's segment ``name`` holding ``tensor``.

    K/V (:func:`kv_segments`) and :data:`INDEX_SEGMENT` are ``token_rows``: their first rows are
    shared with the checkpoint of a shorter prefix. Any other segment is stored whole.
    """
    rows = name == INDEX_SEGMENT or name.startswith(_KV_PREFIXES)
    return SegmentSpec.like(name, tensor, token_rows=rows)


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
