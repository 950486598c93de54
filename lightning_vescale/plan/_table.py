"""The resolved plan as a text table: one line per group (and optionally per parameter)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # the resolved plan formats itself with this module (ResolvedPlan.table)
    from lightning_vescale.plan._resolve import ResolvedPlan

__all__ = ["format_bytes", "format_table"]


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _granularities(values: list) -> str:
    counts = Counter(str(v) for v in values)
    return ", ".join(f"{k} x{c}" if len(counts) > 1 else k for k, c in counts.most_common())


def _rows_to_text(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) if c[:1].isdigit() else c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def format_table(resolved: ResolvedPlan, world_size: Optional[int] = None, *, params: bool = False) -> str:
    from lightning_vescale.plan._layout import block_padding_warnings, group_layouts

    name = resolved.plan.name or "unnamed"
    lines = [f"plan {name!r} on {resolved.model_type}: {len(resolved.groups)} groups, {len(resolved.params)} parameters"
             + (f", {world_size} ranks" if world_size else "")]
    header = ["group", "module", "params", "elements", "bytes", "granularity", "reshard", "prefetch", "dtypes"]
    quantized = any(p.quantization != "none" for p in resolved.params.values())
    if quantized:
        header.append("quantization")
    tiered = any(p.tier for p in resolved.params.values())
    if tiered:
        header.append("tier")  # what the plan places; "-": the memory policy's
    tp_by_group = _tp_styles_by_group(resolved)
    if tp_by_group:
        header.append("tp")  # tensor-parallel styles of the group's modules (applied on a mesh with a tp dim)
    if world_size:
        header += ["shard/rank", "padding", "lower bound"]
    rows = []
    warned: list = []
    total = total_bytes = padded = 0
    for g in resolved.groups:
        members = resolved.group_params(g)
        numel = sum(p.numel for p in members)
        nbytes = sum(p.numel * _itemsize(p.dtype) for p in members)
        total += numel
        total_bytes += nbytes
        dtypes = f"{g.param_dtype or 'orig'}/{g.reduce_dtype or 'param'}"
        row = [g.label, g.module_type, str(len(members)), f"{numel:,}", format_bytes(nbytes),
               _granularities([p.granularity for p in members]) or "-", "yes" if g.reshard_after_forward else "no",
               str(g.prefetch), dtypes]
        if quantized:
            formats = Counter(p.quantization for p in members if p.quantization != "none")
            row.append(", ".join(f"{k} x{c}" for k, c in formats.most_common()) or "-")
        if tiered:
            labels = Counter(p.tier_label for p in members)
            row.append(", ".join(f"{k} x{c}" if len(labels) > 1 else k for k, c in labels.most_common()) or "-")
        if tp_by_group:
            styles = tp_by_group.get(g.name, Counter())
            row.append(", ".join(f"{k} x{c}" for k, c in styles.most_common()) or "-")  # (tp_label strings)
        if world_size:
            layouts = group_layouts(resolved, g, world_size)
            shard = sum(lay.shard_bytes for lay in layouts)
            pad = sum(lay.padding_elements for lay in layouts)
            lower = sum(lay.lower_bound_padding_elements for lay in layouts)
            padded += pad
            flagged = block_padding_warnings([(g.label, layouts)])
            warned.append((g.label, layouts))
            row += [format_bytes(shard), f"{pad / max(numel, 1):.2%}" + (" !" if flagged else ""),
                    f"{lower / max(numel, 1):.2%}"]
        rows.append(row)
    lines.append(_rows_to_text(header, rows))
    summary = f"total: {total:,} elements, {format_bytes(total_bytes)}"
    if world_size:
        summary += f", padding {padded / max(total, 1):.3%} at {world_size} ranks"
    lines.append(summary)
    lines += block_padding_warnings(warned)
    if params:
        prow = []
        for p in resolved.params.values():
            prow.append([p.name, "x".join(map(str, p.shape)), p.dtype, p.group or "<root>", str(p.granularity),
                         p.optimizer, p.quantization, p.tier_label,
                         "; ".join(f"{k}: {v}" for k, v in p.sources.items()
                                   if not v.startswith(("library default", "memory policy")))])
        lines.append("")
        lines.append(_rows_to_text(
            ["parameter", "shape", "dtype", "group", "granularity", "optimizer", "quant", "tier", "set by"], prow))
    return "\n".join(lines)


def _tp_styles_by_group(resolved: ResolvedPlan) -> dict[str, Counter]:
    """Group name -> counts of the tp styles of the modules it holds (a module belongs to its innermost group)."""
    names = sorted((g.name for g in resolved.groups), key=len, reverse=True)
    out: dict[str, Counter] = {}
    from lightning_vescale.plan._spec import tp_label

    for module, style in resolved.tensor_parallel.items():
        owner = next((n for n in names if n == "" or module == n or module.startswith(n + ".")), "")
        out.setdefault(owner, Counter())[tp_label(style)] += 1
    return out


def _itemsize(dtype_name: str) -> int:
    import torch

    return getattr(torch, dtype_name).itemsize
