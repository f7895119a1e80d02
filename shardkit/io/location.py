"""The one parser of every location a user gives: a local path, or `s3://bucket/prefix`.

Every command, the Python API and the trainer pass each path they are given through
`parse_location`, so a URL is never taken for a relative local path (`s3://b/x` once created a
folder named `s3:`), and a scheme shardkit has no backend for (`gs://`, `http://`, `hf://`...)
is refused in one line instead.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import ShardkitError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
"""A URL's scheme. A Windows drive (`C:\\x`) or a Hub repo id (`org/name`) has none."""

SUPPORTED = ("s3",)
# bucket names as S3 allows them (3-63 characters; dots allowed for older buckets)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,62}$")


class LocationError(ShardkitError):
    """A location that is not a local path nor a supported object-store URL."""


@dataclass(frozen=True)
class RemoteLocation:
    """`s3://bucket/prefix`: a "folder" of an object store, i.e. every key under `prefix/`."""

    scheme: str
    bucket: str
    prefix: str  # without leading or trailing "/"; "" for the whole bucket

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}" if self.prefix else f"{self.scheme}://{self.bucket}"

    def key(self, name: str) -> str:
        """The object key of `name` (a relative POSIX name) inside this location."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def child(self, name: str) -> RemoteLocation:
        return RemoteLocation(self.scheme, self.bucket, self.key(name.strip("/")))

    @property
    def name(self) -> str:
        """The last part of the prefix (a tag's name, a folder's name)."""
        return PurePosixPath(self.prefix).name

    @property
    def parent(self) -> RemoteLocation:
        return RemoteLocation(self.scheme, self.bucket, str(PurePosixPath(self.prefix).parent).lstrip("."))

    def contains(self, other: RemoteLocation) -> bool:
        """`other` is this location or inside it (same bucket, prefix within ours)."""
        if (self.scheme, self.bucket) != (other.scheme, other.bucket):
            return False
        return not self.prefix or other.prefix == self.prefix or other.prefix.startswith(self.prefix + "/")

    def overlaps(self, other: RemoteLocation) -> bool:
        return self.contains(other) or other.contains(self)


Location = Path | RemoteLocation


def is_url(text: object) -> bool:
    """Whether `text` has a URL scheme (supported or not): it is never a local path."""
    return isinstance(text, str) and _SCHEME.match(text) is not None


def parse_location(text: str | os.PathLike[str] | RemoteLocation, what: str = "path") -> Location:
    """A local Path, or a RemoteLocation for `s3://bucket[/prefix]`; LocationError (one line)
    for any other scheme or a malformed URL. `what` names the argument in the message."""
    if isinstance(text, RemoteLocation):
        return text
    if isinstance(text, os.PathLike):
        return Path(text)
    match = _SCHEME.match(text)
    if match is None:
        return Path(text)
    scheme = match.group(1).lower()
    if scheme not in SUPPORTED:
        raise LocationError(
            f"{what} {text!r}: {scheme}:// is not supported; give a local path or s3://bucket/prefix "
            "(S3-compatible stores through AWS_ENDPOINT_URL)"
        )
    rest = text[match.end() :]
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not _BUCKET.match(bucket):
        raise LocationError(f"{what} {text!r} does not name a valid S3 bucket: give s3://bucket/prefix")
    parts = prefix.split("/") if prefix else []
    if any(p in ("", ".", "..") for p in parts) or "\x00" in prefix:
        raise LocationError(f"{what} {text!r}: empty, '.' or '..' parts are not allowed in an S3 prefix")
    try:
        prefix.encode("utf-8")
    except UnicodeEncodeError:  # bytes of a name that is not UTF-8 (os.fsdecode's surrogates)
        raise LocationError(
            f"{what} {text!r} is not valid UTF-8, and S3 keys are UTF-8: give the prefix in UTF-8"
        ) from None
    return RemoteLocation(scheme, bucket, prefix)


def remote(text: object, what: str = "path") -> RemoteLocation | None:
    """The RemoteLocation `text` names, None for a local path (other schemes refused)."""
    if isinstance(text, RemoteLocation):
        return text
    if not isinstance(text, (str, os.PathLike)):
        return None
    parsed = parse_location(text, what)
    return parsed if isinstance(parsed, RemoteLocation) else None


def as_local(text: str | os.PathLike[str], what: str = "path") -> Path:
    """`text` as a local Path; LocationError for a URL (a place that takes local paths only)."""
    parsed = parse_location(text, what)
    if isinstance(parsed, RemoteLocation):
        raise LocationError(f"{what} {text!r}: only a local path is accepted here, not an {parsed.scheme}:// URL")
    return parsed
