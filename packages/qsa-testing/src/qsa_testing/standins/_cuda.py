"""Stand-ins for a CUDA machine that lacks optional upstream dependencies (see docs/testing.md).

The H200 test machine has torch 2.11, triton 3.6 and the real sglang-kernel 0.4.5, but neither the
CuTe DSL (``cutlass``) nor any FA2/FA4 build. Two upstream paths of a Qwen4Exp engine need them:

- :attr:`StandIn.CUTEDSL_DUAL_GEMM_UNAVAILABLE`: ``DualGemm._select_mode``
  (``sglang/srt/layers/dual_gemm.py``) imports ``sglang.kernels.ops.gemm.cutedsl_dual_gemm`` for
  every dense MLP on CUDA, and that module imports ``cutlass`` at the top. Without it the import
  fails. :func:`provide_if_absent` then serves a module with the real one's public names whose
  ``can_use_dual_gemm`` is False, which is what the real module answers on every GPU below SM100
  (its predicate requires ``is_sm100_supported()``), so upstream takes the plain
  ``gate_up_proj``, activation, ``down_proj`` path it takes on an H200 with ``cutlass`` installed.
- :attr:`StandIn.FLASH_ATTN_VARLEN_TORCH`: the QSA decode on CUDA
  (``QwenSparseAttnBackend._forward_paged_attention``) packs each row's selected K/V and calls
  FA2's ``flash_attn_varlen_func``, found by ``_resolve_flash_attn_varlen_func``. When that
  resolver finds none of FA2, FA4 or aiter, the edited resolver returns
  :func:`flash_attn_varlen_torch`, FA2's semantics in torch, capturable in a CUDA graph.

One more makes a Qwen4Exp engine repeat itself bit for bit:

- :attr:`StandIn.QSA_TOPK_SORTED`: QSA's 512-block top-k on CUDA is SGLang's nvcc JIT kernel
  ``fast_topk`` (``sglang/kernels/jit/csrc/elementwise/fast_topk.cuh``), whose radix select
  claims each output slot with ``atomicAdd``: the set it selects is fixed, the order it writes
  it in is not. The sparse attention sums the selected blocks in that order, so two fresh
  engines agree on token ids but not on every logprob bit. :func:`sorted_fast_topk` returns the
  same indices with each row's valid entries in ascending order and its ``-1`` padding after
  them.
"""

from __future__ import annotations

import ast
import enum
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final, NoReturn

from qsa_testing._errors import StandInError
from qsa_testing.standins._hook import spec_from_other_finders
from qsa_testing.standins._spec import StandIn, StandInSpec, logger

if TYPE_CHECKING:
    import torch

__all__ = (
    "CUDA_STANDIN_SPECS",
    "DUAL_GEMM_MODULE",
    "FAST_TOPK_MODULE",
    "BlackwellDualGemmKernel",
    "DualGemmQuantMode",
    "ProvidingFinder",
    "can_use_dual_gemm",
    "dual_gemm_swiglu",
    "dual_gemm_swiglu_fp8",
    "fill_unavailable_dual_gemm",
    "flash_attn_varlen_torch",
    "provide_if_absent",
    "sort_selected_indices",
    "sorted_fast_topk",
    "upstream_public_names",
)

ModuleFactory = Callable[[ModuleType], None]

# ---- serving a module that cannot be imported as is ---------------------------------------------

#: Origin recorded in the spec of every module :func:`provide_if_absent` serves.
PROVIDED_ORIGIN: Final = "qsa-testing stand-in"


class _ProvidingLoader(importlib.abc.Loader):
    def __init__(self, factory: ModuleFactory) -> None:
        self._factory = factory

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        self._factory(module)


class ProvidingFinder(importlib.abc.MetaPathFinder):
    """Serves one module from a factory when the real one cannot be imported.

    The real module "cannot be imported" when one of ``requires`` cannot be found (its own
    top-level import would fail) or when no other finder on ``sys.meta_path`` finds it at all.
    Otherwise this finder steps aside and the real module loads as usual.

    Attributes:
        name: the dotted module name served.
        requires: top-level modules the real module imports unconditionally.
    """

    def __init__(self, name: str, factory: ModuleFactory, requires: Sequence[str]) -> None:
        self.name = name
        self.requires = tuple(requires)
        self._factory = factory
        self._busy = threading.local()

    def _found(self, fullname: str) -> bool:
        try:
            return importlib.util.find_spec(fullname) is not None
        except (ImportError, ValueError):
            return False

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name or getattr(self._busy, "active", False):
            return None
        self._busy.active = True  # other finders may ask the meta path again; answer them None
        try:
            if all(self._found(name) for name in self.requires) and (
                spec_from_other_finders(self, fullname, path, target) is not None
            ):
                return None
        finally:
            self._busy.active = False
        return importlib.machinery.ModuleSpec(
            fullname, _ProvidingLoader(self._factory), origin=PROVIDED_ORIGIN
        )


_PROVIDED: dict[str, ProvidingFinder] = {}


def provide_if_absent(
    module_name: str, factory: ModuleFactory, *, requires: Sequence[str] = ()
) -> ProvidingFinder:
    """Serve ``module_name`` from ``factory`` whenever the real module cannot be imported.

    Installs a :class:`ProvidingFinder` on ``sys.meta_path`` just before the path finder (once
    per name: a second call returns the first finder), so finders ahead of it, such as the one
    behind :func:`~qsa_testing.standins._hook.after_import`, still see and wrap what it serves.
    A module already in ``sys.modules`` is left alone.

    Args:
        module_name: the dotted name, e.g. ``"sglang.kernels.ops.gemm.cutedsl_dual_gemm"``; its
            parent package must import as usual.
        factory: ``factory(module)`` fills a fresh module object (its ``__name__`` and
            ``__spec__`` are set) with the stand-in's attributes.
        requires: top-level module names the real module imports unconditionally; when one of
            them cannot be found the stand-in is served even though the real file exists.

    Returns:
        The finder; remove it from ``sys.meta_path`` to stop serving.

    Raises:
        StandInError: ``module_name`` is already provided by another factory.
    """
    existing = _PROVIDED.get(module_name)
    if existing is not None:
        if existing._factory is not factory or existing.requires != tuple(requires):
            msg = f"module {module_name!r} is already provided by {existing._factory!r}"
            raise StandInError(msg)
        if existing not in sys.meta_path:
            _insert_before_path_finder(existing)
        return existing
    finder = ProvidingFinder(module_name, factory, requires)
    _PROVIDED[module_name] = finder
    _insert_before_path_finder(finder)
    return finder


def _insert_before_path_finder(finder: ProvidingFinder) -> None:
    for position, other in enumerate(sys.meta_path):
        if other is importlib.machinery.PathFinder:
            sys.meta_path.insert(position, finder)
            return
    sys.meta_path.append(finder)


# ---- the CuTe-DSL dual GEMM, reported unavailable ------------------------------------------------

#: The module :attr:`StandIn.CUTEDSL_DUAL_GEMM_UNAVAILABLE` serves while ``cutlass`` is absent.
DUAL_GEMM_MODULE: Final = "sglang.kernels.ops.gemm.cutedsl_dual_gemm"
#: The upstream module whose import of :data:`DUAL_GEMM_MODULE` the stand-in serves.
DUAL_GEMM_LAYER_MODULE: Final = "sglang.srt.layers.dual_gemm"
#: What the real module imports at the top that the test machine lacks.
DUAL_GEMM_REQUIRES: Final = ("cutlass",)
#: The real module's token limit of its decode kernel (``MAX_DUAL_GEMM_DECODE_TOKENS``).
MAX_DUAL_GEMM_DECODE_TOKENS: Final = 16


class DualGemmQuantMode(enum.IntEnum):
    """The real module's quantization modes: the same members, values and properties."""

    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4

    @property
    def is_quantized(self) -> bool:
        """Every mode but ``UNQUANT``."""
        return self is not DualGemmQuantMode.UNQUANT

    @property
    def is_dynamic(self) -> bool:
        """The activation scale is computed by the kernel."""
        return self in (DualGemmQuantMode.DYNAMIC_PER_TENSOR, DualGemmQuantMode.DYNAMIC_PER_TOKEN)

    @property
    def is_per_token(self) -> bool:
        """One activation scale per token."""
        return self in (DualGemmQuantMode.STATIC_PER_TOKEN, DualGemmQuantMode.DYNAMIC_PER_TOKEN)


def _unavailable(what: str) -> NoReturn:
    msg = (
        f"{what}: the CuTe DSL dual GEMM is unavailable here (qsa-testing stand-in for "
        f"{DUAL_GEMM_MODULE}: 'cutlass' is not installed; the real kernel requires an SM10x GPU)"
    )
    raise RuntimeError(msg)


class BlackwellDualGemmKernel:
    """The real module's SM100 kernel class; constructing it raises ``RuntimeError``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        del args, kwargs
        _unavailable("BlackwellDualGemmKernel")


def can_use_dual_gemm(
    num_tokens: int,
    hidden_size: int,
    intermediate_size: int,
    quant_mode: DualGemmQuantMode,
) -> bool:
    """Always False: the real predicate is False without SM100, and the kernel needs ``cutlass``.

    Args:
        num_tokens: tokens of the batch.
        hidden_size: the MLP's input width.
        intermediate_size: the MLP's gate (and up) width.
        quant_mode: the GEMM's quantization mode.

    Returns:
        False.
    """
    del num_tokens, hidden_size, intermediate_size, quant_mode
    return False


def dual_gemm_swiglu(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """Raises ``RuntimeError``, as the real kernel does on a GPU below SM100."""
    del x, gate_up_weight
    _unavailable("dual_gemm_swiglu")


def dual_gemm_swiglu_fp8(  # noqa: PLR0917 (the real module's positional signature)
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    x_scale: torch.Tensor,
    gate_up_weight_scale: torch.Tensor,
    output_scale: torch.Tensor | None = None,
    quant_mode: DualGemmQuantMode = DualGemmQuantMode.DYNAMIC_PER_TOKEN,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raises ``RuntimeError``, as the real kernel does on a GPU below SM100."""
    del x, gate_up_weight, x_scale, gate_up_weight_scale, output_scale, quant_mode
    _unavailable("dual_gemm_swiglu_fp8")


#: The public names of the real module (what it defines, not what it imports), served as is.
_DUAL_GEMM_PUBLIC: Final[dict[str, object]] = {
    "MAX_DUAL_GEMM_DECODE_TOKENS": MAX_DUAL_GEMM_DECODE_TOKENS,
    "DualGemmQuantMode": DualGemmQuantMode,
    "BlackwellDualGemmKernel": BlackwellDualGemmKernel,
    "can_use_dual_gemm": can_use_dual_gemm,
    "dual_gemm_swiglu": dual_gemm_swiglu,
    "dual_gemm_swiglu_fp8": dual_gemm_swiglu_fp8,
}


def fill_unavailable_dual_gemm(module: ModuleType) -> None:
    """Fill ``module`` with the real dual-GEMM module's public names, reporting it unavailable."""
    vars(module).update(_DUAL_GEMM_PUBLIC, QSA_TESTING_STANDIN=True)
    module.__doc__ = (
        f"qsa-testing stand-in for {DUAL_GEMM_MODULE} ('cutlass' is absent): the dual GEMM is "
        "reported unavailable, as the real module reports it on every GPU below SM100."
    )
    logger.info(
        "[qsa-testing] %s served by the stand-in (no 'cutlass'): can_use_dual_gemm -> False",
        module.__name__,
    )


def upstream_public_names(source: str) -> frozenset[str]:
    """The public names a module's source defines at top level (imports excluded).

    Args:
        source: Python source text.

    Returns:
        Names of top-level functions, classes and assigned variables not starting with ``_``.
    """
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return frozenset(name for name in names if not name.startswith("_"))


def _edit_dual_gemm_layer(module: ModuleType) -> None:
    del module  # the layer imports the kernel module lazily, in DualGemm._select_mode
    provide_if_absent(DUAL_GEMM_MODULE, fill_unavailable_dual_gemm, requires=DUAL_GEMM_REQUIRES)


# ---- FA2's varlen attention in torch -------------------------------------------------------------

#: The upstream module whose FA2 resolver :attr:`StandIn.FLASH_ATTN_VARLEN_TORCH` edits.
QSA_BACKEND_MODULE: Final = "sglang.srt.layers.attention.qwen_sparse_attn_backend"
_RESOLVER: Final = "_resolve_flash_attn_varlen_func"
#: Float32 elements one chunk of query rows may gather (keys, values and scores), ~256 MiB.
_CHUNK_ELEMENTS: Final = 1 << 26


def _unsupported(argument: str, value: object, why: str) -> NotImplementedError:
    return NotImplementedError(
        f"flash_attn_varlen_torch: {argument}={value!r} is not supported ({why})"
    )


def _check_host_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        msg = (
            f"flash_attn_varlen_torch: {name}={value!r} must be a host int (it fixes the padded "
            "width, and reading a device tensor would break CUDA-graph capture)"
        )
        raise TypeError(msg)
    return value


def flash_attn_varlen_torch(  # noqa: PLR0917 (FA2's positional signature)
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """FA2's ``flash_attn_varlen_func`` in torch, free of host reads so a CUDA graph can hold it.

    Sequence ``b`` has queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` (``lq`` rows) and keys and
    values ``k/v[cu_seqlens_k[b]:cu_seqlens_k[b+1]]`` (``lk`` rows). Query head ``h`` reads K/V
    head ``h // (Hq // Hk)`` (GQA). Query ``i`` of a sequence may see key ``j`` when, with the
    bottom-right diagonal ``d = i + lk - lq``, ``j <= d`` under ``causal`` (else ``j <= d +
    window_size[1]`` when that is not -1) and ``j >= d - window_size[0]`` when that is not -1.
    Scores are ``q·k * softmax_scale``, then ``softcap * tanh(score / softcap)`` when ``softcap >
    0``; a row that may see no key gets zeros, as FA2 returns.

    Only shapes and host ints decide the work: each query row gathers ``max_seqlen_k`` key slots
    of its sequence and masks those past ``lk``; no device value is read on the host. Every
    ``lk`` must therefore be at most ``max_seqlen_k``, as FA2 requires (``max_seqlen_q`` is FA2's
    grid bound and is only checked). Rows of ``q`` past ``cu_seqlens_q[-1]`` get zeros; K/V rows
    past ``cu_seqlens_k[-1]`` are never read. Computes in float32.

    Args:
        q: ``[total_q, Hq, D]``, float16, bfloat16 or float32.
        k: ``[total_k, Hk, D]``, ``Hq % Hk == 0``; may hold more rows than the sequences use.
        v: ``[total_k, Hk, Dv]``.
        cu_seqlens_q: ``[B + 1]`` int32 or int64, non-decreasing from 0.
        cu_seqlens_k: ``[B + 1]`` int32 or int64, non-decreasing from 0.
        max_seqlen_q: the largest ``lq``, a host int.
        max_seqlen_k: the largest ``lk``, a host int (the padded key width).
        dropout_p: must be 0 (inference).
        softmax_scale: score scale; ``D ** -0.5`` when None.
        causal: bottom-right aligned causal mask.
        window_size: ``(left, right)`` sliding window, -1 for unbounded.
        softcap: tanh soft cap of the scores; 0 for none.
        alibi_slopes: must be None.
        deterministic: accepted; this implementation is deterministic.
        return_attn_probs: must be False.
        block_table: must be None (the paged-KV form; upstream's QSA decode packs K/V instead).

    Returns:
        ``[total_q, Hq, Dv]`` in ``q.dtype``.

    Raises:
        NotImplementedError: dropout, ALiBi, attention probabilities or a block table requested.
        TypeError: ``max_seqlen_q`` or ``max_seqlen_k`` is not a host int.
        ValueError: shapes that do not fit together.
    """
    del deterministic
    if dropout_p != 0.0:
        raise _unsupported("dropout_p", dropout_p, "inference only")
    if alibi_slopes is not None:
        raise _unsupported("alibi_slopes", tuple(alibi_slopes.shape), "no ALiBi")
    if return_attn_probs:
        raise _unsupported("return_attn_probs", return_attn_probs, "only the output is returned")
    if block_table is not None:
        raise _unsupported(
            "block_table", tuple(block_table.shape), "paged K/V; pass packed K/V with cu_seqlens_k"
        )
    import torch

    _check_host_int("max_seqlen_q", max_seqlen_q)
    width = _check_host_int("max_seqlen_k", max_seqlen_k)
    left, right = (int(w) for w in window_size)
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        msg = (
            f"flash_attn_varlen_torch: q, k, v must be [tokens, heads, dim], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
        raise ValueError(msg)
    total_q, heads_q, dim = q.shape
    total_k, heads_k, dim_k = k.shape
    dim_v = v.shape[2]
    if v.shape[:2] != k.shape[:2] or dim_k != dim:
        msg = (
            f"flash_attn_varlen_torch: k {tuple(k.shape)} and v {tuple(v.shape)} must share rows "
            f"and heads, and k's head dim must be q's ({dim})"
        )
        raise ValueError(msg)
    if heads_k == 0 or heads_q % heads_k:
        msg = f"flash_attn_varlen_torch: Hq={heads_q} is not a multiple of Hk={heads_k}"
        raise ValueError(msg)
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape != cu_seqlens_k.shape:
        msg = (
            f"flash_attn_varlen_torch: cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k "
            f"{tuple(cu_seqlens_k.shape)} must both be [B + 1]"
        )
        raise ValueError(msg)
    batch = cu_seqlens_q.shape[0] - 1
    scale = dim**-0.5 if softmax_scale is None else float(softmax_scale)
    output = q.new_zeros((total_q, heads_q, dim_v))
    if batch < 1 or total_q == 0 or total_k == 0 or width < 1:
        return output

    group = heads_q // heads_k
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.long)
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.long)
    slots = torch.arange(width, device=q.device)
    per_row = width * (heads_k * (dim + dim_v) + heads_q)
    chunk = max(1, _CHUNK_ELEMENTS // per_row)
    for start in range(0, total_q, chunk):
        stop = min(start + chunk, total_q)
        rows = torch.arange(start, stop, device=q.device)
        # Sequence of each row: cu_q[b] <= row < cu_q[b + 1]; rows past cu_q[-1] get b == B.
        sequence = torch.searchsorted(cu_q[1:], rows, right=True)
        row_used = sequence < batch
        sequence = sequence.clamp(max=batch - 1)
        q_start, k_start = cu_q[sequence], cu_k[sequence]
        len_q = cu_q[sequence + 1] - q_start
        len_k = cu_k[sequence + 1] - k_start
        diagonal = (rows - q_start + len_k - len_q)[:, None]  # [n, 1]
        seen = row_used[:, None] & (slots[None, :] < len_k[:, None])  # [n, width]
        if causal:
            seen &= slots[None, :] <= diagonal
        elif right >= 0:
            seen &= slots[None, :] <= diagonal + right
        if left >= 0:
            seen &= slots[None, :] >= diagonal - left
        key_rows = (k_start[:, None] + slots[None, :]).clamp(0, total_k - 1).flatten()
        n = stop - start
        keys = k.index_select(0, key_rows).view(n, width, heads_k, dim).float()
        values = v.index_select(0, key_rows).view(n, width, heads_k, dim_v).float()
        queries = q[start:stop].float().reshape(n, heads_k, group, dim)
        scores = torch.einsum("nhgd,nwhd->nhgw", queries, keys) * scale
        if softcap > 0.0:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
        peak = scores.amax(dim=-1, keepdim=True)
        peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
        weights = torch.exp(scores - peak)  # exactly 0 where masked
        total = weights.sum(dim=-1, keepdim=True)
        attended = torch.einsum("nhgw,nwhd->nhgd", weights, values)
        attended = attended / total.clamp_min(torch.finfo(torch.float32).tiny)
        output[start:stop] = attended.reshape(n, heads_q, dim_v).to(output.dtype)
    return output


_SERVED_LOGGED = threading.Event()


def _edit_qsa_backend(module: ModuleType) -> None:
    upstream = getattr(module, _RESOLVER, None)
    if upstream is None:
        msg = f"{module.__name__} has no {_RESOLVER} any more; stand-in flash_attn_varlen_torch"
        raise StandInError(msg)

    @functools.cache
    def resolve() -> Callable[..., Any]:
        try:
            found: Callable[..., Any] = upstream()
        except ImportError as exc:
            if not _SERVED_LOGGED.is_set():
                _SERVED_LOGGED.set()
                logger.info(
                    "[qsa-testing] QSA decode attention: %s; flash_attn_varlen_torch serves it",
                    exc,
                )
            return flash_attn_varlen_torch
        return found

    setattr(module, _RESOLVER, resolve)


# ---- QSA's block top-k, in a fixed order ---------------------------------------------------------

#: The module whose ``fast_topk`` :attr:`StandIn.QSA_TOPK_SORTED` wraps. QSA's two CUDA call sites,
#: ``QSAIndexer.select_decode_tokens`` (``sglang/srt/layers/attention/qsa/qsa_indexer.py``) and
#: ``qsa_fast_topk`` (``sglang/srt/layers/attention/qsa/kernel.py``, the prefill selection and
#: ``QSAIndexerMetadata.topk_transform``), import it inside the function body, so each call reads
#: this module's attribute afresh; no module binds it at import time.
FAST_TOPK_MODULE: Final = "sglang.kernels.ops.attention.fast_topk"
_FAST_TOPK: Final = "fast_topk"


def sort_selected_indices(indices: torch.Tensor) -> torch.Tensor:
    """Each row's selected indices in ascending order, its padding (negative entries) after them.

    Only the order within a row changes: the row holds the same valid indices, and as many
    ``-1`` as it had negative entries. Device-side only (no host read), so a CUDA graph can
    capture it.

    Args:
        indices: ``[rows, width]`` integer indices, ``-1`` for an unused slot, in any order.

    Returns:
        A new ``[rows, width]`` tensor of ``indices``' dtype and device: per row the valid
        indices ascending, then ``-1``.
    """
    import torch

    padding = indices < 0
    sentinel = torch.iinfo(indices.dtype).max
    ordered = indices.masked_fill(padding, sentinel).sort(dim=-1).values
    valid = padding.logical_not().sum(dim=-1, keepdim=True)
    slots = torch.arange(indices.shape[-1], device=indices.device)
    return ordered.masked_fill(slots >= valid, -1)


def sorted_fast_topk(upstream: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap SGLang's ``fast_topk`` so that each CUDA row comes out in ascending index order.

    Args:
        upstream: ``sglang.kernels.ops.attention.fast_topk.fast_topk``.

    Returns:
        A function with upstream's signature. For a CUDA ``score`` it returns upstream's result
        passed through :func:`sort_selected_indices`; for any other device, upstream's result
        as is.
    """

    @functools.wraps(upstream)
    def fast_topk(
        score: torch.Tensor,
        lengths: torch.Tensor,
        topk: int,
        row_starts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        indices = upstream(score, lengths, topk=topk, row_starts=row_starts)
        if not score.is_cuda:
            return indices
        return sort_selected_indices(indices)

    return fast_topk


def _edit_fast_topk(module: ModuleType) -> None:
    upstream = module.__dict__.get(_FAST_TOPK)
    if upstream is None:
        msg = f"{module.__name__} has no {_FAST_TOPK} any more; stand-in qsa_topk_sorted"
        raise StandInError(msg)
    module.__dict__[_FAST_TOPK] = sorted_fast_topk(upstream)


CUDA_STANDIN_SPECS: Final[tuple[StandInSpec, ...]] = (
    StandInSpec(
        StandIn.CUTEDSL_DUAL_GEMM_UNAVAILABLE,
        (DUAL_GEMM_LAYER_MODULE,),
        _edit_dual_gemm_layer,
        f"DualGemm._select_mode imports {DUAL_GEMM_MODULE} on CUDA, which needs the CuTe DSL "
        "('cutlass'); while 'cutlass' cannot be found that import gets a module with the real "
        "one's public names that reports the dual GEMM unavailable, as the real one does below "
        "SM100",
    ),
    StandInSpec(
        StandIn.FLASH_ATTN_VARLEN_TORCH,
        (QSA_BACKEND_MODULE,),
        _edit_qsa_backend,
        "the QSA decode calls FA2's flash_attn_varlen_func; when _resolve_flash_attn_varlen_func "
        "finds no FA2, FA4 or aiter, it returns FA2's semantics in torch "
        "(qsa_testing.standins._cuda.flash_attn_varlen_torch, CUDA-graph capturable)",
    ),
    StandInSpec(
        StandIn.QSA_TOPK_SORTED,
        (FAST_TOPK_MODULE,),
        _edit_fast_topk,
        "QSA's 512-block top-k on CUDA (the JIT fast_topk) claims its output slots with "
        "atomicAdd, so the selected blocks come out in a run-dependent order and the sparse "
        "attention sums them in that order; each CUDA row is sorted ascending, -1 padding last, "
        "which keeps the selected set and fixes the summation order",
    ),
)
