"""Each stand-in keeps the semantics of the upstream path it replaces, and is logged when applied.

Edits are checked on private copies of SGLang's modules (loaded under another name), so this
process's SGLang stays as upstream ships it for the reference kernels the tests compare against.
Those Triton kernels run on CPU tensors through Triton's interpreter (see ``conftest.py``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch

from qsa_pytest.processes import hang_guard_s
from qsa_testing import StandInError
from qsa_testing.standins import (
    APPLIED_MARKER,
    CPU_STANDINS,
    ENV_DUMMY_WEIGHT_RANGE,
    ENV_STANDINS,
    STANDINS,
    StandIn,
    boot_directory,
    parse_standins,
)
from qsa_testing.standins._hook import after_import
from qsa_testing.standins._patches import (
    gate_sigmoid_mul_torch,
    gather_compressed_keys_torch,
    perturb_first_selected_block,
)


def _private_copy(module_name: str) -> ModuleType:
    """Execute ``module_name``'s file again as a new module that nothing else sees."""
    spec = importlib.util.find_spec(module_name)
    assert spec is not None
    assert spec.origin is not None
    copy_spec = importlib.util.spec_from_file_location(f"_copy_of_{module_name}", spec.origin)
    assert copy_spec is not None
    assert copy_spec.loader is not None
    module = importlib.util.module_from_spec(copy_spec)
    sys.modules[copy_spec.name] = module  # dataclasses in the module look themselves up here
    copy_spec.loader.exec_module(module)
    return module


def test_every_standin_is_declared_with_its_modules_and_reason() -> None:
    assert set(STANDINS) == set(StandIn)
    for name, spec in STANDINS.items():
        assert spec.name is name
        assert spec.modules
        assert len(spec.reason) > 40
    assert StandIn.PERTURB_DECODE_SELECTION not in CPU_STANDINS
    assert StandIn.DUMMY_WEIGHT_RANGE not in CPU_STANDINS


def test_unknown_standin_names_are_refused_with_the_allowed_ones() -> None:
    assert parse_standins(" cpu_sgl_kernel, ,qsa_indexer_cpu") == {
        StandIn.CPU_SGL_KERNEL,
        StandIn.QSA_INDEXER_CPU,
    }
    with pytest.raises(StandInError, match=r"unknown stand-ins \['bogus'\]; allowed: \["):
        parse_standins("cpu_sgl_kernel,bogus")


def test_after_import_edits_a_module_when_it_runs_and_at_once_when_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "qsa_hook_probe.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[str] = []

    def edit(module: ModuleType) -> None:
        module.__dict__["VALUE"] = 2
        seen.append(module.__name__)

    after_import("qsa_hook_probe", edit)
    import qsa_hook_probe  # type: ignore[import-not-found]

    assert qsa_hook_probe.VALUE == 2
    after_import("qsa_hook_probe", lambda m: setattr(m, "VALUE", 3))
    assert qsa_hook_probe.VALUE == 3
    assert seen == ["qsa_hook_probe"]
    monkeypatch.delitem(sys.modules, "qsa_hook_probe")


def test_gate_sigmoid_mul_matches_sglang_triton_kernel() -> None:
    from sglang.kernels.ops.elementwise import elementwise

    gen = torch.Generator().manual_seed(0)
    tokens, hidden = 5, 48
    h = torch.randn(tokens, hidden, generator=gen).bfloat16()
    w = torch.randn(hidden, generator=gen).bfloat16()
    shared = torch.randn(tokens, hidden, generator=gen).bfloat16()
    for do_add in (False, True):
        start = torch.randn(tokens, hidden, generator=gen).bfloat16()
        want, got = start.clone(), start.clone()
        elementwise._launch_fused_gate_sigmoid_mul(h, w, shared, want, do_add=do_add)
        gate_sigmoid_mul_torch(h, w, shared, got, do_add=do_add)
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


def test_gate_launcher_edit_sends_cpu_tensors_to_torch() -> None:
    module = _private_copy("sglang.kernels.ops.elementwise.elementwise")
    STANDINS[StandIn.SHARED_EXPERT_GATE_TORCH].edit(module)
    h, w, s = torch.ones(2, 8), torch.full((8,), 0.25), torch.full((2, 8), 3.0)
    out = torch.zeros(2, 8)
    module._launch_fused_gate_sigmoid_mul(h, w, s, out, do_add=False)
    torch.testing.assert_close(
        out, torch.full((2, 8), 3.0 * torch.sigmoid(torch.tensor(2.0)).item())
    )


def test_compressed_key_gather_matches_sglang_triton_kernel() -> None:
    from sglang.srt.layers.attention.qsa.kernel import gather_qsa_compressed_keys

    gen = torch.Generator().manual_seed(1)
    ratio, heads, dim = 4, 1, 32
    compressed = torch.randn(64, heads, dim, generator=gen).bfloat16()
    # Three sequences of 5, 0 and 9 complete blocks, each on page-aligned token slots.
    counts = [5, 0, 9]
    table = torch.zeros(3, 48, dtype=torch.int32)
    for row, base in enumerate((64, 0, 128)):
        table[row] = torch.arange(base, base + 48, dtype=torch.int32)
    cu = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    want = gather_qsa_compressed_keys(compressed, table, cu, sum(counts), max(counts), ratio)
    got = gather_compressed_keys_torch(compressed, table, cu, sum(counts), max(counts), ratio)
    assert torch.equal(got, want)
    # The host total bounds the output even where the device offsets run past it.
    short = gather_compressed_keys_torch(compressed, table, cu, 7, max(counts), ratio)
    assert torch.equal(short, want[:7])


def test_perturbation_drops_exactly_the_lowest_selected_block_of_each_row() -> None:
    indices = torch.tensor(
        [
            [9, 10, 11, 12, 13, 40, -1, -1],  # lowest 9 → block 8..11: drops 9, 10, 11
            [0, 1, 2, 3, 4, 5, 6, 7],  # block 0..3
            [-1, -1, -1, -1, -1, -1, -1, -1],  # no selection: unchanged
        ],
        dtype=torch.int32,
    )
    got = perturb_first_selected_block(indices, 4)
    assert got.tolist() == [
        [-1, -1, -1, 12, 13, 40, -1, -1],
        [-1, -1, -1, -1, 4, 5, 6, 7],
        [-1] * 8,
    ]
    assert got.dtype == indices.dtype


def test_gated_rmsnorm_edit_turns_on_the_cpu_op_in_both_modules() -> None:
    spec = STANDINS[StandIn.GATED_RMSNORM_CPU_OP]
    for name in spec.modules:
        module = _private_copy(name)
        assert module._use_cpu is False  # no AMX on a CPU-only test machine
        spec.edit(module)
        assert module._use_cpu is True


def test_gated_rmsnorm_edit_refuses_a_module_without_the_switch() -> None:
    with pytest.raises(StandInError, match="has no _use_cpu switch"):
        STANDINS[StandIn.GATED_RMSNORM_CPU_OP].edit(ModuleType("elsewhere"))


def test_qsa_indexer_edit_dispatches_cpu_to_its_own_forward_impl() -> None:
    module = _private_copy("sglang.srt.layers.attention.qsa.qsa_indexer")
    calls: list[tuple[object, ...]] = []

    def recording_impl(self: object, *args: object) -> str:
        calls.append(args)
        return "impl"

    module.QSAIndexer._forward_impl = recording_impl
    STANDINS[StandIn.QSA_INDEXER_CPU].edit(module)
    indexer = object.__new__(module.QSAIndexer)
    assert indexer.forward_cpu("h", "p", "fb", "meta") == "impl"
    assert indexer.forward_native("h", "p", "fb", "meta", "cp") == "impl"
    assert calls == [("h", "p", "fb", "meta", None), ("h", "p", "fb", "meta", "cp")]


def test_dummy_weight_edit_widens_the_seeded_uniform_init(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _private_copy("sglang.srt.model_loader.loader")
    upstream = module.initialize_dummy_weights
    monkeypatch.setenv(ENV_DUMMY_WEIGHT_RANGE, "0.25")
    STANDINS[StandIn.DUMMY_WEIGHT_RANGE].edit(module)
    wide, reference = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    module.initialize_dummy_weights(wide)
    upstream(reference, -0.25, 0.25, 1234)
    assert torch.equal(wide.weight, reference.weight)
    assert 0.2 < wide.weight.abs().max().item() <= 0.25
    monkeypatch.setenv(ENV_DUMMY_WEIGHT_RANGE, "2")
    with pytest.raises(StandInError, match=r"QSA_TESTING_DUMMY_WEIGHT_RANGE='2' .* \(0, 1\]"):
        STANDINS[StandIn.DUMMY_WEIGHT_RANGE].edit(_private_copy("sglang.srt.model_loader.loader"))


def test_host_register_edit_leaves_a_cpu_buffer_allocated_with_no_registered_range() -> None:
    """Without CUDA, SGLang's pinned host allocation (routed experts' host cache) succeeds, and
    records no range for a destroy to unregister."""
    module = _private_copy("sglang.srt.mem_cache.pool_host.common")
    STANDINS[StandIn.HOST_REGISTER_CPU].edit(module)
    buffer = module.alloc_with_host_register(
        (4, 2), torch.int32, "cpu", True, module.HostTensorAllocator()
    )
    assert buffer.shape == (4, 2)
    assert getattr(buffer, module._CUDA_HOST_REGISTERED_RANGES_ATTR) == []
    assert StandIn.HOST_REGISTER_CPU in CPU_STANDINS


def test_cpu_sgl_kernel_loads_the_real_python_layer_and_torch_cpu_ops() -> None:
    """In a fresh interpreter, the way an engine's processes get it: boot directory on the path."""
    script = textwrap.dedent(
        """
        import torch, sgl_kernel
        from qsa_testing.standins._cpu_ops import STANDIN_OPS
        assert sgl_kernel.common_ops is None
        print("wrapper", sgl_kernel.causal_conv1d_update_cpu.__module__)
        for op in STANDIN_OPS:
            getattr(torch.ops.sgl_kernel, op.name)
        try:
            torch.ops.sgl_kernel.rmsnorm_cpu
        except AttributeError as exc:
            print("missing", exc)
        """
    )
    env = {
        **os.environ,
        ENV_STANDINS: StandIn.CPU_SGL_KERNEL.value,
        "PYTHONPATH": os.pathsep.join([str(boot_directory()), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=hang_guard_s(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "wrapper sgl_kernel.mamba" in done.stdout
    assert "missing" in done.stdout
    assert "rmsnorm_cpu" in done.stdout
    assert f"{APPLIED_MARKER} cpu_sgl_kernel on sgl_kernel.load_utils" in done.stderr
