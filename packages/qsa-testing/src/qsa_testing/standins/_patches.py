"""The named stand-ins: each changes one upstream behaviour that a test machine cannot run as is.

Every stand-in states what it replaces and why, is logged when applied (one ``[qsa-testing]``
line on stderr, which lands in the engine's log), and is tested against the upstream path whose
semantics it keeps (``tests/test_standins.py``). None of them is ever installed for serving.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any, Final

from qsa_testing._errors import StandInError
from qsa_testing.standins._cuda import CUDA_STANDIN_SPECS
from qsa_testing.standins._hook import after_import
from qsa_testing.standins._spec import APPLIED_MARKER, StandIn, StandInSpec, announce, logger

__all__ = (
    "APPLIED_MARKER",
    "DEFAULT_DUMMY_WEIGHT_RANGE",
    "ENV_DUMMY_WEIGHT_RANGE",
    "STANDINS",
    "StandIn",
    "StandInSpec",
    "gate_sigmoid_mul_torch",
    "gather_compressed_keys_torch",
    "perturb_first_selected_block",
)

#: Half-width of the uniform dummy-weight range (``U(-a, a)``); SGLang's own is 1e-3.
ENV_DUMMY_WEIGHT_RANGE: Final = "QSA_TESTING_DUMMY_WEIGHT_RANGE"
DEFAULT_DUMMY_WEIGHT_RANGE: Final = 0.2


# ---- sgl_kernel's Python layer without its CUDA library ------------------------------------------

_CPU_LIBRARY: list[Any] = []  # keeps the torch.library fragment alive for the process


def _edit_sgl_kernel_load_utils(module: ModuleType) -> None:
    import torch

    if torch.cuda.is_available():
        msg = (
            "stand-in cpu_sgl_kernel is for machines without CUDA, but torch.cuda.is_available() "
            "is True here; use the real sgl_kernel"
        )
        raise StandInError(msg)

    def load_cpu_ops() -> None:
        from qsa_testing.standins._cpu_ops import register_cpu_ops

        library = torch.library.Library("sgl_kernel", "FRAGMENT")  # type: ignore[no-untyped-call]
        _CPU_LIBRARY.append(library)
        names = register_cpu_ops(library)
        logger.info("[qsa-testing] torch.ops.sgl_kernel CPU ops in torch: %s", ", ".join(names))

    module.__dict__["_load_architecture_specific_ops"] = load_cpu_ops
    module.__dict__["_preload_cuda_library"] = lambda: None


# ---- AMX-only CPU switches -----------------------------------------------------------------------


def _edit_use_cpu(module: ModuleType) -> None:
    if not hasattr(module, "_use_cpu"):
        msg = f"{module.__name__} has no _use_cpu switch any more; stand-in gated_rmsnorm_cpu_op"
        raise StandInError(msg)
    module.__dict__["_use_cpu"] = True


def _torch_on_cpu(
    upstream: Callable[..., Any], torch_form: Callable[..., Any]
) -> Callable[..., Any]:
    """``upstream`` for CUDA tensors, ``torch_form`` (same signature) when the first is on CPU."""

    @functools.wraps(upstream)
    def dispatch(first: Any, *args: Any, **kwargs: Any) -> Any:
        fn = upstream if first.is_cuda else torch_form
        return fn(first, *args, **kwargs)

    return dispatch


# ---- the shared-expert gate, a Triton-only launcher ----------------------------------------------


def gate_sigmoid_mul_torch(
    hidden_states: Any, gate_weight: Any, shared_output: Any, output: Any, *, do_add: bool
) -> None:
    """``output (+)= sigmoid(hidden_states · gate_weight) * shared_output``, row by row, in fp32.

    The semantics of ``_fused_gate_sigmoid_mul_kernel`` in
    ``sglang/kernels/ops/elementwise/elementwise.py``.

    Args:
        hidden_states: ``[T, H]``, any float dtype.
        gate_weight: ``[H]``.
        shared_output: ``[T, H]``.
        output: ``[T, H]``, written in place (added to when ``do_add``).
        do_add: add to ``output`` instead of overwriting it.
    """
    gate = (hidden_states.float() * gate_weight.float()).sum(-1, keepdim=True).sigmoid()
    result = gate * shared_output.float()
    if do_add:
        result = result + output.float()
    output.copy_(result.to(output.dtype))


def _edit_gate_launcher(module: ModuleType) -> None:
    launcher = module._launch_fused_gate_sigmoid_mul
    module.__dict__["_launch_fused_gate_sigmoid_mul"] = _torch_on_cpu(
        launcher, gate_sigmoid_mul_torch
    )


# ---- the QSA indexer's missing CPU dispatch ------------------------------------------------------


def _edit_qsa_indexer(module: ModuleType) -> None:
    cls = module.QSAIndexer
    impl = cls._forward_impl

    def forward_cpu(  # noqa: PLR0917 (positional, as upstream's signature)
        self: Any,
        hidden_states: Any,
        positions: Any,
        forward_batch: Any,
        indexer_metadata: Any,
        cp_global_rope_positions: Any = None,
    ) -> Any:
        return impl(
            self,
            hidden_states,
            positions,
            forward_batch,
            indexer_metadata,
            cp_global_rope_positions,
        )

    cls.forward_cpu = forward_cpu
    cls.forward_native = forward_cpu


# ---- the compressed-key gather, a Triton-only kernel ---------------------------------------------


def gather_compressed_keys_torch(  # noqa: PLR0917 (positional, as upstream's signature)
    compressed: Any,
    token_slot_table: Any,
    cu_blocks: Any,
    total_blocks: int,
    max_blocks: int,
    compress_ratio: int,
) -> Any:
    """Every sequence's complete compressed keys, packed in sequence order.

    The semantics of ``gather_qsa_compressed_keys`` in
    ``sglang/srt/layers/attention/qsa/kernel.py``: output row ``cu_blocks[i] + b`` is
    ``compressed[token_slot_table[i, b * ratio] // ratio]`` for
    ``b < cu_blocks[i + 1] - cu_blocks[i]``, never past ``total_blocks``.

    Args:
        compressed: ``[S // ratio, heads, dim]`` compressed index keys (any dtype, copied as is).
        token_slot_table: ``[N, W]`` int token slots per sequence.
        cu_blocks: ``[N + 1]`` int cumulative block counts.
        total_blocks: rows of the output (a host int).
        max_blocks: the largest per-sequence count (a host int; bounds the gather).
        compress_ratio: tokens per block.

    Returns:
        ``[total_blocks, heads, dim]``, the dtype of ``compressed``.
    """
    output = compressed.new_empty((total_blocks, *compressed.shape[1:]))
    bounds = cu_blocks.tolist()
    for sequence in range(len(bounds) - 1):
        start = bounds[sequence]
        count = min(bounds[sequence + 1] - start, total_blocks - start, max_blocks)
        if count <= 0:
            continue
        first = token_slot_table[sequence, : count * compress_ratio : compress_ratio].long()
        output[start : start + count] = compressed[first // compress_ratio]
    return output


def _edit_gather(module: ModuleType) -> None:
    gather = module.gather_qsa_compressed_keys
    module.__dict__["gather_qsa_compressed_keys"] = _torch_on_cpu(
        gather, gather_compressed_keys_torch
    )


# ---- host memory registration without a CUDA device ---------------------------------------------


def _edit_host_register(module: ModuleType) -> None:
    registered = module._CUDA_HOST_REGISTERED_RANGES_ATTR

    def register_nothing(buffer: Any, registration_granularity_bytes: int | None = None) -> None:
        del registration_granularity_bytes
        setattr(buffer, registered, [])  # no ranges: nothing for a destroy to unregister

    module.__dict__["_cuda_host_register"] = register_nothing


# ---- dummy weights that carry signal -------------------------------------------------------------


def _dummy_weight_range() -> float:
    raw = os.environ.get(ENV_DUMMY_WEIGHT_RANGE, str(DEFAULT_DUMMY_WEIGHT_RANGE))
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 1.0:
        msg = f"{ENV_DUMMY_WEIGHT_RANGE}={raw!r} is not allowed; allowed: a number in (0, 1]"
        raise StandInError(msg)
    return value


def _edit_dummy_weights(module: ModuleType) -> None:
    initialize = module.initialize_dummy_weights
    half_width = _dummy_weight_range()

    def initialize_wide(
        model: Any, low: float = -1e-3, high: float = 1e-3, seed: int = 1234
    ) -> None:
        del low, high
        initialize(model, -half_width, half_width, seed)

    module.__dict__["initialize_dummy_weights"] = initialize_wide


# ---- a deliberately wrong K/V read, for sensitivity checks only ----------------------------------


def perturb_first_selected_block(token_indices: Any, compress_ratio: int) -> Any:
    """Drop the lowest selected block of every row: its token indices become ``-1`` (padding).

    Args:
        token_indices: ``[rows, width]`` int logical token positions selected per query row,
            ``-1`` for padding.
        compress_ratio: tokens per block.

    Returns:
        A new ``[rows, width]`` tensor of the same dtype; rows with no selection are unchanged.
    """
    import torch

    valid = token_indices >= 0
    largest = torch.iinfo(token_indices.dtype).max
    first = torch.where(valid, token_indices, largest).amin(dim=1, keepdim=True)
    start = first - first % compress_ratio
    hit = valid & (token_indices >= start) & (token_indices < start + compress_ratio)
    return torch.where(hit, torch.full_like(token_indices, -1), token_indices)


def _edit_decode_selection(module: ModuleType) -> None:
    cls = module.QwenSparseAttnBackend
    expand = cls._expand_block_indices

    def expand_perturbed(self: Any, indices: Any, metadata: Any) -> Any:
        return perturb_first_selected_block(expand(self, indices, metadata), self.compress_ratio)

    cls._expand_block_indices = expand_perturbed


STANDINS: Final[dict[StandIn, StandInSpec]] = {
    spec.name: spec
    for spec in (
        StandInSpec(
            StandIn.CPU_SGL_KERNEL,
            ("sgl_kernel.load_utils",),
            _edit_sgl_kernel_load_utils,
            "PyPI's sgl_kernel loads a CUDA library at import; its Python layer is kept and the "
            "CPU ops SGLang calls are torch implementations (qsa_testing.standins._cpu_ops)",
        ),
        StandInSpec(
            StandIn.GATED_RMSNORM_CPU_OP,
            (
                "sglang.kernels.ops.attention.fla.layernorm_gated",
                "sglang.kernels.ops.attention.fla.fused_norm_gate",
            ),
            _edit_use_cpu,
            "the gated RMSNorm takes its CPU op only with AMX and otherwise launches Triton on CPU "
            "tensors; _use_cpu is set so it calls sgl_kernel.fused_rmsnorm_gated_cpu",
        ),
        StandInSpec(
            StandIn.SHARED_EXPERT_GATE_TORCH,
            ("sglang.kernels.ops.elementwise.elementwise",),
            _edit_gate_launcher,
            "the shared-expert gate is a Triton-only launcher; CPU tensors take its torch form",
        ),
        StandInSpec(
            StandIn.QSA_INDEXER_CPU,
            ("sglang.srt.layers.attention.qsa.qsa_indexer",),
            _edit_qsa_indexer,
            "QSAIndexer defines forward_cuda/forward_xpu only; CPU dispatch goes to its own "
            "_forward_impl, which has torch fallbacks for CPU tensors",
        ),
        StandInSpec(
            StandIn.COMPRESSED_KEY_GATHER_TORCH,
            ("sglang.srt.layers.attention.qsa.metadata",),
            _edit_gather,
            "gather_qsa_compressed_keys is a Triton-only kernel; CPU tensors take its torch form",
        ),
        StandInSpec(
            StandIn.HOST_REGISTER_CPU,
            ("sglang.srt.mem_cache.pool_host.common",),
            _edit_host_register,
            "pinned host buffers are registered with cudaHostRegister, which needs a CUDA "
            "device; without one there is no device to copy to, and the buffer stays ordinary "
            "host memory with no registered ranges (SGLang's routed-experts capture allocates one)",
        ),
        StandInSpec(
            StandIn.DUMMY_WEIGHT_RANGE,
            ("sglang.srt.model_loader.loader",),
            _edit_dummy_weights,
            "SGLang's dummy init U(-1e-3, 1e-3) gives near-uniform logits; the same seeded "
            f"init over U(-a, a), a from {ENV_DUMMY_WEIGHT_RANGE} "
            f"(default {DEFAULT_DUMMY_WEIGHT_RANGE})",
        ),
        StandInSpec(
            StandIn.PERTURB_DECODE_SELECTION,
            ("sglang.srt.layers.attention.qwen_sparse_attn_backend",),
            _edit_decode_selection,
            "SENSITIVITY CHECK ONLY: every decode row's lowest selected block is dropped, a "
            "deliberately wrong K/V read that an equality test must notice",
        ),
        *CUDA_STANDIN_SPECS,
    )
}


_INSTALLED: set[StandIn] = set()


def install(names: frozenset[StandIn]) -> None:
    """Install the named stand-ins in this process (each edits its modules once they run).

    A stand-in already installed here is not installed again (a process forked from one that
    installed it, as an engine host's children are, has its edits already).
    """
    missing = sorted(name.value for name in names if name not in STANDINS)
    if missing:
        msg = f"stand-ins {missing!r} are declared but not implemented"
        raise StandInError(msg)
    for name in sorted(names - _INSTALLED):
        _INSTALLED.add(name)
        spec = STANDINS[name]
        for module in spec.modules:

            def edit(loaded: ModuleType, _spec: StandInSpec = spec) -> None:
                _spec.edit(loaded)
                announce(_spec, loaded)

            after_import(module, edit)
