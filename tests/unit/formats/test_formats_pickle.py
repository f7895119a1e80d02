"""Never run arbitrary pickle: malicious rank files (NxD, shardkit, xser tensor, main and info files,
an HF pytorch_model.bin) are refused, from the API and the CLI, and their payloads never run."""

from __future__ import annotations

import builtins
import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch
from format_helpers import (
    LAYOUT,
    MODEL,
    _Ref,
    copy_tree,
    load_plain,
    load_refs,
    no_output_left,
    nxd_copy,
    rank_files,
)
from safetensors.torch import load_file

from shardkit import FormatError, Layout, convert, merge, open_checkpoint

# ---- 3. never run arbitrary pickle ---------------------------------------------------------------


class _Payload:
    """Unpickling calls func(arg): what a malicious checkpoint does."""

    def __init__(self, func, arg):
        self.func, self.arg = func, arg

    def __reduce__(self):
        return (self.func, (self.arg,))


def payload(kind: str, marker: Path) -> _Payload:
    if kind == "os.system":
        return _Payload(os.system, f"touch '{marker}'")
    return _Payload(builtins.exec, f"open({str(marker)!r}, 'w').close()")


PAYLOADS = ("os.system", "exec")


@pytest.mark.parametrize("kind", PAYLOADS)
def test_payloads_are_live(kind, tmp_path):
    """Guard against a vacuous test: full pickle really runs these payloads."""
    marker = tmp_path / "canary"
    torch.save({"w": payload(kind, marker)}, tmp_path / "evil.pt")
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()


def _malicious_rank_file(path: Path, kind: str, marker: Path) -> None:
    """Rewrite a torch rank file with one tensor replaced by the payload."""
    sd = load_plain(path)
    first = next(iter(sd))
    sd[first] = payload(kind, marker)
    torch.save(sd, path)


def assert_refused(excinfo, bad_file: Path, marker: Path) -> None:
    message = str(excinfo.value)
    assert "refus" in message.lower(), message
    assert bad_file.name in message, message
    assert "\n" not in message, message
    assert not marker.exists(), "the malicious pickle ran"


@pytest.mark.parametrize("kind", PAYLOADS)
def test_refuses_malicious_nxd_rank_file(kind, torch_shards, tmp_path):
    """(a) A rank file of an NxD directory: open_checkpoint (first rank) and merge (any rank)."""
    marker = tmp_path / "pwned"
    first = nxd_copy(torch_shards, tmp_path / "first")
    bad = rank_files(first)[0]
    _malicious_rank_file(bad, kind, marker)
    with pytest.raises(FormatError) as excinfo:
        open_checkpoint(first)
    assert_refused(excinfo, bad, marker)
    with pytest.raises(FormatError) as excinfo:
        merge(first, tmp_path / "out1")
    assert_refused(excinfo, bad, marker)
    no_output_left(tmp_path / "out1")

    last = nxd_copy(torch_shards, tmp_path / "last")
    bad = rank_files(last)[-1]
    _malicious_rank_file(bad, kind, marker)
    with pytest.raises(FormatError) as excinfo:
        merge(last, tmp_path / "out2")
    assert_refused(excinfo, bad, marker)
    no_output_left(tmp_path / "out2")


@pytest.mark.parametrize("kind", PAYLOADS)
def test_refuses_malicious_rank_file_in_shardkit_dir(kind, torch_shards, tmp_path):
    """(a) A rank file of shardkit's own shards (manifest present): merge and reshard refuse."""
    marker = tmp_path / "pwned"
    shards = copy_tree(torch_shards, tmp_path / "shards")
    bad = rank_files(shards)[-1]
    _malicious_rank_file(bad, kind, marker)
    with pytest.raises(FormatError) as excinfo:
        merge(shards, tmp_path / "out")
    assert_refused(excinfo, bad, marker)
    no_output_left(tmp_path / "out")
    with pytest.raises(FormatError) as excinfo:
        convert(shards, tmp_path / "resharded", Layout(tp=1, pp=1, qkv="gqa"))
    assert_refused(excinfo, bad, marker)
    no_output_left(tmp_path / "resharded")


@pytest.mark.parametrize("kind", PAYLOADS)
@pytest.mark.parametrize("target", ["tensor", "main", "info"])
def test_refuses_malicious_xser_files(kind, target, hand_xser, tmp_path):
    """(b) An xser tensor file, the xser reference file itself, and NxD's .info.pt."""
    marker = tmp_path / "pwned"
    root = copy_tree(hand_xser, tmp_path / "xser")
    main = rank_files(root)[0]  # rank 0 has an .info.pt (even rank files do)
    if target == "tensor":
        bad = sorted(Path(str(main) + ".tensors").iterdir())[0]
        torch.save(payload(kind, marker), bad)
    elif target == "main":
        bad = main  # the reference file: payload first, then the file's tensors (inline)
        resolved = {
            k: (load_plain(Path(str(main) + ".tensors") / f"tensor_{v.tid}.pt") if isinstance(v, _Ref) else v)
            for k, v in load_refs(main).items()
        }
        resolved[next(iter(resolved))] = payload(kind, marker)
        torch.save(resolved, main)
    else:
        bad = Path(str(main) + ".info.pt")
        assert bad.is_file()
        info = load_plain(bad)
        info[next(iter(info))]["dtype"] = payload(kind, marker)
        torch.save(info, bad)
    with pytest.raises(FormatError) as excinfo:
        merge(root, tmp_path / "out")
    assert_refused(excinfo, bad, marker)
    no_output_left(tmp_path / "out")


@pytest.mark.parametrize("kind", PAYLOADS)
def test_refuses_malicious_hf_pytorch_model_bin(kind, tiny_model, tmp_path):
    """(c) The Hugging Face source's pytorch_model.bin: convert refuses (directory and file)."""
    marker = tmp_path / "pwned"
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copyfile(tiny_model(MODEL) / "config.json", hf / "config.json")
    sd = load_file(tiny_model(MODEL) / "model.safetensors")
    sd["model.embed_tokens.weight"] = payload(kind, marker)
    torch.save(sd, hf / "pytorch_model.bin")
    bad = hf / "pytorch_model.bin"
    with pytest.raises(FormatError) as excinfo:
        convert(hf, tmp_path / "out", LAYOUT)
    assert_refused(excinfo, bad, marker)
    no_output_left(tmp_path / "out")
    with pytest.raises(FormatError) as excinfo:
        convert(bad, tmp_path / "out2", LAYOUT)
    assert_refused(excinfo, bad, marker)
    no_output_left(tmp_path / "out2")
    with pytest.raises(FormatError) as excinfo:
        open_checkpoint(hf)
    assert_refused(excinfo, bad, marker)


def test_cli_refuses_malicious_files(torch_shards, tiny_model, tmp_path):
    """The CLI (merge and convert): exit 2, one line naming the refusal, no DST, payload not run."""
    if importlib.util.find_spec("shardkit.cli") is None:
        pytest.skip("the shardkit CLI (shardkit.cli) does not exist yet")
    from click.testing import CliRunner

    from shardkit.cli import cli

    marker = tmp_path / "pwned"
    shards = nxd_copy(torch_shards, tmp_path / "nxd")
    bad_rank = rank_files(shards)[-1]
    _malicious_rank_file(bad_rank, "os.system", marker)
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copyfile(tiny_model(MODEL) / "config.json", hf / "config.json")
    torch.save({"model.embed_tokens.weight": payload("exec", marker)}, hf / "pytorch_model.bin")
    runs = [
        (bad_rank, "merge", shards, tmp_path / "out1"),
        (hf / "pytorch_model.bin", "convert", hf, tmp_path / "out2", "--tp", "2", "--pp", "2", "--qkv", "gqa"),
    ]
    for bad, command, src, dst, *rest in runs:
        result = CliRunner().invoke(cli, ["-q", command, str(src), str(dst), *rest])
        assert result.exit_code == 2, (command, result.exit_code, result.output, result.exception)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, (command, result.stderr)
        assert "refus" in lines[0].lower() and bad.name in lines[0], (command, lines[0])
        assert "Traceback" not in result.stderr
        no_output_left(dst)
        assert not marker.exists(), "the malicious pickle ran"
