"""The CUDA machine's stand-ins keep the semantics of what they replace.

``flash_attn_varlen_torch`` is checked against a plain per-sequence float64 reference and against
SDPA with a bottom-right causal bias, on CPU tensors everywhere and on the GPU under
``@pytest.mark.gpu``, where it is also captured in a CUDA graph and replayed on new inputs. The
dual-GEMM stand-in is checked against the real module's source, which is read, not imported (it
needs ``cutlass``).
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

from qsa_testing.standins import CUDA_STANDINS, STANDINS, StandIn
from qsa_testing.standins._cuda import (
    DUAL_GEMM_LAYER_MODULE,
    DUAL_GEMM_MODULE,
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
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "served 16" in result.stdout
    applied = f"stand-in applied: cutedsl_dual_gemm_unavailable on {DUAL_GEMM_LAYER_MODULE}"
    assert applied in result.stderr
    assert f"{DUAL_GEMM_MODULE} served by the stand-in" in result.stderr


def test_cuda_standins_edit_modules_every_qwen4exp_engine_imports() -> None:
    assert {
        spec.name
        for spec in STANDINS.values()
        if spec.modules[0] in {DUAL_GEMM_LAYER_MODULE, QSA_BACKEND_MODULE}
    } >= CUDA_STANDINS
    assert STANDINS[StandIn.CUTEDSL_DUAL_GEMM_UNAVAILABLE].modules == (DUAL_GEMM_LAYER_MODULE,)
    # Every model module is imported by SGLang's registry, Llama's among them, which imports the
    # dual-GEMM layer: so it runs in a Qwen4Exp engine too.
    llama = ast.parse(_sglang_source("sglang.srt.models.llama"))
    imported = {
        node.module for node in llama.body if isinstance(node, ast.ImportFrom) and node.module
    }
    assert DUAL_GEMM_LAYER_MODULE in imported
