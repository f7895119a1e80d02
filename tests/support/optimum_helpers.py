"""Helpers of the optimum-neuron tests (tests/system/golden/test_optimum_neuron*.py): optimum-neuron's
own code run in a process of its own (optimum_neuron_ref.py, beside this file), the CLI, and
exact tensor comparison."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from shardkit.cli import cli

HERE = Path(__file__).resolve().parent
REF = HERE / "optimum_neuron_ref.py"


def ref(*args: object) -> None:
    """optimum-neuron's own code (tests/optimum_neuron_ref.py) in a process of its own."""
    done = subprocess.run([sys.executable, str(REF), *map(str, args)], capture_output=True, text=True, timeout=600)
    if done.returncode == 77 and not os.environ.get("OPTIMUM_NEURON_SRC"):  # CI sets it: there, a missing oracle fails
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, done.stderr[-3000:]


def same_tensors(a: dict, b: dict) -> None:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def invoke(*args: object) -> str:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output
