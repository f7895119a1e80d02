"""The check of a training tag an operation reads (`checkpoint.tree.tag_check`): the engine's one
source check (`formats.source_check.HashCheck`) with the tag's whole folder held. A listed file
that does not match its digest, or any file removed, added or written to since the check was made,
is refused by `finish()`, which every writer from a tag calls before its commit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from safety_helpers import MODEL_FILE, ckpt_of_two

from shardkit.checkpoint.tree import tag_check
from shardkit.errors import FormatError, ShardkitError


@pytest.fixture
def tag(tmp_path) -> Path:
    return ckpt_of_two(tmp_path) / "step_2"


def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_an_untouched_tag_passes(tag):
    tag_check(tag).finish()


def test_a_flipped_bit_is_refused_with_what_to_do(tag):
    flip_a_bit(tag / MODEL_FILE)  # before the check: the tag as opened is damaged
    with pytest.raises(FormatError, match=f"{MODEL_FILE} in {tag} does not match its size and xxh3_128.*another tag"):
        tag_check(tag).finish()
    tag_check(tag, verify_hashes=False).finish()  # unchecked: only changes are refused


@pytest.mark.parametrize("hashes", [True, False])
@pytest.mark.parametrize(
    ("change", "what"),
    [
        (lambda tag: (tag / MODEL_FILE).unlink(), f"{MODEL_FILE} was removed"),
        (lambda tag: (tag / "notes.txt").write_text("x"), "notes.txt appeared"),
        (lambda tag: os.utime(tag / "done", ns=(1, 1)), "done was written to"),
        (lambda tag: (tag / "model" / "link").symlink_to("/etc"), "model/link appeared"),
    ],
    ids=["removed", "added", "written", "link"],
)
def test_a_tag_changed_while_it_is_read_is_refused(tag, change, what, hashes):
    check = tag_check(tag, verify_hashes=hashes)
    change(tag)
    with pytest.raises(FormatError, match=f"{tag} changed while shardkit read it \\({what}"):
        check.finish()


def test_a_listed_name_that_leaves_the_tag_is_one_line(tag):
    manifest = tag / "shardkit.json"
    manifest.write_text(manifest.read_text().replace(f'"{MODEL_FILE}"', '"../../outside.pt"', 1))
    with pytest.raises(ShardkitError, match="outside.pt") as caught:
        tag_check(tag).finish()
    assert "\n" not in str(caught.value)
