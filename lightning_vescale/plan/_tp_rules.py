"""A plan's ``tp`` rules checked against a model: which modules run on split tokens, and whether a tensor-parallel
size divides what the rules split. Pure (no mesh, no process group; runs on a meta model), so the dry run, the
strategies' checks before launch and the applier (:mod:`lightning_vescale.parallel.tensor_parallel`) share it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch.nn as nn

from lightning_vescale.plan._spec import tp_style_name

__all__ = ["check_tensor_parallel", "token_split_modules"]


def token_split_modules(styles: Mapping[str, Any]) -> list[str]:
    """The modules a plan gives ``tp: split_tokens`` (see [Note: experts on ep, attention on tp])."""
    return [name for name, value in styles.items() if tp_style_name(value) == "split_tokens"]



def _split_size(module: nn.Module, style: str) -> Optional[tuple[str, int]]:
    """(what is split, its size) for a colwise / rowwise Linear or Embedding."""
    if isinstance(module, nn.Linear):
        return ("out_features", module.out_features) if style == "colwise" else ("in_features", module.in_features)
    if isinstance(module, nn.Embedding):
        return ("embedding_dim", module.embedding_dim) if style == "colwise" else ("num_embeddings", module.num_embeddings)
    return None


def check_tensor_parallel(model: nn.Module, styles: Mapping[str, Any], tp_size: int) -> None:
    """Raise ``ValueError`` listing every module whose shapes ``tp_size`` does not divide: a colwise / rowwise
    split dimension, and the head counts (``n_heads``, ``n_kv_heads``) of a module whose projections are split
    (attention reshapes its output into heads: each tp rank must hold whole heads). Runs on a meta model."""
    if tp_size <= 1:
        return
    modules = dict(model.named_modules())
    problems = []
    split_parents = set()
    for name, value in styles.items():
        module, style = modules.get(name), tp_style_name(value)
        if module is None or style in ("replicate", "sequence", "heads", "split_tokens"):
            continue
        split = _split_size(module, style)
        if split is not None and split[1] % tp_size != 0:
            problems.append(f"{name} ({type(module).__name__}, tp: {style}) has {split[0]}={split[1]}, not divisible "
                            f"by tp={tp_size}")
        split_parents.add(name.rpartition(".")[0])
    for parent in sorted(split_parents):
        module = modules.get(parent)
        # A whole parameter beside split projections (a per-head norm, a low-rank projection whose output all heads
        # share) gets the gradient of this rank's heads only: tp must sum it, which only a style does.
        styled = {n for n, v in styles.items() if tp_style_name(v) != "replicate"}
        for mname, m in (module.named_modules(prefix=parent) if module is not None else []):
            owner_styled = any(mname == n or mname.startswith(n + ".") for n in styled)
            if not owner_styled and any(True for _ in m.parameters(recurse=False)):
                problems.append(f"{mname} ({type(m).__name__}) holds whole parameters inside {parent or '<model>'}, whose "
                                f"projections are split over tp: its gradient would cover this rank's heads only. Give "
                                f"it a tp style (tp: heads for a per-head norm), or leave the projections of {parent or '<model>'} whole")
        for attr in ("n_heads", "n_kv_heads"):
            heads = getattr(module, attr, None)
            if isinstance(heads, int) and heads % tp_size != 0:
                problems.append(f"{parent or '<model>'} ({type(module).__name__}) has {attr}={heads}, not divisible by "
                                f"tp={tp_size}: each tensor-parallel rank must hold whole heads")
    token_split = token_split_modules(styles)
    for name in token_split:
        inside = [n for n, v in styles.items() if n.startswith(name + ".") and tp_style_name(v) != "replicate"]
        if inside:
            problems.append(f"{name} (tp: split_tokens) holds modules the plan splits over tp too ({', '.join(inside[:3])}): "
                            f"a module running on 1/tp of the tokens keeps its parameters whole")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; ... ({len(problems)} in all)" if len(problems) > 5 else "")
        raise ValueError(f"tensor parallelism over {tp_size} ranks cannot split this model: {shown}. Choose a "
                         f"tensor-parallel size that divides them (strategy.tp_size / tensor_parallel_size), or mark "
                         f"those modules tp: replicate in the plan")
