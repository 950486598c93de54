"""Assertions shared by the tests."""

from __future__ import annotations

import torch


def assert_equal_tree(got, want, path="") -> None:
    """Bitwise equality of nested dicts / lists of tensors and values (same keys in the same order, dtypes)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (path, list(got), list(want))
        for k in want:
            assert_equal_tree(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_equal_tree(g, w, f"{path}/{i}")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype, path
        assert torch.equal(got, want), (path, (got.float() - want.float()).abs().max().item())
    else:
        assert got == want, (path, got, want)
