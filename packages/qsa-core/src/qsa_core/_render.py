"""Plain-text rendering of a capacity plan (the ``qsa-plan plan`` table and the demo's opening)."""

from __future__ import annotations

from qsa_core._capacity import CapacityPlan, MemoryPartKind, index_ranks
from qsa_core._units import format_bytes

__all__ = ("render_plan",)


def render_plan(plan: CapacityPlan) -> str:
    """A readable table of every part with and without offload, totals, budgets and fits."""
    p = plan.profile
    ranks = index_ranks(plan.sharding_size, plan.tp_size)
    d2 = plan.index_sharded and ranks > 1
    lines = [
        "QSA capacity plan (per TP rank)",
        f"  model: {p.num_qsa_layers} QSA layers of {p.num_hidden_layers}, "
        f"{p.num_attention_heads} q / {p.num_kv_heads} kv heads × {p.head_dim}, "
        f"indexer {p.index_n_heads} × {p.index_head_dim}, ratio {p.compress_ratio}, "
        f"top-{p.block_topk} blocks, page {p.page_size}",
        f"  setup: TP{plan.tp_size}, K/V {plan.kv_dtype.value}, index {plan.index_dtype.value}, "
        f"{plan.num_requests} requests × {plan.context_len:,} tokens"
        + (
            f", offloaded K/V sharded over {plan.sharding_size} ranks"
            if plan.sharding_size > 1
            else ""
        )
        + (f", compressed index sharded over {ranks} ranks" if d2 else ""),
        f"  per token: raw K/V {plan.raw_bytes_per_token:,} B, index "
        f"{plan.index_bytes_per_token:,} B"
        + (f" ({plan.index_bytes_per_token_per_rank:,} B on this rank)" if d2 else "")
        + f"; one block of one layer {plan.bytes_per_block:,} B; "
        f"host K/V per request {format_bytes(plan.host_bytes_per_request)}",
        "  pool sizing charges: "
        + "; ".join(
            f"{name} {price.token_bytes:,} B per token + {format_bytes(price.fixed_bytes)} fixed"
            for name, price in (
                ("offloaded", plan.offloaded_price),
                ("resident", plan.resident_price),
            )
        ),
        "",
    ]
    header = ("part", "where", "offloaded", "resident", "offloaded formula")
    rows: list[tuple[str, str, str, str, str]] = []
    for kind in MemoryPartKind:
        off, res = plan.offloaded.part(kind), plan.resident.part(kind)
        rows.append(
            (
                kind.value,
                off.tier.value,
                format_bytes(off.nbytes),
                format_bytes(res.nbytes),
                off.formula,
            )
        )
    rows.append(
        (
            "total GPU",
            "gpu",
            format_bytes(plan.offloaded.gpu_bytes),
            format_bytes(plan.resident.gpu_bytes),
            f"budget {format_bytes(plan.gpu_budget_bytes)}",
        )
    )
    rows.append(
        (
            "total host",
            "host",
            format_bytes(plan.offloaded.host_bytes),
            format_bytes(plan.resident.host_bytes),
            f"budget {format_bytes(plan.host_budget_bytes)}",
        )
    )
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def fmt(row: tuple[str, ...]) -> str:
        cells = [
            cell.rjust(widths[i]) if i in {2, 3} else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        return "  " + "  ".join(cells).rstrip()

    lines.append(fmt(header))
    lines.append("  " + "  ".join("-" * w for w in widths))
    lines.extend(fmt(r) for r in rows[:-2])
    lines.append("  " + "  ".join("-" * w for w in widths))
    lines.extend(fmt(r) for r in rows[-2:])
    budgets = (plan.gpu_budget_bytes, plan.host_budget_bytes)
    fit_off = "fits" if plan.offloaded.fits(*budgets) else "does NOT fit"
    fit_res = "fits" if plan.resident.fits(*budgets) else "does NOT fit"
    lines += [
        "",
        f"  {plan.num_requests} requests: offloaded {fit_off}, resident {fit_res}",
        f"  most {plan.context_len:,}-token requests that fit: offloaded "
        f"{plan.max_requests_offloaded}, resident {plan.max_requests_resident}",
    ]
    return "\n".join(lines) + "\n"
