"""Shared fixtures: tiny seeded HF models built from fixtures/ configs, and the golden folder."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from shardkit.testing import make_tiny_model

# fixture plugins in tests/support (on the import path: pyproject's pythonpath), asked for by name in
# any module: the tests' S3 (a moto server, buckets, a faulty proxy), and the format tests' shared
# shards (torch, and xser written by a fake torch-xla)
pytest_plugins = ["s3_fixtures", "format_fixtures"]


@pytest.fixture(autouse=True)
def _restore_logger_levels():
    """The trainer's main(), run in-process by some tests, quiets the shardkit and torch loggers
    for its run; give every test the levels it started with."""
    names = ("shardkit", "torch.distributed", "torch.distributed.pipelining", "trainer")
    levels = {n: logging.getLogger(n).level for n in names}
    yield
    for n, level in levels.items():
        logging.getLogger(n).setLevel(level)


ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT.parent / "shared" / "golden"


def stage_layers(num_layers: int, pp: int) -> list[list[int]]:
    """An independent reference of FORMATS.md's rule (not the library's): layers split evenly over
    the pp stages, the remainder going to the LAST stages."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for stage in range(pp):
        count = base + (1 if stage >= pp - extra else 0)
        out.append(list(range(start, start + count)))
        start += count
    return out


@pytest.fixture(scope="module")
def one_thread():
    """Thousands of tiny matmuls: one intra-op thread beats contended thread pools on 2 cores. A
    module asks for it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def golden_or_skip() -> Path:
    """The golden reference folder (../shared/golden), or skip the test saying why."""
    if not GOLDEN.is_dir():
        pytest.skip(f"golden NxD shards not found at {GOLDEN} (they live in the shared folder beside the repo)")
    return GOLDEN


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(config_name, dtype=torch.float32, seed=0) -> path of a saved HF model (cached)."""
    cache: dict = {}

    def build(name: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
        key = (name, dtype, seed)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{name}-{str(dtype).split('.')[-1]}-{seed}")
            cache[key] = make_tiny_model(name, out / "hf", seed=seed, dtype=dtype)
        return cache[key]

    return build
