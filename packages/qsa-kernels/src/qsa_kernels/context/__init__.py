"""Sparse GQA prefill over one request's contiguous context, on an engine's kernels.

A prefill chunk attends either over itself (no prefix: :func:`attend_chunks`, several requests
packed) or over a context that holds the request's first tokens in position order
(:func:`attend_context`: an offload's staging area, or a chunk gathered over context-parallel
ranks, this rank's zigzag blocks then being one kernel entry each, :class:`ZigzagEntries`). The
kernels are the engine's (:class:`PrefillKernels`, e.g. SGLang's QSA prefill kernels); this
package turns token positions into what they read. :meth:`PrefillKernels.reference` are torch
references of the same contracts.
"""

from qsa_kernels.context._attend import (
    PrefillKernels,
    ZigzagEntries,
    attend_chunks,
    attend_context,
)
from qsa_kernels.context.reference import (
    chunk_prefill_reference,
    packed_prefill_reference,
    slot_attention_reference,
)

__all__ = (
    # -- Attention over a context --
    "PrefillKernels",
    "ZigzagEntries",
    "attend_chunks",
    "attend_context",
    # -- References of the kernels' contracts --
    "chunk_prefill_reference",
    "packed_prefill_reference",
    "slot_attention_reference",
)
