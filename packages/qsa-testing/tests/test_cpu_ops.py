"""The torch stand-ins for ``torch.ops.sgl_kernel.*_cpu`` against SGLang's own references.

Each op is run next to the SGLang code whose semantics it keeps (``StandInOp.reference``) on
small random inputs with odd shapes and the cases SGLang's call sites produce: several
sequences of different lengths in one varlen batch, sequences with and without a cached state,
padding slots.

Every comparison with a Triton or fla reference takes ``kernel_device`` and has two variants.
``interpreter``: without CUDA the reference runs on CPU tensors through Triton's interpreter
(``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` there, before any test module loads).
``cuda`` (marked ``gpu``): the reference is the compiled kernel, run on CUDA copies of the
inputs. The stand-in, a CPU op, always runs on the CPU tensors; the reference's outputs and
in-place state updates are brought back to the CPU to be compared. Where CUDA is present the
``interpreter`` variant skips; where it is absent the ``cuda`` variant skips (or fails, under
``QSA_REQUIRE_GPU=1``).
"""

import contextlib
import functools
import importlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import triton.language as tl

from qsa_testing.standins import _cpu_ops as ops


@dataclass(frozen=True)
class Tol:
    atol: float
    rtol: float


BF16_TOL = Tol(atol=1e-2, rtol=1e-2)  # bf16 outputs: a few ulps of a value of about 1
FP32_TOL = Tol(atol=1e-5, rtol=1e-5)
# bf16 outputs of a kernel that also rounds each of its products to bf16: twice BF16_TOL.
BF16_PRODUCTS_TOL = Tol(atol=2e-2, rtol=2e-2)


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: Tol) -> None:
    torch.testing.assert_close(got, want, atol=tol.atol, rtol=tol.rtol)


EXPECTED_OPS = (
    "fused_qkvzba_split_reshape_cat_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
    "fused_input_proj_cpu",
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_rmsnorm_gated_cpu",
    "fused_gdn_gating_cpu",
    "causal_conv1d_fwd_cpu",
    "causal_conv1d_update_cpu",
    "chunk_gated_delta_rule_cpu",
    "fused_sigmoid_gating_delta_rule_update_cpu",
)


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


@functools.cache
def _triton_interpreted() -> bool:
    """Whether SGLang's Triton kernels in this process are interpreter functions (asked of one)."""
    from sglang.kernels.ops.attention.linear.fused_gdn_gating import fused_gdn_gating_kernel
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(fused_gdn_gating_kernel, InterpretedFunction)


@pytest.fixture(
    params=[
        pytest.param("cpu", id="interpreter"),
        pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
    ]
)
def kernel_device(request: pytest.FixtureRequest) -> str:
    """Where the SGLang reference runs: ``"cpu"`` (interpreted) or ``"cuda"`` (compiled).

    The ``cuda`` variant is marked ``gpu``; conftest skips it without CUDA (fails it under
    ``QSA_REQUIRE_GPU=1``) before this fixture runs.
    """
    device: str = request.param
    if device == "cpu":
        if torch.cuda.is_available():
            pytest.skip("CUDA is present: the references run compiled, in the cuda variant")
        if not _triton_interpreted():
            pytest.fail(
                "no CUDA, yet SGLang's Triton kernels are compiled, not interpreted: Triton "
                "was imported before TRITON_INTERPRET=1 was set; references cannot run"
            )
    elif _triton_interpreted():
        pytest.fail(
            "TRITON_INTERPRET=1 is set on a CUDA machine: the references would run through "
            "Triton's interpreter, not as the compiled CUDA kernels this variant checks"
        )
    return device


def _on(device: str, t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` on ``device`` with ``t``'s sizes and strides (a strided view stays one).

    Always a copy, on the CPU too, so a reference's in-place writes never reach the stand-in's
    inputs.
    """
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).copy_(t)


def _back(device: str, t: torch.Tensor) -> torch.Tensor:
    """``t``, which the reference wrote on ``device``, on the CPU to be compared there."""
    assert t.device.type == device
    return t.cpu()


def _via_tl(path: str) -> Callable[[Any], Any]:
    """``x -> triton.language.<path>(x)``, looked up per call, when the interpreter patched it."""

    def call(x: Any) -> Any:
        fn: Any = tl
        for part in path.split("."):
            fn = getattr(fn, part)
        return fn(x)

    return call


@pytest.fixture
def fla_on_cpu(kernel_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter, let SGLang's fla kernels run without changing what they compute.

    Nothing is patched on CUDA, where the kernels run as SGLang runs them. Under the
    interpreter:

    * ``input_guard`` enters ``torch.cpu.device(index)``, which torch does not have;
    * an autotuner with several configs benchmarks them through a GPU driver; the first config
      is taken instead (configs only change tiling);
    * ``fla.op`` binds ``exp = tl.exp`` etc. at import, and the interpreter patches only names
      it finds on ``triton.language``, so those aliases are rebound to calls through it.
    """
    if kernel_device != "cpu":
        return
    import sglang.kernels.ops.attention.fla.utils as fla_utils
    from triton.runtime.autotuner import Autotuner

    monkeypatch.setattr(fla_utils, "custom_device_ctx", lambda index: contextlib.nullcontext())
    prune = Autotuner.prune_configs
    monkeypatch.setattr(Autotuner, "prune_configs", lambda self, kwargs: prune(self, kwargs)[:1])
    through_tl = {name: _via_tl(name) for name in ("exp", "math.exp2", "log", "log2")}
    importlib.import_module("sglang.kernels.ops.attention.fla.chunk")
    for name, module in list(sys.modules.items()):
        if not name.startswith("sglang.kernels.ops.attention.fla"):
            continue
        for path, call in through_tl.items():
            alias = path.rpartition(".")[2]
            if tl.core.is_builtin(vars(module).get(alias)):
                monkeypatch.setattr(module, alias, call)


# ---- projections ---------------------------------------------------------------------------


def test_fused_qkvzba_split_reshape_cat_matches_sglang_triton_kernel(kernel_device: str) -> None:
    from sglang.kernels.ops.attention.triton_gdn_fused_proj import fused_qkvzba_split_reshape_cat

    gen = _seeded(0)
    nk, nv, hk, hv, tokens = 2, 4, 8, 4, 3
    qkvz = _randn(gen, tokens, nk * (2 * hk + 2 * (nv // nk) * hv), dtype=torch.bfloat16)
    ba = _randn(gen, tokens, 2 * nv, dtype=torch.bfloat16)

    got = ops.fused_qkvzba_split_reshape_cat_cpu(qkvz, ba, nk, nv, hk, hv)
    want = fused_qkvzba_split_reshape_cat(
        _on(kernel_device, qkvz), _on(kernel_device, ba), nk, nv, hk, hv
    )

    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert g.dtype == w.dtype
        assert g.is_contiguous()
        assert torch.equal(g, _back(kernel_device, w))


@pytest.mark.parametrize("group", [2, 3], ids=["v_per_k_2", "v_per_k_3"])
def test_fused_qkvzba_split_reshape_cat_contiguous_matches_sglang_triton_kernel(
    group: int, kernel_device: str
) -> None:
    from sglang.kernels.ops.attention.triton_gdn_fused_proj import (
        fused_qkvzba_split_reshape_cat_contiguous,
    )

    gen = _seeded(1)
    nk, hk, hv, tokens = 2, 8, 4, 5
    nv = nk * group
    width = 2 * nk * hk + 2 * nv * hv
    # A strided row view, as a column split of a wider projection output would be.
    qkvz = _randn(gen, tokens, width + 6, dtype=torch.bfloat16)[:, 3 : 3 + width]
    ba = _randn(gen, tokens, 2 * nv + 2, dtype=torch.bfloat16)[:, : 2 * nv]

    got = ops.fused_qkvzba_split_reshape_cat_contiguous_cpu(qkvz, ba, nk, nv, hk, hv)
    want = fused_qkvzba_split_reshape_cat_contiguous(
        _on(kernel_device, qkvz), _on(kernel_device, ba), nk, nv, hk, hv
    )

    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert g.dtype == w.dtype
        assert g.is_contiguous()
        assert torch.equal(g, _back(kernel_device, w))
        assert g.untyped_storage().data_ptr() != qkvz.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_input_proj_matches_two_linear_projections(dtype: torch.dtype) -> None:
    """Reference: the unfused branch of ``Qwen3_5GatedDeltaNet._forward_input_proj``.

    It runs ``in_proj_qkvz`` and ``in_proj_ba`` (bias-free ``UnquantizedLinearMethod``), which
    on a CPU without AMX is ``torch.nn.functional.linear``; the test calls that directly, on
    the CPU on every machine (no Triton kernel is involved).
    """
    gen = _seeded(2)
    x = _randn(gen, 3, 64, dtype=dtype)
    w_qkvz, w_ba = _randn(gen, 48, 64, dtype=dtype), _randn(gen, 16, 64, dtype=dtype)

    qkvz, ba = ops.fused_input_proj_cpu(x, w_qkvz, w_ba, False)

    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    assert_close(qkvz, torch.nn.functional.linear(x, w_qkvz), tol)
    assert_close(ba, torch.nn.functional.linear(x, w_ba), tol)


def test_fused_input_proj_refuses_vnni_packed_weights() -> None:
    x, w = torch.zeros(1, 32), torch.zeros(16, 32)
    with pytest.raises(NotImplementedError, match=r"fused_input_proj_cpu: is_vnni=True"):
        ops.fused_input_proj_cpu(x, w, w, True)


# ---- gates and norms -----------------------------------------------------------------------


@pytest.mark.parametrize("strided_gate", [False, True], ids=["flat_gate", "strided_3d_gate"])
def test_fused_sigmoid_mul_matches_sglang_triton_kernel(
    strided_gate: bool, kernel_device: str
) -> None:
    from sglang.kernels.ops.elementwise.elementwise import fused_sigmoid_mul

    gen = _seeded(3)
    tokens, heads, head_dim = 5, 3, 8
    x = _randn(gen, tokens, heads * head_dim, dtype=torch.bfloat16)
    if strided_gate:  # gate half of a per-head interleaved [q | gate] buffer
        gate = _randn(gen, tokens, heads, 2 * head_dim, dtype=torch.bfloat16)[..., head_dim:]
    else:
        gate = _randn(gen, tokens, heads * head_dim, dtype=torch.bfloat16)

    got = x.clone()
    ops.fused_sigmoid_mul_cpu(got, gate)
    want = _on(kernel_device, x)
    fused_sigmoid_mul(want, _on(kernel_device, gate), inplace=True)

    assert_close(got, _back(kernel_device, want), BF16_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_qk_gemma_rmsnorm_matches_sglang_triton_kernel(
    dtype: torch.dtype, kernel_device: str
) -> None:
    from sglang.srt.models.utils import fused_qk_gemma_rmsnorm

    gen = _seeded(4)
    tokens, heads, kv_heads, head_dim = 3, 3, 1, 24
    qkv = _randn(gen, tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, _ = torch.split(qkv, [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q_w, k_w = _randn(gen, head_dim, dtype=dtype), _randn(gen, head_dim, dtype=dtype)

    got_q, got_k = ops.fused_qk_gemma_rmsnorm_cpu(q, k, q_w, k_w, 1e-6, head_dim)
    on = functools.partial(_on, kernel_device)
    want_q, want_k = fused_qk_gemma_rmsnorm(on(q), on(k), on(q_w), on(k_w), 1e-6, head_dim)

    assert got_q.shape == q.shape
    assert got_k.shape == k.shape
    assert_close(got_q.view(want_q.shape), _back(kernel_device, want_q), BF16_TOL)
    assert_close(got_k.view(want_k.shape), _back(kernel_device, want_k), BF16_TOL)


def test_fused_qk_gemma_rmsnorm_with_gate_matches_sglang_triton_kernel(kernel_device: str) -> None:
    from sglang.srt.models.utils import fused_qk_gemma_rmsnorm_with_gate

    gen = _seeded(5)
    tokens, heads, kv_heads, head_dim = 3, 3, 1, 24
    qkv = _randn(gen, tokens, (2 * heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
    q_gate, k, _ = torch.split(
        qkv, [2 * heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1
    )
    q_w, k_w = (
        _randn(gen, head_dim, dtype=torch.bfloat16),
        _randn(gen, head_dim, dtype=torch.bfloat16),
    )

    got = ops.fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate, k, q_w, k_w, 1e-6, head_dim, heads)
    on = functools.partial(_on, kernel_device)
    want = [
        _back(kernel_device, w)
        for w in fused_qk_gemma_rmsnorm_with_gate(
            on(q_gate), on(k), on(q_w), on(k_w), 1e-6, head_dim, heads
        )
    ]

    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert g.dtype == w.dtype
        assert_close(g, w, BF16_TOL)
    assert torch.equal(got[2], want[2])  # the gate is copied, not computed


def test_fused_rmsnorm_gated_matches_sglang_fla_layernorm_fn(
    kernel_device: str, monkeypatch: pytest.MonkeyPatch, fla_on_cpu: None
) -> None:
    from sglang.kernels.ops.attention.fla import layernorm_gated

    if kernel_device == "cpu":
        # Rows per Triton program come from the CUDA SM count and the launch enters a device
        # context; neither changes what a row computes.
        monkeypatch.setattr(layernorm_gated, "calc_rows_per_block", lambda rows, device: 1)
        monkeypatch.setattr(
            layernorm_gated, "device_context", lambda device: contextlib.nullcontext()
        )
    gen = _seeded(6)
    x = _randn(gen, 7, 48, dtype=torch.bfloat16)
    z = _randn(gen, 7, 48, dtype=torch.bfloat16)
    w = _randn(gen, 48, dtype=torch.bfloat16)

    got = ops.fused_rmsnorm_gated_cpu(x, w, z, 1e-6)
    on = functools.partial(_on, kernel_device)
    want = layernorm_gated.layernorm_fn(
        on(x), on(w), None, z=on(z), eps=1e-6, norm_before_gate=True, is_rms_norm=True,
        activation="swish",
    )  # fmt: skip

    assert got.dtype == want.dtype
    assert_close(got, _back(kernel_device, want), BF16_TOL)


def test_fused_gdn_gating_matches_sglang_triton_kernel(kernel_device: str) -> None:
    from sglang.kernels.ops.attention.linear.fused_gdn_gating import fused_gdn_gating

    gen = _seeded(7)
    tokens, heads = 5, 6
    a = (_randn(gen, tokens, heads) * 12).to(torch.bfloat16)  # past softplus' threshold 20
    b = _randn(gen, tokens, heads, dtype=torch.bfloat16)
    a_log, dt_bias = _randn(gen, heads), _randn(gen, heads, dtype=torch.bfloat16)

    g, beta = ops.fused_gdn_gating_cpu(a_log, a, b, dt_bias)
    on = functools.partial(_on, kernel_device)
    want_g, want_beta = fused_gdn_gating(on(a_log), on(a), on(b), on(dt_bias))

    assert g.dtype == torch.float32
    assert g.shape == (1, tokens, heads)
    assert beta.dtype == b.dtype
    assert beta.shape == (1, tokens, heads)
    assert_close(g, _back(kernel_device, want_g), FP32_TOL)
    # One bf16 ulp below 1: the stand-in rounds beta to b's dtype, the kernel keeps float32.
    assert_close(beta.float(), _back(kernel_device, want_beta), Tol(atol=4e-3, rtol=0))


# ---- causal conv1d -------------------------------------------------------------------------

PAD = -1

CONV_DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)


def _conv_reference_dtype(dtype: torch.dtype, kernel_device: str) -> torch.dtype:
    """The dtype the conv reference runs in: ``dtype``, except for bf16 under the interpreter.

    Under Triton 3.8's interpreter, arithmetic on two bf16 values works on their raw bits, and
    the conv kernels multiply input by weight in the input dtype; a bf16 case therefore runs the
    interpreted reference on the same values in fp32 (exact upcasts). On CUDA the compiled
    kernel runs in bf16, as SGLang runs it.
    """
    return torch.float32 if dtype == torch.bfloat16 and kernel_device == "cpu" else dtype


def _conv_tol(dtype: torch.dtype, reference_dtype: torch.dtype) -> Tol:
    """The kernels round each input * weight product to the dtype they run in; fp32 outputs
    differ only by fp32 rounding, fp16 and bf16 outputs by a few ulps of their own."""
    if dtype == torch.float32:
        return FP32_TOL
    return BF16_PRODUCTS_TOL if reference_dtype == torch.bfloat16 else BF16_TOL


@CONV_DTYPES
def test_causal_conv1d_fwd_matches_sglang_triton_kernel(
    dtype: torch.dtype, kernel_device: str
) -> None:
    """Varlen prefill: a cached prefix (long and shorter than the window), a fresh sequence, a
    padding entry and an empty sequence; conv states compared slot by slot."""
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_fn

    gen = _seeded(8)
    dim, width, slots = 24, 4, 6
    lengths = [5, 1, 2, 3, 0]
    cache_indices = torch.tensor([2, 4, 0, PAD, 5], dtype=torch.int32)
    has_initial_state = torch.tensor([True, True, False, True, False])
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    mixed = _randn(gen, sum(lengths), dim, dtype=dtype)
    weight, bias = _randn(gen, dim, width, dtype=dtype), _randn(gen, dim, dtype=dtype)
    states = _randn(gen, slots, dim, width - 1, dtype=dtype)
    ref = _conv_reference_dtype(dtype, kernel_device)
    on = functools.partial(_on, kernel_device)
    got_states, want_states = states.clone(), on(states.to(ref))

    got = ops.causal_conv1d_fwd_cpu(
        mixed.transpose(0, 1), weight, bias, got_states, qsl, cache_indices,
        has_initial_state, True, PAD, True,
    )  # fmt: skip
    want = causal_conv1d_fn(
        on(mixed.to(ref).transpose(0, 1)), on(weight.to(ref)), on(bias.to(ref)),
        conv_states=want_states, query_start_loc=on(qsl), seq_lens_cpu=lengths,
        cache_indices=on(cache_indices), has_initial_state=on(has_initial_state),
        activation="silu", pad_slot_id=PAD,
    )  # fmt: skip

    assert got.shape == want.shape
    assert got.stride() == want.stride()
    assert got.dtype == dtype
    real = torch.arange(8)  # tokens of sequences 0-2; 8-10 belong to the padding entry
    want = _back(kernel_device, want)
    assert_close(got[:, real], want[:, real].to(dtype), _conv_tol(dtype, ref))
    assert torch.equal(got_states, _back(kernel_device, want_states).to(dtype))
    assert torch.equal(got_states[[1, 3, 5]], states[[1, 3, 5]])  # unused, padding, empty


def test_causal_conv1d_fwd_pads_from_zero_history_without_touching_states() -> None:
    gen = _seeded(9)
    dim, width = 8, 4
    x = _randn(gen, 3, dim)
    weight = _randn(gen, dim, width)
    states = _randn(gen, 2, dim, width - 1)
    before = states.clone()
    qsl = torch.tensor([0, 3], dtype=torch.int32)

    padded = ops.causal_conv1d_fwd_cpu(
        x.T, weight, None, states, qsl, torch.tensor([PAD], dtype=torch.int32),
        torch.tensor([True]), False, PAD, True,
    )  # fmt: skip
    stateless = ops.causal_conv1d_fwd_cpu(
        x.T, weight, None, None, qsl, None, None, False, PAD, True
    )

    assert torch.equal(states, before)
    assert torch.equal(padded, stateless)
    expected = torch.nn.functional.conv1d(
        torch.nn.functional.pad(x.T, (width - 1, 0)).unsqueeze(0), weight.unsqueeze(1), groups=dim
    )[0]
    assert_close(padded, expected, FP32_TOL)


@pytest.mark.parametrize("new_tokens", [None, 2], ids=["one_token_2d", "two_tokens_3d"])
@CONV_DTYPES
def test_causal_conv1d_update_matches_sglang_triton_kernel(
    dtype: torch.dtype, new_tokens: int | None, kernel_device: str
) -> None:
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update

    gen = _seeded(10)
    batch, dim, width, slots = 5, 24, 4, 7
    shape = (batch, dim) if new_tokens is None else (batch, dim, new_tokens)
    x = _randn(gen, *shape, dtype=dtype)
    weight, bias = _randn(gen, dim, width, dtype=dtype), _randn(gen, dim, dtype=dtype)
    states = _randn(gen, slots, dim, width - 1, dtype=dtype)
    # One entry past the batch, as a graph-padded index tensor has; neither side reads it.
    indices = torch.tensor([3, 0, PAD, 6, 1, 2], dtype=torch.int32)
    ref = _conv_reference_dtype(dtype, kernel_device)
    on = functools.partial(_on, kernel_device)
    got_states, want_states = states.clone(), on(states.to(ref))

    got = ops.causal_conv1d_update_cpu(x, got_states, weight, bias, True, None, indices, PAD, True)
    want = causal_conv1d_update(
        on(x.to(ref)), want_states, on(weight.to(ref)), on(bias.to(ref)), "silu",
        conv_state_indices=on(indices), pad_slot_id=PAD,
    )  # fmt: skip

    real = [0, 1, 3, 4]  # row 2 is padding
    assert got.shape == x.shape
    assert got.dtype == dtype
    want = _back(kernel_device, want)
    assert_close(got[real], want[real].to(dtype), _conv_tol(dtype, ref))
    assert torch.equal(got_states, _back(kernel_device, want_states).to(dtype))


# ---- gated delta rule ----------------------------------------------------------------------


def test_chunk_gated_delta_rule_matches_sglang_fla_chunk_kernel(
    kernel_device: str, fla_on_cpu: None
) -> None:
    """Varlen prefill, one sequence longer than fla's 64-token chunk, with cached and fresh states.

    On CUDA q, k, v and beta are bf16, as SGLang runs the kernel. Under the interpreter they are
    fp16 instead: there ``tl.dot`` multiplies the raw bits of bf16 operands (Triton 3.8; fp32
    and fp16 are right), and the fla kernels refuse fp32.
    """
    from sglang.kernels.ops.attention.fla.chunk import chunk_gated_delta_rule

    dtype = torch.float16 if kernel_device == "cpu" else torch.bfloat16
    gen = _seeded(11)
    heads, heads_v, dk, dv, slots = 2, 4, 32, 16, 5
    lengths = [5, 70, 1]
    tokens = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q = _randn(gen, 1, tokens, heads, dk, dtype=dtype)
    k = _randn(gen, 1, tokens, heads, dk, dtype=dtype)
    v = _randn(gen, 1, tokens, heads_v, dv, dtype=dtype)
    g = -torch.rand(1, tokens, heads_v, generator=gen) * 0.3
    beta = torch.rand(1, tokens, heads_v, generator=gen).to(dtype)
    pool = _randn(gen, slots, heads_v, dv, dk) * 0.1
    indices = torch.tensor([3, PAD, 0], dtype=torch.int32)
    on = functools.partial(_on, kernel_device)
    got_pool, want_pool = pool.clone(), on(pool)

    got, final = ops.chunk_gated_delta_rule_cpu(
        q, k, v, g, beta, got_pool, True, cu, False, True, indices
    )
    want, _, _ = chunk_gated_delta_rule(
        q=on(q), k=on(k), v=on(v), g=on(g), beta=on(beta), initial_state=want_pool,
        initial_state_indices=on(indices), cu_seqlens=on(cu), head_first=False,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip

    assert got.shape == v.shape
    assert got.dtype == v.dtype
    assert want.dtype == v.dtype
    # The reference also rounds its intermediates (w, u, v_new) to the input dtype; bf16's
    # rounding step is 8 times fp16's, and so are its tolerances.
    scale = 1 if dtype == torch.float16 else 8
    out_tol = Tol(atol=5e-4 * scale, rtol=2e-3 * scale)
    state_tol = Tol(atol=1.5e-3 * scale, rtol=2e-3 * scale)
    assert_close(got, _back(kernel_device, want), out_tol)
    assert_close(got_pool, _back(kernel_device, want_pool), state_tol)
    assert torch.equal(got_pool[[1, 2, 4]], pool[[1, 2, 4]])  # unused slots
    assert final.dtype == torch.float32
    assert torch.equal(final, got_pool)
    assert final.untyped_storage().data_ptr() != got_pool.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    "lengths", [[1, 1, 1, 1, 1], [2, 3]], ids=["decode_one_token_each", "varlen_multi_token"]
)
def test_fused_sigmoid_gating_delta_rule_update_matches_sglang_triton_kernel(
    lengths: list[int], kernel_device: str
) -> None:
    from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (
        fused_sigmoid_gating_delta_rule_update,
    )

    gen = _seeded(12)
    heads, heads_v, dk, dv, slots = 1, 2, 16, 8, 6
    tokens, count = sum(lengths), len(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q = _randn(gen, 1, tokens, heads, dk, dtype=torch.bfloat16)
    k = _randn(gen, 1, tokens, heads, dk, dtype=torch.bfloat16)
    v = _randn(gen, 1, tokens, heads_v, dv, dtype=torch.bfloat16)
    a = (_randn(gen, tokens, heads_v) * 10).to(torch.bfloat16)
    b = _randn(gen, tokens, heads_v, dtype=torch.bfloat16)
    a_log, dt_bias = _randn(gen, heads_v), _randn(gen, heads_v, dtype=torch.bfloat16)
    pool = _randn(gen, slots, heads_v, dv, dk) * 0.1
    indices = torch.tensor([4, PAD, 0, 5, 2][:count], dtype=torch.int32)
    on = functools.partial(_on, kernel_device)
    got_pool, want_pool = pool.clone(), on(pool)

    got = ops.fused_sigmoid_gating_delta_rule_update_cpu(
        a_log, dt_bias, q, k, v, a, b, got_pool, indices, cu, True
    )
    want = fused_sigmoid_gating_delta_rule_update(
        A_log=on(a_log), a=on(a), dt_bias=on(dt_bias), softplus_beta=1.0,
        softplus_threshold=20.0, q=on(q), k=on(k), v=on(v), b=on(b),
        initial_state_source=want_pool, initial_state_indices=on(indices), cu_seqlens=on(cu),
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip

    assert got.shape == (tokens, 1, heads_v, dv)
    assert got.dtype == q.dtype
    assert_close(got.reshape(want.shape), _back(kernel_device, want), BF16_TOL)
    assert_close(got_pool, _back(kernel_device, want_pool), FP32_TOL)


def test_gated_delta_rule_ops_agree_with_a_token_by_token_reference() -> None:
    """Both GDN ops against a plain per-token loop written here, in float32, one sequence."""
    gen = _seeded(13)
    heads, dk, dv, tokens = 1, 8, 4, 6
    q = _randn(gen, 1, tokens, heads, dk)
    k = torch.nn.functional.normalize(_randn(gen, 1, tokens, heads, dk), dim=-1)
    v = _randn(gen, 1, tokens, heads, dv)
    a, b = _randn(gen, tokens, heads), _randn(gen, tokens, heads)
    a_log, dt_bias = _randn(gen, heads), _randn(gen, heads)
    h0 = _randn(gen, 1, heads, dv, dk) * 0.1
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    slot = torch.tensor([0], dtype=torch.int32)

    g = -a_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    beta = b.sigmoid()
    state, expected = h0[0, 0].clone(), []
    for t in range(tokens):
        state = state * g[t, 0].exp()
        update = beta[t, 0] * (v[0, t, 0] - state @ k[0, t, 0])
        state = state + torch.outer(update, k[0, t, 0])
        expected.append(state @ (q[0, t, 0] * dk**-0.5))
    want = torch.stack(expected)

    pool = h0.clone()
    recurrent = ops.fused_sigmoid_gating_delta_rule_update_cpu(
        a_log, dt_bias, q, k, v, a, b, pool, slot, cu, False
    )
    assert_close(recurrent[:, 0, 0], want, FP32_TOL)
    assert_close(pool[0, 0], state, FP32_TOL)

    pool = h0.clone()
    chunked, _ = ops.chunk_gated_delta_rule_cpu(
        q, k, v, g.unsqueeze(0), beta.unsqueeze(0), pool, True, cu, False, False, slot
    )
    assert_close(chunked[0, :, 0], want, FP32_TOL)
    assert_close(pool[0, 0], state, FP32_TOL)


# ---- refusals --------------------------------------------------------------------------------


def test_unsupported_arguments_raise_not_implemented_naming_op_and_value() -> None:
    x, w = torch.zeros(2, 8), torch.zeros(8, 4)
    states = torch.zeros(2, 8, 3)
    with pytest.raises(NotImplementedError, match=r"causal_conv1d_update_cpu: cache_seqlens"):
        ops.causal_conv1d_update_cpu(x, states, w, None, True, torch.zeros(2), None, PAD, True)
    with pytest.raises(NotImplementedError, match=r"causal_conv1d_fwd_cpu: query_start_loc=None"):
        ops.causal_conv1d_fwd_cpu(x.T, w, None, states, None, None, None, True, PAD, True)
    with pytest.raises(NotImplementedError, match=r"causal_conv1d_update_cpu: conv_states.shape"):
        ops.causal_conv1d_update_cpu(x, torch.zeros(2, 8, 5), w, None, True, None, None, PAD, True)
    q = torch.zeros(1, 2, 1, 8)
    with pytest.raises(NotImplementedError, match=r"chunk_gated_delta_rule_cpu: head_first=True"):
        ops.chunk_gated_delta_rule_cpu(
            q, q, q, torch.zeros(1, 2, 1), torch.zeros(1, 2, 1), torch.zeros(1, 1, 8, 8), True,
            torch.tensor([0, 2]), True, True, torch.tensor([0]),
        )  # fmt: skip


# ---- registration ----------------------------------------------------------------------------


def _example_calls() -> Iterator[tuple[str, tuple[Any, ...]]]:
    """One small argument tuple per op (fresh tensors each time it is called)."""
    gen = _seeded(14)

    def r(*shape: int) -> torch.Tensor:
        return _randn(gen, *shape)

    qkvz, ba = r(3, 2 * 2 * 4 + 2 * 4 * 2), r(3, 8)
    yield "fused_qkvzba_split_reshape_cat_cpu", (qkvz, ba, 2, 4, 4, 2)
    yield "fused_qkvzba_split_reshape_cat_contiguous_cpu", (qkvz, ba, 2, 4, 4, 2)
    yield "fused_input_proj_cpu", (r(3, 32), r(16, 32), r(8, 32), False)
    yield "fused_sigmoid_mul_cpu", (r(3, 8), r(3, 8))
    yield "fused_qk_gemma_rmsnorm_cpu", (r(3, 16), r(3, 8), r(8), r(8), 1e-6, 8)
    yield "fused_qk_gemma_rmsnorm_with_gate_cpu", (r(3, 32), r(3, 8), r(8), r(8), 1e-6, 8, 2)
    yield "fused_rmsnorm_gated_cpu", (r(3, 8), r(8), r(3, 8), 1e-6)
    yield "fused_gdn_gating_cpu", (r(4), r(3, 4), r(3, 4), r(4))
    qsl, idx = torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([1, PAD], dtype=torch.int32)
    conv = (r(3, 8).T, r(8, 4), r(8), r(2, 8, 3), qsl, idx, torch.tensor([True, False]), True)
    yield "causal_conv1d_fwd_cpu", (*conv, PAD, True)
    yield (
        "causal_conv1d_update_cpu",
        (r(2, 8), r(3, 8, 3), r(8, 4), None, True, None, idx, PAD, True),
    )
    q, v = r(1, 3, 1, 8), r(1, 3, 2, 4)
    yield "chunk_gated_delta_rule_cpu", (
        q, r(1, 3, 1, 8), v, -r(1, 3, 2).abs(), r(1, 3, 2).sigmoid(), r(3, 2, 4, 8), True,
        qsl, False, True, idx,
    )  # fmt: skip
    yield "fused_sigmoid_gating_delta_rule_update_cpu", (
        r(2), r(2), q, r(1, 3, 1, 8), v, r(3, 2), r(3, 2), r(3, 2, 4, 8), idx, qsl, True,
    )  # fmt: skip


def _clone_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _as_tuple(result: Any) -> tuple[Any, ...]:
    return result if isinstance(result, tuple) else (result,)


def test_standin_ops_cover_every_op_sglang_calls_on_a_cpu_without_amx() -> None:
    assert tuple(op.name for op in ops.STANDIN_OPS) == EXPECTED_OPS
    assert {name for name, _ in _example_calls()} == set(EXPECTED_OPS)
    for op in ops.STANDIN_OPS:
        assert op.schema.startswith(f"{op.name}(")
        assert getattr(ops, op.name) is op.impl
        module, _, qualname = op.reference.partition(":")
        target: Any = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
        assert callable(target), op.reference


def test_register_cpu_ops_defines_every_op_and_dispatches_to_its_impl() -> None:
    library = torch.library.Library("qsa_testing_selftest", "FRAGMENT")  # type: ignore[no-untyped-call]

    defined = ops.register_cpu_ops(library)

    assert defined == EXPECTED_OPS
    assert ops.register_cpu_ops(library) == ()
    namespace = torch.ops.qsa_testing_selftest
    for name, args in _example_calls():
        via_op, direct = _clone_args(args), _clone_args(args)
        got = _as_tuple(getattr(namespace, name)(*via_op))
        want = _as_tuple(getattr(ops, name)(*direct))
        assert len(got) == len(want), name
        for g, w in zip(got, want, strict=True):
            assert (g is None and w is None) or torch.equal(g, w), name
        for g, w in zip(via_op, direct, strict=True):  # in-place updates of inputs match too
            if isinstance(g, torch.Tensor):
                assert torch.equal(g, w), name


def test_register_cpu_ops_leaves_an_existing_op_untouched() -> None:
    library = torch.library.Library("qsa_testing_selftest_existing", "FRAGMENT")  # type: ignore[no-untyped-call]
    library.define("fused_gdn_gating_cpu(Tensor x) -> Tensor")  # type: ignore[no-untyped-call]
    library.impl("fused_gdn_gating_cpu", lambda x: x + 1, "CPU")  # type: ignore[no-untyped-call]

    defined = ops.register_cpu_ops(library)

    assert defined == tuple(n for n in EXPECTED_OPS if n != "fused_gdn_gating_cpu")
    namespace = torch.ops.qsa_testing_selftest_existing
    assert torch.equal(namespace.fused_gdn_gating_cpu(torch.zeros(2)), torch.ones(2))
