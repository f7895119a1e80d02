"""The checkpoint tree on disk: markers, durable writes, listing, ordering, retention, deletion,
and the lock that keeps one writer per checkpoint directory.

Nothing here knows about tensors. See base.py for the protocol these functions keep.

Safety rules kept here:
- Nothing is ever deleted *through* a symlink: a tag that is a link is removed by unlinking the
  link (its target is left as it was); links inside a tag are unlinked, never followed.
- A tag whose manifest (shardkit.json) is unreadable or malformed is *damaged*; a complete tag
  without the files of a checkpoint (`tag_problem`: only a `done` marker, a missing or short rank
  file, a name that is no tag's) *cannot be loaded*. Both are listed as such, never loaded as "the
  latest", never counted or removed by retention (a person decides).
- Saves, retention and prune hold `<dir>/.shardkit.lock` (an flock, released when the holder
  finishes or dies); a second writer gets a one-line error naming the holder.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import unicodedata
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from ..errors import ShardkitError
from ..formats import MANIFEST, hf, nxd
from ..formats.source_check import HashCheck
from ..io.data.digest import FAST, NONE, CheckMode, check_mode, has_digest
from ..io.safety.delete import is_link, refuse_mounts
from ..io.safety.lock import FolderLock, lock_folder
from ..io.safety.small import SmallFileError, read_json
from ..io.safety.transaction import MarkedFolder, dead_owner, refuse_link
from ..io.store import Store
from ..layout import Layout
from ..paths import UnsafePathError, inside
from .base import (
    FORMATS,
    CheckpointError,
    CheckpointLockedError,
    UnsafeTagError,
    check_retention,
)

log = logging.getLogger(__name__)

CHECKPOINT_MARKER = nxd.TAG_MARKER
DONE_MARKER = "done"
CONFIG = "config.json"
SCHEDULER = "scheduler.pt"
USER_CONTENT = "user_content.pt"
MODEL_DIR = "model"
OPTIM_DIR = "optim"

_STEP_RE = re.compile(r"step[=_\-]?(\d+)", re.IGNORECASE)
_LAST_INT_RE = re.compile(r"(\d+)(?!.*\d)")


NAME_MAX = 255
"""Bytes of a folder name (Linux's NAME_MAX): a longer tag cannot be created."""

_HIDDEN = ("Cc", "Cf", "Cs", "Zl", "Zp")
"""Unicode categories a tag name never holds: control and format characters (a newline, an escape
sequence, a right-to-left override), undecodable bytes, line and paragraph separators."""


def tag_name_problem(tag: str) -> str | None:
    """Why `tag` is not a plain folder name of a checkpoint directory (None: it is). The one rule
    for every name given to save, load, prune and the CLI's --tag, and for the tags listed."""
    text = str(tag)
    odd = next((c for c in text if unicodedata.category(c) in _HIDDEN), None)
    if not text or text in (".", ".."):
        return "it is empty or a dot" if text in ("", ".") else "'..' climbs out of the checkpoint directory"
    if odd is not None:
        return f"it holds the control character {ascii(odd)[1:-1]}"
    if PurePosixPath(text).is_absolute() or PureWindowsPath(text).is_absolute() or PureWindowsPath(text).drive:
        return "it is an absolute path"
    if ".." in text.replace("\\", "/").split("/"):
        return "'..' climbs out of the checkpoint directory"
    if "/" in text or "\\" in text:
        return "it holds a path separator"
    if text.startswith("."):
        return "names starting with '.' are not tags"
    if text.startswith("-"):
        return "a name starting with '-' reads as an option to shell tools"
    if text != text.strip():
        return "it starts or ends with a space"
    if len(os.fsencode(text)) > NAME_MAX:
        return f"it is longer than {NAME_MAX} bytes"
    return None


def shown_tag(tag: str) -> str:
    """A tag (or a file name) as printed on one line: itself, or quoted with escapes when it holds
    what a terminal would not show as it is (a newline, an escape sequence)."""
    return tag if tag.isprintable() else ascii(tag)


def check_tag_name(tag: str, directory: str | Path | None = None) -> str:
    """A tag must be a plain folder name (UnsafeTagError otherwise, saying why)."""
    why = tag_name_problem(tag)
    if why:
        where = f" inside {directory}" if directory is not None else ""
        raise UnsafeTagError(f"tag {str(tag)!r} is not a plain folder name{where} ({why}): use e.g. step_1000")
    return str(tag)


def tag_path(directory: str | Path, tag: str) -> Path:
    """`<directory>/<tag>` for a tag name given by a user or read from data: a plain folder name
    that resolves inside `directory` (shardkit.paths.inside), else UnsafeTagError. A tag that is
    itself a symlink is returned as it is: read through, but never written or deleted through
    (see remove_tag, which unlinks the link)."""
    root = Path(directory)
    text = check_tag_name(tag, root)
    if is_link(root / text):
        return root / text
    try:
        return inside(root, text, "checkpoint tag")
    except UnsafePathError as e:
        raise UnsafeTagError(str(e)) from None


# ---- listing -------------------------------------------------------------------------------------


def tag_step(tag: str) -> int | None:
    """The step in a tag name: step_120, epoch=1-step=120, global_step120, or a bare number."""
    m = _STEP_RE.search(tag) or _LAST_INT_RE.search(tag)
    return int(m.group(1)) if m else None


def read_manifest(tag_dir: Path) -> dict[str, Any] | None:
    """The tag's manifest when it is present and well-formed, else None (see check_manifest)."""
    return check_manifest(tag_dir)[0]


TAG_REMEDY = "restore it or use another tag (--tag)"


def tag_check(tag_dir: Path, verify_hashes: bool | str | CheckMode = True, store: Store | None = None) -> HashCheck:
    """The check of a tag an operation reads (`ckpt reshard`, `ckpt export`): its listed files
    against their digests, hashed by a thread while the operation reads them, and every file of
    the tag held to what it was now. `finish()` (before the output is committed) refuses a tag
    pruned, rewritten or damaged meanwhile: a flipped bit listed with its digest never becomes a
    clean-looking new checkpoint."""
    mode = check_mode(verify_hashes)
    manifest = read_manifest(tag_dir) if mode is not NONE else None
    store = store if store is not None else Store(tag_dir)
    check = HashCheck(tag_dir, manifest, store, FAST if mode is NONE else mode, remedy=TAG_REMEDY, whole_folder=True)
    return check.start(background=True)


def check_manifest(tag_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) for a well-formed shardkit.json; (None, None) when there is none (an NxD
    tag); (None, what is wrong) when it is unreadable, not a regular file, too large, not JSON or
    malformed (a damaged tag). Read with the bounded reader: a FIFO there never hangs a listing."""
    path = Path(tag_dir) / MANIFEST
    if not os.path.lexists(path):
        return None, None
    try:
        data = read_json(path, MANIFEST)
    except SmallFileError as e:
        reason = str(e).replace(f"{MANIFEST} {path} ", "", 1)
        return None, f"{MANIFEST} {reason}"
    problem = manifest_problem(data)
    return (None, problem) if problem else (data, None)


def _file_problem(tag_dir: Path, name: str, size: int | None = None, listed: str = "") -> str | None:
    """Why `name` is not a file of the tag (None: it is): missing, leading outside the tag, not a
    regular file, empty, or (with `size`) not of that size. Only stat is used: nothing is read, so
    a FIFO never hangs a listing and an object store's mirror fetches nothing."""
    try:
        st = os.stat(inside(tag_dir, name, f"file {name!r}{listed}"))
    except UnsafePathError as e:
        return str(e)
    except OSError:
        return f"{name} is missing{listed}"
    if not stat.S_ISREG(st.st_mode):
        return f"{name} is not a regular file{listed}"
    if size is None and st.st_size == 0:
        return f"{name} is empty (0 bytes)"
    if size is not None and st.st_size != size:
        return f"{name} has {st.st_size} bytes, {MANIFEST} says {size} (truncated or replaced)"
    return None


def files_problem(tag_dir: Path, manifest: dict[str, Any]) -> str | None:
    """The cheap check of a tag's files against its manifest: each listed file is there, inside
    the tag, a regular file with the listed size (None when all are). Hashes are checked where
    the files are read."""
    for entry in manifest.get("files", []):
        problem = _file_problem(tag_dir, entry["path"], entry["size"], f" (listed in {MANIFEST})")
        if problem:
            return problem
    return None


def _optim_name(dp: int, ep: int | None, tp: int, pp: int) -> str:
    """NxD's optimizer file of a rank (`zero1.optim_name`; named here, which zero1 imports)."""
    mid = f"ep_rank_{ep:02d}_" if ep is not None else ""
    return f"{OPTIM_DIR}/dp_rank_{dp:02d}_{mid}tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"


def _expected_files(manifest: dict[str, Any]) -> Iterator[str]:
    """The files a tag whose manifest is sound must list: the model file of every rank of its
    layout (with xser's `.info.pt`), and when it says an optimizer was saved, the optimizer file
    of every rank (of every dp rank with ZeRO-1; NxD's zero1-dcp layout: `optim/.metadata`).
    Named one at a time: a crafted layout of a billion ranks is caught at its first gap."""
    section = manifest.get("checkpoint") or {}
    if section.get("generic"):
        yield f"{MODEL_DIR}/dp_rank_00_tp_rank_00_pp_rank_00.pt"
        return
    fmt = manifest["format"]
    if fmt not in FORMATS:
        return
    layout = Layout.from_dict(manifest["layout"])
    dp: int = section["dp"] if section.get("zero1") is True and _whole_number(section.get("dp")) else 1
    optimizer = section.get("nxd_mode") != "zero1-dcp" and bool(section.get("optimizer"))
    if section.get("nxd_mode") == "zero1-dcp":
        yield f"{OPTIM_DIR}/.metadata"
    for ep, tp, pp in layout.ranks():
        model = nxd.rank_file_name(ep, tp, pp, layout, fmt)
        yield model
        if fmt == "xser":
            yield model + ".info.pt"
        for d in range(max(1, dp)) if optimizer else ():
            yield _optim_name(d, ep if layout.ep > 1 else None, tp, pp)


_RANK_FILE = re.compile(r"^dp_rank_(\d+)_(?:ep_rank_(\d+)_)?tp_rank_(\d+)_pp_rank_(\d+)(\.pt|\.safetensors)$")
_V1_FOLDER = re.compile(r"^tp_rank_(\d+)_pp_rank_(\d+)$")
_V1_FILE = "checkpoint.pt"


def _rank_names(folder: Path) -> dict[tuple[int, int, int, int], str]:
    """NxD rank files in `folder` by (dp, ep, tp, pp), from their names alone (v1's
    `tp_rank_XX_pp_rank_YY/checkpoint.pt` as (0, 0, tp, pp))."""
    try:
        with os.scandir(folder) as entries:
            names = [e.name for e in entries]
    except OSError:
        return {}
    found = {}
    for name in names:
        if m := _RANK_FILE.match(name):
            found[(int(m[1]), int(m[2] or 0), int(m[3]), int(m[4]))] = name
        elif m := _V1_FOLDER.match(name):
            found.setdefault((0, 0, int(m[1]), int(m[2])), f"{name}/{_V1_FILE}")
    return found


def nxd_problem(tag_dir: Path) -> str | None:
    """Why a tag without a manifest (NxD's own) lacks the files its layout implies (None: it has
    them). The layout is read off the file names: the model files' and the optimizer files' tp,
    pp and ep ranks together; every rank's model file must be there, non-empty (with its
    `.info.pt` when the tag is xser), and every dp rank's optimizer file of every rank when the
    tag has optimizer files."""
    model = _rank_names(tag_dir / MODEL_DIR)
    where = MODEL_DIR + "/"
    if not model:  # older trees keep the rank files beside the markers
        model, where = _rank_names(tag_dir), ""
    model = {k: v for k, v in model.items() if k[0] == 0}
    if not model:
        return f"no model files ({MODEL_DIR}/dp_rank_00_tp_rank_00_pp_rank_00.pt, ...): the save did not finish"
    optim = _rank_names(tag_dir / OPTIM_DIR)
    keys = {k[1:] for k in model} | {k[1:] for k in optim}
    ep, tp, pp = (max(k[i] for k in keys) + 1 for i in range(3))
    v3 = any("ep_rank_" in name for name in model.values())
    v1 = all(name.endswith("/" + _V1_FILE) for name in model.values())
    suffix = next(iter(model.values())).rsplit(".", 1)[1]
    xser = any(os.path.lexists(tag_dir / f"{where}{name}.info.pt") for name in model.values())
    said = f"the rank files say tp {tp}, pp {pp}" + (f", ep {ep}" if ep > 1 else "")
    for e, t, p in ((e, t, p) for e in range(ep) for t in range(tp) for p in range(pp)):
        mid = f"ep_rank_{e:02d}_" if v3 else ""
        named = (
            f"tp_rank_{t:02d}_pp_rank_{p:02d}/{_V1_FILE}" if v1 else f"dp_rank_00_{mid}tp_rank_{t:02d}_pp_rank_{p:02d}"
        )
        name = model.get((0, e, t, p), named if v1 else f"{named}.{suffix}")
        for rel in [where + name] + ([f"{where}{name}.info.pt"] if xser else []):
            problem = _file_problem(tag_dir, rel)
            if problem:
                return f"{problem} ({said})"
    dp = max((k[0] for k in optim), default=-1) + 1
    for d, e, t, p in ((d, e, t, p) for d in range(dp) for e in range(ep) for t in range(tp) for p in range(pp)):
        found = optim.get((d, e, t, p))
        rel = f"{OPTIM_DIR}/{found}" if found else _optim_name(d, e if ep > 1 else None, t, p)
        problem = _file_problem(tag_dir, rel)
        if problem:
            return f"{problem} ({said}, dp {dp})"
    return None


def tag_problem(tag_dir: Path) -> tuple[dict[str, Any] | None, str | None, bool]:
    """(manifest, why the tag cannot be loaded, whether that is its files or name rather than a
    malformed manifest) for a tag whose `done` marker exists: THE rule of "loadable" that listing,
    `latest`, retention, prune, resuming and loading a tag by name all follow. A tag is loadable
    when its name is a plain tag name, its manifest (if any) is sound, and its structure is there:
    every file the manifest lists with its size, and the files of the layout it names
    (`_expected_files`); without a manifest, the rank files its file names imply (`nxd_problem`).
    Nothing is read but the manifest."""
    tag_dir = Path(tag_dir)
    manifest, problem = check_manifest(tag_dir)
    if problem is not None:
        return None, problem, False
    why = tag_name_problem(tag_dir.name)
    if why is not None:
        return manifest, f"its name is not a plain tag name ({why})", True
    if manifest is None:
        return None, nxd_problem(tag_dir), True
    problem = files_problem(tag_dir, manifest)
    if problem is None:
        listed = {entry["path"] for entry in manifest["files"]}
        missing = next((name for name in _expected_files(manifest) if name not in listed), None)
        if missing:
            problem = f"{missing} is not listed in {MANIFEST} (a checkpoint of its layout has it)"
    return manifest, problem, True


def _whole_number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def manifest_problem(data: Any) -> str | None:
    """What is wrong with a parsed shardkit.json (None: every field loading relies on is sound)."""
    if not isinstance(data, dict):
        return f"{MANIFEST} is a JSON {type(data).__name__}, not an object"
    for key, kind in (("format", str), ("layout", dict), ("files", list)):
        if key not in data:
            return f"{MANIFEST} lacks {key!r}"
        if not isinstance(data[key], kind):
            return f"{MANIFEST} field {key!r} is a {type(data[key]).__name__}, not a {kind.__name__}"
    try:
        Layout.from_dict(data["layout"])
    except Exception as e:  # noqa: BLE001 - any failure is a malformed layout
        return f"{MANIFEST} layout is invalid ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    for entry in data["files"]:
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("path"), str)
            and _whole_number(entry.get("size"))
            and has_digest(entry)
        ):
            return f"{MANIFEST} lists a file entry {str(entry)[:80]!r} without a path, size and digest"
        if any(unicodedata.category(c) in _HIDDEN for c in entry["path"]):
            return f"{MANIFEST} lists a file name with a control character ({ascii(entry['path'])[:80]})"
    info = data.get("checkpoint")
    if info is None:
        return None
    if not isinstance(info, dict):
        return f"{MANIFEST} field 'checkpoint' is a {type(info).__name__}, not an object"
    step = info.get("step")
    if step is not None and not _whole_number(step):
        return f"{MANIFEST} step {step!r} is not a whole number"
    optim = info.get("optimizer")
    if optim is not None and not (
        isinstance(optim, dict)
        and optim.get("format") == "nxd-zero1"
        and isinstance(optim.get("param_groups") or [], list)
    ):
        return f"{MANIFEST} optimizer section is malformed (format nxd-zero1, param_groups)"
    return None


def is_complete(tag_dir: Path) -> bool:
    return (Path(tag_dir) / DONE_MARKER).is_file()


@dataclass
class CheckpointInfo:
    """One tag of a checkpoint directory."""

    tag: str
    path: Path
    complete: bool
    step: int | None
    layout: dict[str, Any] | None  # the saved layout (manifest), or tp/pp/ep seen in file names
    format: str | None
    size: int  # bytes of every file under the tag
    mtime: float  # of the `checkpoint` marker (when the save began)
    manifest: bool = False  # True when written by shardkit (shardkit.json present)
    files: int = 0
    problem: str | None = None  # why the tag cannot be loaded (tag_problem), or why its manifest is damaged
    link: bool = False  # the tag is a symlink (removing it unlinks the link, never its target)
    abandoned: int | None = None  # incomplete, and its writer (this pid, on this host) no longer runs
    dp: int | None = None  # optimizer files per (ep, tp, pp) rank: ZeRO-1's dp shards (None: no optimizer seen)
    zero1: bool | None = None  # the manifest's word on ZeRO-1 (NxD tags: dp > 1)
    unloadable: bool = False  # the problem is the tag's files or name, not a malformed manifest

    @property
    def damaged(self) -> bool:
        """Its manifest is malformed, or (complete) it lacks files: never loaded, counted or pruned."""
        return self.problem is not None

    @property
    def loadable(self) -> bool:
        """Complete, and its structure is there (tag_problem): a candidate for "the latest checkpoint"."""
        return self.complete and self.problem is None

    @property
    def verdict(self) -> str:
        """Why it is not loadable, in a few words: "is damaged: ..." or "cannot be loaded: ..."."""
        return f"{'cannot be loaded' if self.unloadable else 'is damaged'}: {self.problem}"

    @property
    def state(self) -> str:
        """complete, INCOMPLETE, DAMAGED (a malformed manifest) or UNLOADABLE (files or name)."""
        if self.problem is not None and (self.complete or self.unloadable):
            return "UNLOADABLE" if self.unloadable else "DAMAGED"
        return "complete" if self.complete else "INCOMPLETE"

    @property
    def layout_text(self) -> str:
        """The whole layout in a few words: `ep2 tp2 pp2 vpp2 kv2 gqa dp4 ZeRO-1`."""
        if not self.layout:
            return "-"
        text = f"tp{self.layout.get('tp', 1)} pp{self.layout.get('pp', 1)}"
        if self.layout.get("ep", 1) > 1:
            text = f"ep{self.layout['ep']} " + text
        if self.layout.get("vpp", 1) > 1:
            text += f" vpp{self.layout['vpp']}"
        if self.layout.get("kv_multiplier", 1) > 1:
            text += f" kv{self.layout['kv_multiplier']}"
        if self.layout.get("qkv") and self.layout.get("qkv") != "separate":
            text += f" {self.layout['qkv']}"
        if self.dp is not None:
            text += f" dp{self.dp}" + (" ZeRO-1" if self.zero1 and self.dp > 1 else "")
        return text

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["path"] = str(self.path)
        data["damaged"] = self.damaged
        data["loadable"] = self.loadable
        return data


def _tree_size(path: Path) -> tuple[int, int]:
    size = count = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                size += os.stat(os.path.join(folder, name)).st_size
                count += 1
            except OSError:
                pass  # removed meanwhile
    return size, count


def _info(tag_dir: Path, details: bool = True) -> CheckpointInfo:
    complete = is_complete(tag_dir)
    if complete:
        manifest, problem, unloadable = tag_problem(tag_dir)
    else:  # never loaded: only a malformed manifest or a name that is no tag's is said
        manifest, problem = check_manifest(tag_dir)
        why = tag_name_problem(tag_dir.name)
        unloadable = problem is None and why is not None
        if unloadable:
            problem = f"its name is not a plain tag name ({why})"
    marker = tag_dir / CHECKPOINT_MARKER
    try:
        mtime = (marker if marker.is_file() else tag_dir).stat().st_mtime
    except OSError:
        mtime = 0.0
    step = None
    layout = fmt = None
    dp, zero1 = _optimizer_shards(tag_dir) if details else (None, None)
    if manifest:
        section = manifest.get("checkpoint") or {}
        step = section.get("step")
        layout, fmt = manifest.get("layout"), manifest.get("format")
        if dp is not None and isinstance(section.get("zero1"), bool):
            zero1 = section["zero1"]
    if step is None:
        step = tag_step(tag_dir.name)
    if layout is None and details and problem is None:
        try:
            found = nxd.find_rank_files(tag_dir)
        except Exception:  # noqa: BLE001 - incomplete or damaged: no layout to show
            found = None
        if found is not None:
            layout, fmt = {"tp": found.tp, "pp": found.pp, "ep": found.ep}, found.format
    size, count = _tree_size(tag_dir) if details else (0, 0)
    return CheckpointInfo(
        tag_dir.name,
        tag_dir,
        complete,
        step,
        layout,
        fmt,
        size,
        mtime,
        manifest is not None or problem is not None,
        count,
        problem,
        is_link(tag_dir),
        None if complete else dead_owner(tag_dir),
        dp,
        zero1,
        unloadable,
    )


_OPTIM_DP = re.compile(r"^dp_rank_(\d+)_(?:ep_rank_\d+_)?tp_rank_\d+_pp_rank_\d+\.pt$")


def _optimizer_shards(tag_dir: Path) -> tuple[int | None, bool | None]:
    """(dp shards of the optimizer, ZeRO-1) from a tag's optim/ file names; (None, None) without."""
    try:
        with os.scandir(tag_dir / OPTIM_DIR) as entries:
            ranks = [int(m.group(1)) for e in entries if (m := _OPTIM_DP.match(e.name))]
    except OSError:
        return None, None
    if not ranks:
        return None, None
    dp = max(ranks) + 1
    return dp, dp > 1


def _is_tag(path: Path) -> bool:
    return (
        path.is_dir()
        and not path.name.startswith(".")
        and ((path / CHECKPOINT_MARKER).is_file() or (path / DONE_MARKER).is_file())
    )


def is_tag(path: str | Path) -> bool:
    """A checkpoint tag folder: it has a `checkpoint` or `done` marker."""
    return _is_tag(Path(path))


def is_checkpoint_root(path: str | Path) -> bool:
    """A checkpoint directory (the trainer's --checkpoint-dir): tags below it, and no model of its own."""
    path = Path(path)
    if not path.is_dir() or _is_tag(path) or (path / MANIFEST).is_file() or (path / MODEL_DIR).is_dir():
        return False
    return any(_is_tag(p) for p in path.iterdir())


def model_folder_kind(path: str | Path) -> str | None:
    """What model folder `path` is ("shardkit shards", ...), or None when it is none."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return "shardkit shards"
    try:
        if nxd.find_rank_files(path) is not None:
            return "NxD shards"
        weights = hf.weight_files(path, strict=False)
    except (ShardkitError, OSError):
        return None
    return "a Hugging Face model" if weights or (path / CONFIG).is_file() else None


def list_checkpoints(directory: str | Path, details: bool = True) -> list[CheckpointInfo]:
    """Every tag (complete or not) of a checkpoint directory, oldest first (see base.py, rule 5).
    Without `details`, sizes and the layouts of NxD tags (no manifest) are not looked up."""
    root = Path(directory)
    if not root.is_dir():
        return []
    infos = [_info(p, details) for p in root.iterdir() if _is_tag(p)]
    if all(i.step is not None for i in infos):
        infos.sort(key=lambda i: (i.step, i.mtime, i.tag))
    else:
        infos.sort(key=lambda i: (i.mtime, i.tag))
    return infos


def latest(directory: str | Path) -> str | None:
    """The newest loadable tag (complete, its structure there: `tag_problem`), or None."""
    loadable = [i for i in list_checkpoints(directory, details=False) if i.loadable]
    return loadable[-1].tag if loadable else None


def has_checkpoint(directory: str | Path) -> bool:
    """Whether the directory holds at least one loadable checkpoint."""
    return latest(directory) is not None


# ---- retention -----------------------------------------------------------------------------------


@dataclass
class RetentionPlan:
    """Which tags retention keeps and removes, and why."""

    keep: list[str] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)  # filled by prune (not in dry runs)
    failed: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_retention(
    infos: list[CheckpointInfo], num_kept: int | None, keep_every: int | None, protect: tuple[str, ...] = ()
) -> RetentionPlan:
    """Keep the newest `num_kept` loadable tags and those whose step is a multiple of `keep_every`;
    remove the other loadable tags, the incomplete tags older than the newest loadable one, and the
    incomplete tags whose writer (a process of this host) no longer runs. The newest loadable tag
    and `protect`ed tags are always kept. Complete tags that cannot be loaded (`tag_problem`: a
    malformed manifest, missing or short files, only a `done` marker) and tags whose name is no
    tag's are neither counted nor removed: a person decides; a newer one never costs an older
    loadable tag its place."""
    check_retention(num_kept, keep_every)
    plan = RetentionPlan()
    complete = [i for i in infos if i.loadable]
    newest = complete[-1] if complete else None
    newest_pos = infos.index(newest) if newest is not None else -1
    kept_recent = {i.tag for i in (complete if num_kept in (None, -1) else complete[-num_kept:])}
    for pos, info in enumerate(infos):
        why = _removal(info, pos, newest, newest_pos, kept_recent, num_kept, keep_every, protect)
        if why.startswith("-"):
            plan.remove.append(info.tag)
            why = why[1:]
        else:
            plan.keep.append(info.tag)
            if info.damaged and (info.complete or info.unloadable):  # said by every retention, not only prune's
                log.warning("retention leaves %s alone: it %s (not counted; fix or remove it)", info.path, info.verdict)
        plan.reasons[info.tag] = why
    return plan


def _removal(
    info: CheckpointInfo,
    pos: int,
    newest: CheckpointInfo | None,
    newest_pos: int,
    kept_recent: set[str],
    num_kept: int | None,
    keep_every: int | None,
    protect: tuple[str, ...],
) -> str:
    """Why retention keeps `info`, or "-" + why it removes it."""
    if info.damaged and (info.complete or info.unloadable):
        return f"{info.verdict}: not counted, never removed by retention; fix or remove it"
    if info.complete:
        if info.tag in kept_recent or info is newest:
            return "newest" if info is newest else "recent"
        if keep_every and info.step is not None and info.step % keep_every == 0:
            return f"step multiple of {keep_every}"
        if info.tag in protect:
            return "just saved"
        return f"-beyond the newest {num_kept}"
    if info.tag in protect:
        return "being saved"
    if info.abandoned is not None and not info.link:
        return f"-incomplete, left by a save (process {info.abandoned}) that no longer runs"
    if newest is not None and pos < newest_pos:
        return "-incomplete and older than the newest complete tag (interrupted save or deletion)"
    return "incomplete, newer than the newest complete tag (a save in progress or crashed)"


def tag_folder(tag_dir: Path, fsync: bool = True) -> MarkedFolder:
    """A tag as the I/O core writes and deletes it: complete once `done` exists, recognisable by
    its `checkpoint` marker until the very end of a deletion."""
    return MarkedFolder(Path(tag_dir), DONE_MARKER, CHECKPOINT_MARKER, fsync)


def clear_done(tag_dir: Path, fsync: bool = True) -> bool:
    """Remove a tag's `done` marker durably (the first step of deleting or re-saving it). Through
    a tag that is a symlink nothing is removed (the link's target is not ours)."""
    return tag_folder(tag_dir, fsync).clear_marker()


def remove_tag(tag_dir: Path, fsync: bool = True) -> None:
    """Delete a tag so that an interruption at any point leaves an incomplete tag (or nothing):
    `done` first (durably), then every file, then the `checkpoint` marker, then the folder. A tag
    that is a symlink is removed by unlinking the link (its target is never touched); a tag with a
    mount point inside is refused before anything is deleted (`io.safety.delete`)."""
    tag_dir = Path(tag_dir)
    if is_link(tag_dir):
        log.info(
            "%s is a symlink: removing the link only (its target %s is left untouched)",
            tag_dir,
            os.path.realpath(tag_dir),
        )
    elif os.path.lexists(tag_dir) and not tag_dir.is_dir():
        raise CheckpointError(f"{tag_dir} is a file, not a checkpoint tag folder: move it away or pick another tag")
    tag_folder(tag_dir, fsync).remove()


def apply_retention(directory: Path, plan: RetentionPlan, fsync: bool = True) -> RetentionPlan:
    """Remove `plan.remove`: every `done` marker first, then the tags one by one. A failure is
    recorded in `plan.failed` and logged; the other tags are still removed. The caller holds the
    directory's lock (lock_directory)."""
    directory = Path(directory)
    for tag in plan.remove:
        try:
            path = tag_path(directory, tag)
            if not is_link(path):
                refuse_mounts(path, "remove the checkpoint")  # before its done marker goes
            clear_done(path, fsync)
        except (OSError, ShardkitError) as e:
            plan.failed[tag] = str(e)
    for tag in plan.remove:
        if tag in plan.failed:
            continue
        try:
            remove_tag(tag_path(directory, tag), fsync)
            plan.removed.append(tag)
        except (OSError, ShardkitError) as e:
            plan.failed[tag] = str(e)
    for tag, why in plan.failed.items():
        log.warning("retention could not remove %s: %s (it is retried at the next save)", directory / tag, why)
    if plan.removed:
        log.info("retention removed %s from %s", ", ".join(plan.removed), directory)
    return plan


def prune_checkpoints(
    directory: str | Path,
    num_kept: int | None = None,
    keep_every: int | None = None,
    dry_run: bool = False,
    protect: tuple[str, ...] = (),
    fsync: bool = True,
) -> RetentionPlan:
    """Apply retention to a checkpoint directory now (what `shardkit ckpt prune` runs). Holds the
    directory's lock (CheckpointLockedError while a save or another prune is running)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} does not exist: give the checkpoint directory (the parent of the tags)")
    if dry_run:
        return plan_retention(list_checkpoints(directory, details=False), num_kept, keep_every, protect)
    refuse_link(directory)  # its tags are never deleted through a link to the folder
    with lock_directory(directory, "pruning"):
        plan = plan_retention(list_checkpoints(directory, details=False), num_kept, keep_every, protect)
        return apply_retention(directory, plan, fsync)


# ---- one writer per checkpoint directory -----------------------------------------------------------

DirectoryLock = FolderLock


def lock_directory(directory: str | Path, what: str) -> FolderLock:
    """Take the checkpoint directory's writer lock (`<dir>/.shardkit.lock`, `io.safety.lock`) without
    waiting, or raise CheckpointLockedError naming the holder."""
    return lock_folder(directory, what, error=CheckpointLockedError)
