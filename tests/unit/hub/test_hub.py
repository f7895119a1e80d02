"""Hub support against a loopback stand-in server (tests/support/hub_server.py) with the real
huggingface_hub client: repo ids as sources (only the needed files), push (merge first, model
card, byte-for-byte content), clear errors, retries and resuming, and the token never shown.

In-process tests point the client at the server with `endpoint=`/`cache_dir=`; CLI tests run
`python -m shardkit` with HF_ENDPOINT / HF_HOME / HF_TOKEN / HF_HUB_OFFLINE in its environment.
Uploads use the LFS protocol (HF_HUB_DISABLE_XET=1): the stand-in does not speak Xet.
No test leaves 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from hub_server import GITATTRIBUTES, HubStandIn, Token

import shardkit
from shardkit import hub as skhub
from shardkit.testing import make_tiny_model

TOKEN = "hf_shardkitTestWRITE0123456789abcdefXYZ"
READ_TOKEN = "hf_shardkitTestREAD0123456789abcdefXYZ"
BOB_TOKEN = "hf_shardkitTestBOB0123456789abcdefXYZ"
BAD_TOKEN = "hf_shardkitTestBAD0123456789abcdefXYZ"
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")

REPO = "shardkit-test/tiny-llama"
FETCHED = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
LAYOUT = shardkit.make_layout(tp=2, pp=3, qkv="gqa")
SHARD_SIZE = "100KB"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(Path(path).rglob("*")) if p.is_file()}


def assert_same_bytes(got: dict[str, bytes], want: dict[str, bytes]) -> None:
    for name, data in want.items():
        assert name in got, f"{name} did not arrive"
        assert sha256(got[name]) == sha256(data), f"{name} differs"


# ---- fixtures ------------------------------------------------------------------------------------


@pytest.fixture
def hub():
    """The stand-in Hub on 127.0.0.1 (a free port), shut down afterwards. LFS objects of 96 KiB and
    more go through the multipart transfer (32 KiB parts), smaller ones through the basic one."""
    server = HubStandIn(
        {
            TOKEN: Token("alice", orgs=("shardkit-test",)),
            READ_TOKEN: Token("alice", write=False),
            BOB_TOKEN: Token("bob"),
        },
        multipart_threshold=96 * 1024,
        part_size=32 * 1024,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()
    assert not server.errors, server.errors
    assert not server.unhandled, f"the client called endpoints the stand-in lacks: {server.unhandled}"


@pytest.fixture
def client(monkeypatch, tmp_path):
    """huggingface_hub in this process: token from HF_TOKEN only, LFS uploads (no Xet), online,
    bounded timeouts, and backoff retries without the waiting."""
    import httpx2
    from huggingface_hub import constants, set_client_factory
    from huggingface_hub.utils import _http, are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-stored-token"))
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(_http, "time", types.SimpleNamespace(sleep=lambda seconds: None))
    set_client_factory(
        lambda: httpx2.Client(
            event_hooks={"request": [_http.hf_request_event_hook]},
            follow_redirects=True,
            timeout=httpx2.Timeout(30.0),
            trust_env=False,
        )
    )
    bars_were_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        set_client_factory(_http.default_client_factory)
        if not bars_were_disabled:
            enable_progress_bars()


@pytest.fixture(scope="session")
def served(tmp_path_factory) -> Path:
    """A tiny Llama repo as people publish them: safetensors AND .bin, tokenizer files, a README,
    and an original/ folder of consolidated weights."""
    from safetensors.torch import load_file

    root = make_tiny_model("llama-mha", tmp_path_factory.mktemp("served") / "repo")
    state = load_file(root / "model.safetensors")
    torch.save(state, root / "pytorch_model.bin")
    (root / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}}}))
    (root / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    (root / "README.md").write_text("---\nlicense: mit\n---\n# tiny llama\n")
    (root / ".gitattributes").write_bytes(GITATTRIBUTES)
    (root / "original").mkdir()
    torch.save(state, root / "original" / "consolidated.00.pth")
    return root


@pytest.fixture(scope="session")
def shards(served, tmp_path_factory) -> Path:
    """shardkit shards (tp 2, pp 3, qkv gqa; NxD torch files) of the served model."""
    out = tmp_path_factory.mktemp("shards") / "tp2pp3"
    shardkit.convert(served, out, LAYOUT, command="shardkit convert ./repo ./tp2pp3 --tp 2 --pp 3 --qkv gqa")
    return out


@pytest.fixture(scope="session")
def reference(shards, tmp_path_factory) -> Path:
    """What pushing `shards` must upload: their merge, made locally."""
    out = tmp_path_factory.mktemp("reference") / "merged"
    shardkit.merge(shards, out, max_shard_size=SHARD_SIZE)
    return out


def hub_env(hub: HubStandIn, home: Path, token: str | None = TOKEN, offline: bool = False) -> dict[str, str]:
    """The environment of a user whose Hub is the stand-in (as a user would set it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    env.update(
        HF_ENDPOINT=hub.url,
        HF_HOME=str(home),
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_ETAG_TIMEOUT="10",
        HF_HUB_DOWNLOAD_TIMEOUT="10",
        NO_PROXY="127.0.0.1",
        no_proxy="127.0.0.1",
    )
    if token:
        env["HF_TOKEN"] = token
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def run_cli(*args, hub: HubStandIn, home: Path, token: str | None = TOKEN, offline: bool = False):
    """`python -m shardkit ARGS` with the Hub settings in its environment."""
    return subprocess.run(
        [sys.executable, "-m", "shardkit", *map(str, args)],
        env=hub_env(hub, home, token, offline),
        capture_output=True,
        text=True,
        timeout=240,
    )


def one_line_error(result, *phrases: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("shardkit: error: ") and "Traceback" not in result.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    return lines[0]


# ---- choosing files ------------------------------------------------------------------------------


def test_choose_files_prefers_safetensors_and_skips_the_rest():
    listing = [
        ".gitattributes",
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "pytorch_model.bin",
        "tokenizer.json",
        "tokenizer_config.json",
        "original/consolidated.00.pth",
        "onnx/model.onnx",
    ]
    assert skhub.choose_files(listing) == sorted(FETCHED)
    sharded = [
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "consolidated.safetensors",
        "pytorch_model.bin",
    ]
    assert skhub.choose_files(sharded) == ["config.json", "model.safetensors.index.json"]  # index first
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    assert skhub.choose_files(sharded, index) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert skhub.choose_files(["config.json", "pytorch_model.bin", "README.md"]) == ["config.json", "pytorch_model.bin"]
    shardkit_repo = ["shardkit.json", "config.json", "model/dp_rank_00_tp_rank_00_pp_rank_00.pt", "README.md"]
    assert skhub.choose_files(shardkit_repo) == [
        "config.json",
        "model/dp_rank_00_tp_rank_00_pp_rank_00.pt",
        "shardkit.json",
    ]
    with pytest.raises(shardkit.FormatError, match="no model weights"):
        skhub.choose_files(["config.json", "README.md"])


# ---- download ------------------------------------------------------------------------------------


def test_download_fetches_only_safetensors_config_and_tokenizer(hub, client, served, tmp_path):
    hub.add_repo(REPO, served)
    path = skhub.resolve_source(REPO, endpoint=hub.url, cache_dir=tmp_path / "cache")
    assert {p.name for p in path.iterdir()} == FETCHED
    assert sorted(hub.downloads(REPO)) == sorted(FETCHED), "only the needed files may be fetched (no .bin)"
    for name in FETCHED:
        assert sha256((path / name).read_bytes()) == sha256((served / name).read_bytes())
    assert shardkit.open_checkpoint(path).format == "safetensors"
    assert skhub.resolve_source(str(served)) == served  # a local path is returned unchanged
    with pytest.raises(shardkit.FormatError, match="does not exist"):
        skhub.resolve_source(str(tmp_path / "nowhere"))  # a missing path is not a repo id: no network


def test_download_of_a_sharded_repo_takes_only_the_indexed_files(hub, client, tmp_path):
    model = make_tiny_model("llama-mha", tmp_path / "sharded", max_shard_size=SHARD_SIZE)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    shutil.copy(model / "model-00001-of-00005.safetensors", model / "consolidated.safetensors")
    hub.add_repo("shardkit-test/sharded", model)
    path = skhub.resolve_source("shardkit-test/sharded", endpoint=hub.url, cache_dir=tmp_path / "cache")
    wanted = {"config.json", "generation_config.json", "model.safetensors.index.json", *index["weight_map"].values()}
    assert {p.name for p in path.iterdir()} == wanted
    assert "consolidated.safetensors" not in hub.downloads("shardkit-test/sharded")
    report = shardkit.verify(model, path)
    assert report.ok


def test_download_of_a_repo_of_shardkit_shards(hub, client, shards, served, tmp_path):
    hub.add_repo("alice/tp2pp3", {**tree(shards), "README.md": b"# shards\n"})
    path = skhub.resolve_source("alice/tp2pp3", endpoint=hub.url, cache_dir=tmp_path / "cache")
    assert {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} == set(tree(shards))
    assert "README.md" not in hub.downloads("alice/tp2pp3")
    shardkit.merge(path, tmp_path / "merged")
    assert shardkit.verify(served, tmp_path / "merged").ok


def test_download_revision_and_missing_revision(hub, client, served, tmp_path):
    main = hub.add_repo(REPO, served)
    hub.add_repo(REPO, served, branch="v2")
    hub.add_repo(REPO, {"tokenizer_config.json": b'{"model_max_length": 128}'}, branch="v2")
    v2 = skhub.resolve_source(REPO, revision="v2", endpoint=hub.url, cache_dir=tmp_path / "cache")
    assert json.loads((v2 / "tokenizer_config.json").read_text()) == {"model_max_length": 128}
    pinned = skhub.resolve_source(REPO, revision=main, endpoint=hub.url, cache_dir=tmp_path / "cache")
    assert json.loads((pinned / "tokenizer_config.json").read_text()) == {"model_max_length": 64}
    with pytest.raises(skhub.HubRevisionNotFoundError, match="has no revision 'nope'"):
        skhub.resolve_source(REPO, revision="nope", endpoint=hub.url, cache_dir=tmp_path / "cache")
    with pytest.raises(shardkit.ShardkitError, match="--revision applies to Hub repo ids"):
        skhub.resolve_source(str(served), revision="v2")


def test_cli_convert_from_a_repo_id_end_to_end_then_offline_from_the_cache(hub, served, tmp_path):
    hub.add_repo(REPO, served)
    home = tmp_path / "hf-home"
    result = run_cli("-q", "convert", REPO, tmp_path / "tp2", "--tp", "2", hub=hub, home=home)
    assert result.returncode == 0, result.stderr
    assert shardkit.verify(served, tmp_path / "tp2").ok
    assert json.loads((tmp_path / "tp2" / "shardkit.json").read_text())["layout"]["tp"] == 2
    assert (home / "hub" / "models--shardkit-test--tiny-llama").is_dir(), "HF_HOME decides the cache"
    assert sorted(hub.downloads(REPO)) == sorted(FETCHED)
    assert all(r["authorization"] == f"Bearer {TOKEN}" for r in hub.requests), "HF_TOKEN is sent"
    assert TOKEN not in result.stdout + result.stderr

    seen = len(hub.requests)
    offline = run_cli("-q", "convert", REPO, tmp_path / "tp2-offline", "--tp", "2", hub=hub, home=home, offline=True)
    assert offline.returncode == 0, offline.stderr
    assert len(hub.requests) == seen, "offline mode must not touch the network"
    assert shardkit.verify(served, tmp_path / "tp2-offline").ok


@pytest.mark.slow  # every command with repo ids (subprocesses); a repo id as SRC: the convert tests
def test_reshard_inspect_and_verify_take_repo_ids(hub, served, shards, tmp_path):
    """Every command's SRC may be a Hub repo id: reshard a repo of shards, inspect it, verify a
    local result against the original repo; the library API takes repo ids as the CLI does."""
    hub.add_repo(REPO, served)
    hub.add_repo("alice/tp2pp3", tree(shards))
    home = tmp_path / "hf-home"
    result = run_cli("-q", "reshard", "alice/tp2pp3", tmp_path / "tp1pp2", "--tp", "1", "--pp", "2", hub=hub, home=home)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "tp1pp2" / "shardkit.json").read_text())["layout"]["pp"] == 2

    result = run_cli("inspect", "alice/tp2pp3", "--json", hub=hub, home=home)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["layout"]["tp"], report["layout"]["pp"], report["layout"]["qkv"]) == (2, 3, "gqa")

    result = run_cli("verify", REPO, tmp_path / "tp1pp2", hub=hub, home=home)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tensors compared: equal" in result.stdout
    result = run_cli("verify", REPO, tmp_path / "tp1pp2", "--revision-a", "nope", hub=hub, home=home)
    one_line_error(result, "has no revision 'nope'")

    api = textwrap.dedent(f"""
        import shardkit
        assert shardkit.verify({REPO!r}, "alice/tp2pp3").ok
        assert shardkit.inspect("alice/tp2pp3")["layout"]["pp"] == 3
        shardkit.merge("alice/tp2pp3", {str(tmp_path / "merged")!r})
    """)
    result = subprocess.run(
        [sys.executable, "-c", api],
        env=hub_env(hub, tmp_path / "api-home"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    assert shardkit.verify(served, tmp_path / "merged").ok


def test_cli_offline_without_cache_is_one_clear_line(hub, tmp_path):
    result = run_cli(
        "-q", "convert", REPO, tmp_path / "out", "--tp", "2", hub=hub, home=tmp_path / "empty-home", offline=True
    )
    one_line_error(result, REPO, "not in the local Hugging Face cache", "HF_HUB_OFFLINE")
    assert not hub.requests and not (tmp_path / "out").exists()


def test_cli_gated_and_missing_repos_are_one_clear_line(hub, served, tmp_path):
    hub.add_repo("shardkit-test/gated", served, gated=True, granted=(BOB_TOKEN,))
    gated = run_cli("-q", "convert", "shardkit-test/gated", tmp_path / "out", "--tp", "2", hub=hub, home=tmp_path / "h")
    one_line_error(gated, "shardkit-test/gated is a gated repo", "request access at", f"{hub.url}/shardkit-test/gated")
    assert hub.count("HEAD", r"^/shardkit-test/gated/resolve/", status=403), "the server refused as gated"
    missing = run_cli("-q", "merge", "shardkit-test/nope", tmp_path / "out", hub=hub, home=tmp_path / "h")
    one_line_error(missing, "shardkit-test/nope is neither a local path nor a Hub repo")
    assert not (tmp_path / "out").exists()
    # the granted account downloads the gated repo
    granted = run_cli(
        "-q",
        "convert",
        "shardkit-test/gated",
        tmp_path / "ok",
        "--tp",
        "2",
        hub=hub,
        home=tmp_path / "h",
        token=BOB_TOKEN,
    )
    assert granted.returncode == 0, granted.stderr


# ---- push ----------------------------------------------------------------------------------------


def test_push_of_shards_uploads_the_merge_byte_for_byte_with_a_model_card(
    hub, client, shards, reference, tmp_path, caplog
):
    caplog.set_level(logging.DEBUG)
    stage = tmp_path / "stage"
    stage.mkdir()
    result = skhub.push(
        shards,
        "alice/tiny-merged",
        create=True,
        private=True,
        endpoint=hub.url,
        max_shard_size=SHARD_SIZE,
        tmp_dir=stage,
        command="shardkit push ./tp2pp3 alice/tiny-merged",
    )
    got = hub.files("alice/tiny-merged")
    want = tree(reference)
    assert_same_bytes(got, want)
    assert set(got) == set(want) | {"README.md", ".gitattributes"}
    for name in want:
        assert hub.blob("alice/tiny-merged", name).lfs == name.endswith(".safetensors")
    assert hub.count("PUT", r"^/__lfs/[0-9a-f]{64}/part/\d+$") and hub.count("PUT", r"^/__lfs/[0-9a-f]{64}$"), (
        "both LFS transfers (multipart for the larger files, basic for the smaller) were used"
    )
    assert hub.repos["alice/tiny-merged"].private

    stats = skhub.weight_stats(reference)
    card = got["README.md"].decode()
    assert "tp 2, pp 3, qkv gqa (NxD torch shards, llama family)" in card
    assert f"| Tensors | {stats['tensors']:,} |" in card and stats["tensors"] == 30
    assert f"| Parameters | {stats['parameters']:,} |" in card
    assert "`shardkit push ./tp2pp3 alice/tiny-merged`" in card
    assert "`shardkit convert ./repo ./tp2pp3 --tp 2 --pp 3 --qkv gqa`" in card  # what wrote the shards
    assert result["merged"] and result["model_card"] and result["tensors"] == 30
    assert result["commit"] == hub.repos["alice/tiny-merged"].branches["main"]
    assert not any(stage.iterdir()), "the staging directory is removed"
    assert TOKEN not in caplog.text
    assert all(r["authorization"] in (f"Bearer {TOKEN}", None) for r in hub.requests)
    storage = [r for r in hub.requests if r["method"] == "PUT" or r["path"].endswith("/complete")]
    assert storage and not [r for r in storage if r["authorization"]], "the token is not sent to the storage URLs"


def test_push_of_a_training_checkpoint_tag_merges_it(hub, client, shards, reference, tmp_path):
    """NxD's training tree: <dir>/<tag>/model/<rank files>, config and tokenizer beside the tags."""
    run = tmp_path / "run"
    shutil.copytree(shards / "model", run / "step_100" / "model")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(shards / name, run / name)
    (run / "step_100" / "done").touch()
    result = skhub.push(run / "step_100", "alice/from-tag", create=True, endpoint=hub.url, max_shard_size=SHARD_SIZE)
    assert result["merged"]
    got = hub.files("alice/from-tag")
    assert_same_bytes(got, tree(reference))
    assert "tp 2, pp 3, qkv gqa (NxD torch shards, llama family)" in got["README.md"].decode()


def test_push_of_an_hf_directory_to_a_branch_and_as_a_pull_request(hub, client, reference, tmp_path):
    before = tree(reference)
    skhub.push(reference, "alice/hf", create=True, revision="dev", endpoint=hub.url)
    assert set(hub.files("alice/hf")) == {".gitattributes"}, "main is untouched"
    dev = hub.files("alice/hf", "dev")
    assert_same_bytes(dev, before)
    assert "not known (pushed from a Hugging Face directory)" in dev["README.md"].decode()
    assert tree(reference) == before, "push never writes into SRC"

    pr = skhub.push(reference, "alice/hf", create_pr=True, commit_message="weights", endpoint=hub.url)
    assert pr["pr_url"] == f"{hub.url}/alice/hf/discussions/1"
    assert_same_bytes(hub.files("alice/hf", "refs/pr/1"), before)
    assert set(hub.files("alice/hf")) == {".gitattributes"}
    assert hub.repos["alice/hf"].messages[pr["commit"]] == "weights"
    with pytest.raises(skhub.HubError, match="--create-pr opens a pull request against the default branch"):
        skhub.push(reference, "alice/hf", create_pr=True, revision="dev", endpoint=hub.url)


def test_push_to_a_missing_repo_says_create_before_any_work(hub, client, shards, tmp_path):
    stage = tmp_path / "stage"
    stage.mkdir()
    with pytest.raises(skhub.HubRepoNotFoundError, match="pass --create to create it") as info:
        skhub.push(shards, "alice/absent", endpoint=hub.url, tmp_dir=stage)
    assert "\n" not in str(info.value)
    assert "alice/absent" not in hub.repos and not any(stage.iterdir()), "nothing merged, nothing created"


def test_push_auth_errors_are_clear(hub, client, shards, reference, monkeypatch):
    hub.add_repo("alice/existing", {"README.md": b"# x\n"})
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(skhub.HubAuthError, match="needs a Hugging Face token with write access: set HF_TOKEN"):
        skhub.push(reference, "alice/existing", endpoint=hub.url)
    monkeypatch.setenv("HF_TOKEN", BAD_TOKEN)
    with pytest.raises(skhub.HubAuthError, match=r"rejected your token \(401") as bad:
        skhub.push(reference, "alice/existing", endpoint=hub.url)
    assert BAD_TOKEN not in str(bad.value)
    monkeypatch.setenv("HF_TOKEN", READ_TOKEN)
    with pytest.raises(skhub.HubAuthError, match=r"cannot write to alice/existing \(403 Forbidden"):
        skhub.push(reference, "alice/existing", endpoint=hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with pytest.raises(skhub.HubAuthError, match=r"cannot write to someone-else/model \(403"):
        skhub.push(reference, "someone-else/model", create=True, endpoint=hub.url)


def test_a_dropped_upload_connection_is_retried(hub, client, shards, reference):
    fault = hub.fail("PUT", r"^/__lfs/", mode="drop", after=1, times=1)
    skhub.push(shards, "alice/dropped", create=True, endpoint=hub.url, max_shard_size=SHARD_SIZE)
    assert fault.fired == 1 and hub.count("PUT", r"^/__lfs/", status="dropped") == 1
    assert_same_bytes(hub.files("alice/dropped"), tree(reference))


def test_a_failed_commit_is_retried_without_uploading_again(hub, client, shards, reference, caplog):
    caplog.set_level(logging.WARNING)
    hub.fail("POST", r"/commit/main$", mode="status", status=500, times=1)
    skhub.push(shards, "alice/commit-retry", create=True, endpoint=hub.url, max_shard_size=SHARD_SIZE, retry_wait=0)
    assert hub.count("POST", r"/commit/main$") == 2
    objects = {sha256(d) for n, d in tree(reference).items() if n.endswith(".safetensors")}
    uploads = [r["path"] for r in hub.requests if r["method"] == "PUT" and r["status"] == 200]
    assert {re.match(r"^/__lfs/([0-9a-f]{64})", p).group(1) for p in uploads} == objects
    assert hub.count("POST", r"^/alice/commit-retry\.git/info/lfs/objects/batch$") == 2
    assert len(uploads) == hub.count("PUT", r"^/__lfs/"), "each object was sent once: the retry skipped them"
    assert "upload attempt 1 of 3 failed" in caplog.text
    assert_same_bytes(hub.files("alice/commit-retry"), tree(reference))


def test_an_upload_that_keeps_failing_says_how_to_resume_and_resumes(hub, client, shards, reference, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    hub.multipart_threshold = None  # one PUT per file
    hub.fail("PUT", r"^/__lfs/", mode="drop", after=2, times=10**6)  # the network dies after two files
    stage = tmp_path / "stage"
    stage.mkdir()
    with pytest.raises(skhub.HubUploadError) as info:
        skhub.push(
            shards,
            "alice/resume",
            create=True,
            endpoint=hub.url,
            max_shard_size=SHARD_SIZE,
            tmp_dir=stage,
            retries=2,
            retry_wait=0,
        )
    message = str(info.value)
    assert "\n" not in message and "failed after 2 attempts" in message
    kept = Path(re.search(r"the merged model is kept in (\S+);", message).group(1))
    assert f"resume with: shardkit push {kept} alice/resume" in message
    assert kept.is_dir() and kept.parent.parent == stage
    assert set(hub.files("alice/resume")) == {".gitattributes"}, "nothing was committed"
    objects = {sha256(d) for n, d in tree(reference).items() if n.endswith(".safetensors")}
    stored = objects & set(hub.lfs)
    assert len(stored) == 2 and len(objects) == 5

    hub.clear_faults()
    sent = hub.count("PUT", r"^/__lfs/", status=200)
    result = skhub.push(kept, "alice/resume", endpoint=hub.url)
    assert hub.count("PUT", r"^/__lfs/", status=200) - sent == len(objects) - 2, "only the missing files are sent"
    got = hub.files("alice/resume")
    assert_same_bytes(got, tree(reference))
    assert "tp 2, pp 3, qkv gqa" in got["README.md"].decode()
    assert not result["merged"] and not result["model_card"]  # the kept folder already holds both
    assert TOKEN not in caplog.text and TOKEN not in message
    shutil.rmtree(kept.parent)


def test_cli_merge_push_to_and_push_errors_never_show_the_token(hub, shards, reference, tmp_path):
    dst = tmp_path / "merged"
    result = run_cli(
        "-v",
        "merge",
        shards,
        dst,
        "--max-shard-size",
        SHARD_SIZE,
        "--push-to",
        "alice/cli-merged",
        "--create",
        "--private",
        "--json",
        hub=hub,
        home=tmp_path / "h",
    )
    assert result.returncode == 0, result.stderr
    assert TOKEN not in result.stdout and TOKEN not in result.stderr
    report = json.loads(result.stdout)
    assert report["push"]["repo_id"] == "alice/cli-merged" and report["push"]["model_card"]
    got = hub.files("alice/cli-merged")
    assert_same_bytes(got, tree(dst))
    assert_same_bytes(got, tree(reference))
    assert not (dst / "README.md").exists()
    card = got["README.md"].decode()
    assert "tp 2, pp 3, qkv gqa" in card and "| Tensors | 30 |" in card
    assert "--push-to alice/cli-merged --create --private --json`" in card
    assert hub.repos["alice/cli-merged"].private
    assert any(r["authorization"] == f"Bearer {TOKEN}" for r in hub.requests)

    missing = run_cli("-q", "push", shards, "alice/absent", hub=hub, home=tmp_path / "h")
    one_line_error(missing, "the Hub has no model repo alice/absent", "pass --create")
    bad = run_cli("-q", "push", shards, "alice/cli-merged", hub=hub, home=tmp_path / "h", token=BAD_TOKEN)
    one_line_error(bad, "rejected your token")
    for run in (missing, bad):
        assert TOKEN not in run.stdout + run.stderr and BAD_TOKEN not in run.stdout + run.stderr


def test_cli_push_of_shards_converted_from_the_hub_records_the_base_model(hub, served, tmp_path):
    hub.add_repo(REPO, served)
    home = tmp_path / "h"
    converted = run_cli("-q", "convert", REPO, tmp_path / "tp2", "--tp", "2", hub=hub, home=home)
    assert converted.returncode == 0, converted.stderr
    pushed = run_cli(
        "push", tmp_path / "tp2", "alice/from-hub", "--create", "--commit-message", "tp2 round trip", hub=hub, home=home
    )
    assert pushed.returncode == 0, pushed.stderr
    assert pushed.stdout.startswith("pushed to alice/from-hub (main): ") and "model card generated" in pushed.stdout
    card = hub.files("alice/from-hub")["README.md"].decode()
    assert "base_model: shardkit-test/tiny-llama" in card
    assert f"`shardkit -q convert {REPO} {tmp_path / 'tp2'} --tp 2`" in card
    assert "tp 2, pp 1, qkv separate" in card
    assert TOKEN not in pushed.stdout + pushed.stderr


def test_merge_options_need_push_to():
    from click.testing import CliRunner

    from shardkit.cli import cli

    result = CliRunner().invoke(cli, ["-q", "merge", "a", "b", "--create"])
    assert result.exit_code == 2 and "only apply with --push-to" in result.stderr


# ---- missing local paths ---------------------------------------------------------------------------


def test_a_missing_path_beside_a_local_folder_is_never_looked_up_on_the_hub(tiny_model, tmp_path, monkeypatch):
    """`runs/llama70b-tp16pp2` looks like a repo id, but `runs/` is a folder here: every command
    says at once that it does not exist, as for ./x, ../x, /x and ~/x, and never calls the Hub."""
    import socket

    from click.testing import CliRunner

    from shardkit.cli import cli

    def no_hub(*args, **kwargs):
        raise AssertionError("the Hub was called")

    monkeypatch.setattr(socket.socket, "connect", no_hub)
    monkeypatch.setattr("shardkit.hub.download._download", no_hub)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    model = str(tiny_model("llama-mha"))
    where = "runs/llama70b-tp16pp2"
    for args in (
        ["convert", where, "out", "--tp", "2"],
        ["merge", where, "out"],
        ["reshard", where, "out"],
        ["inspect", where],
        ["verify", where, model],
        ["verify", model, where],
        ["merge", where, "out", "--push-to", "me/model"],
    ):
        result = CliRunner().invoke(cli, ["-q", *args])
        assert result.exit_code == 2, (args, result.output)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and f"{where} does not exist" in lines[0] and "runs/ is a local folder" in lines[0]
    with pytest.raises(shardkit.FormatError, match=f"{where} does not exist"):
        shardkit.api.open_source(where)
    assert not (tmp_path / "out").exists()
    assert skhub.download.missing_local_path("some-org/some-model") is None  # no such folder here: a repo id


# ---- side files linked out of a source -------------------------------------------------------------


def test_merge_push_to_never_publishes_a_file_the_shards_link_to_outside(hub, shards, served, tmp_path):
    """`merge --push-to` of shards whose tokenizer.json links to a secret outside them is refused
    in one line, before the merge writes or the Hub receives anything (plain `push` already
    refused the same folder); files of a Hub cache snapshot, links into its blobs, still copy."""
    src = tmp_path / "shards"
    shutil.copytree(shards, src)
    secret = tmp_path / "id_rsa"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY----- secret\n")
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to(secret)
    home = tmp_path / "h"
    result = run_cli("-q", "merge", src, tmp_path / "merged", "--push-to", "alice/leak", "--create", hub=hub, home=home)
    one_line_error(result, "tokenizer.json", "outside")
    assert "alice/leak" not in hub.repos and not (tmp_path / "merged").exists()
    assert not any(b"secret" in data for repo in hub.repos for data in hub.files(repo).values())

    hub.add_repo(REPO, served)
    result = run_cli("-q", "convert", REPO, tmp_path / "tp2", "--tp", "2", hub=hub, home=home)
    assert result.returncode == 0, result.stderr
    copied = tmp_path / "tp2" / "tokenizer.json"
    assert not copied.is_symlink() and copied.read_bytes() == (served / "tokenizer.json").read_bytes()
