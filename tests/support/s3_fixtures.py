"""The tests' S3: a moto server on loopback (one for the session), a new bucket in it, a proxy of it
that fails some requests, a model small enough to move through it, and a test's own system
temporary folder and working directory.

A fixture plugin (tests/conftest.py's `pytest_plugins`): every test module asks for these fixtures
by name, none imports them. `own_temporary_folder` is autouse only where a module says so (as
the modules of tests/system/s3 and tests/system/safety/test_safety_s3.py do, by overriding it with an
autouse fixture: their own, or s3_helpers' imported).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from shardkit.io.objects import s3

ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on 127.0.0.1 (its own process), and the environment that points boto3 at it.
    Skips the test when moto's server or boto3 is not installed."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e '.[test]')")
    pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e '.[s3]')")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("the moto server did not start")
            time.sleep(0.1)
    saved = {k: os.environ.get(k) for k in [*ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(ENV, AWS_ENDPOINT_URL=endpoint)
    s3.reset_client()
    yield endpoint
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    s3.reset_client()


@pytest.fixture(scope="session")
def small_model(tmp_path_factory):
    """small_model(dtype=torch.float32) -> tinyllama-mini with 4 of its 22 layers, saved (cached):
    for tests where the model's size is not the point, since every byte goes through the loopback
    server (7 MB in bf16, not 31; the streamed tests' 32 KiB parts make each MB 32 GETs)."""
    import torch

    from shardkit.testing import fixture_config, make_tiny_model

    cache: dict = {}

    def build(dtype: torch.dtype = torch.float32):
        if dtype not in cache:
            out = tmp_path_factory.mktemp(f"tinyllama-mini-4-layers-{str(dtype).split('.')[-1]}")
            config = fixture_config("tinyllama-mini") | {"num_hidden_layers": 4}
            cache[dtype] = make_tiny_model(config, out / "hf", dtype=dtype)
        return cache[dtype]

    return build


_COUNT = [0]


@pytest.fixture
def bucket(s3_server):
    """A new empty bucket."""
    _COUNT[0] += 1
    name = f"shardkit-test-{_COUNT[0]}"
    s3.client().create_bucket(Bucket=name)
    return name


@pytest.fixture
def own_temporary_folder(tmp_path, monkeypatch):
    """The test's own system temporary folder (this process's and its commands'): what a test
    leaves there (mirrors, staged outputs, a save's staging root) is seen by it alone and never
    left in the machine's."""
    folder = tmp_path / "system-temporary-folder"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """The working directory of the test (checked to stay empty)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


@pytest.fixture
def faulty(s3_server):
    """A proxy in front of the server that fails some requests (`tests/support/s3_faults.py`); boto3 in
    this process goes through it while the test runs."""
    from s3_faults import FaultProxy

    proxies: list[FaultProxy] = []

    def start(**options) -> FaultProxy:
        proxies.append(FaultProxy(s3_server, **options))
        os.environ["AWS_ENDPOINT_URL"] = proxies[-1].url
        s3.reset_client()
        return proxies[-1]

    yield start
    os.environ["AWS_ENDPOINT_URL"] = s3_server
    s3.reset_client()
    for proxy in proxies:
        proxy.close()
