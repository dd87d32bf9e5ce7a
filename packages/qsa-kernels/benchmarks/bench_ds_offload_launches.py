"""How many device launches one captured DS-Offload decode layer makes, against resident DS.

Inside a CUDA graph every launch still costs the GPU a few microseconds of its own, so a layer's
launch count is a floor under its captured time that no kernel speed-up removes. This counts,
for one layer of the fixed-shape decode the ``qsa_ds`` backend captures, the torch operations that
launch work (views and allocations excluded) and the Triton kernels, at Llama-3.1-8B's attention
shape with per-head records (8 K/V and 32 query heads of 128, bf16; 32 heavy channels, 256 heavy
tokens, a sparse row of 8,192 tokens): DS-Offload's :meth:`DSOffloadedKV.decode_fixed` against
resident double sparsity's :func:`ds_heavy_decode_split`. The counts do not depend on the
batch or the context once the rows are sparse.

Runs on CUDA, or on the CPU through Triton's interpreter (the same launches, counted without
their time). Writes ``<out-dir>/ds_offload_launches.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import _report
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module imports triton

_LAYERS, _HKV, _HQ, _D = 2, 8, 32, 128
_CHANNELS, _HEAVY, _THRESHOLD, _CONTEXT = 32, 256, 4096, 8192
#: Operations that only view, describe or allocate memory: no device work of their own.
_NO_LAUNCH = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "select", "slice", "expand",
    "as_strided", "unsqueeze", "squeeze", "permute", "t", "transpose", "alias", "detach", "unbind",
    "split", "split_with_sizes", "narrow", "view_as", "unflatten", "flatten", "chunk",
    "lift_fresh", "resolve_conj", "resolve_neg", "empty", "empty_like", "new_empty",
    "empty_strided", "new_empty_strided", "sym_size", "sym_stride", "sym_numel", "is_pinned",
})  # fmt: skip


class _Launches(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the torch operations and Triton kernels launched while it is active."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.torch: Counter[str] = Counter()
        self.triton: Counter[str] = Counter()
        self._in_triton = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if not self._in_triton and name not in _NO_LAUNCH:  # the interpreter's own copies
            self.torch[name] += 1
        return func(*args, **(kwargs or {}))

    @contextmanager
    def counting_triton(self) -> Iterator[None]:
        """Count each Triton kernel run (compiled or interpreted) while this is open."""
        from triton.runtime import jit

        classes = [jit.JITFunction]
        try:
            from triton.runtime.interpreter import InterpretedFunction

            classes.append(InterpretedFunction)
        except ImportError:
            pass
        saved = {cls: cls.run for cls in classes}

        def counted(original: Callable[..., Any]) -> Callable[..., Any]:
            def run(kernel: Any, *args: Any, **kwargs: Any) -> Any:
                self.triton[getattr(kernel, "__name__", None) or kernel.fn.__name__] += 1
                self._in_triton += 1
                try:
                    return original(kernel, *args, **kwargs)
                finally:
                    self._in_triton -= 1

            return run

        for cls, original in saved.items():
            cls.run = counted(original)
        try:
            yield
        finally:
            for cls, original in saved.items():
                cls.run = original

    def report(self) -> dict[str, object]:
        return {
            "launches": sum(self.torch.values()) + sum(self.triton.values()),
            "torch_ops": dict(self.torch.most_common()),
            "triton_kernels": dict(self.triton.most_common()),
        }


def _count(body: Callable[[], object]) -> dict[str, object]:
    body()  # compiles (or interprets) every kernel once before counting
    counter = _Launches()
    with counter.counting_triton(), counter:
        body()
    return counter.report()


def _measure(batch: int, device: torch.device) -> dict[str, object]:
    from qsa_kernels import KernelPath
    from qsa_kernels.double_sparsity import DSConfig, DSOffloadedKV, ds_heavy_decode_split
    from qsa_kernels.offload import OffloadGeometry

    config = DSConfig(
        heavy_channel_num=_CHANNELS, heavy_token_num=_HEAVY, sparse_decode_threshold=_THRESHOLD
    )
    gen = torch.Generator(device=device).manual_seed(0)
    blocks = (_CONTEXT + 16) // 4 + 1
    geometry = OffloadGeometry(
        _LAYERS, batch, config.hot_blocks(), blocks, _HKV, _D, torch.bfloat16, per_head=True
    )
    picks = [torch.randperm(_D, device=device, generator=gen) for _ in range(_LAYERS * _HKV)]
    channels = torch.stack([p[:_CHANNELS] for p in picks]).view(_LAYERS, _HKV, _CHANNELS)
    store = DSOffloadedKV(
        geometry, channels.int(), config=config, device=device, path=KernelPath.TRITON
    )
    for row in range(batch):
        k = torch.randn(_LAYERS, _CONTEXT, _HKV, _D, generator=gen, device=device).bfloat16()
        store.admit(row, k, torch.randn_like(k))
    rows = list(range(batch))
    q = torch.randn(batch, _HQ, _D, generator=gen, device=device).bfloat16()
    store.begin_step()
    new = torch.randn(_LAYERS, batch, _HKV, _D, generator=gen, device=device).bfloat16()
    store.append(rows, new, torch.randn_like(new))
    resident_k = torch.randn(batch * geometry.max_tokens, _HKV, _D, generator=gen, device=device)
    resident_k = resident_k.bfloat16()
    resident_v = torch.randn_like(resident_k)
    table = store.labels.slots(rows, geometry.max_tokens)
    lengths = store.kv.step_lengths
    return {
        "batch": batch,
        "ds_offload": _count(lambda: store.decode_fixed(0, rows, q)),
        "resident": _count(
            lambda: ds_heavy_decode_split(
                q, resident_k, resident_v, store.labels.layer(0), store.labels.channels[0],
                table, lengths, heavy_token_num=_HEAVY,
            )
        ),
    }  # fmt: skip


def main(argv: list[str]) -> int:
    """Count each batch's launches, write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("docs/bench"))
    parser.add_argument("--batches", default="1,8")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = [_measure(int(b), device) for b in args.batches.split(",")]
    write_report(args.out_dir, _report.machine(cpu="CPU (Triton's interpreter)"), rows)
    return 0


def write_report(
    out_dir: pathlib.Path, machine: dict[str, str], rows: list[dict[str, object]]
) -> None:
    """Write ``ds_offload_launches.json`` and ``.md`` and print the table."""
    lines = [
        "# Launches of one captured decode layer: DS-Offload against resident double sparsity",
        "",
        f"{machine['device']}, torch {machine['torch']}; Llama-3.1-8B's attention shape, per-head "
        f"records, {_CHANNELS} heavy channels, {_HEAVY} heavy tokens, sparse rows of "
        f"{_CONTEXT:,} tokens. `packages/qsa-kernels/benchmarks/bench_ds_offload_launches.py`.",
        "",
        "| batch | arm | launches | torch operations | Triton kernels |",
        "| ---: | --- | ---: | --- | --- |",
    ]
    for row in rows:
        for arm in ("ds_offload", "resident"):
            counted = row[arm]
            assert isinstance(counted, dict)
            ops = ", ".join(f"{k} {v}" for k, v in counted["torch_ops"].items())
            kernels = ", ".join(f"{k} {v}" for k, v in counted["triton_kernels"].items())
            lines.append(f"| {row['batch']} | {arm} | {counted['launches']} | {ops} | {kernels} |")
    _report.write(out_dir, "ds_offload_launches", {"machine": machine, "rows": rows}, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
