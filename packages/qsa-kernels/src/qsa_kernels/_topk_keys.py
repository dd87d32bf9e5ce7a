"""The non-candidate sentinel of the packed order keys (:mod:`._select`), in one place.

Python code compares against :data:`KEY_NONE`; Triton kernels use :data:`KEY_NONE_JIT`, the same
value as a compile-time constant.
"""

from __future__ import annotations

import triton.language as tl

#: ``INT64_MIN``: the key of a non-candidate; below every real key.
KEY_NONE = -(2**63)
#: :data:`KEY_NONE` inside ``@triton.jit`` functions.
KEY_NONE_JIT = tl.constexpr(KEY_NONE)
