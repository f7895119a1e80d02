"""The S3 backend: listing, ranged reads into local files, multipart uploads, deletes.

boto3 is an optional dependency (`pip install 'shardkit[s3]'`), imported on first use. The
client is built from the standard AWS chain (environment, shared config and credentials files,
instance roles) and honours `AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3`, so any S3-compatible
store works. Throttling (SlowDown) and 5xx answers are retried by botocore with jittered
exponential back-off (`SHARDKIT_S3_RETRY_MODE`: adaptive by default, or standard;
`SHARDKIT_S3_MAX_ATTEMPTS`: 10 attempts in all), as NxD's own checkpoint storage does. Every failure becomes one
line naming the location and what to do (a missing bucket, denied access, missing credentials).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ShardkitError
from ...sizes import format_bytes
from ..data.direct import WRITE_BLOCK
from ..location import RemoteLocation

log = logging.getLogger(__name__)

EXTRA = "pip install 'shardkit[s3]'"
GET_CHUNK = 1 << 20
"""A ranged GET's body is read in blocks of this size (bounded memory), each written to the mirror
in writes of at most `io.data.direct.WRITE_BLOCK` (the kernel's copy into the page cache costs several
times as much per byte in larger writes)."""
PART_SIZE = 32 << 20
"""A multipart upload's part (raised for files that would need more than 10,000 parts), and the
largest ranged GET (`io.objects.remote`): large enough that a request's round trip costs little beside
its bytes, small enough that a file of a few hundred MB still moves as many requests at once."""
CONCURRENCY = 16
"""Requests in flight: the GETs of a mirror, the part uploads of an uploader."""


class RemoteError(ShardkitError):
    """The object store refused or failed a request (one line: where, why, what to do)."""


class MissingDependencyError(ShardkitError):
    """boto3 (the `s3` extra) is not installed."""


MAX_OBJECT_SIZE = 1 << 50
"""More than any store holds in one object (S3: 5 TiB; MinIO: 50 TiB): a listing claiming more is
refused before anything is made of it."""


@dataclass(frozen=True)
class ObjectInfo:
    """One object under a location: its name relative to the location, size and ETag; `stored`,
    when not "", the name (under the same location) its bytes are read from (an output's objects
    staged under a sub-prefix while their replace is finished: `io.objects.published`)."""

    name: str
    size: int
    etag: str
    stored: str = ""


def _boto3() -> Any:
    try:
        import boto3
    except ImportError:
        raise MissingDependencyError(f"s3:// locations need boto3, the 's3' extra: {EXTRA}") from None
    return boto3


_CLIENT: Any = None
_CLIENT_LOCK = threading.Lock()
_CLIENT_PID = 0


def client() -> Any:
    """The process's S3 client (thread-safe; one per process, rebuilt after a fork)."""
    global _CLIENT, _CLIENT_PID
    with _CLIENT_LOCK:
        if _CLIENT is None or _CLIENT_PID != os.getpid():
            boto3 = _boto3()
            from botocore.config import Config

            mode = os.environ.get("SHARDKIT_S3_RETRY_MODE", "adaptive")
            if mode not in ("adaptive", "standard", "legacy"):
                raise ShardkitError(f"SHARDKIT_S3_RETRY_MODE={mode!r}: use adaptive or standard")
            attempts_text = os.environ.get("SHARDKIT_S3_MAX_ATTEMPTS", "10")
            if not attempts_text.isdigit() or int(attempts_text) < 1:
                raise ShardkitError(
                    f"SHARDKIT_S3_MAX_ATTEMPTS={attempts_text!r}: give a whole number of attempts, 1 or more"
                )
            attempts = int(attempts_text)
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            config = Config(
                retries={"total_max_attempts": attempts, "mode": mode},  # the first request included
                max_pool_connections=64,
                connect_timeout=10,
                read_timeout=120,
                s3={"addressing_style": "path"} if endpoint else {},
            )
            # botocore says at INFO where it found the credentials ("Found credentials in environment
            # variables."): not a message of shardkit's, nor of a trainer that logs at INFO
            logging.getLogger("botocore.credentials").setLevel(logging.WARNING)
            session = boto3.session.Session()
            _CLIENT = session.client("s3", endpoint_url=endpoint or None, config=config)
            _CLIENT_PID = os.getpid()
        return _CLIENT


def reset_client() -> None:
    """Forget the client (its endpoint or credentials changed: tests, a new environment)."""
    global _CLIENT
    with _CLIENT_LOCK:
        _CLIENT = None


def error(e: BaseException, action: str, where: object) -> ShardkitError:
    """The one-line error for a failed request: `action` (e.g. "list") on `where`."""
    try:
        import botocore.exceptions as bex
    except ImportError:  # pragma: no cover - only reached with botocore installed
        return RemoteError(f"cannot {action} {where}: {e}")
    if isinstance(e, ShardkitError):
        return e
    if isinstance(e, bex.NoCredentialsError | bex.PartialCredentialsError):
        return RemoteError(
            f"cannot {action} {where}: no AWS credentials found; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or run on a host with an instance role"
        )
    if isinstance(e, bex.EndpointConnectionError | bex.ConnectTimeoutError):
        return RemoteError(f"cannot {action} {where}: the S3 endpoint cannot be reached ({e}); check AWS_ENDPOINT_URL")
    if isinstance(e, bex.ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            bucket = getattr(where, "bucket", None) or str(where).partition("://")[2].split("/")[0] or where
            return RemoteError(
                f"cannot {action} {where}: the bucket {bucket} does not exist (create it, or fix the URL)"
            )
        if (
            code in ("AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch")
            or status == 403
        ):
            return RemoteError(
                f"cannot {action} {where}: access denied ({code}); check the credentials and the bucket policy"
            )
        if code in ("NoSuchKey", "404") or status == 404:
            return RemoteError(f"cannot {action} {where}: no such object")
        if code == "PreconditionFailed" or status == 412:
            return RemoteError(f"{where} was replaced while shardkit read it: run the command again")
        return RemoteError(f"cannot {action} {where}: {code or status} {err.get('Message', '')}".rstrip())
    if isinstance(e, bex.BotoCoreError):
        return RemoteError(f"cannot {action} {where}: {e}")
    if isinstance(e, OSError):
        return RemoteError(f"cannot {action} {where}: {e.strerror or e}")
    return RemoteError(f"cannot {action} {where}: {type(e).__name__}: {e}")


@contextlib.contextmanager
def _translated(action: str, where: object) -> Iterator[None]:
    """botocore's exceptions, as one-line RemoteErrors."""
    try:
        yield
    except ShardkitError:
        raise
    except Exception as e:
        raise error(e, action, where) from None


def list_objects(loc: RemoteLocation) -> list[ObjectInfo]:
    """Every object under `loc` (names relative to it), sorted by name. A missing bucket, denied
    access or missing credentials are one-line RemoteErrors; an empty or absent prefix is []."""
    prefix = f"{loc.prefix}/" if loc.prefix else ""
    found: list[ObjectInfo] = []
    with _translated("list", loc):
        pages = client().get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                name = obj["Key"][len(prefix) :]
                if name and not name.endswith("/"):
                    found.append(ObjectInfo(name, _listed_size(obj.get("Size"), loc, name), str(obj.get("ETag", ""))))
    return sorted(found, key=lambda o: o.name)


def _listed_size(size: object, loc: RemoteLocation, name: str) -> int:
    """An object's size as listed, refused (one line naming the object) when no object can have it."""
    try:
        value = int(size)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        value = -1
    if not 0 <= value <= MAX_OBJECT_SIZE or isinstance(size, bool):
        raise RemoteError(
            f"{loc}/{name}: the store lists its size as {size!r} bytes, which no object can have: check the store "
            "(AWS_ENDPOINT_URL) and the object, then run again"
        )
    return value


def check_bucket(loc: RemoteLocation) -> None:
    """Refuse (one line) a bucket that does not exist or cannot be reached, before any work."""
    with _translated("access", loc):
        client().head_bucket(Bucket=loc.bucket)


def get_range(  # noqa: PLR0913
    loc: RemoteLocation, name: str, start: int, length: int, etag: str, fd: int, at: int, size: int | None = None
) -> int:
    """Write `length` bytes of object `name` from `start` into `fd` at `at` (one ranged GET, its
    body streamed in GET_CHUNK blocks); the object must still have `etag` (If-Match), so bytes of
    a replaced object are never mixed with the old one's, and (`size`) the size it was listed
    with. Returns the bytes written."""
    if length <= 0:
        return 0
    args: dict[str, Any] = {"Bucket": loc.bucket, "Key": loc.key(name), "Range": f"bytes={start}-{start + length - 1}"}
    if etag:
        args["IfMatch"] = etag
    where = f"{loc}/{name}"
    with _translated("read", where):
        answer = client().get_object(**args)
        body = answer["Body"]
        total = str(answer.get("ContentRange") or "").rpartition("/")[2]
        if size is not None and total.isdigit() and int(total) != size:
            body.close()
            raise RemoteError(
                f"{where} holds {int(total):,} bytes, not the {size:,} its listing said: it was replaced while "
                "shardkit read it, or the store lists it wrongly: run the command again"
            )
        done = 0
        try:
            while done < length:
                chunk = body.read(min(GET_CHUNK, length - done))
                if not chunk:
                    break
                view, position = memoryview(chunk), at + done
                while view:
                    written = os.pwrite(fd, view[:WRITE_BLOCK], position)
                    view, position = view[written:], position + written
                done += len(chunk)
        finally:
            body.close()
    if done != length:
        raise RemoteError(f"{where}: the object is shorter than listed (got {done} of {length} bytes): run again")
    return done


def head(loc: RemoteLocation) -> ObjectInfo | None:
    """The object `loc` names (its name relative to its parent), or None when there is none."""
    try:
        found = client().head_object(Bucket=loc.bucket, Key=loc.prefix)
    except Exception as e:  # noqa: BLE001 - botocore's errors: a missing key is None, others one line
        code = str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))
        if code in ("404", "NoSuchKey", "NotFound"):
            return None
        raise error(e, "read", loc) from None
    return ObjectInfo(loc.name, int(found["ContentLength"]), str(found.get("ETag", "")))


def get_bytes(loc: RemoteLocation, name: str) -> bytes | None:
    """A small object's bytes, None when it does not exist."""
    import botocore.exceptions as bex

    try:
        return client().get_object(Bucket=loc.bucket, Key=loc.key(name))["Body"].read()
    except bex.ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return None
        raise error(e, "read", f"{loc}/{name}") from None
    except Exception as e:
        raise error(e, "read", f"{loc}/{name}") from None


def put_bytes(loc: RemoteLocation, name: str, data: bytes) -> None:
    """Write a small object in one PUT."""
    with _translated("write", f"{loc}/{name}"):
        client().put_object(Bucket=loc.bucket, Key=loc.key(name), Body=data)


def put_new(loc: RemoteLocation, name: str, data: bytes) -> bool:
    """Write a small object only if none exists by that name (a conditional PUT, If-None-Match:
    *, which S3 decides atomically); False when one does. A store that does not offer conditional
    writes (NotImplemented) gets a plain PUT."""
    import botocore.exceptions as bex

    try:
        client().put_object(Bucket=loc.bucket, Key=loc.key(name), Body=data, IfNoneMatch="*")
        return True
    except bex.ClientError as e:
        err = e.response.get("Error", {})
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if err.get("Code") in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
            return False
        if err.get("Code") == "NotImplemented" or status == 501:
            log.debug("%s does not take conditional writes: %s written unconditionally", loc, name)
            put_bytes(loc, name, data)
            return True
        raise error(e, "write", f"{loc}/{name}") from None
    except Exception as e:
        raise error(e, "write", f"{loc}/{name}") from None


def _part_size(size: int) -> int:
    part = PART_SIZE
    while size > part * 10_000:
        part *= 2
    return part


class _FileSent:
    """The s3transfer subscriber of one queued file: once every byte of it has been sent, its slot
    is freed (and with `remove` the local file deleted), without waiting for the store's answer
    to the last request. A multipart upload ends with CompleteMultipartUpload, which can take
    seconds while the store assembles the object; the next file need not wait for that.

    s3transfer reports a part's bytes only while it sends them (not while botocore reads them
    for checksums or signing) and reports a rewind for a retry as negative progress, so the sum
    reaches the file's size only once every part has opened the file: a part retried after the
    deletion reads from its open descriptor. The name goes at once; the disk blocks go when the
    last part still awaiting its answer closes its descriptor (a request's round trip later)."""

    def __init__(self, path: Path, size: int, slots: threading.BoundedSemaphore, remove: bool):
        self._path, self._size, self._slots, self._remove = path, size, slots, remove
        self._sent = 0
        self._freed = False
        self._lock = threading.Lock()

    def _free(self) -> None:
        with self._lock:
            if self._freed:
                return
            self._freed = True
        if self._remove:  # unlinked before its slot is free, so a writer never finds more names than the bound
            with contextlib.suppress(OSError):
                self._path.unlink()
        self._slots.release()

    def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
        with self._lock:
            self._sent += bytes_transferred
            whole = self._size > 0 and self._sent >= self._size
        if whole:
            self._free()

    def on_done(self, future: Any, **kwargs: Any) -> None:
        self._free()


class Uploader:
    """Uploads local files as objects, several at once: files past one part go up as multipart
    uploads whose parts are read from the file as they are sent (boto3's TransferManager), so
    memory holds a few parts, never a file. At most `files_in_flight` files are being sent; a
    file whose bytes are all sent no longer counts (see `_FileSent`). `wait()` raises the first
    failure."""

    def __init__(self, files_in_flight: int = 4):
        boto3 = _boto3()
        from boto3.s3.transfer import TransferConfig, TransferManager

        self._config = TransferConfig(
            multipart_threshold=PART_SIZE,
            multipart_chunksize=PART_SIZE,
            max_concurrency=CONCURRENCY,
            use_threads=True,
        )
        del boto3
        self._manager = TransferManager(client(), self._config)
        self._slots = threading.BoundedSemaphore(files_in_flight)
        self._in_flight = files_in_flight
        self._futures: list[Any] = []
        self.sent = 0

    def upload(self, path: Path, loc: RemoteLocation, name: str, remove: bool = False) -> None:
        """Queue `path` to become `loc/name` (waiting while `files_in_flight` files are being sent);
        with `remove`, the local file is deleted once all of it is sent. A failed upload is raised here
        already, rather than once every file is written."""
        self._raise_failed()
        size = path.stat().st_size
        if size > self._config.multipart_chunksize * 10_000:
            self._config.multipart_chunksize = _part_size(size)
        self._slots.acquire()
        try:
            sent = _FileSent(path, size, self._slots, remove)
            future = self._manager.upload(str(path), loc.bucket, loc.key(name), subscribers=[sent])
        except BaseException:
            self._slots.release()
            raise
        self._futures.append((future, f"{loc}/{name}", size))

    def _raise_failed(self) -> None:
        for future, where, _ in self._futures:
            if future.done():
                try:
                    future.result()
                except Exception as e:  # noqa: BLE001 - said as one line
                    raise error(e, "upload to", where) from None

    def wait(self) -> int:
        """Wait for every queued upload; raise the first failure as one line. Returns the bytes sent."""
        first: BaseException | None = None
        for future, where, size in self._futures:
            try:
                future.result()
                self.sent += size
            except Exception as e:  # noqa: BLE001 - the first failure is raised below
                if first is None:
                    first = error(e, "upload to", where)
        self._futures.clear()
        # s3transfer marks a transfer done before it runs its done callbacks: wait for those too
        # (each frees its slot last), so that no local file is deleted after `wait` returns
        for _ in range(self._in_flight):
            self._slots.acquire()
        for _ in range(self._in_flight):
            self._slots.release()
        if first is not None:
            raise first
        return self.sent

    def close(self, cancel: bool = False) -> None:
        """Wait for the uploads under way; with `cancel`, cancel them first (their multipart
        uploads aborted). Each future is cancelled itself: `TransferManager.shutdown(cancel=True)`
        passes its arguments to the wrong parameters (s3transfer 0.17: a TypeError)."""
        if cancel:
            for future, _, _ in self._futures:
                future.cancel()
        self._manager.shutdown()


def copy_objects(loc: RemoteLocation, pairs: Iterable[tuple[str, str, int, str]]) -> int:
    """Copy objects inside `loc`'s bucket without moving their bytes through this host (server-side:
    CopyObject, or a multipart copy past PART_SIZE), several at once: each (source name, name,
    size, ETag), the source copied only while it still has that ETag. Returns how many."""
    pairs = list(pairs)
    if not pairs:
        return 0
    from boto3.s3.transfer import TransferConfig, TransferManager

    chunk = _part_size(max(size for _, _, size, _ in pairs))
    config = TransferConfig(multipart_threshold=PART_SIZE, multipart_chunksize=chunk, max_concurrency=CONCURRENCY)
    manager = TransferManager(client(), config)
    futures = []
    ok = False
    try:
        for source, name, _, etag in pairs:
            extra = {"CopySourceIfMatch": etag} if etag else {}
            copy_source = {"Bucket": loc.bucket, "Key": loc.key(source)}
            futures.append((manager.copy(copy_source, loc.bucket, loc.key(name), extra_args=extra), f"{loc}/{name}"))
        for future, where in futures:
            try:
                future.result()
            except Exception as e:  # noqa: BLE001 - said as one line
                raise error(e, "copy to", where) from None
        ok = True
    finally:
        if not ok:
            for future, _ in futures:
                future.cancel()
        manager.shutdown()
    return len(pairs)


def delete_objects(loc: RemoteLocation, names: Iterable[str]) -> int:
    """Delete `names` under `loc` (batches of 1,000); returns how many were asked for."""
    names = list(names)
    with _translated("delete from", loc):
        for i in range(0, len(names), 1000):
            batch = [{"Key": loc.key(n)} for n in names[i : i + 1000]]
            answer = client().delete_objects(Bucket=loc.bucket, Delete={"Objects": batch, "Quiet": True})
            errors = answer.get("Errors") or []
            if errors:
                first = errors[0]
                raise RemoteError(
                    f"cannot delete {loc}/{first.get('Key')}: {first.get('Code')} {first.get('Message', '')}"
                )
    return len(names)


def abort_uploads(loc: RemoteLocation) -> int:
    """Abort the multipart uploads left open under `loc` (a killed writer's: their parts are
    stored, and billed, until aborted, yet no listing shows them). Returns how many."""
    prefix = f"{loc.prefix}/" if loc.prefix else ""
    aborted = 0
    with _translated("abort the unfinished uploads under", loc):
        pages = client().get_paginator("list_multipart_uploads").paginate(Bucket=loc.bucket, Prefix=prefix)
        for page in pages:
            for upload in page.get("Uploads", []):
                client().abort_multipart_upload(Bucket=loc.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                aborted += 1
    return aborted


def describe(objects: Iterable[ObjectInfo]) -> str:
    objs = list(objects)
    return f"{len(objs)} objects, {format_bytes(sum(o.size for o in objs))}"
