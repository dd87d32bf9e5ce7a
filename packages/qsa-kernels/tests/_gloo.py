"""The worker side of the gloo multi-process tests (``spawn_workers`` starts the processes).

A worker runs as a script, ``python test_x.py RANK PORT OUT_DIR``, so it imports this module from
its own directory rather than through pytest.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

_Variant = TypeVar("_Variant")


def member_groups(
    rank: int, port: int, world: int, sizes: Iterable[int]
) -> Iterator[tuple[int, dist.ProcessGroup]]:
    """Join the ``world`` ranks on ``127.0.0.1:port`` and yield ``(n, group of ranks 0..n-1)``
    for each ``n`` in ``sizes`` this rank belongs to; at the end, wait for every rank and leave.

    Every rank creates every group in the same order (``new_group`` is collective), one OpenMP
    thread each.
    """
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        for n in sizes:
            group = dist.new_group(list(range(n)))
            if rank < n and isinstance(group, dist.ProcessGroup):  # others get a placeholder
                yield n, group
        dist.barrier()
    finally:
        dist.destroy_process_group()


def write_group_results(  # noqa: PLR0917 (the worker's own arguments, then its cases)
    rank: int,
    port: int,
    out_dir: Path,
    world: int,
    sizes: Iterable[int],
    variants: Mapping[str, _Variant],
    run: Callable[[Any, _Variant], dict[str, Any]],
) -> None:
    """Every group of :func:`member_groups` as a ``ShardGroup``, ``run`` once per variant;
    ``{"<n>/<variant>": result}`` written to ``out_dir/rank<rank>.json`` for the test side."""
    from qsa_kernels.sharded import ShardGroup

    results: dict[str, Any] = {}
    for n, group in member_groups(rank, port, world, sizes):
        shard = ShardGroup.from_process_group(group)
        for name, variant in variants.items():
            results[f"{n}/{name}"] = run(shard, variant)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


def mismatch(a: torch.Tensor, b: torch.Tensor, *, rtol: float, atol: float) -> str:
    """How ``a`` differs from ``b`` beyond the tolerances (``torch.testing``'s words, 400 chars
    at most), or ``""``: what a worker reports for the test side to assert empty."""
    try:
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    except AssertionError as exc:
        return str(exc)[:400]
    return ""
