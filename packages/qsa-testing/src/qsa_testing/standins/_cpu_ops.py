"""Plain-torch implementations of the ``torch.ops.sgl_kernel.*_cpu`` ops a tiny Qwen4Exp reaches.

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang 0.5.23 calls ops that only the CPU build of sgl-kernel
registers; PyPI ships the CUDA build alone. :func:`register_cpu_ops` defines each op of
:data:`STANDIN_OPS` in the ``sgl_kernel`` namespace with the schema SGLang calls it through and
implements it (dispatch key ``CPU``) in torch.

Every op keeps the semantics of SGLang's *own* reference for the same computation, named in
:attr:`StandInOp.reference` (a Triton kernel, an fla kernel or a torch path), and computes in
float32 where that reference does, casting to the reference's output dtype. Where the CPU op's
contract differs from the GPU reference only in packaging (an output laid out as SGLang's
``register_fake_ops`` in ``sglang/srt/model_executor/cpu_graph_runner.py`` declares it, a
returned state), the CPU contract wins and the docstring says so.

The stand-ins serve a CPU *without AMX*. There SGLang never packs weights into the VNNI layout
(``sglang.srt.layers.amx_utils.amx_process_weight_after_loading`` returns them unchanged), so a
weight is always the plain ``[out, in]`` / ``[dim, width]`` tensor, whatever ``is_vnni`` says;
each op that takes the flag documents what it does with it.

No path returns made-up data: an argument value an op does not support raises
``NotImplementedError`` naming the op and the value.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch

__all__ = (
    "STANDIN_OPS",
    "StandInOp",
    "causal_conv1d_fwd_cpu",
    "causal_conv1d_update_cpu",
    "chunk_gated_delta_rule_cpu",
    "fused_gdn_gating_cpu",
    "fused_input_proj_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
    "fused_qkvzba_split_reshape_cat_cpu",
    "fused_rmsnorm_gated_cpu",
    "fused_sigmoid_gating_delta_rule_update_cpu",
    "fused_sigmoid_mul_cpu",
    "register_cpu_ops",
)

#: ``eps`` inside the Q/K L2 norm of SGLang's recurrent GDN kernels (a literal in the kernel).
_RECURRENT_L2NORM_EPS: Final = 1e-6


@dataclass(frozen=True, slots=True)
class StandInOp:
    """One ``torch.ops.sgl_kernel`` op this module implements.

    Attributes:
        name: the op name as SGLang calls it, e.g. ``"fused_gdn_gating_cpu"``.
        schema: the ``torch.library`` schema string; argument names and order match SGLang's
            call sites (some call by keyword) and the CPU build's registration.
        impl: the torch implementation (also importable from this module by ``name``).
        reference: ``"module:function"`` of the SGLang code whose semantics ``impl`` keeps.
    """

    name: str
    schema: str
    impl: Callable[..., Any]
    reference: str


def _unsupported(op: str, argument: str, value: object, why: str) -> NotImplementedError:
    return NotImplementedError(f"{op}: {argument}={value!r} is not supported ({why})")


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy that never aliases an input (custom ops must not return input views)."""
    return t.clone(memory_format=torch.contiguous_format)


def _check_last_dim(op: str, name: str, t: torch.Tensor, expected: int) -> None:
    if t.dim() != 2 or t.shape[-1] != expected:
        msg = f"{op}: {name} must be [tokens, {expected}], got {tuple(t.shape)}"
        raise ValueError(msg)


def _head_group(op: str, num_heads_qk: int, num_heads_v: int) -> int:
    if num_heads_qk <= 0 or num_heads_v % num_heads_qk != 0:
        msg = f"{op}: num_heads_v={num_heads_v} is not a multiple of num_heads_qk={num_heads_qk}"
        raise ValueError(msg)
    return num_heads_v // num_heads_qk


# ---- projections: split / reshape / concatenate ------------------------------------------------


def fused_qkvzba_split_reshape_cat_cpu(  # noqa: PLR0917 (positional, as the op schema)
    mixed_qkvz: torch.Tensor,
    mixed_ba: torch.Tensor,
    num_heads_qk: int,
    num_heads_v: int,
    head_qk: int,
    head_v: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpack Qwen3-Next's head-group-interleaved GDN projections (pure data movement).

    Semantics of ``fused_qkvzba_split_reshape_cat`` in
    ``sglang/kernels/ops/attention/triton_gdn_fused_proj.py``. With ``g = num_heads_v //
    num_heads_qk``, each row of ``mixed_qkvz`` holds, per k-head ``i``, ``[q_i (head_qk), k_i
    (head_qk), v_i (g*head_v), z_i (g*head_v)]``, and each row of ``mixed_ba`` holds, per k-head,
    ``[b_i (g), a_i (g)]``.

    Args:
        mixed_qkvz: ``[T, num_heads_qk * (2*head_qk + 2*g*head_v)]``, any dtype.
        mixed_ba: ``[T, 2 * num_heads_v]``.
        num_heads_qk: k (and q) heads on this rank.
        num_heads_v: v heads on this rank, a multiple of ``num_heads_qk``.
        head_qk: q/k head dim.
        head_v: v head dim.

    Returns:
        ``mixed_qkv [T, 2*num_heads_qk*head_qk + num_heads_v*head_v]`` laid out ``[all q | all
        k | all v]``, ``z [T, num_heads_v, head_v]``, ``b [T, num_heads_v]`` and ``a [T,
        num_heads_v]``; input dtypes, new contiguous tensors.
    """
    op = "fused_qkvzba_split_reshape_cat_cpu"
    group = _head_group(op, num_heads_qk, num_heads_v)
    tokens = mixed_qkvz.shape[0]
    per_head = 2 * head_qk + 2 * group * head_v
    _check_last_dim(op, "mixed_qkvz", mixed_qkvz, num_heads_qk * per_head)
    _check_last_dim(op, "mixed_ba", mixed_ba, 2 * num_heads_v)
    grouped = mixed_qkvz.reshape(tokens, num_heads_qk, per_head)
    q, k, v, z = torch.split(grouped, [head_qk, head_qk, group * head_v, group * head_v], -1)
    mixed_qkv = torch.cat([part.reshape(tokens, -1) for part in (q, k, v)], dim=-1)
    b, a = torch.split(mixed_ba.reshape(tokens, num_heads_qk, 2 * group), group, -1)
    return (
        mixed_qkv,
        _fresh(z.reshape(tokens, num_heads_v, head_v)),
        _fresh(b.reshape(tokens, num_heads_v)),
        _fresh(a.reshape(tokens, num_heads_v)),
    )


def fused_qkvzba_split_reshape_cat_contiguous_cpu(  # noqa: PLR0917 (positional, as the op schema)
    mixed_qkvz: torch.Tensor,
    mixed_ba: torch.Tensor,
    num_heads_qk: int,
    num_heads_v: int,
    head_qk: int,
    head_v: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpack Qwen3.5's contiguous GDN projections (pure data movement).

    Semantics of ``fused_qkvzba_split_reshape_cat_contiguous`` in
    ``sglang/kernels/ops/attention/triton_gdn_fused_proj.py``: each row of ``mixed_qkvz`` is
    ``[all q | all k | all v | all z]`` and each row of ``mixed_ba`` is ``[all b | all a]``.

    Args:
        mixed_qkvz: ``[T, 2*num_heads_qk*head_qk + 2*num_heads_v*head_v]``, rows may be strided.
        mixed_ba: ``[T, 2 * num_heads_v]``.
        num_heads_qk: k (and q) heads on this rank.
        num_heads_v: v heads on this rank, a multiple of ``num_heads_qk``.
        head_qk: q/k head dim.
        head_v: v head dim.

    Returns:
        ``mixed_qkv [T, 2*num_heads_qk*head_qk + num_heads_v*head_v]``, ``z [T, num_heads_v,
        head_v]``, ``b [T, num_heads_v]``, ``a [T, num_heads_v]``; input dtypes, new
        contiguous tensors.
    """
    op = "fused_qkvzba_split_reshape_cat_contiguous_cpu"
    _head_group(op, num_heads_qk, num_heads_v)
    tokens = mixed_qkvz.shape[0]
    qk_width = num_heads_qk * head_qk
    v_width = num_heads_v * head_v
    _check_last_dim(op, "mixed_qkvz", mixed_qkvz, 2 * qk_width + 2 * v_width)
    _check_last_dim(op, "mixed_ba", mixed_ba, 2 * num_heads_v)
    qkv, z = torch.split(mixed_qkvz, [2 * qk_width + v_width, v_width], -1)
    b, a = torch.split(mixed_ba, num_heads_v, -1)
    return _fresh(qkv), _fresh(z.reshape(tokens, num_heads_v, head_v)), _fresh(b), _fresh(a)


def fused_input_proj_cpu(
    hidden_states: torch.Tensor,
    qkvz_weight: torch.Tensor,
    ba_weight: torch.Tensor,
    is_vnni: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both GDN input projections of one hidden state: ``x @ qkvz_weight.T``, ``x @ ba_weight.T``.

    Semantics of the unfused branch of ``Qwen3_5GatedDeltaNet._forward_input_proj`` in
    ``sglang/srt/models/qwen3_5.py`` (``in_proj_qkvz`` and ``in_proj_ba``, bias-free, which on a
    CPU without AMX run ``torch.nn.functional.linear``). Accumulates in float32 and rounds once,
    as the CPU kernel does.

    ``is_vnni=True`` means the weights were packed by ``convert_weight_packed``; SGLang passes it
    only on its AMX path (``_fused_input_proj_cpu_enabled``), after packing, which never happens
    on the machines these stand-ins serve, so it raises rather than read packed data as plain.

    Args:
        hidden_states: ``[T, hidden]``.
        qkvz_weight: ``[qkvz_dim, hidden]``, plain layout.
        ba_weight: ``[ba_dim, hidden]``, plain layout.
        is_vnni: must be False.

    Returns:
        ``[T, qkvz_dim]`` and ``[T, ba_dim]`` in ``hidden_states.dtype``.
    """
    if is_vnni:
        raise _unsupported(
            "fused_input_proj_cpu",
            "is_vnni",
            is_vnni,
            "VNNI-packed weights exist only after AMX prepacking, which a CPU without AMX never "
            "does",
        )
    x = hidden_states.float()
    qkvz = torch.nn.functional.linear(x, qkvz_weight.float())
    ba = torch.nn.functional.linear(x, ba_weight.float())
    return qkvz.to(hidden_states.dtype), ba.to(hidden_states.dtype)


# ---- elementwise gates and norms ---------------------------------------------------------------


def fused_sigmoid_mul_cpu(input: torch.Tensor, gate: torch.Tensor) -> None:
    """``input *= sigmoid(gate)`` in place, in float32.

    Semantics of ``fused_sigmoid_mul(..., inplace=True)`` in
    ``sglang/kernels/ops/elementwise/elementwise.py``: either the two tensors have one shape, or
    ``gate`` is a (possibly strided) ``[T, heads, head_dim]`` view and ``input`` is ``[T,
    heads*head_dim]``.

    Args:
        input: ``[T, hidden]``, overwritten with the gated value in its own dtype.
        gate: same shape as ``input``, or ``[T, heads, head_dim]`` with ``heads*head_dim ==
            hidden``.
    """
    if gate.numel() != input.numel() or gate.shape[0] != input.shape[0]:
        msg = (
            f"fused_sigmoid_mul_cpu: gate {tuple(gate.shape)} does not match input "
            f"{tuple(input.shape)}"
        )
        raise ValueError(msg)
    gated = input.float() * torch.sigmoid(gate.reshape(input.shape).float())
    input.copy_(gated)


def _gemma_rmsnorm_rows(rows: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GemmaRMSNorm of each row, float32: ``x * rsqrt(mean(x**2) + eps) * (1 + weight)``."""
    x = rows.float()
    variance = (x * x).sum(-1, keepdim=True) / x.shape[-1]
    return x * torch.rsqrt(variance + eps) * (weight.float() + 1.0)


def fused_qk_gemma_rmsnorm_cpu(  # noqa: PLR0917 (positional, as the op schema)
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head GemmaRMSNorm of q and k, computed in float32.

    Semantics of ``fused_qk_gemma_rmsnorm`` in ``sglang/srt/models/utils.py`` (its Triton
    kernel). The Triton kernel always stores bf16 (fp16 for fp16 input) values; this op returns
    the input dtype, which is the same for the bf16 and fp16 models SGLang runs it on. The
    outputs have the inputs' shapes, as the CPU op's fake in ``cpu_graph_runner.py`` declares
    (``empty_like(q)``); SGLang views them back to ``q.shape`` either way.

    Args:
        q: ``[T, num_heads*head_dim]`` (may be a strided split of the qkv projection).
        k: ``[T, num_kv_heads*head_dim]``.
        q_weight: ``[head_dim]``, Gemma offset weight (``1 + w`` is applied).
        k_weight: ``[head_dim]``.
        eps: variance epsilon.
        head_dim: head dim.

    Returns:
        Normalised ``q`` and ``k``, contiguous, shapes and dtypes of the inputs.
    """
    q_out = _gemma_rmsnorm_rows(q.reshape(-1, head_dim), q_weight, eps).to(q.dtype)
    k_out = _gemma_rmsnorm_rows(k.reshape(-1, head_dim), k_weight, eps).to(k.dtype)
    return q_out.reshape(q.shape), k_out.reshape(k.shape)


def fused_qk_gemma_rmsnorm_with_gate_cpu(  # noqa: PLR0917 (positional, as the op schema)
    q_gate: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
    num_head: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head GemmaRMSNorm of q and k plus the output gate, from a head-interleaved q_gate.

    Semantics of ``fused_qk_gemma_rmsnorm_with_gate`` in ``sglang/srt/models/utils.py``: each
    row of ``q_gate`` is ``[q_0, gate_0, q_1, gate_1, ...]`` (``head_dim`` each); q and k are
    normalised as in :func:`fused_qk_gemma_rmsnorm_cpu`, the gate is copied unchanged.

    Args:
        q_gate: ``[T, num_head*2*head_dim]``, may be a strided view.
        k: ``[T, num_kv_heads*head_dim]``.
        q_weight: ``[head_dim]``.
        k_weight: ``[head_dim]``.
        eps: variance epsilon.
        head_dim: head dim.
        num_head: q heads.

    Returns:
        ``q [T*num_head, head_dim]``, ``k [T*num_kv_heads, head_dim]``, ``gate [T*num_head,
        head_dim]``, contiguous, in the inputs' dtypes.
    """
    tokens = q_gate.shape[0]
    per_head = q_gate.reshape(tokens, num_head, 2 * head_dim)
    q, gate = torch.split(per_head, head_dim, -1)
    q_out = _gemma_rmsnorm_rows(q.reshape(-1, head_dim), q_weight, eps).to(q_gate.dtype)
    k_out = _gemma_rmsnorm_rows(k.reshape(-1, head_dim), k_weight, eps).to(k.dtype)
    return q_out, k_out, _fresh(gate.reshape(-1, head_dim))


def fused_rmsnorm_gated_cpu(
    input: torch.Tensor,
    weight: torch.Tensor,
    gate: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """``rmsnorm(input) * weight * silu(gate)`` per row, in float32.

    Semantics of ``layernorm_fn(x, weight, None, z=gate, eps=eps, group_size=None,
    norm_before_gate=True, is_rms_norm=True, activation="swish")`` in
    ``sglang/kernels/ops/attention/fla/layernorm_gated.py`` — the only configuration the CPU
    branches of its ``RMSNorm`` and of ``fused_norm_gate.FusedRMSNormGated`` call this op with.

    Args:
        input: ``[..., N]``.
        weight: ``[N]``.
        gate: same number of elements as ``input`` (``z`` of the GDN output gate).
        eps: variance epsilon.

    Returns:
        ``input``'s shape and dtype.
    """
    if gate.numel() != input.numel():
        msg = (
            f"fused_rmsnorm_gated_cpu: gate {tuple(gate.shape)} does not match input "
            f"{tuple(input.shape)}"
        )
        raise ValueError(msg)
    x = input.float()
    variance = (x * x).sum(-1, keepdim=True) / x.shape[-1]
    y = x * (1.0 / torch.sqrt(variance + eps)) * weight.float()
    z = gate.reshape(input.shape).float()
    return (y * z * torch.sigmoid(z)).to(input.dtype)


# ---- GDN gates -------------------------------------------------------------------------------


def _softplus(x: torch.Tensor, beta: float, threshold: float) -> torch.Tensor:
    """Triton's softplus: ``log(1 + exp(beta*x)) / beta`` up to ``beta*x <= threshold``, else x."""
    bx = beta * x
    return torch.where(bx <= threshold, torch.log(1.0 + torch.exp(bx)) / beta, x)


def _gdn_decay(
    a_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    beta: float = 1.0,
    threshold: float = 20.0,
) -> torch.Tensor:
    """Log-space decay ``g = -exp(A_log) * softplus(a + dt_bias)``, float32, ``a``'s shape."""
    x = a.float() + dt_bias.float()
    return -torch.exp(a_log.float()) * _softplus(x, beta, threshold)


def fused_gdn_gating_cpu(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN gates: decay ``g = -exp(A_log) * softplus(a + dt_bias)``, strength ``sigmoid(b)``.

    Semantics of ``fused_gdn_gating`` in
    ``sglang/kernels/ops/attention/linear/fused_gdn_gating.py`` (softplus beta 1, threshold 20).
    The Triton kernel rounds ``beta`` to ``b``'s dtype and stores it in float32; the CPU op's
    contract (``register_fake_ops``) returns it in ``b``'s dtype, which holds the same values.

    Args:
        A_log: ``[HV]``.
        a: ``[T, HV]``.
        b: ``[T, HV]``.
        dt_bias: ``[HV]``.

    Returns:
        ``g [1, T, HV]`` float32 and ``beta [1, T, HV]`` in ``b.dtype``.
    """
    if a.dim() != 2 or b.shape != a.shape:
        msg = f"fused_gdn_gating_cpu: a {tuple(a.shape)} and b {tuple(b.shape)} must be [T, HV]"
        raise ValueError(msg)
    g = _gdn_decay(A_log, a, dt_bias)
    beta = torch.sigmoid(b.float()).to(b.dtype)
    return g.unsqueeze(0), beta.unsqueeze(0)


# ---- causal depthwise conv1d -------------------------------------------------------------------


def _conv_weight(op: str, weight: torch.Tensor) -> torch.Tensor:
    """``[dim, width]`` float32 from a plain ``[dim, width]`` or ``[dim, 1, width]`` weight."""
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight.squeeze(1)
    if weight.dim() != 2 or weight.shape[1] < 2:
        msg = f"{op}: weight must be [dim, width >= 2], got {tuple(weight.shape)}"
        raise ValueError(msg)
    return weight.float()


def _causal_conv(
    window: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool,
) -> torch.Tensor:
    """Depthwise conv of ``window [..., dim, width-1+L]`` by ``weight [dim, width]``.

    Returns ``[..., dim, L]``, accumulated in float32 from the bias tap by tap, then
    ``x / (1 + exp(-x))`` when ``silu``, as the Triton conv kernels do.
    """
    dim, width = weight.shape
    length = window.shape[-1] - (width - 1)
    acc = window.new_zeros((*window.shape[:-1], length))
    if bias is not None:
        acc = acc + bias.float().reshape(dim, 1)
    for tap in range(width):
        acc = acc + window[..., tap : tap + length] * weight[:, tap : tap + 1]
    if silu:
        acc = acc / (1.0 + torch.exp(-acc))
    return acc


def _conv_slots(
    op: str,
    indices: torch.Tensor | None,
    count: int,
    num_slots: int,
    pad_slot_id: int,
) -> tuple[list[int], list[bool]]:
    """Cache slot of each sequence and whether it is a padding entry; checks every real slot.

    As in the Triton kernels, sequence ``i`` reads ``indices[i]``; entries past the sequence
    count (a batch padded for graph replay) are not read.
    """
    slots = list(range(count)) if indices is None else [int(i) for i in indices.tolist()]
    if len(slots) < count:
        msg = f"{op}: {len(slots)} cache indices for {count} sequences"
        raise ValueError(msg)
    slots = slots[:count]
    padded = [slot == pad_slot_id for slot in slots]
    bad = [s for s, pad in zip(slots, padded, strict=True) if not pad and not 0 <= s < num_slots]
    if bad:
        msg = f"{op}: cache indices {bad} outside the {num_slots} conv-state slots"
        raise IndexError(msg)
    return slots, padded


def causal_conv1d_fwd_cpu(  # noqa: PLR0917 (positional, as the op schema)
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    cache_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    silu_activation: bool,
    pad_slot_id: int,
    is_vnni: bool,
) -> torch.Tensor:
    """Prefill causal depthwise conv1d over a varlen batch, advancing each sequence's conv state.

    Semantics of ``causal_conv1d_fn`` (``_causal_conv1d_fwd_kernel``) in
    ``sglang/kernels/ops/mamba/causal_conv1d_triton.py``, called as
    ``sgl_kernel.mamba.causal_conv1d_fn_cpu`` calls the CPU op. Sequence ``i`` covers tokens
    ``query_start_loc[i]:query_start_loc[i+1]`` and uses slot ``cache_indices[i]`` (``i`` when
    None). Its history is ``conv_states[slot]`` (cast to ``x``'s dtype) when
    ``has_initial_state[i]``, else zeros; afterwards the slot holds the last ``width-1`` inputs
    of ``history ++ x``. An empty sequence is skipped, as the kernel does.

    A sequence whose slot is ``pad_slot_id`` leaves every conv state untouched; the reference
    leaves its output rows unwritten, here they are its convolution from a zero history.

    ``is_vnni``: the weight is read as the plain ``[dim, width]`` tensor either way.
    ``sgl_kernel.mamba`` passes True unconditionally, but SGLang packs conv weights
    (``causal_conv1d_weight_pack``) only on AMX machines, which these stand-ins do not serve.

    Args:
        x: ``[dim, total_tokens]`` (the transpose of ``[total_tokens, dim]``, any strides).
        weight: ``[dim, width]`` (or ``[dim, 1, width]``).
        bias: ``[dim]`` or None.
        conv_states: ``[num_slots, dim, width-1]`` or None; updated in place.
        query_start_loc: ``[batch+1]`` int token offsets from 0 to ``total_tokens``; required.
        cache_indices: ``[>= batch]`` int slots or None.
        has_initial_state: ``[>= batch]`` bool or None (no sequence has history).
        silu_activation: apply SiLU to the output.
        pad_slot_id: slot value marking a padding entry (SGLang uses -1).
        is_vnni: see above.

    Returns:
        ``x``'s shape, strides and dtype.
    """
    del is_vnni  # plain weights on a machine without AMX; see the docstring
    op = "causal_conv1d_fwd_cpu"
    if query_start_loc is None:
        raise _unsupported(op, "query_start_loc", None, "only the varlen [dim, tokens] layout")
    if x.dim() != 2:
        msg = f"{op}: x must be [dim, total_tokens] for varlen input, got {tuple(x.shape)}"
        raise ValueError(msg)
    w = _conv_weight(op, weight)
    dim, width = w.shape
    if conv_states is not None and tuple(conv_states.shape[1:]) != (dim, width - 1):
        raise _unsupported(
            op,
            "conv_states.shape",
            tuple(conv_states.shape),
            f"state must be [slots, {dim}, {width - 1}]",
        )
    starts, lengths = _sequence_bounds(op, query_start_loc, x.shape[1])
    count = len(lengths)
    if conv_states is None:  # no state to read or write: every sequence starts from zeros
        slots, padded = list(range(count)), [True] * count
    else:
        slots, padded = _conv_slots(op, cache_indices, count, conv_states.shape[0], pad_slot_id)
    initial = [False] * count if has_initial_state is None else has_initial_state.tolist()
    if len(initial) < count:
        msg = f"{op}: has_initial_state has {len(initial)} entries for {count} sequences"
        raise ValueError(msg)
    out = torch.empty_like(x)
    for seq in range(count):
        start, end = starts[seq], starts[seq] + lengths[seq]
        if end == start:
            continue
        tokens = x[:, start:end].float()
        if not padded[seq] and initial[seq]:
            assert conv_states is not None
            state = conv_states[slots[seq]]
            history = state.to(x.dtype).float()
            kept = state.float()
        else:
            history = kept = tokens.new_zeros((dim, width - 1))
        out[:, start:end] = _causal_conv(torch.cat([history, tokens], -1), w, bias, silu_activation)
        if not padded[seq]:
            assert conv_states is not None
            new_state = torch.cat([kept, tokens], -1)[:, -(width - 1) :]
            conv_states[slots[seq]] = new_state.to(conv_states.dtype)
    return out


def causal_conv1d_update_cpu(  # noqa: PLR0917 (positional, as the op schema)
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu_activation: bool,
    cache_seqlens: torch.Tensor | None,
    conv_state_indices: torch.Tensor | None,
    pad_slot_id: int,
    is_vnni: bool,
) -> torch.Tensor:
    """Decode causal depthwise conv1d: new tokens against each sequence's conv state.

    Semantics of ``causal_conv1d_update`` (``_causal_conv1d_update_kernel``, no speculative
    decoding) in ``sglang/kernels/ops/mamba/causal_conv1d_triton.py``, called as
    ``sgl_kernel.mamba.causal_conv1d_update_cpu`` calls the CPU op. Row ``i`` convolves
    ``conv_states[slot_i] ++ x[i]``; the slot then holds the last ``width-1`` columns of that.

    A row whose slot is ``pad_slot_id`` leaves every conv state untouched; the reference leaves
    its output unwritten, here it is its convolution from a zero history.

    ``is_vnni``: as in :func:`causal_conv1d_fwd_cpu`, the weight is always read as plain.

    Args:
        x: ``[batch, dim]`` or ``[batch, dim, L]``.
        conv_states: ``[num_slots, dim, width-1]``; updated in place.
        weight: ``[dim, width]`` (or ``[dim, 1, width]``).
        bias: ``[dim]`` or None.
        silu_activation: apply SiLU to the output.
        cache_seqlens: must be None (the circular-buffer mode the reference does not implement
            either).
        conv_state_indices: ``[>= batch]`` int slots or None (row ``i`` uses slot ``i``).
        pad_slot_id: slot value marking a padding row (SGLang uses -1).
        is_vnni: see above.

    Returns:
        ``x``'s shape and dtype.
    """
    del is_vnni  # plain weights on a machine without AMX; see causal_conv1d_fwd_cpu
    op = "causal_conv1d_update_cpu"
    if cache_seqlens is not None:
        raise _unsupported(op, "cache_seqlens", "a tensor", "circular conv states")
    if x.dim() not in (2, 3):
        msg = f"{op}: x must be [batch, dim] or [batch, dim, L], got {tuple(x.shape)}"
        raise ValueError(msg)
    w = _conv_weight(op, weight)
    dim, width = w.shape
    if conv_states.dim() != 3 or tuple(conv_states.shape[1:]) != (dim, width - 1):
        raise _unsupported(
            op,
            "conv_states.shape",
            tuple(conv_states.shape),
            f"state must be [slots, {dim}, {width - 1}]",
        )
    tokens = (x.unsqueeze(-1) if x.dim() == 2 else x).float()
    batch = tokens.shape[0]
    slots, padded = _conv_slots(op, conv_state_indices, batch, conv_states.shape[0], pad_slot_id)
    rows = [i for i in range(batch) if not padded[i]]
    real = torch.tensor([slots[i] for i in rows], dtype=torch.long)
    history = tokens.new_zeros((batch, dim, width - 1))
    if rows:
        history[rows] = conv_states[real].float()
    window = torch.cat([history, tokens], -1)
    out = _causal_conv(window, w, bias, silu_activation).to(x.dtype)
    if rows:
        conv_states[real] = window[rows, :, -(width - 1) :].to(conv_states.dtype)
    return out.reshape(x.shape)


# ---- gated delta rule ------------------------------------------------------------------------


def _sequence_bounds(op: str, cu_seqlens: torch.Tensor, tokens: int) -> tuple[list[int], list[int]]:
    offsets = [int(o) for o in cu_seqlens.tolist()]
    if (
        not offsets
        or offsets[0] != 0
        or offsets[-1] != tokens
        or any(b < a for a, b in itertools.pairwise(offsets))
    ):
        msg = f"{op}: cu_seqlens {offsets} must rise from 0 to the token count {tokens}"
        raise ValueError(msg)
    return offsets[:-1], [b - a for a, b in itertools.pairwise(offsets)]


def _gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    *,
    states: torch.Tensor,
    slots: torch.Tensor,
    starts: list[int],
    lengths: list[int],
) -> torch.Tensor:
    """The gated delta rule, token by token, for every sequence at once; float32.

    Per token, with state ``S [V, K]`` of a v-head: ``S *= exp(g)``; ``u = beta * (v - S k)``;
    ``S += u k^T``; ``o = S q``. This is the loop of SGLang's recurrent GDN kernels and the
    exact (unchunked) value of its chunked prefill.

    Args:
        q: ``[T, H, K]``, normalised and scaled.
        k: ``[T, H, K]``, normalised.
        v: ``[T, HV, V]``.
        log_decay: ``[T, HV]`` (``g``).
        beta: ``[T, HV]``.
        states: ``[num_slots, HV, V, K]``; slot ``slots[i] >= 0`` is sequence ``i``'s initial
            state and receives its final state (in its own dtype); ``slots[i] < 0`` starts from
            zeros and writes nothing.
        slots: ``[N]`` int.
        starts: first token of each of the ``N`` sequences.
        lengths: token count of each sequence.

    Returns:
        ``o [T, HV, V]`` float32.
    """
    heads_v = v.shape[1]
    group = heads_v // q.shape[1]
    q = q.repeat_interleave(group, dim=1)
    k = k.repeat_interleave(group, dim=1)
    slots = slots.long()
    owned = slots >= 0
    if bool(owned.any()) and int(slots[owned].max()) >= states.shape[0]:
        msg = f"state indices {slots.tolist()} outside the {states.shape[0]} state slots"
        raise IndexError(msg)
    state = torch.zeros((len(lengths), heads_v, v.shape[2], k.shape[2]), dtype=torch.float32)
    state[owned] = states[slots[owned]].float()
    out = torch.empty(v.shape, dtype=torch.float32)
    start = torch.tensor(starts, dtype=torch.long)
    length = torch.tensor(lengths, dtype=torch.long)
    for step in range(max(lengths, default=0)):
        seqs = (length > step).nonzero().squeeze(1)
        pos = start[seqs] + step
        h = state[seqs] * torch.exp(log_decay[pos])[:, :, None, None]
        k_t = k[pos]
        update = (v[pos] - torch.einsum("nhvk,nhk->nhv", h, k_t)) * beta[pos][:, :, None]
        h = h + update[..., None] * k_t[:, :, None, :]
        out[pos] = torch.einsum("nhvk,nhk->nhv", h, q[pos])
        state[seqs] = h
    states[slots[owned]] = state[owned].to(states.dtype)
    return out


def _check_qkv(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        msg = (
            f"{op}: q {tuple(q.shape)}, k {tuple(k.shape)} must be [B, T, H, K] and v "
            f"{tuple(v.shape)} [B, T, HV, V]"
        )
        raise ValueError(msg)
    if q.shape[0] != 1:
        msg = f"{op}: varlen input needs batch 1, got {q.shape[0]}; flatten the sequences"
        raise ValueError(msg)
    if v.shape[2] % q.shape[2] != 0:
        msg = f"{op}: {v.shape[2]} v-heads are not a multiple of {q.shape[2]} q/k-heads"
        raise ValueError(msg)


def chunk_gated_delta_rule_cpu(  # noqa: PLR0917 (positional, as the op schema)
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    output_final_state: bool,
    cu_seqlens: torch.Tensor,
    head_first: bool,
    use_qk_l2norm_in_kernel: bool,
    initial_state_indices: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN prefill over a varlen batch, reading and writing each sequence's SSM state in place.

    Semantics of ``chunk_gated_delta_rule`` (``inplace_update=True``) in
    ``sglang/kernels/ops/attention/fla/chunk.py``, computed by its exact token-by-token
    recurrence in float32 instead of 64-token chunks. As the reference: q and k are
    L2-normalised (``x / sqrt(sum(x**2) + eps)``) and rounded to their dtype when
    ``use_qk_l2norm_in_kernel``, q is scaled by ``K**-0.5``, sequence ``i`` starts from
    ``initial_state[initial_state_indices[i]]`` and writes its final state there; a negative
    index starts from zeros and writes nothing.

    The CPU op also returns the state: as its fake in ``cpu_graph_runner.py`` declares
    (``initial_state.to(torch.float32)``), a float32 copy of the whole updated state pool, made
    whatever ``output_final_state`` says (SGLang passes True and ignores it on CPU).

    Args:
        query: ``[1, T, H, K]``.
        key: ``[1, T, H, K]``.
        value: ``[1, T, HV, V]``, ``HV`` a multiple of ``H``.
        g: ``[1, T, HV]`` log-space decay (from :func:`fused_gdn_gating_cpu`).
        beta: ``[1, T, HV]``.
        initial_state: ``[num_slots, HV, V, K]`` state pool; updated in place.
        output_final_state: see above.
        cu_seqlens: ``[N+1]`` int token offsets covering all ``T`` tokens.
        head_first: must be False (the reference rejects True too).
        use_qk_l2norm_in_kernel: L2-normalise q and k first.
        initial_state_indices: ``[N]`` int slots.
        eps: the L2-norm epsilon.

    Returns:
        ``o [1, T, HV, V]`` in ``value.dtype`` and the float32 copy of ``initial_state``.
    """
    del output_final_state  # the pool is updated in place either way; see the docstring
    op = "chunk_gated_delta_rule_cpu"
    if head_first:
        raise _unsupported(op, "head_first", head_first, "inputs are [B, T, H, ...]")
    _check_qkv(op, query, key, value)
    tokens = query.shape[1]
    starts, lengths = _sequence_bounds(op, cu_seqlens, tokens)
    if initial_state_indices.numel() != len(lengths):
        msg = f"{op}: {initial_state_indices.numel()} state indices for {len(lengths)} sequences"
        raise ValueError(msg)
    q, k = query[0].float(), key[0].float()
    if use_qk_l2norm_in_kernel:
        q = (q / torch.sqrt((q * q).sum(-1, keepdim=True) + eps)).to(query.dtype).float()
        k = (k / torch.sqrt((k * k).sum(-1, keepdim=True) + eps)).to(key.dtype).float()
    out = _gated_delta_rule(
        q * query.shape[-1] ** -0.5,
        k,
        value[0].float(),
        g[0].float(),
        beta[0].float(),
        states=initial_state,
        slots=initial_state_indices,
        starts=starts,
        lengths=lengths,
    )
    return out.to(value.dtype).unsqueeze(0), initial_state.to(torch.float32, copy=True)


def fused_sigmoid_gating_delta_rule_update_cpu(  # noqa: PLR0917 (positional, as the op schema)
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    initial_state_source: torch.Tensor,
    initial_state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    use_qk_l2norm_in_kernel: bool,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> torch.Tensor:
    """GDN decode: gates from ``a``/``b`` fused into the recurrent update of each sequence's state.

    Semantics of ``fused_sigmoid_gating_delta_rule_update`` (decode: no intermediate states,
    state written back) in
    ``sglang/kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py``, all in float32:
    per token ``g = -exp(A_log) * softplus(a + dt_bias)`` (with ``softplus_beta`` and
    ``softplus_threshold``), ``beta = 1 / (1 + exp(-b))``, q and k multiplied by ``1 /
    sqrt(sum(x**2) + 1e-6)`` when ``use_qk_l2norm_in_kernel``, q scaled by ``K**-0.5``, then the
    recurrence of :func:`chunk_gated_delta_rule_cpu`. Sequence ``i`` (tokens
    ``cu_seqlens[i]:cu_seqlens[i+1]``) uses slot ``initial_state_indices[i]``; a negative slot
    starts from zeros and writes nothing.

    The output is laid out ``[T, 1, HV, V]``, as the CPU op's fake in ``cpu_graph_runner.py``
    declares (``q.new_empty(q.shape[1], q.shape[0], HV, V)``); the GPU op returns the same
    values as ``[1, T, HV, V]``, and SGLang flattens either.

    Args:
        A_log: ``[HV]``.
        dt_bias: ``[HV]``.
        q: ``[1, T, H, K]``.
        k: ``[1, T, H, K]``.
        v: ``[1, T, HV, V]``.
        a: ``[T, HV]`` (any shape of ``T*HV`` elements, token-major).
        b: ``[T, HV]``.
        initial_state_source: ``[num_slots, HV, V, K]`` state pool; updated in place.
        initial_state_indices: ``[>= N]`` int slots (the first ``N`` are read).
        cu_seqlens: ``[N+1]`` int token offsets covering all ``T`` tokens.
        use_qk_l2norm_in_kernel: L2-normalise q and k first.
        softplus_beta: softplus beta.
        softplus_threshold: softplus linear threshold.

    Returns:
        ``[T, 1, HV, V]`` in ``q.dtype``.
    """
    op = "fused_sigmoid_gating_delta_rule_update_cpu"
    _check_qkv(op, q, k, v)
    tokens, heads_v = v.shape[1], v.shape[2]
    starts, lengths = _sequence_bounds(op, cu_seqlens, tokens)
    if initial_state_indices.numel() < len(lengths):  # as the kernel, extra entries go unread
        msg = f"{op}: {initial_state_indices.numel()} state indices for {len(lengths)} sequences"
        raise ValueError(msg)
    if a.numel() != tokens * heads_v or b.numel() != tokens * heads_v:
        msg = f"{op}: a {tuple(a.shape)} and b {tuple(b.shape)} must be [{tokens}, {heads_v}]"
        raise ValueError(msg)
    log_decay = _gdn_decay(
        A_log, a.reshape(tokens, heads_v), dt_bias, softplus_beta, softplus_threshold
    )
    write = 1.0 / (1.0 + torch.exp(-b.reshape(tokens, heads_v).float()))
    q32, k32 = q[0].float(), k[0].float()
    if use_qk_l2norm_in_kernel:
        q32 = q32 * (1.0 / torch.sqrt((q32 * q32).sum(-1, keepdim=True) + _RECURRENT_L2NORM_EPS))
        k32 = k32 * (1.0 / torch.sqrt((k32 * k32).sum(-1, keepdim=True) + _RECURRENT_L2NORM_EPS))
    out = _gated_delta_rule(
        q32 * q.shape[-1] ** -0.5,
        k32,
        v[0].float(),
        log_decay,
        write,
        states=initial_state_source,
        slots=initial_state_indices.reshape(-1)[: len(lengths)],
        starts=starts,
        lengths=lengths,
    )
    return out.to(q.dtype).unsqueeze(1)


# ---- registration ----------------------------------------------------------------------------

_M = "sglang.kernels.ops"

#: Every op this module implements, with the schema SGLang calls it through.
STANDIN_OPS: Final[tuple[StandInOp, ...]] = (
    StandInOp(
        "fused_qkvzba_split_reshape_cat_cpu",
        "fused_qkvzba_split_reshape_cat_cpu(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk, "
        "int num_heads_v, int head_qk, int head_v) -> (Tensor, Tensor, Tensor, Tensor)",
        fused_qkvzba_split_reshape_cat_cpu,
        f"{_M}.attention.triton_gdn_fused_proj:fused_qkvzba_split_reshape_cat",
    ),
    StandInOp(
        "fused_qkvzba_split_reshape_cat_contiguous_cpu",
        "fused_qkvzba_split_reshape_cat_contiguous_cpu(Tensor mixed_qkvz, Tensor mixed_ba, "
        "int num_heads_qk, int num_heads_v, int head_qk, int head_v) "
        "-> (Tensor, Tensor, Tensor, Tensor)",
        fused_qkvzba_split_reshape_cat_contiguous_cpu,
        f"{_M}.attention.triton_gdn_fused_proj:fused_qkvzba_split_reshape_cat_contiguous",
    ),
    StandInOp(
        "fused_input_proj_cpu",
        "fused_input_proj_cpu(Tensor hidden_states, Tensor qkvz_weight, Tensor ba_weight, "
        "bool is_vnni) -> (Tensor, Tensor)",
        fused_input_proj_cpu,
        "sglang.srt.models.qwen3_5:Qwen3_5GatedDeltaNet._forward_input_proj",
    ),
    StandInOp(
        "fused_sigmoid_mul_cpu",
        "fused_sigmoid_mul_cpu(Tensor(a!) input, Tensor gate) -> ()",
        fused_sigmoid_mul_cpu,
        f"{_M}.elementwise.elementwise:fused_sigmoid_mul",
    ),
    StandInOp(
        "fused_qk_gemma_rmsnorm_cpu",
        "fused_qk_gemma_rmsnorm_cpu(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, "
        "float eps, int head_dim) -> (Tensor, Tensor)",
        fused_qk_gemma_rmsnorm_cpu,
        "sglang.srt.models.utils:fused_qk_gemma_rmsnorm",
    ),
    StandInOp(
        "fused_qk_gemma_rmsnorm_with_gate_cpu",
        "fused_qk_gemma_rmsnorm_with_gate_cpu(Tensor q_gate, Tensor k, Tensor q_weight, "
        "Tensor k_weight, float eps, int head_dim, int num_head) -> (Tensor, Tensor, Tensor)",
        fused_qk_gemma_rmsnorm_with_gate_cpu,
        "sglang.srt.models.utils:fused_qk_gemma_rmsnorm_with_gate",
    ),
    StandInOp(
        "fused_rmsnorm_gated_cpu",
        "fused_rmsnorm_gated_cpu(Tensor input, Tensor weight, Tensor gate, float eps) -> Tensor",
        fused_rmsnorm_gated_cpu,
        f"{_M}.attention.fla.layernorm_gated:layernorm_fn",
    ),
    StandInOp(
        "fused_gdn_gating_cpu",
        "fused_gdn_gating_cpu(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) "
        "-> (Tensor, Tensor)",
        fused_gdn_gating_cpu,
        f"{_M}.attention.linear.fused_gdn_gating:fused_gdn_gating",
    ),
    StandInOp(
        "causal_conv1d_fwd_cpu",
        "causal_conv1d_fwd_cpu(Tensor x, Tensor weight, Tensor? bias, Tensor(a!)? conv_states, "
        "Tensor? query_start_loc, Tensor? cache_indices, Tensor? has_initial_state, "
        "bool silu_activation, int pad_slot_id, bool is_vnni) -> Tensor",
        causal_conv1d_fwd_cpu,
        f"{_M}.mamba.causal_conv1d_triton:causal_conv1d_fn",
    ),
    StandInOp(
        "causal_conv1d_update_cpu",
        "causal_conv1d_update_cpu(Tensor x, Tensor(a!) conv_states, Tensor weight, Tensor? bias, "
        "bool silu_activation, Tensor? cache_seqlens, Tensor? conv_state_indices, "
        "int pad_slot_id, bool is_vnni) -> Tensor",
        causal_conv1d_update_cpu,
        f"{_M}.mamba.causal_conv1d_triton:causal_conv1d_update",
    ),
    StandInOp(
        "chunk_gated_delta_rule_cpu",
        "chunk_gated_delta_rule_cpu(Tensor query, Tensor key, Tensor value, Tensor g, Tensor beta, "
        "Tensor(a!) initial_state, bool output_final_state, Tensor cu_seqlens, bool head_first, "
        "bool use_qk_l2norm_in_kernel, Tensor initial_state_indices, float eps=1e-6) "
        "-> (Tensor, Tensor)",
        chunk_gated_delta_rule_cpu,
        f"{_M}.attention.fla.chunk:chunk_gated_delta_rule",
    ),
    StandInOp(
        "fused_sigmoid_gating_delta_rule_update_cpu",
        "fused_sigmoid_gating_delta_rule_update_cpu(Tensor A_log, Tensor dt_bias, Tensor q, "
        "Tensor k, Tensor v, Tensor a, Tensor b, Tensor(a!) initial_state_source, "
        "Tensor initial_state_indices, Tensor cu_seqlens, bool use_qk_l2norm_in_kernel, "
        "float softplus_beta=1.0, float softplus_threshold=20.0) -> Tensor",
        fused_sigmoid_gating_delta_rule_update_cpu,
        f"{_M}.attention.linear.fused_sigmoid_gating_recurrent:fused_sigmoid_gating_delta_rule_update",
    ),
)


def _op_exists(namespace: str, name: str) -> bool:
    """Whether ``namespace::name`` has a schema, asked of the dispatcher (no attribute lookups)."""
    try:
        torch._C._dispatch_find_schema_or_throw(f"{namespace}::{name}", "")
    except RuntimeError:
        return False
    return True


def register_cpu_ops(library: torch.library.Library) -> tuple[str, ...]:
    """Define and implement (dispatch key CPU) every op of :data:`STANDIN_OPS` in ``library``.

    ``library`` is a ``FRAGMENT`` library of the ``sgl_kernel`` namespace (another namespace
    works the same, for tests); the caller keeps it alive for as long as the ops are needed. An
    op whose name the namespace already has (a real CPU build, an earlier call) is skipped and
    left untouched.

    Args:
        library: where to define the ops.

    Returns:
        The names defined by this call, in :data:`STANDIN_OPS` order.
    """
    namespace = library.ns
    defined: list[str] = []
    for op in STANDIN_OPS:
        if _op_exists(namespace, op.name):
            continue
        library.define(op.schema)  # type: ignore[no-untyped-call]
        library.impl(op.name, op.impl, "CPU")  # type: ignore[no-untyped-call]
        defined.append(op.name)
    return tuple(defined)
