"""The CUDA machine's stand-ins keep the semantics of what they replace.

``flash_attn_varlen_torch`` is checked against a plain per-sequence float64 reference and against
SDPA with a bottom-right causal bias, on CPU tensors everywhere and on the GPU under
``@pytest.mark.gpu``, where it is also captured in a CUDA graph and replayed on new inputs. The
dual-GEMM stand-in is checked against the real module's source, which is read, not imported (it
needs ``cutlass``). The sorted QSA top-k is checked on a shuffled stand-in for upstream's output
everywhere, and under ``@pytest.mark.gpu`` against upstream's own JIT kernel, eagerly and in a
CUDA graph.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

import pytest
import torch

from qsa_pytest.processes import hang_guard_s
from qsa_testing import StandInError
from qsa_testing.standins import CUDA_STANDINS, STANDINS, StandIn
from qsa_testing.standins._cuda import (
    DUAL_GEMM_LAYER_MODULE,
    DUAL_GEMM_MODULE,
    FAST_TOPK_MODULE,
    PROVIDED_ORIGIN,
    QSA_BACKEND_MODULE,
    DualGemmQuantMode,
    ProvidingFinder,
    can_use_dual_gemm,
    dual_gemm_swiglu,
    dual_gemm_swiglu_fp8,
    fill_unavailable_dual_gemm,
    flash_attn_varlen_torch,
    provide_if_absent,
    sort_selected_indices,
    sorted_fast_topk,
    upstream_public_names,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _sglang_source(module: str) -> str:
    """The source of an SGLang module, located without importing it or its parent packages."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None
    assert spec.submodule_search_locations is not None
    root = Path(next(iter(spec.submodule_search_locations)))
    path = root.joinpath(*module.split(".")[1:]).with_suffix(".py")
    return path.read_text(encoding="utf-8")


# ---- the reference ------------------------------------------------------------------------------


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: Sequence[tuple[int, int]],
    *,
    scale: float,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> torch.Tensor:
    """FA2's varlen attention, one sequence at a time, in float64 on the CPU."""
    heads_q, heads_k = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape[0], heads_q, v.shape[2], dtype=torch.float64)
    q0 = k0 = 0
    for lq, lk in lengths:
        qs = q[q0 : q0 + lq].double().cpu().transpose(0, 1)  # [Hq, lq, D]
        ks = k[k0 : k0 + lk].double().cpu().transpose(0, 1).repeat_interleave(heads_q // heads_k, 0)
        vs = v[k0 : k0 + lk].double().cpu().transpose(0, 1).repeat_interleave(heads_q // heads_k, 0)
        scores = qs @ ks.transpose(1, 2) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        allowed = torch.ones(lq, lk, dtype=torch.bool)
        for i in range(lq):
            for j in range(lk):
                diagonal = i + lk - lq
                right = 0 if causal else window[1]
                if right >= 0 and j > diagonal + right:
                    allowed[i, j] = False
                if window[0] >= 0 and j < diagonal - window[0]:
                    allowed[i, j] = False
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing -> 0
        out[q0 : q0 + lq] = (probs @ vs).transpose(0, 1)
        q0, k0 = q0 + lq, k0 + lk
    return out


def _cu(lengths: Sequence[int], device: str) -> torch.Tensor:
    return torch.nn.functional.pad(
        torch.tensor(list(lengths), dtype=torch.int32).cumsum(0), (1, 0)
    ).to(device=device, dtype=torch.int32)


def _inputs(
    lengths: Sequence[tuple[int, int]],
    heads: tuple[int, int],
    dims: tuple[int, int],
    dtype: torch.dtype,
    device: str,
    *,
    spare_k: int = 0,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    total_q = sum(lq for lq, _ in lengths)
    total_k = sum(lk for _, lk in lengths) + spare_k
    q = torch.randn(total_q, heads[0], dims[0], generator=generator)
    k = torch.randn(total_k, heads[1], dims[0], generator=generator)
    v = torch.randn(total_k, heads[1], dims[1], generator=generator)
    q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    cu_q = _cu([lq for lq, _ in lengths], device)
    cu_k = _cu([lk for _, lk in lengths], device)
    return q, k, v, cu_q, cu_k


_TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}

CASES = [
    # (name, [(lq, lk), ...], (Hq, Hk), (D, Dv), causal, window, softcap)
    ("gqa-causal-mixed", [(5, 9), (1, 7), (4, 4), (3, 1)], (6, 2), (40, 24), True, (-1, -1), 0.0),
    ("mqa-causal-decode", [(1, 13), (1, 3), (1, 1)], (5, 1), (16, 16), True, (-1, -1), 0.0),
    ("mha-full", [(7, 3), (2, 11)], (3, 3), (8, 12), False, (-1, -1), 0.0),
    ("empty-sequences", [(0, 5), (3, 0), (2, 6), (0, 0)], (4, 2), (16, 8), True, (-1, -1), 0.0),
    ("window", [(6, 10), (4, 4)], (4, 2), (16, 16), False, (3, 1), 0.0),
    ("causal-window-softcap", [(6, 10), (5, 2)], (4, 1), (32, 32), True, (2, -1), 5.0),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("lengths", "heads", "dims", "causal", "window", "softcap"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_varlen_matches_the_reference(  # noqa: PLR0917 (parametrized)
    device: str,
    dtype: torch.dtype,
    lengths: list[tuple[int, int]],
    heads: tuple[int, int],
    dims: tuple[int, int],
    causal: bool,
    window: tuple[int, int],
    softcap: float,
) -> None:
    q, k, v, cu_q, cu_k = _inputs(lengths, heads, dims, dtype, device, spare_k=3)
    scale = 0.37
    out = flash_attn_varlen_torch(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(lq for lq, _ in lengths),
        max(lk for _, lk in lengths),
        softmax_scale=scale,
        causal=causal,
        window_size=window,
        softcap=softcap,
    )
    assert out.shape == (q.shape[0], heads[0], dims[1])
    assert out.dtype == dtype
    assert out.device == q.device
    expected = _reference(
        q, k, v, lengths, scale=scale, causal=causal, window=window, softcap=softcap
    )
    tol = _TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_matches_sdpa_with_a_bottom_right_causal_bias(device: str) -> None:
    from torch.nn.attention.bias import causal_lower_right

    lengths = [(3, 8), (5, 5), (1, 6), (2, 3)]  # lq <= lk: no row sees nothing
    heads_q, heads_k = 6, 3
    q, k, v, cu_q, cu_k = _inputs(lengths, (heads_q, heads_k), (24, 24), torch.float32, device)
    out = flash_attn_varlen_torch(q, k, v, cu_q, cu_k, 5, 8, causal=True)
    q0 = k0 = 0
    for lq, lk in lengths:
        qs = q[q0 : q0 + lq].transpose(0, 1)[None]
        ks = k[k0 : k0 + lk].transpose(0, 1).repeat_interleave(heads_q // heads_k, 0)[None]
        vs = v[k0 : k0 + lk].transpose(0, 1).repeat_interleave(heads_q // heads_k, 0)[None]
        expected = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=causal_lower_right(lq, lk)
        )
        torch.testing.assert_close(out[q0 : q0 + lq], expected[0].transpose(0, 1))
        q0, k0 = q0 + lq, k0 + lk


def _decode_inputs(
    counts: Sequence[int],
    topk: int,
    device: str,
    dtype: torch.dtype = torch.bfloat16,
    *,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Upstream's QSA decode call: one query per row, K/V packed into a fixed-capacity scratch."""
    generator = torch.Generator().manual_seed(seed)
    batch = len(counts)
    q = torch.randn(batch, 4, 64, generator=generator).to(device=device, dtype=dtype)
    # Scratch of capacity batch * topk; rows past cu_seqlens_k[-1] hold stale data.
    k = torch.randn(batch * topk, 2, 64, generator=generator).to(device=device, dtype=dtype)
    v = torch.randn(batch * topk, 2, 64, generator=generator).to(device=device, dtype=dtype)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return q, k, v, cu_q, _cu(counts, device)


def _decode(  # noqa: PLR0917 (upstream's tensors, in its order)
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    topk: int,
) -> torch.Tensor:
    return flash_attn_varlen_torch(
        q=q,
        k=k,
        v=v,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=1,
        max_seqlen_k=topk,
        softmax_scale=0.125,
        causal=True,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_upstream_decode_call_reads_only_the_valid_packed_keys(device: str) -> None:
    counts, topk = [37, 0, 64, 1, 12], 64
    q, k, v, cu_q, cu_k = _decode_inputs(counts, topk, device)
    out = _decode(q, k, v, cu_q, cu_k, topk)
    expected = _reference(q, k, v, [(1, c) for c in counts], scale=0.125, causal=True)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-2, atol=2e-2)
    assert torch.count_nonzero(out[1]) == 0  # a row that selected nothing


@pytest.mark.parametrize("device", DEVICES)
def test_rows_past_the_last_sequence_are_zero(device: str) -> None:
    q, k, v, cu_q, cu_k = _inputs([(2, 4), (3, 3)], (2, 1), (8, 8), torch.float32, device)
    padded_q = torch.cat([q, torch.ones(4, 2, 8, device=device)])
    out = flash_attn_varlen_torch(padded_q, k, v, cu_q, cu_k, 3, 4, causal=True)
    assert torch.count_nonzero(out[5:]) == 0
    torch.testing.assert_close(
        out[:5], flash_attn_varlen_torch(q, k, v, cu_q, cu_k, 3, 4, causal=True)
    )


def test_large_batches_are_processed_in_chunks_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from qsa_testing.standins import _cuda

    lengths = [(1, 9)] * 7 + [(3, 5)]
    q, k, v, cu_q, cu_k = _inputs(lengths, (4, 2), (16, 16), torch.float32, "cpu")
    whole = flash_attn_varlen_torch(q, k, v, cu_q, cu_k, 3, 9, causal=True)
    monkeypatch.setattr(_cuda, "_CHUNK_ELEMENTS", 1)  # one query row per chunk
    torch.testing.assert_close(
        flash_attn_varlen_torch(q, k, v, cu_q, cu_k, 3, 9, causal=True), whole
    )


def test_default_scale_is_one_over_sqrt_head_dim() -> None:
    q, k, v, cu_q, cu_k = _inputs([(3, 5)], (2, 2), (16, 16), torch.float32, "cpu")
    torch.testing.assert_close(
        flash_attn_varlen_torch(q, k, v, cu_q, cu_k, 3, 5),
        flash_attn_varlen_torch(q, k, v, cu_q, cu_k, 3, 5, softmax_scale=0.25),
    )


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("dropout_p", 0.1),
        ("alibi_slopes", torch.ones(2)),
        ("return_attn_probs", True),
        ("block_table", torch.zeros(1, 4, dtype=torch.int32)),
    ],
)
def test_unsupported_options_raise_naming_them(option: str, value: object) -> None:
    q, k, v, cu_q, cu_k = _inputs([(2, 2)], (2, 2), (8, 8), torch.float32, "cpu")
    with pytest.raises(NotImplementedError, match=option):
        flash_attn_varlen_torch(q, k, v, cu_q, cu_k, 2, 2, **{option: value})  # type: ignore[arg-type]


def test_bad_arguments_raise_naming_the_values() -> None:
    q, k, v, cu_q, cu_k = _inputs([(2, 2)], (3, 2), (8, 8), torch.float32, "cpu")
    with pytest.raises(ValueError, match="Hq=3 is not a multiple of Hk=2"):
        flash_attn_varlen_torch(q, k, v, cu_q, cu_k, 2, 2)
    q, k, v, cu_q, cu_k = _inputs([(2, 2)], (2, 2), (8, 8), torch.float32, "cpu")
    with pytest.raises(TypeError, match="max_seqlen_k=tensor"):
        flash_attn_varlen_torch(q, k, v, cu_q, cu_k, 2, torch.tensor(2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"must both be \[B \+ 1\]"):
        flash_attn_varlen_torch(q, k, v, cu_q, cu_k[:1], 2, 2)


def test_the_signature_takes_every_keyword_upstream_passes() -> None:
    tree = ast.parse(_sglang_source(QSA_BACKEND_MODULE))
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "flash_attn_varlen_func"
    ]
    assert calls, "upstream no longer calls flash_attn_varlen_func"
    accepted = set(inspect.signature(flash_attn_varlen_torch).parameters)
    for call in calls:
        passed = {kw.arg for kw in call.keywords}
        assert passed <= accepted, passed - accepted
        # Upstream's QSA decode: one query per row, the padded key width a host value.
        values = {kw.arg: ast.unparse(kw.value) for kw in call.keywords}
        assert values["max_seqlen_q"] == "1"
        assert values["causal"] == "True"


# ---- CUDA graphs ---------------------------------------------------------------------------------


Call = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


@contextlib.contextmanager
def _no_host_sync() -> Iterator[None]:
    """Any synchronising host read of a device tensor (``.item()``, ``.tolist()``) raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _capture(fn: Call, *static: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``fn(*static)`` captured in a CUDA graph after two warm-up calls on a side stream."""
    q, k, v, cu_q, cu_k = static
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), _no_host_sync():
        for _ in range(2):
            fn(q, k, v, cu_q, cu_k)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), _no_host_sync():
        out = fn(q, k, v, cu_q, cu_k)
    return graph, out


def _refill(static: Sequence[torch.Tensor], fresh: Sequence[torch.Tensor]) -> None:
    for target, source in zip(static, fresh, strict=True):
        target.copy_(source)


@pytest.mark.gpu
def test_decode_call_replays_in_a_cuda_graph_on_new_inputs() -> None:
    topk = 2051  # the selection budget plus one open block, as upstream's tiny Qwen4Exp decodes

    def call(*t: torch.Tensor) -> torch.Tensor:
        q, k, v, cu_q, cu_k = t
        return _decode(q, k, v, cu_q, cu_k, topk)

    static = _decode_inputs([topk, 5, 0, 700], topk, "cuda", seed=1)
    graph, out = _capture(call, *static)
    counts = [3, topk, 1000, 0]
    fresh = _decode_inputs(counts, topk, "cuda", seed=2)
    _refill(static, fresh)
    graph.replay()
    torch.cuda.synchronize()
    with _no_host_sync():
        eager = call(*fresh)
    assert torch.equal(out, eager)
    expected = _reference(*fresh[:3], [(1, c) for c in counts], scale=0.125, causal=True)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_varlen_call_replays_in_a_cuda_graph_on_new_lengths() -> None:
    first = [(5, 9), (1, 7), (4, 4), (2, 1)]
    second = [(1, 9), (4, 2), (3, 5), (4, 5)]  # the same totals (12 queries, 21 keys), split anew

    def call(*t: torch.Tensor) -> torch.Tensor:
        q, k, v, cu_q, cu_k = t
        return flash_attn_varlen_torch(q, k, v, cu_q, cu_k, 5, 9, softmax_scale=0.2, causal=True)

    static = _inputs(first, (6, 2), (40, 24), torch.bfloat16, "cuda", seed=3)
    graph, out = _capture(call, *static)
    fresh = _inputs(second, (6, 2), (40, 24), torch.bfloat16, "cuda", seed=4)
    _refill(static, fresh)
    graph.replay()
    torch.cuda.synchronize()
    with _no_host_sync():
        eager = call(*fresh)
    assert torch.equal(out, eager)
    expected = _reference(*fresh[:3], second, scale=0.2, causal=True)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-2, atol=2e-2)


# ---- the flash_attn resolver edit ----------------------------------------------------------------


def _fake_backend(resolver: object) -> ModuleType:
    module = ModuleType("fake_qsa_backend")
    module._resolve_flash_attn_varlen_func = resolver  # type: ignore[attr-defined]
    return module


def test_resolver_falls_back_to_torch_only_when_upstream_finds_nothing() -> None:
    spec = STANDINS[StandIn.FLASH_ATTN_VARLEN_TORCH]
    assert spec.modules == (QSA_BACKEND_MODULE,)

    def absent() -> object:
        msg = "QSA decode requires flash_attn (FA2), flash-attn-4 (FA4 cute), or aiter (ROCm)"
        raise ImportError(msg)

    module = _fake_backend(absent)
    spec.edit(module)
    assert module._resolve_flash_attn_varlen_func() is flash_attn_varlen_torch

    def real() -> object:
        return real

    module = _fake_backend(real)
    spec.edit(module)
    assert module._resolve_flash_attn_varlen_func() is real


def test_upstream_still_resolves_flash_attn_through_the_edited_function() -> None:
    tree = ast.parse(_sglang_source(QSA_BACKEND_MODULE))
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert "_resolve_flash_attn_varlen_func" in defined
    called = {
        n.func.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    assert "_resolve_flash_attn_varlen_func" in called


# ---- the dual GEMM -------------------------------------------------------------------------------


def _served_dual_gemm() -> ModuleType:
    module = ModuleType(DUAL_GEMM_MODULE)
    fill_unavailable_dual_gemm(module)
    return module


def test_dual_gemm_standin_has_the_real_modules_public_names() -> None:
    real = upstream_public_names(_sglang_source(DUAL_GEMM_MODULE))
    served = {name for name in vars(_served_dual_gemm()) if not name.startswith("_")}
    assert real == served - {"QSA_TESTING_STANDIN"}


def _real_definitions() -> dict[str, ast.AST]:
    tree = ast.parse(_sglang_source(DUAL_GEMM_MODULE))
    found: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            found[node.name] = node
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = node.value
    return found


def test_dual_gemm_standin_keeps_the_real_enum_constant_and_signatures() -> None:
    real = _real_definitions()
    enum_node = real["DualGemmQuantMode"]
    assert isinstance(enum_node, ast.ClassDef)
    members = {
        stmt.targets[0].id: ast.literal_eval(stmt.value)
        for stmt in enum_node.body
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name)
    }
    assert members == {m.name: m.value for m in DualGemmQuantMode}
    properties = {s.name for s in enum_node.body if isinstance(s, ast.FunctionDef)}
    assert properties == {"is_quantized", "is_dynamic", "is_per_token"}
    assert [m.name for m in DualGemmQuantMode if m.is_quantized] == [
        "STATIC_PER_TENSOR",
        "STATIC_PER_TOKEN",
        "DYNAMIC_PER_TENSOR",
        "DYNAMIC_PER_TOKEN",
    ]
    assert [m.name for m in DualGemmQuantMode if m.is_dynamic] == [
        "DYNAMIC_PER_TENSOR",
        "DYNAMIC_PER_TOKEN",
    ]
    assert [m.name for m in DualGemmQuantMode if m.is_per_token] == [
        "STATIC_PER_TOKEN",
        "DYNAMIC_PER_TOKEN",
    ]
    served = _served_dual_gemm()
    assert (
        ast.literal_eval(real["MAX_DUAL_GEMM_DECODE_TOKENS"]) == served.MAX_DUAL_GEMM_DECODE_TOKENS
    )
    for name in ("can_use_dual_gemm", "dual_gemm_swiglu", "dual_gemm_swiglu_fp8"):
        node = real[name]
        assert isinstance(node, ast.FunctionDef)
        assert [a.arg for a in node.args.args] == list(
            inspect.signature(getattr(served, name)).parameters
        ), name


def test_dual_gemm_standin_reports_itself_unavailable() -> None:
    for mode in DualGemmQuantMode:
        # A shape inside the real kernel's contract: only SM100 (and cutlass) is missing.
        assert can_use_dual_gemm(1, 128, 256, mode) is False
    x = torch.zeros(1, 128)
    with pytest.raises(RuntimeError, match="SM10x"):
        dual_gemm_swiglu(x, torch.zeros(256, 128))
    with pytest.raises(RuntimeError, match="cutlass"):
        dual_gemm_swiglu_fp8(x, torch.zeros(256, 128), torch.ones(1), torch.ones(1))
    with pytest.raises(RuntimeError, match="unavailable"):
        _served_dual_gemm().BlackwellDualGemmKernel()


@pytest.mark.gpu
def test_on_this_gpu_the_real_module_would_decline_the_dual_gemm_too() -> None:
    from sglang.srt.utils import is_sm100_supported

    if is_sm100_supported():
        pytest.skip("on SM100 the real module offers the dual GEMM; the stand-in answers for SM90")
    assert torch.cuda.get_device_capability() < (10, 0)


# ---- serving an absent module -------------------------------------------------------------------


@pytest.fixture
def scratch_package(tmp_path: Path) -> Iterator[str]:
    """A package ``qsa_scratch_pkg`` holding ``real.py`` (``WHO = "real"``), on ``sys.path``."""
    package = tmp_path / "qsa_scratch_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "real.py").write_text("WHO = 'real'\n")
    sys.path.insert(0, str(tmp_path))
    before = list(sys.meta_path)
    try:
        yield "qsa_scratch_pkg"
    finally:
        sys.path.remove(str(tmp_path))
        sys.meta_path[:] = before
        for name in [n for n in sys.modules if n.startswith("qsa_scratch_pkg")]:
            del sys.modules[name]
        from qsa_testing.standins import _cuda

        for name in [n for n in _cuda._PROVIDED if n.startswith("qsa_scratch_pkg")]:
            del _cuda._PROVIDED[name]


def _fill_standin(module: ModuleType) -> None:
    module.WHO = "stand-in"  # type: ignore[attr-defined]


def test_provide_if_absent_serves_only_what_cannot_be_imported(scratch_package: str) -> None:
    import importlib

    finder = provide_if_absent(f"{scratch_package}.missing", _fill_standin)
    assert isinstance(finder, ProvidingFinder)
    assert finder in sys.meta_path
    missing = importlib.import_module(f"{scratch_package}.missing")
    assert missing.WHO == "stand-in"
    assert missing.__spec__ is not None
    assert missing.__spec__.origin == PROVIDED_ORIGIN

    provide_if_absent(f"{scratch_package}.real", _fill_standin)
    assert importlib.import_module(f"{scratch_package}.real").WHO == "real"
    assert provide_if_absent(f"{scratch_package}.missing", _fill_standin) is finder


def test_provide_if_absent_serves_a_module_whose_requirement_is_missing(
    scratch_package: str,
) -> None:
    import importlib

    provide_if_absent(
        f"{scratch_package}.real", _fill_standin, requires=("qsa_no_such_module_anywhere",)
    )
    assert importlib.import_module(f"{scratch_package}.real").WHO == "stand-in"


def test_dual_gemm_standin_serves_upstreams_import_when_cutlass_is_absent(tmp_path: Path) -> None:
    """In a fresh process, with ``cutlass`` hidden: the spec applies and upstream's import works."""
    script = textwrap.dedent(
        f"""
        import importlib.abc, sys

        class HideCutlass(importlib.abc.MetaPathFinder):
            def find_spec(self, fullname, path=None, target=None):
                if fullname == "cutlass" or fullname.startswith("cutlass."):
                    raise ModuleNotFoundError(fullname)
                return None

        sys.meta_path.insert(0, HideCutlass())
        from qsa_testing.standins import install, StandIn
        install(frozenset({{StandIn.CUTEDSL_DUAL_GEMM_UNAVAILABLE}}))
        import {DUAL_GEMM_LAYER_MODULE}
        from {DUAL_GEMM_MODULE} import (
            MAX_DUAL_GEMM_DECODE_TOKENS, DualGemmQuantMode, can_use_dual_gemm,
        )
        import {DUAL_GEMM_MODULE} as served
        assert served.QSA_TESTING_STANDIN
        assert not can_use_dual_gemm(1, 128, 128, DualGemmQuantMode.UNQUANT)
        print("served", MAX_DUAL_GEMM_DECODE_TOKENS)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=hang_guard_s(),
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "served 16" in result.stdout
    applied = f"stand-in applied: cutedsl_dual_gemm_unavailable on {DUAL_GEMM_LAYER_MODULE}"
    assert applied in result.stderr
    assert f"{DUAL_GEMM_MODULE} served by the stand-in" in result.stderr


def test_cuda_standins_edit_modules_every_qwen4exp_engine_imports() -> None:
    # The first two are imported when the engine loads its model; the top-k module on the first
    # QSA top-k on CUDA (see test_every_qsa_call_of_fast_topk_resolves_the_edited_attribute).
    assert {
        spec.name
        for spec in STANDINS.values()
        if spec.modules[0] in {DUAL_GEMM_LAYER_MODULE, QSA_BACKEND_MODULE, FAST_TOPK_MODULE}
    } >= CUDA_STANDINS
    assert STANDINS[StandIn.CUTEDSL_DUAL_GEMM_UNAVAILABLE].modules == (DUAL_GEMM_LAYER_MODULE,)
    # Every model module is imported by SGLang's registry, Llama's among them, which imports the
    # dual-GEMM layer: so it runs in a Qwen4Exp engine too.
    llama = ast.parse(_sglang_source("sglang.srt.models.llama"))
    imported = {
        node.module for node in llama.body if isinstance(node, ast.ImportFrom) and node.module
    }
    assert DUAL_GEMM_LAYER_MODULE in imported


# ---- QSA's block top-k, sorted -------------------------------------------------------------------

TOPK = 512


def _shuffled_selection(
    sizes: Sequence[int], width: int, device: str, seed: int = 0
) -> tuple[torch.Tensor, list[list[int]]]:
    """What upstream's top-k may return: row ``r`` selects ``sizes[r]`` distinct indices.

    The selected indices and the ``-1`` padding are interleaved in a random order, the worst a
    caller could be handed; the second value is each row's selected set, ascending.
    """
    generator = torch.Generator().manual_seed(seed)
    rows, chosen = [], []
    for size in sizes:
        picked = torch.randperm(4 * width, generator=generator)[:size]
        row = torch.cat([picked, torch.full((width - size,), -1, dtype=torch.long)])
        rows.append(row[torch.randperm(width, generator=generator)])
        chosen.append(sorted(picked.tolist()))
    return torch.stack(rows).to(device=device, dtype=torch.int32), chosen


def _assert_sorted_selection(indices: torch.Tensor, chosen: Sequence[Sequence[int]]) -> None:
    assert indices.dtype == torch.int32
    for row, expected in zip(indices.cpu().tolist(), chosen, strict=True):
        assert row[: len(expected)] == list(expected)
        assert row[len(expected) :] == [-1] * (len(row) - len(expected))


@pytest.mark.parametrize("device", DEVICES)
def test_sorting_keeps_each_rows_selection_and_puts_it_in_ascending_order(device: str) -> None:
    sizes = [TOPK, 0, 1, 300, TOPK - 1, TOPK]
    indices, chosen = _shuffled_selection(sizes, TOPK, device)
    ordered = sort_selected_indices(indices)
    assert ordered.shape == indices.shape
    assert ordered.device == indices.device
    _assert_sorted_selection(ordered, chosen)
    assert torch.equal(sort_selected_indices(ordered), ordered)
    assert sort_selected_indices(indices[:0]).shape == (0, TOPK)


def test_the_wrapper_sorts_what_upstream_returns_for_a_cuda_score() -> None:
    """The wrapper's CUDA branch on CPU tensors: a fake upstream, and a score that says CUDA."""
    indices, chosen = _shuffled_selection([TOPK, 7, 0], TOPK, "cpu", seed=1)
    calls: list[tuple[object, object, int, object]] = []

    def upstream(
        score: object, lengths: torch.Tensor, topk: int, row_starts: torch.Tensor | None
    ) -> torch.Tensor:
        calls.append((score, lengths, topk, row_starts))
        return indices.clone()

    class CudaScore:
        is_cuda = True

    score, lengths, starts = CudaScore(), torch.tensor([900, 7, 0]), torch.zeros(3)
    wrapped = sorted_fast_topk(upstream)
    _assert_sorted_selection(wrapped(score, lengths, topk=TOPK, row_starts=starts), chosen)
    _assert_sorted_selection(wrapped(score, lengths, TOPK), chosen)
    assert len(calls) == 2
    for call, row_starts in zip(calls, (starts, None), strict=True):
        assert call[0] is score
        assert call[1] is lengths
        assert call[2] == TOPK
        assert call[3] is row_starts


def test_the_wrapper_hands_cpu_tensors_to_upstream_untouched() -> None:
    indices, _ = _shuffled_selection([TOPK, 3], TOPK, "cpu", seed=2)

    def upstream(
        score: torch.Tensor, lengths: torch.Tensor, topk: int, row_starts: torch.Tensor | None
    ) -> torch.Tensor:
        del score, lengths, topk, row_starts
        return indices

    wrapped = sorted_fast_topk(upstream)
    assert wrapped(torch.zeros(2, 900), torch.tensor([900, 3]), topk=TOPK) is indices
    assert wrapped.__wrapped__ is upstream  # type: ignore[attr-defined]


def test_the_edit_replaces_fast_topk_in_its_module() -> None:
    spec = STANDINS[StandIn.QSA_TOPK_SORTED]
    assert spec.modules == (FAST_TOPK_MODULE,)
    assert StandIn.QSA_TOPK_SORTED in CUDA_STANDINS
    assert "atomicAdd" in spec.reason

    def fast_topk(
        score: torch.Tensor, lengths: torch.Tensor, topk: int, row_starts: torch.Tensor | None
    ) -> torch.Tensor:
        raise AssertionError

    module = ModuleType(FAST_TOPK_MODULE)
    module.fast_topk = fast_topk  # type: ignore[attr-defined]
    spec.edit(module)
    assert module.fast_topk is not fast_topk
    assert module.fast_topk.__wrapped__ is fast_topk
    with pytest.raises(StandInError, match="no fast_topk"):
        spec.edit(ModuleType(FAST_TOPK_MODULE))


def _upstream_fast_topk_stub(*args: object, **kwargs: object) -> torch.Tensor:
    raise AssertionError((args, kwargs))


def test_the_wrapper_takes_upstreams_signature() -> None:
    tree = ast.parse(_sglang_source(FAST_TOPK_MODULE))
    (node,) = (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "fast_topk")
    upstream = [a.arg for a in node.args.args]
    wrapped = sorted_fast_topk(_upstream_fast_topk_stub)
    assert upstream == list(inspect.signature(wrapped, follow_wrapped=False).parameters)
    assert ast.unparse(node.args.defaults[-1]) == "None"  # row_starts


def _modules_naming_fast_topk() -> dict[str, ast.Module]:
    """Every SGLang module whose source mentions ``fast_topk``, parsed, by dotted name."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None
    assert spec.submodule_search_locations is not None
    root = Path(next(iter(spec.submodule_search_locations)))
    found = {}
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if "fast_topk" in text:
            dotted = ".".join(("sglang", *path.relative_to(root).with_suffix("").parts))
            found[dotted] = ast.parse(text)
    return found


def test_every_qsa_call_of_fast_topk_resolves_the_edited_attribute() -> None:
    """Every import of the JIT ``fast_topk`` in SGLang sits inside the calling function.

    ``from M import fast_topk`` inside a function reads ``M.fast_topk`` on every call, so the
    edited attribute is what runs; a module-level binding anywhere would keep the original. The
    two importers are QSA's: the decode selection and ``qsa_fast_topk`` (prefill, top-k 512).
    """
    package, _, name = FAST_TOPK_MODULE.rpartition(".")
    local_imports: dict[str, int] = {}
    for dotted, tree in _modules_naming_fast_topk().items():
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert FAST_TOPK_MODULE not in {a.name for a in node.names}, dotted
            if not isinstance(node, ast.ImportFrom):
                continue
            names = {alias.name: alias.asname for alias in node.names}
            if node.module == FAST_TOPK_MODULE:
                assert id(node) not in top_level, f"{dotted} binds fast_topk at import time"
                assert names == {name: None}, dotted
                local_imports[dotted] = local_imports.get(dotted, 0) + 1
            elif node.module == package:
                assert name not in names, f"{dotted} imports the module {FAST_TOPK_MODULE}"
    assert local_imports == {
        "sglang.srt.layers.attention.qsa.qsa_indexer": 1,  # QSAIndexer.select_decode_tokens
        "sglang.srt.layers.attention.qsa.kernel": 1,  # qsa_fast_topk
    }


def _scores(lengths: Sequence[int], starts: Sequence[int], seed: int) -> torch.Tensor:
    """Distinct float32 scores (no ties at any row's k-th value), ``[rows, max(start + len)]``."""
    width = max(s + n for s, n in zip(starts, lengths, strict=True))
    generator = torch.Generator().manual_seed(seed)
    values = torch.randperm(len(lengths) * width, generator=generator).float()
    return values.view(len(lengths), width)


def _topk_sets(
    score: torch.Tensor, lengths: Sequence[int], starts: Sequence[int]
) -> list[list[int]]:
    """Each row's ``TOPK`` largest scores in its section, as ascending section-relative indices."""
    sets = []
    for row, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        section = score[row, start : start + length].cpu()
        picked = torch.topk(section, min(TOPK, length)).indices if length else torch.zeros(0)
        sets.append(sorted(int(i) for i in picked.tolist()))
    return sets


def _upstream_fast_topk() -> Callable[..., torch.Tensor]:
    import importlib

    module = importlib.import_module(FAST_TOPK_MODULE)
    found = module.fast_topk
    return getattr(found, "__wrapped__", found)  # type: ignore[no-any-return]


TOPK_LENGTHS = [0, 1, 300, TOPK, TOPK + 1, 700, 2000, 4096]
TOPK_STARTS = [0, 5, 0, 17, 0, 100, 3, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("with_starts", [True, False])
def test_sorted_fast_topk_selects_what_upstream_selects_in_ascending_order(
    with_starts: bool,
) -> None:
    upstream = _upstream_fast_topk()
    wrapped = sorted_fast_topk(upstream)
    starts = TOPK_STARTS if with_starts else [0] * len(TOPK_LENGTHS)
    score = _scores(TOPK_LENGTHS, TOPK_STARTS, seed=3).cuda()
    lengths = torch.tensor(TOPK_LENGTHS, dtype=torch.int32, device="cuda")
    row_starts = torch.tensor(starts, dtype=torch.int32, device="cuda") if with_starts else None
    theirs = upstream(score, lengths, topk=TOPK, row_starts=row_starts)
    ours = wrapped(score, lengths, topk=TOPK, row_starts=row_starts)
    torch.cuda.synchronize()
    assert ours.shape == theirs.shape == (len(TOPK_LENGTHS), TOPK)
    _assert_sorted_selection(ours, _topk_sets(score, TOPK_LENGTHS, starts))
    for mine, upstreams in zip(ours.tolist(), theirs.tolist(), strict=True):
        assert mine == sorted(i for i in upstreams if i >= 0) + [-1] * upstreams.count(-1)


@pytest.mark.gpu
def test_sorted_fast_topk_replays_in_a_cuda_graph_on_new_scores() -> None:
    wrapped = sorted_fast_topk(_upstream_fast_topk())
    lengths_now = [4096, 700, TOPK + 1, 9]
    lengths_next = [TOPK + 1, 4096, 9, 700]
    starts = [0] * 4
    score = _scores(lengths_now, starts, seed=4).cuda()
    lengths = torch.tensor(lengths_now, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), _no_host_sync():
        for _ in range(2):
            wrapped(score, lengths, topk=TOPK)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), _no_host_sync():
        out = wrapped(score, lengths, topk=TOPK)
    fresh = _scores(lengths_next, starts, seed=5).cuda()
    score.copy_(fresh)
    lengths.copy_(torch.tensor(lengths_next, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    _assert_sorted_selection(out, _topk_sets(fresh, lengths_next, starts))
    with _no_host_sync():
        eager = wrapped(fresh, lengths, topk=TOPK)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
