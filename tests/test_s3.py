"""s3:// everywhere, against a real S3 API on loopback: moto's server mode, started here.

Every command, the checkpoint API and the trainer read from and write to a bucket of a moto server
on 127.0.0.1 (no network). Checked: exact results (verify), the objects really in the bucket,
nothing created locally (no `s3:` folder, nothing in the working directory or beside a local
destination), reads of only the byte ranges used, the commit protocol without rename (an
interrupted upload never lists as complete; the next run removes it, saying so), and one-line
errors (unsupported schemes, missing buckets and credentials, missing boto3).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e '.[test]')")
boto3 = pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e '.[s3]')")

import ckpt_child  # noqa: E402
from click.testing import CliRunner  # noqa: E402

import shardkit  # noqa: E402
from shardkit.api import convert, merge, reshard, verify  # noqa: E402
from shardkit.checkpoint import finalize_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint  # noqa: E402
from shardkit.cli import cli  # noqa: E402
from shardkit.io import remote, s3  # noqa: E402
from shardkit.layout import Layout  # noqa: E402
from shardkit.testing import fixture_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on 127.0.0.1 (its own process), and the environment that points boto3 at it."""
    port = _free_port()
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


_COUNT = [0]


@pytest.fixture
def bucket(s3_server):
    """A new empty bucket."""
    _COUNT[0] += 1
    name = f"shardkit-test-{_COUNT[0]}"
    s3.client().create_bucket(Bucket=name)
    return name


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """The working directory of the test (checked to stay empty)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def keys(bucket: str, prefix: str = "") -> list[str]:
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def no_mirrors_left() -> None:
    import tempfile

    left = [e for e in os.listdir(tempfile.gettempdir()) if e.startswith(("shardkit-s3-", "shardkit-s3-out-"))]
    assert not [e for e in left if not e.startswith("shardkit-s3-save-")], left


def run(*args: object):
    return CliRunner().invoke(cli, ["-q", *map(str, args)], catch_exceptions=False)


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
    out = run_sub("ckpt", "list", "s3://no-such-bucket-here/x")
    assert out.returncode == 2 and "does not exist" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") or k == "AWS_ENDPOINT_URL"}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"))
    env["AWS_EC2_METADATA_DISABLED"] = "true"
    out = subprocess.run(
        [sys.executable, "-m", "shardkit", "ckpt", "list", "s3://bucket/x"],
        capture_output=True,
        text=True,
        env=env,
        cwd=workdir,
    )
    assert out.returncode == 2 and "no AWS credentials" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def run_sub(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardkit", *map(str, args)], capture_output=True, text=True, cwd=cwd, env=os.environ
    )


# ---- convert, merge, reshard, verify -----------------------------------------------------------------


def test_convert_merge_reshard_verify_through_s3(tiny_model, bucket, tmp_path, workdir):
    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    url = f"s3://{bucket}/models/tp4"
    result = convert(hf, url, shardkit.make_layout(tp=4, pp=2, qkv="gqa"))
    assert str(result.path) == url
    names = keys(bucket, "models/tp4/")
    assert "models/tp4/shardkit.json" in names and "models/tp4/config.json" in names
    assert "models/tp4/model/dp_rank_00_tp_rank_03_pp_rank_01.pt" in names
    assert not any(".shardkit-writing" in n for n in names)
    assert verify(hf, url).ok

    merged = tmp_path / "out" / "merged"
    merge(url, merged)
    assert verify(hf, merged).ok
    assert sorted(p.name for p in merged.parent.iterdir()) == ["merged"]  # nothing beside it

    url2 = f"s3://{bucket}/models/tp2"
    res = run("reshard", url, url2, "--tp", "2", "--pp", "1")
    assert res.exit_code == 0, res.output
    assert verify(url, url2).ok and verify(hf, url2).ok
    assert not list(workdir.iterdir())
    no_mirrors_left()


def test_cli_convert_to_s3_and_verify(tiny_model, bucket, workdir):
    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    url = f"s3://{bucket}/cli/tp2"
    out = run_sub("convert", hf, url, "--tp", "2", cwd=workdir)
    assert out.returncode == 0, out.stderr
    out = run_sub("verify", hf, url, cwd=workdir)
    assert out.returncode == 0, out.stderr + out.stdout
    out = run_sub("inspect", url, "--json", cwd=workdir)
    assert out.returncode == 0 and json.loads(out.stdout)["path"] == url
    again = run_sub("convert", hf, url, "--tp", "2", cwd=workdir)
    assert again.returncode == 2 and "--overwrite" in again.stderr
    assert run_sub("convert", hf, url, "--tp", "4", "--overwrite", cwd=workdir).returncode == 0
    assert run_sub("verify", hf, url, cwd=workdir).returncode == 0
    overlap = run_sub("reshard", url, f"{url}/inner", "--tp", "1", cwd=workdir)
    assert overlap.returncode == 2 and "overlaps" in overlap.stderr
    assert not list(workdir.iterdir())


def test_reshard_reads_only_the_ranges_it_uses(tiny_model, bucket, tmp_path):
    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    url = f"s3://{bucket}/tp8"
    convert(hf, url, shardkit.make_layout(tp=8, pp=1, qkv="gqa", kv_multiplier=2))
    size = sum(o.size for o in s3.list_objects(s3_loc(url)))
    fetched: list[int] = []
    original = remote.Mirror.close

    def close(self):
        fetched.append(self.bytes_fetched)
        original(self)

    remote.Mirror.close = close  # type: ignore[method-assign]
    try:
        merge(url, tmp_path / "merged")  # every tensor byte once, and only the metadata around them
    finally:
        remote.Mirror.close = original  # type: ignore[method-assign]
    assert verify(hf, tmp_path / "merged").ok
    assert 0 < fetched[0] <= size
    tensors = sum(t.numel() * t.element_size() for t in _hf_tensors(hf))
    # merge reads each shard's tensors (kv replicas too: tp8 holds 2x the kv heads) plus headers
    assert fetched[0] < tensors * 1.3


def s3_loc(url: str):
    from shardkit.io.location import parse_location

    return parse_location(url)


def _hf_tensors(hf: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    return [t for f in hf.glob("*.safetensors") for t in load_file(f).values()]


def test_interrupted_upload_is_incomplete_and_cleaned_up(tiny_model, bucket, tmp_path, workdir):
    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    url = f"s3://{bucket}/killed"
    # a run that uploads slowly, killed while it uploads
    code = (
        "import time, sys\n"
        "from shardkit.io import s3\n"
        "orig = s3.Uploader.upload\n"
        "def slow(self, *a, **k):\n"
        "    print('UPLOADING', flush=True); time.sleep(0.5); return orig(self, *a, **k)\n"
        "s3.Uploader.upload = slow\n"
        f"sys.argv = ['shardkit', 'convert', {str(hf)!r}, {url!r}, '--tp', '2']\n"
        "from shardkit.cli import main; main()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=workdir)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "UPLOADING" in line:
            break
    time.sleep(1.2)
    proc.kill()
    proc.wait()
    names = keys(bucket, "killed/")
    assert "killed/.shardkit-writing" in names and "killed/shardkit.json" not in names
    refused = run_sub("merge", url, tmp_path / "m", cwd=workdir)
    assert refused.returncode == 2 and "incomplete" in refused.stderr
    again = run_sub("-v", "convert", hf, url, "--tp", "2", cwd=workdir)
    assert again.returncode == 0, again.stderr
    assert "left incomplete by a run" in again.stderr
    assert "killed/.shardkit-writing" not in keys(bucket, "killed/")
    assert verify(hf, url).ok
    assert not list(workdir.iterdir())


# ---- training checkpoints ------------------------------------------------------------------------------

CONFIG = "tinyllama-mini"
TP2PP2 = Layout(tp=2, pp=2, qkv="gqa")


def _save(root: str, tag: str, layout: Layout, config: dict, state: dict, step: int, **options) -> None:
    ranks = [ckpt_child.Rank(tp=tp, pp=pp, ep=ep) for ep, tp, pp in layout.ranks()]
    model = {(r.tp, r.pp): ckpt_child.rank_pieces(config, layout, r, state["weight"]) for r in ranks}
    from shardkit.checkpoint import OptimizerState

    optim = {
        (r.tp, r.pp): OptimizerState(ckpt_child.rank_optimizer(config, layout, r, state, step), [{"lr": 1e-3}])
        for r in ranks
    }
    save_checkpoint(root, tag, model, optim, scheduler={"last_epoch": step}, layout=layout, config=config, **options)


def test_checkpoint_save_list_reshard_export(bucket, tmp_path, workdir):
    config = fixture_config(CONFIG)
    state = ckpt_child.full_state(config, 100, seed=1)
    root = f"s3://{bucket}/run1"
    _save(root, "step_100", TP2PP2, config, state, 100)
    _save(root, "step_200", TP2PP2, config, state, 200, num_kept=1)
    finalize_checkpoint()
    names = keys(bucket, "run1/")
    assert "run1/step_200/done" in names and "run1/step_200/checkpoint" in names
    assert "run1/step_200/model/dp_rank_00_tp_rank_01_pp_rank_01.pt" in names
    assert any(n.startswith("run1/step_200/optim/") for n in names)
    assert not any(n.startswith("run1/step_100/") for n in names)  # retention on the prefix
    assert not any("shardkit-owner" in n for n in names)
    infos = list_checkpoints(root)
    assert [(i.tag, i.complete) for i in infos] == [("step_200", True)]

    res = run("ckpt", "list", root, "--json")
    assert res.exit_code == 0 and json.loads(res.output)["latest"] == "step_200"
    dst = f"s3://{bucket}/run1-tp1"
    res = run("ckpt", "reshard", root, dst, "--tp", "1", "--pp", "1")
    assert res.exit_code == 0, res.output
    assert f"{bucket}/run1-tp1/step_200/done".split("/", 1)[1] in keys(bucket, "run1-tp1/")
    loaded = load_checkpoint(dst, "latest_if_exists", target_layout=TP2PP2, rank=(1, 1))
    direct = load_checkpoint(root, "latest_if_exists", target_layout=TP2PP2, rank=(1, 1))
    assert loaded is not None and direct is not None
    for name, t in direct.model.items():
        assert torch.equal(loaded.model[name], t), name
    out = tmp_path / "exported"
    res = run("ckpt", "export", dst, out)
    assert res.exit_code == 0, res.output
    full = tmp_path / "hf"
    from safetensors.torch import save_file

    full.mkdir()
    save_file({k: v.contiguous() for k, v in state["weight"].items()}, str(full / "model.safetensors"))
    (full / "config.json").write_text(json.dumps(config))
    assert verify(full, out).ok
    assert not list(workdir.iterdir())
    no_mirrors_left()


def test_killed_checkpoint_upload_lists_incomplete_and_next_save_removes_it(bucket, workdir):
    config = fixture_config(CONFIG)
    state = ckpt_child.full_state(config, 100, seed=1)
    root = f"s3://{bucket}/run2"
    _save(root, "step_100", TP2PP2, config, state, 100)
    finalize_checkpoint()
    # what a save killed mid-upload leaves: its owner object (a dead process of this host), files, no done
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    s3.client().put_object(
        Bucket=bucket, Key="run2/step_200/.shardkit-owner", Body=f"{socket.gethostname()} {dead.pid}\n".encode()
    )
    for key in keys(bucket, "run2/step_100/"):
        if not key.endswith(("/done", "/.shardkit-owner")):
            body = s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()
            s3.client().put_object(Bucket=bucket, Key=key.replace("step_100", "step_200"), Body=body)
    infos = {i.tag: i for i in list_checkpoints(root)}
    assert infos["step_200"].complete is False and infos["step_100"].complete
    loaded = load_checkpoint(root, "latest_if_exists", target_layout=TP2PP2, rank=(0, 0))
    assert loaded is not None and loaded.step == 100
    res = run("ckpt", "prune", root, "--keep", "5", "--dry-run", "--json")
    assert res.exit_code == 0 and "step_200" in json.loads(res.output)["remove"]
    _save(root, "step_300", TP2PP2, config, state, 300)
    finalize_checkpoint()
    assert not keys(bucket, "run2/step_200/")
    assert [i.tag for i in list_checkpoints(root)] == ["step_100", "step_300"]


# ---- the trainer -------------------------------------------------------------------------------------


def test_trainer_saves_to_and_resumes_from_s3(tiny_model, bucket, tmp_path, workdir, caplog):
    import logging

    from trainer.__main__ import main
    from trainer_helpers import COMMON

    hf = tiny_model("tinyllama-mini")
    model_url = f"s3://{bucket}/base"
    convert(hf, model_url, shardkit.make_layout(tp=2, pp=1))
    tokens = tmp_path / "tokens.bin"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "prepare_data.py"), str(ROOT / "fixtures" / "tiny-corpus.txt"),
         "--out", str(tokens)],
        check=True,
    )
    ckpt = f"s3://{bucket}/train"
    args = ["--model", model_url, "--data", str(tokens), *COMMON, "--checkpoint-dir", ckpt,
            "--checkpoint-every", "1", "--num-kept", "2", "--resume", "latest_if_exists"]
    assert main([*args, "--steps", "2"]) == 0
    assert [i.tag for i in list_checkpoints(ckpt)] == ["step_1", "step_2"]
    assert f"train/step_2/done" in keys(bucket, "train/")
    with caplog.at_level(logging.INFO):
        assert main([*args, "--steps", "3", "--override-schedule"]) == 0
    assert "resumed from" in caplog.text and "step 2" in caplog.text
    assert [i.tag for i in list_checkpoints(ckpt)] == ["step_2", "step_3"]
    assert not list(workdir.iterdir())
