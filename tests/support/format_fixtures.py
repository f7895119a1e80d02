"""The format tests' shared files, module-scoped fixtures any test asks for by name (a fixture plugin,
tests/conftest.py's `pytest_plugins`, as s3_fixtures is; none imports them): `fake_xla`, a folder
holding a fake torch_xla package (format_helpers.FAKE_SERIALIZATION) for PYTHONPATH; `torch_shards`,
llama-gqa64 in torch format; `hand_xser`, the same shards as an NxD xser directory written by the fake
torch-xla. Built once per test module that uses them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from format_helpers import FAKE_SERIALIZATION, MODEL, SAVE_SCRIPT, convert_to, load_plain, rank_files, run_with_fake_xla


@pytest.fixture(scope="module")
def fake_xla(tmp_path_factory) -> Path:
    """A folder holding a fake torch_xla package (only utils.serialization), for PYTHONPATH."""
    root = tmp_path_factory.mktemp("fake-torch-xla")
    pkg = root / "torch_xla"
    (pkg / "utils").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Fake torch_xla for tests: only utils.serialization."""\nFAKE = True\n')
    (pkg / "utils" / "__init__.py").write_text("")
    (pkg / "utils" / "serialization.py").write_text(FAKE_SERIALIZATION)
    return root


@pytest.fixture(scope="module")
def torch_shards(tiny_model, tmp_path_factory) -> Path:
    """llama-gqa64 (64 heads, 8 kv) in torch format, tp 2, pp 2, GQA layer; read-only for tests."""
    return convert_to(tiny_model(MODEL), tmp_path_factory.mktemp("torch-shards") / "shards", "torch")


@pytest.fixture(scope="module")
def hand_xser(torch_shards, fake_xla, tmp_path_factory) -> Path:
    """The same shards as an NxD xser directory written by the fake torch-xla: in every rank file
    some tensors are references (<file>.tensors/tensor_<tid>.pt) and some are inline; even rank
    files also carry NxD's .info.pt. Read-only for tests: copy before changing."""
    tmp = tmp_path_factory.mktemp("hand-xser")
    root = tmp / "nxd"
    (root / "model").mkdir(parents=True)
    shutil.copyfile(torch_shards / "config.json", root / "config.json")
    jobs = []
    for i, src in enumerate(rank_files(torch_shards)):
        keys = list(load_plain(src))
        device = [k for j, k in enumerate(keys) if (i + j) % 2 == 0]
        assert 0 < len(device) < len(keys)
        jobs.append({"src": str(src), "dst": str(root / "model" / src.name), "device": device, "info": i % 2 == 0})
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    run_with_fake_xla(fake_xla, SAVE_SCRIPT, tmp / "jobs.json", tmp=tmp)
    return root
