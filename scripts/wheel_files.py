"""Files of a published wheel, fetched without installing it (`pip download --no-deps`): the
oracles that run another project's own code outside shardkit (tests/support/optimum_neuron_ref.py,
scripts/check_torchtitan.py) take only the modules they execute."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path


def fetch_wheel_files(requirement: str, files: Iterable[str], folder: Path) -> None:
    """`files` (paths inside the wheel) of `requirement`'s wheel from the package index, into `folder`."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary",
                ":all:",
                "-d",
                tmp,
                requirement,
            ],
            check=True,
            timeout=600,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            for name in files:
                (folder / name).parent.mkdir(parents=True, exist_ok=True)
                (folder / name).write_bytes(archive.read(name))
