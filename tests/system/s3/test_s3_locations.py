"""s3:// locations and the errors around them, against a real S3 API on loopback (moto's server
mode, tests/support/s3_fixtures.py): unsupported schemes, missing boto3, buckets and credentials,
denied access, throttling and 5xx answers retried, and retries that give up, each in one line.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e '.[test]')")
boto3 = pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e '.[s3]')")

from click.testing import CliRunner  # noqa: E402
from s3_helpers import (  # noqa: E402
    keys,
    own_temporary_folder,  # noqa: F401 - autouse: each test its own temporary folder
    run,
    run_sub,
)

import shardkit  # noqa: E402
from shardkit.api import convert, merge, verify  # noqa: E402
from shardkit.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint  # noqa: E402
from shardkit.cli import cli  # noqa: E402
from shardkit.io.objects import s3  # noqa: E402

# ---- the location parser -------------------------------------------------------------------------------


def test_unsupported_scheme_is_one_line_for_every_command(tmp_path, workdir):
    hf = tmp_path / "x"
    hf.mkdir()
    commands = [
        ["convert", "gs://b/x", tmp_path / "o", "--tp", "2"],
        ["convert", hf, "gs://b/x", "--tp", "2"],
        ["merge", "http://h/x", tmp_path / "o"],
        ["reshard", "hf://org/x", tmp_path / "o", "--tp", "2"],
        ["inspect", "gs://b/x"],
        ["verify", "gs://b/x", hf],
        ["verify", hf, "gs://b/x"],
        ["ckpt", "list", "gs://b/x"],
        ["ckpt", "inspect", "gs://b/x"],
        ["ckpt", "prune", "gs://b/x", "--keep", "1"],
        ["ckpt", "export", "gs://b/x", tmp_path / "o"],
        ["ckpt", "export", hf, "gs://b/x"],
        ["ckpt", "reshard", "gs://b/x", tmp_path / "o", "--tp", "2"],
    ]
    for args in commands:
        out = CliRunner().invoke(cli, list(map(str, args)))
        assert out.exit_code == 2, (args, out.output)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "is not supported" in lines[0], (args, out.stderr)
    out = run_sub("convert", hf, "gs://b/x", "--tp", "2", cwd=workdir)  # the real process, its real stderr
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "gs://" in out.stderr
    assert not list(workdir.iterdir())  # never a folder named gs: or http:


def test_without_boto3_the_extra_is_named(tmp_path, workdir):
    code = (
        "import sys; sys.modules['boto3'] = None\n"
        "from shardkit.cli import main; sys.argv = ['shardkit', 'ckpt', 'list', 's3://bucket/x']; main()"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=workdir)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "shardkit: error: s3:// locations need boto3, the 's3' extra: pip install 'shardkit[s3]'"
    ]


def test_missing_bucket_and_credentials_are_one_line(s3_server, tmp_path, workdir, monkeypatch):
    out = run("ckpt", "list", "s3://no-such-bucket-here/x")
    assert out.exit_code == 2 and "does not exist" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    with monkeypatch.context() as m:  # a client made without credentials, for this command only
        for k in [k for k in os.environ if k.startswith("AWS_") and k != "AWS_ENDPOINT_URL"]:
            m.delenv(k)
        m.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        m.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        m.setenv("AWS_EC2_METADATA_DISABLED", "true")
        s3.reset_client()
        try:
            out = run("ckpt", "list", "s3://bucket/x")
        finally:
            m.undo()
            s3.reset_client()
    assert out.exit_code == 2 and "no AWS credentials" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_api_and_trainer_refuse_other_schemes(tmp_path, workdir, capsys):
    from shardkit.errors import ShardkitError
    from trainer.__main__ import main as trainer_main

    layout = shardkit.make_layout(tp=2)
    calls = {
        "convert": lambda: convert(tmp_path, "gs://b/x", layout),
        "merge": lambda: merge("az://b/x", tmp_path / "o"),
        "inspect": lambda: shardkit.inspect("http://h/x"),
        "save_checkpoint": lambda: save_checkpoint("gs://b/x", "step_1", {"w": torch.zeros(2)}),
        "load_checkpoint": lambda: load_checkpoint("gs://b/x"),
        "list_checkpoints": lambda: list_checkpoints("gs://b/x"),
    }
    for name, call in calls.items():
        with pytest.raises(ShardkitError, match="is not supported") as refused:
            call()
        assert "\n" not in str(refused.value), name
    for flag in ("--model", "--checkpoint-dir", "--resume", "--data"):
        args = {"--model": str(tmp_path), "--data": str(tmp_path / "tokens.bin"), flag: "gs://b/x"}
        assert trainer_main([*(a for item in args.items() for a in item), "--steps", "1"]) == 2, flag
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "gs://" in err[0] and flag in err[0], (flag, err)
    assert not list(workdir.iterdir())


def test_denied_access_is_one_line(s3_server, bucket, small_model, workdir, monkeypatch):
    """A user the store knows, with no permission on the bucket: one line, exit 2, for a read
    and for a write (moto checks IAM once its authentication is switched on)."""
    import urllib.request

    iam = boto3.client("iam", endpoint_url=s3_server, region_name="us-east-1")
    iam.create_user(UserName="nobody")
    key = iam.create_access_key(UserName="nobody")["AccessKey"]
    hf = small_model(torch.bfloat16)

    def auth(count: str) -> None:
        request = urllib.request.Request(
            f"{s3_server}/moto-api/reset-auth",
            data=count.encode(),
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        urllib.request.urlopen(request, timeout=30).read()

    auth("0")
    try:
        for args in (["ckpt", "list", f"s3://{bucket}/x"], ["convert", hf, f"s3://{bucket}/y", "--tp", "2"]):
            with monkeypatch.context() as m:  # this user's client, for this command only
                m.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
                m.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
                s3.reset_client()
                try:
                    out = run(*args)
                finally:
                    m.undo()
                    s3.reset_client()
            assert out.exit_code == 2, out.stderr
            lines = out.stderr.strip().splitlines()
            # (moto answers a signed listing of this user SignatureDoesNotMatch, a PUT AccessDenied: both 403)
            assert len(lines) == 1 and "access denied (" in lines[0] and f"s3://{bucket}/" in lines[0], lines
    finally:
        auth("inf")
    assert not keys(bucket)
    assert not list(workdir.iterdir())


def test_throttling_and_5xx_are_retried(tiny_model, bucket, tmp_path, faulty):
    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    proxy = faulty(fail_every=4)  # a quarter of all requests: SlowDown and InternalError in turn
    url = f"s3://{bucket}/flaky"
    convert(hf, url, shardkit.make_layout(tp=2, pp=2, qkv="gqa"))
    merge(url, tmp_path / "merged")
    assert verify(hf, url).ok and verify(hf, tmp_path / "merged").ok
    methods = {what.split()[0] for what in proxy.faulted}
    assert proxy.faults >= 6 and {"GET", "PUT"} <= methods, proxy.faulted


def test_retries_give_up_in_one_line(bucket, faulty, workdir):
    proxy = faulty(fail_all=True)
    env = dict(os.environ, SHARDKIT_S3_MAX_ATTEMPTS="3")
    out = subprocess.run(
        [sys.executable, "-m", "shardkit", "ckpt", "list", f"s3://{bucket}/x"],
        capture_output=True,
        text=True,
        env=env,
        cwd=workdir,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and f"s3://{bucket}/x" in lines[0] and ("SlowDown" in lines[0] or "InternalError" in lines[0])
    ), lines
    assert proxy.requests == 3, proxy.faulted  # the first attempt and two retries
