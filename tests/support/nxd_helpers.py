"""Helpers of the NxD checkpoint tests (tests/system/golden: test_nxd_train, test_nxd_modes,
test_titan): digests of tensors and files, a nested state dict flattened to dotted names."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def file_hash(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out
