"""The decode step's newest Triton kernels compile for the H100/H200 (SM90) with no GPU here.

The interpreter checks what a kernel computes, not that Triton can lower it for CUDA: an op the
NVIDIA backend refuses (``tl.gather``, ``tl.sort``, an ``if`` over tensors, an int64 atomic)
would fail only on the GPU machine. Triton's wheel carries ``ptxas``, so each kernel is compiled
to an SM90 cubin in a subprocess without ``TRITON_INTERPRET`` (this process's kernels are the
interpreter's). Skipped where the wheel has no NVIDIA backend, and where Triton compiles for a
GPU (the kernel tests then compile and run these kernels for real).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: (module, kernel, signature, constexprs, warps): the launchers' own shapes at Llama-8B's width.
_KERNELS: list[tuple[str, str, dict[str, str], dict[str, object], int]] = [
    (
        "qsa_kernels.head_tokens.triton",
        "_head_blocks_kernel",
        {"pos_ptr": "*i32", "closed_ptr": "*i32", "out_ptr": "*i32", "count_ptr": "*i32",
         "HKV": "i32", "W": "i32", "K": "i32", "BLOCK_W": "constexpr", "TOKENS": "constexpr"},
        {"BLOCK_W": 4096, "TOKENS": 4},
        8,
    ),
    (
        "qsa_kernels.head_tokens.triton",
        "_head_tokens_kernel",
        {"pos_ptr": "*i32", "rows_ptr": "*i32", "closed_ptr": "*i32", "table_ptr": "*i32",
         "hot_ptr": "*i32", "tail_ptr": "*i32", "HKV": "i32", "W": "i32", "R": "i32",
         "NB": "i32", "S": "i32", "BLOCK_W": "constexpr", "TOKENS": "constexpr",
         "RECORD": "constexpr", "TAIL": "constexpr"},
        {"BLOCK_W": 4096, "TOKENS": 4, "RECORD": 8, "TAIL": 3},
        8,
    ),
    (
        "qsa_kernels.ds_label.triton",
        "_fixed_width_kernel",
        {"chosen_ptr": "*i32", "len_ptr": "*i64", "out_ptr": "*i32", "HKV": "i32", "W": "i32",
         "HEAVY": "i32", "threshold": "i32", "BLOCK_W": "constexpr"},
        {"BLOCK_W": 4096},
        8,
    ),
    (
        "qsa_kernels.fetch.triton",
        "_plan_kernel",
        {"sel_ptr": "*i32", "rows_ptr": "*i32", "layers_ptr": "*i32", "slot_block_ptr": "*i32",
         "slot_stamp_ptr": "*i64", "block_slot_ptr": "*i32", "out_ptr": "*i32",
         "victim_ptr": "*i32", "copy_src_ptr": "*i64", "copy_dst_ptr": "*i64",
         "copy_count_ptr": "*i32", "step_ptr": "*i64", "counters_ptr": "*i64",
         "step_arg": "i64", "NL": "i32", "L": "i32", "R": "i32", "S": "i32", "NB": "i32",
         "K": "i32", "BLOCK_K": "constexpr", "BLOCK_S": "constexpr", "SLOT_BITS": "constexpr",
         "MAX_GROUPS": "constexpr", "STEP_FROM_PTR": "constexpr", "COUNT": "constexpr"},
        {"BLOCK_K": 1024, "BLOCK_S": 1024, "SLOT_BITS": 10, "MAX_GROUPS": 8,
         "STEP_FROM_PTR": True, "COUNT": True},
        8,
    ),
    (
        "qsa_kernels.lse_merge.triton",
        "_lse_merge_kernel",
        {"o_ptr": "*fp32", "lse_ptr": "*fp32", "o2_ptr": "*fp32", "lse2_ptr": "*fp32",
         "out_ptr": "*fp32", "out_lse_ptr": "*fp32", "P": "i32", "P2": "i32", "N": "i32",
         "D": "i32", "BLOCK_P": "constexpr", "BLOCK_P2": "constexpr", "BLOCK_D": "constexpr"},
        {"BLOCK_P": 16, "BLOCK_P2": 1, "BLOCK_D": 128},
        4,
    ),
]  # fmt: skip

_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
module, kernel, signature, constexprs, warps = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(module), kernel)
source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
print(len(compiled.asm["cubin"]))
"""


def _ptxas() -> Path | None:
    """The ptxas of Triton's NVIDIA backend, if this wheel carries one."""
    try:
        from triton.backends import nvidia
    except ImportError:
        return None
    path = Path(nvidia.__file__).parent / "bin" / "ptxas"
    return path if path.exists() else None


@pytest.mark.parametrize(
    ("module", "kernel", "signature", "constexprs", "warps"),
    _KERNELS,
    ids=[k[1] for k in _KERNELS],
)
def test_kernel_compiles_to_an_sm90_cubin(  # noqa: PLR0917
    module: str,
    kernel: str,
    signature: dict[str, str],
    constexprs: dict[str, object],
    warps: int,
    tmp_path: Path,
    interpreter_device: str,
) -> None:
    del interpreter_device  # only where this process interprets its kernels
    if _ptxas() is None:
        pytest.skip("this Triton wheel has no NVIDIA backend (ptxas)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a fresh compile, not a cached cubin
    spec = json.dumps([module, kernel, signature, constexprs, warps])
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE, spec],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert int(run.stdout.strip()) > 0
