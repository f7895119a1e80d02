"""A loopback stand-in for the Hugging Face Hub, for tests of shardkit.hub with the real
huggingface_hub client (2.4). In memory, model repos only, on 127.0.0.1 with a free port.

It implements the endpoints the client calls:

download
  GET  /api/models/{repo}[/revision/{rev}]        model info (sha, siblings, private, gated)
  GET  /api/models/{repo}/tree/{rev}[/{path}]     file listing (recursive, with lfs info)
  HEAD /{repo}/resolve/{rev}/{file}               ETag, X-Repo-Commit, Content-Length (+ X-Linked-*)
  GET  /{repo}/resolve/{rev}/{file}               the bytes (Range supported)
upload
  POST /api/repos/create                          create a repo (409 when it exists)
  POST /api/validate-yaml                         README.md front matter must be valid YAML
  POST /api/models/{repo}/preupload/{rev}         upload mode per file (lfs | regular) + remote oid
  POST /{repo}.git/info/lfs/objects/batch         LFS batch API: basic or multipart actions, or
                                                  none when the object is already stored
  PUT  /__lfs/{oid}, /__lfs/{oid}/part/{n}        LFS transfer (basic, multipart parts)
  POST /__lfs/{oid}/complete, /__lfs/verify       multipart completion, verify
  POST /api/models/{repo}/commit/{rev}            NDJSON commit: header, file (base64), lfsFile,
                                                  deletedFile; ?create_pr=1 opens refs/pr/N
  POST /api/models/{repo}/branch/{branch}         create a branch
  GET  /api/whoami-v2

Auth follows the Hub: an unknown token is 401 everywhere; writes need a write token whose user
(or org) owns the namespace (else 401 without a token, 403 with one); a gated repo's files answer
403/401 with `X-Error-Code: GatedRepo` unless the token was granted; a missing repo is 404 with
`X-Error-Code: RepoNotFound`, a missing revision `RevisionNotFound`. Xet is never advertised
(no X-Xet-* headers, no xet transfer), so the client must run with HF_HUB_DISABLE_XET=1 to upload.

`fail(...)` injects failures (drop the connection half-way through the request body, or answer
an HTTP status) on matching requests, to test retries and resuming.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import struct
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".model", ".msgpack", ".h5", ".onnx", ".gguf", ".ckpt")
LFS_THRESHOLD = 10 * 2**20
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def is_lfs(path: str, size: int, sample: bytes = b"") -> bool:
    return path.endswith(LFS_SUFFIXES) or size >= LFS_THRESHOLD or b"\0" in sample


@dataclass
class Blob:
    """A file in a commit: regular content, or an LFS object by sha256."""

    sha256: str
    size: int
    lfs: bool
    data: bytes | None = None  # regular files only

    @property
    def oid(self) -> str:
        """What preupload reports (and the client compares): sha256 for LFS, git sha1 otherwise."""
        return self.sha256 if self.lfs else git_blob_sha1(self.data or b"")


@dataclass
class Repo:
    repo_id: str
    private: bool = False
    gated: bool = False
    granted: set[str] = field(default_factory=set)
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, dict[str, Blob]] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    prs: int = 0


@dataclass
class Fault:
    method: str
    pattern: re.Pattern
    mode: str  # "drop" | "status"
    status: int
    after: int
    times: int
    seen: int = 0
    fired: int = 0


@dataclass
class Token:
    user: str
    write: bool = True
    orgs: tuple[str, ...] = ()

    @property
    def namespaces(self) -> set[str]:
        return {self.user, *self.orgs}


class _Reply(Exception):
    def __init__(self, status: int, body: Any = None, headers: dict | None = None):
        self.status, self.body, self.headers = status, body, headers or {}


def _error(status: int, message: str, code: str | None = None, extra: dict | None = None) -> _Reply:
    headers = {"X-Error-Message": message, **(extra or {})}
    if code:
        headers["X-Error-Code"] = code
    return _Reply(status, {"error": message}, headers)


class HubStandIn:
    """The stand-in server. `with HubStandIn(tokens) as hub:` or start()/stop()."""

    def __init__(
        self, tokens: dict[str, Token] | None = None, multipart_threshold: int | None = None, part_size: int = 64 * 1024
    ):
        self.tokens = dict(tokens or {})
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self._parts: dict[str, dict[int, bytes]] = {}
        self.requests: list[dict] = []  # method, path, status, authorized (bool), query
        self.unhandled: list[str] = []
        self.errors: list[str] = []
        self.faults: list[Fault] = []
        self._connections: set[socket.socket] = set()
        self._lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> HubStandIn:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        server.daemon_threads = True
        server.block_on_close = False
        server.hub = self  # type: ignore[attr-defined]
        server.handle_error = lambda request, address: self.errors.append("handler error")  # type: ignore
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="hub-stand-in", daemon=True
        )
        self._thread.start()
        host, port = server.server_address[:2]
        self._url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        """Stop serving and close every open connection (keep-alive ones included)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            with self._lock:
                for connection in list(self._connections):
                    try:
                        connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
            self._thread.join(timeout=5)
            self._server = None

    def __enter__(self) -> HubStandIn:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """http://127.0.0.1:PORT (kept after stop(), to test a Hub that went away)."""
        return self._url

    # ---- state, for tests ----------------------------------------------------------------------

    def add_repo(
        self,
        repo_id: str,
        files: dict[str, bytes] | Path,
        *,
        private: bool = False,
        gated: bool = False,
        granted: tuple[str, ...] = (),
        branch: str = "main",
        message: str = "initial",
    ) -> str:
        """Create (or add a commit to) a repo holding `files` (a dict or a folder); returns the commit."""
        if isinstance(files, (str, Path)):
            root = Path(files)
            files = {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        with self._lock:
            repo = self.repos.get(repo_id) or Repo(repo_id, private=private, gated=gated, granted=set(granted))
            self.repos[repo_id] = repo
            tree = dict(repo.commits.get(repo.branches.get(branch, ""), {}))
            for path, data in files.items():
                tree[path] = self._store(path, data)
            return self._commit(repo, branch, tree, message)

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """Every file of `repo_id` at `revision` (branch or commit), with its bytes."""
        with self._lock:
            repo = self.repos[repo_id]
            sha = repo.branches.get(revision, revision)
            return {p: self._bytes(b) for p, b in repo.commits[sha].items()}

    def blob(self, repo_id: str, path: str, revision: str = "main") -> Blob:
        with self._lock:
            repo = self.repos[repo_id]
            return repo.commits[repo.branches.get(revision, revision)][path]

    def fail(
        self, method: str, path_regex: str, *, mode: str = "drop", status: int = 500, after: int = 0, times: int = 1
    ) -> Fault:
        """Make matching requests fail: the first `after` pass, the next `times` fail by dropping the
        connection half-way through the body (`drop`) or answering `status`."""
        fault = Fault(method.upper(), re.compile(path_regex), mode, status, after, times)
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._lock:
            self.faults.clear()

    def count(self, method: str, path_regex: str, status: int | None = None) -> int:
        pattern = re.compile(path_regex)
        with self._lock:
            return sum(
                1
                for r in self.requests
                if r["method"] == method and pattern.search(r["path"]) and (status is None or r["status"] == status)
            )

    def downloads(self, repo_id: str) -> list[str]:
        """Files whose bytes were served (GET resolve, 200/206)."""
        prefix = f"/{repo_id}/resolve/"
        with self._lock:
            return [
                unquote(r["path"][len(prefix) :].split("/", 1)[1])
                for r in self.requests
                if r["method"] == "GET" and r["path"].startswith(prefix) and r["status"] in (200, 206)
            ]

    # ---- internals -----------------------------------------------------------------------------

    def _store(self, path: str, data: bytes) -> Blob:
        sha = hashlib.sha256(data).hexdigest()
        if is_lfs(path, len(data), data[:512]):
            self.lfs[sha] = data
            return Blob(sha, len(data), True)
        return Blob(sha, len(data), False, data)

    def _bytes(self, blob: Blob) -> bytes:
        return self.lfs[blob.sha256] if blob.lfs else (blob.data or b"")

    def _commit(self, repo: Repo, branch: str, tree: dict[str, Blob], message: str) -> str:
        sha = hashlib.sha1(f"{repo.repo_id}:{branch}:{message}:{uuid.uuid4()}".encode()).hexdigest()
        repo.commits[sha] = tree
        repo.messages[sha] = message
        repo.branches[branch] = sha
        return sha

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.method == method and fault.pattern.search(path):
                    fault.seen += 1
                    if fault.seen > fault.after and fault.fired < fault.times:
                        fault.fired += 1
                        return fault
        return None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "HubStandIn/1.0"
    timeout = 30  # idle keep-alive connections end

    def log_message(self, format, *args) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        with self.hub._lock:
            self.hub._connections.add(self.connection)

    def finish(self) -> None:
        with self.hub._lock:
            self.hub._connections.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    @property
    def hub(self) -> HubStandIn:
        return self.server.hub  # type: ignore[attr-defined]

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    # ---- plumbing ------------------------------------------------------------------------------

    def _read_body(self, limit: int | None = None) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
                if limit is not None and sum(map(len, chunks)) >= limit:
                    break
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length if limit is None else min(limit, length))

    def _send(
        self,
        status: int,
        body: Any = None,
        headers: dict | None = None,
        content_type: str | None = None,
        head_length: int | None = None,
    ) -> None:
        if isinstance(body, (dict, list)):
            payload = json.dumps(body).encode()
            content_type = content_type or "application/json"
        elif isinstance(body, str):
            payload = body.encode()
            content_type = content_type or "text/plain"
        else:
            payload = body or b""
            content_type = content_type or "application/octet-stream"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(head_length if head_length is not None else len(payload)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)
        self._status = status

    def _drop(self) -> None:
        """Read half of the body, then reset the connection without answering."""
        declared = int(self.headers.get("Content-Length") or 0)
        try:
            self._read_body(limit=max(1, declared // 2) if declared else 1024)
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.close_connection = True

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        path, query = url.path, parse_qs(url.query)
        self._status = 0
        fault = self.hub._take_fault(method, path)
        if fault is not None and fault.mode == "drop":
            self._record(method, path, "dropped", query)
            self._drop()
            return
        body = self._read_body() if method in ("POST", "PUT") else b""
        try:
            if fault is not None:
                raise _error(fault.status, "injected failure")
            self._route(method, path, query, body)
        except _Reply as reply:
            self._send(reply.status, reply.body, reply.headers)
        except Exception as e:  # a bug in the stand-in: answer 500 and remember it
            self.hub.errors.append(f"{method} {path}: {type(e).__name__}: {e}")
            self._send(500, {"error": f"stand-in bug: {e}"})
        self._record(method, path, self._status, query)

    def _record(self, method, path, status, query) -> None:
        with self.hub._lock:
            self.hub.requests.append(
                {
                    "method": method,
                    "path": path,
                    "status": status,
                    "query": query,
                    "authorization": self.headers.get("Authorization"),
                }
            )

    # ---- auth --------------------------------------------------------------------------------

    def _identity(self) -> Token | None:
        header = self.headers.get("Authorization") or ""
        if not header:
            return None
        token = header[7:] if header.lower().startswith("bearer ") else header
        known = self.hub.tokens.get(token)
        if known is None:
            raise _error(401, "Invalid credentials in Authorization header")
        return known

    def _token_string(self) -> str | None:
        header = self.headers.get("Authorization") or ""
        return header[7:] if header.lower().startswith("bearer ") else None

    def _repo_read(self, repo_id: str) -> Repo:
        who = self._identity()
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and (who is None or repo_id.split("/")[0] not in who.namespaces)):
            raise _error(401 if who is None else 404, "Repository not found", "RepoNotFound")
        return repo

    def _repo_write(self, repo_id: str) -> tuple[Repo, Token]:
        who = self._identity()
        if who is None:
            raise _error(401, "You must be authenticated to access this resource")
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and repo_id.split("/")[0] not in who.namespaces):
            raise _error(404, "Repository not found", "RepoNotFound")
        if not who.write or repo_id.split("/")[0] not in who.namespaces:
            raise _error(403, f"You don't have the rights to write to {repo_id}")
        return repo, who

    def _gate(self, repo: Repo) -> None:
        if repo.gated and self._token_string() not in repo.granted:
            raise _error(
                401 if self._identity() is None else 403,
                f"Access to model {repo.repo_id} is restricted and you are not in the authorized list. "
                f"Visit {self.hub.url}/{repo.repo_id} to ask for access.",
                "GatedRepo",
            )

    @staticmethod
    def _commit_of(repo: Repo, revision: str) -> str:
        revision = unquote(revision)
        if revision in repo.branches:
            return repo.branches[revision]
        if revision in repo.commits:
            return revision
        raise _error(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    # ---- routes --------------------------------------------------------------------------------

    REPO = r"(?P<repo>[^/]+/[^/]+)"

    def _route(self, method: str, path: str, query: dict, body: bytes) -> None:
        R = self.REPO
        routes = [
            ("GET", r"^/api/whoami-v2$", self._whoami),
            ("POST", r"^/api/repos/create$", self._create_repo),
            ("POST", r"^/api/validate-yaml$", self._validate_yaml),
            ("GET", rf"^/api/models/{R}/tree/(?P<rev>[^/]+)(?:/(?P<sub>.*))?$", self._tree),
            ("POST", rf"^/api/models/{R}/preupload/(?P<rev>[^/]+)$", self._preupload),
            ("POST", rf"^/api/models/{R}/commit/(?P<rev>[^/]+)$", self._commit),
            ("POST", rf"^/api/models/{R}/branch/(?P<branch>[^/]+)$", self._branch),
            ("GET", rf"^/api/models/{R}(?:/revision/(?P<rev>[^/]+))?$", self._model_info),
            ("POST", rf"^/{R}\.git/info/lfs/objects/batch$", self._lfs_batch),
            ("PUT", r"^/__lfs/(?P<oid>[0-9a-f]{64})$", self._lfs_put),
            ("PUT", r"^/__lfs/(?P<oid>[0-9a-f]{64})/part/(?P<part>\d+)$", self._lfs_put_part),
            ("POST", r"^/__lfs/(?P<oid>[0-9a-f]{64})/complete$", self._lfs_complete),
            ("POST", r"^/__lfs/verify$", self._lfs_verify),
            ("HEAD", rf"^/{R}/resolve/(?P<rev>[^/]+)/(?P<file>.+)$", self._resolve),
            ("GET", rf"^/{R}/resolve/(?P<rev>[^/]+)/(?P<file>.+)$", self._resolve),
        ]
        for verb, pattern, handler in routes:
            if verb == method and (m := re.match(pattern, path)):
                return handler(query=query, body=body, **m.groupdict())
        self.hub.unhandled.append(f"{method} {path}")
        raise _error(404, f"stand-in has no route for {method} {path}")

    def _whoami(self, **_) -> None:
        who = self._identity()
        if who is None:
            raise _error(401, "You must be authenticated to access this resource")
        role = "write" if who.write else "read"
        self._send(
            200,
            {
                "type": "user",
                "name": who.user,
                "orgs": [{"name": o} for o in who.orgs],
                "auth": {"type": "access_token", "accessToken": {"role": role}},
            },
        )

    def _model_info(self, repo: str, rev: str | None = None, **_) -> None:
        r = self._repo_read(repo)
        sha = self._commit_of(r, rev or "main")
        tree = r.commits[sha]
        self._send(
            200,
            {
                "_id": hashlib.md5(repo.encode()).hexdigest()[:24],
                "id": repo,
                "modelId": repo,
                "sha": sha,
                "private": r.private,
                "gated": "manual" if r.gated else False,
                "disabled": False,
                "tags": [],
                "library_name": "transformers",
                "siblings": [{"rfilename": p} for p in sorted(tree)],
            },
        )

    def _tree(self, repo: str, rev: str, query: dict, sub: str | None = None, **_) -> None:
        r = self._repo_read(repo)
        tree = r.commits[self._commit_of(r, rev)]
        recursive = (query.get("recursive", ["false"])[0]).lower() in ("true", "1")
        prefix = (unquote(sub).strip("/") + "/") if sub else ""
        entries, folders = [], set()
        for path in sorted(tree):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix) :]
            parts = rest.split("/")
            for i in range(1, len(parts)):
                folder = prefix + "/".join(parts[:i])
                if (recursive or i == 1) and folder not in folders:
                    folders.add(folder)
                    entries.append(
                        {
                            "type": "directory",
                            "oid": hashlib.sha1(folder.encode()).hexdigest(),
                            "size": 0,
                            "path": folder,
                        }
                    )
            if not recursive and len(parts) > 1:
                continue
            blob = tree[path]
            entry = {"type": "file", "path": path, "size": blob.size}
            if blob.lfs:
                pointer = lfs_pointer(blob.sha256, blob.size)
                entry["oid"] = git_blob_sha1(pointer)
                entry["lfs"] = {"oid": blob.sha256, "size": blob.size, "pointerSize": len(pointer)}
            else:
                entry["oid"] = git_blob_sha1(blob.data or b"")
            entries.append(entry)
        self._send(200, entries)

    def _resolve(self, repo: str, rev: str, file: str, **_) -> None:
        r = self._repo_read(repo)
        sha = self._commit_of(r, rev)
        self._gate(r)
        filename = unquote(file)
        blob = r.commits[sha].get(filename)
        if blob is None:
            raise _error(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": sha})
        data = self.hub._bytes(blob)
        etag = blob.sha256 if blob.lfs else git_blob_sha1(data)
        headers = {"ETag": f'"{etag}"', "X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        if blob.lfs:
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(blob.size)})
        status, payload = 200, data
        ranged = re.match(r"bytes=(\d+)-(\d*)$", self.headers.get("Range", ""))
        if ranged and self.command == "GET":
            start = int(ranged.group(1))
            stop = int(ranged.group(2)) + 1 if ranged.group(2) else len(data)
            status, payload = 206, data[start:stop]
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{len(data)}"
        self._send(status, payload, headers, head_length=len(payload))

    def _create_repo(self, body: bytes, **_) -> None:
        who = self._identity()
        if who is None:
            raise _error(401, "You must be authenticated to create a repo")
        data = json.loads(body or b"{}")
        if data.get("type", "model") not in (None, "model"):
            raise _error(400, "the stand-in only hosts model repos")
        namespace = data.get("organization") or who.user
        repo_id = f"{namespace}/{data['name']}"
        if not who.write or namespace not in who.namespaces:
            raise _error(403, f'You don\'t have the rights to create a model under the namespace "{namespace}"')
        with self.hub._lock:
            if repo_id in self.hub.repos:
                raise _Reply(409, {"error": "You already created this model repo", "url": f"{self.hub.url}/{repo_id}"})
            private = data.get("visibility") == "private" or bool(data.get("private"))
            repo = Repo(repo_id, private=private)
            self.hub.repos[repo_id] = repo
            self.hub._commit(
                repo, "main", {".gitattributes": self.hub._store(".gitattributes", GITATTRIBUTES)}, "initial commit"
            )
        self._send(200, {"url": f"{self.hub.url}/{repo_id}", "name": repo_id, "id": uuid.uuid4().hex})

    def _validate_yaml(self, body: bytes, **_) -> None:
        import yaml

        content = json.loads(body or b"{}").get("content", "")
        errors = []
        if content.startswith("---"):
            end = content.find("\n---", 3)
            if end < 0:
                errors.append({"message": "metadata block is not closed with ---"})
            else:
                try:
                    meta = yaml.safe_load(content[3:end])
                    if meta is not None and not isinstance(meta, dict):
                        errors.append({"message": "metadata must be a mapping"})
                except yaml.YAMLError as e:
                    errors.append({"message": f"invalid YAML: {e}"})
        if errors:
            raise _Reply(400, {"errors": errors, "warnings": []})
        self._send(200, {"errors": [], "warnings": []})

    def _preupload(self, repo: str, rev: str, body: bytes, query: dict, **_) -> None:
        r, _who = self._repo_write(repo)
        sha = self._commit_of(r, "main" if query.get("create_pr") else rev)
        tree = r.commits[sha]
        answer = []
        for f in json.loads(body)["files"]:
            sample = base64.b64decode(f.get("sample", ""))
            mode = "lfs" if is_lfs(f["path"], int(f["size"]), sample) else "regular"
            entry = {"path": f["path"], "uploadMode": mode, "shouldIgnore": False}
            existing = tree.get(f["path"])
            if existing is not None and existing.lfs == (mode == "lfs"):
                entry["oid"] = existing.oid
            answer.append(entry)
        self._send(200, {"files": answer, "commitOid": sha})

    def _lfs_batch(self, repo: str, body: bytes, **_) -> None:
        self._repo_write(repo)
        request = json.loads(body)
        if request.get("operation") != "upload":
            raise _error(400, "the stand-in only accepts uploads")
        objects = []
        for obj in request["objects"]:
            oid, size = obj["oid"], int(obj["size"])
            if oid in self.hub.lfs and len(self.hub.lfs[oid]) == size:
                objects.append({"oid": oid, "size": size})  # already stored: nothing to do
                continue
            base = f"{self.hub.url}/__lfs/{oid}"
            verify = {"href": f"{self.hub.url}/__lfs/verify", "header": {}}
            if self.hub.multipart_threshold is not None and size >= self.hub.multipart_threshold:
                chunk = self.hub.part_size
                header = {"chunk_size": str(chunk)}
                for i in range(-(-size // chunk)):
                    header[f"{i + 1:05d}"] = f"{base}/part/{i + 1}"
                upload = {"href": f"{base}/complete", "header": header}
            else:
                upload = {"href": base, "header": {}}
            objects.append(
                {"oid": oid, "size": size, "authenticated": True, "actions": {"upload": upload, "verify": verify}}
            )
        self._send(
            200,
            {"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
            content_type="application/vnd.git-lfs+json",
        )

    def _lfs_put(self, oid: str, body: bytes, **_) -> None:
        if hashlib.sha256(body).hexdigest() != oid:
            raise _error(400, f"content does not match oid {oid} ({len(body)} bytes received)")
        with self.hub._lock:
            self.hub.lfs[oid] = body
        self._send(200, b"", {"ETag": f'"{hashlib.md5(body).hexdigest()}"'})

    def _lfs_put_part(self, oid: str, part: str, body: bytes, **_) -> None:
        with self.hub._lock:
            self.hub._parts.setdefault(oid, {})[int(part)] = body
        self._send(200, b"", {"ETag": f'"{hashlib.md5(body).hexdigest()}"'})

    def _lfs_complete(self, oid: str, body: bytes, **_) -> None:
        data = json.loads(body)
        with self.hub._lock:
            parts = self.hub._parts.get(oid, {})
            pieces = []
            for p in data["parts"]:
                piece = parts.get(int(p["partNumber"]))
                if piece is None or f'"{hashlib.md5(piece).hexdigest()}"' != p["etag"]:
                    raise _error(400, f"part {p['partNumber']} of {oid} is missing or its etag differs")
                pieces.append(piece)
            content = b"".join(pieces)
            if hashlib.sha256(content).hexdigest() != oid:
                raise _error(400, f"assembled parts do not match oid {oid}")
            self.hub.lfs[oid] = content
            self.hub._parts.pop(oid, None)
        self._send(200, {})

    def _lfs_verify(self, body: bytes, **_) -> None:
        data = json.loads(body)
        stored = self.hub.lfs.get(data["oid"])
        if stored is None or len(stored) != int(data["size"]):
            raise _error(404, f"object {data['oid']} was not uploaded")
        self._send(200, {})

    def _commit(self, repo: str, rev: str, body: bytes, query: dict, **_) -> None:
        r, _who = self._repo_write(repo)
        create_pr = bool(query.get("create_pr"))
        branch = unquote(rev)
        base_sha = self._commit_of(r, "main" if create_pr else branch)
        tree = dict(r.commits[base_sha])
        summary = ""
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                summary = value.get("summary", "")
                parent = value.get("parentCommit")
                if parent and parent != base_sha:
                    raise _error(412, "A commit has happened since. Please refresh and try again.")
            elif key == "file":
                if value.get("encoding") != "base64":
                    raise _error(400, "file content must be base64")
                data = base64.b64decode(value["content"])
                tree[value["path"]] = Blob(hashlib.sha256(data).hexdigest(), len(data), False, data)
            elif key == "lfsFile":
                oid = value["oid"]
                stored = self.hub.lfs.get(oid)
                if stored is None or ("size" in value and len(stored) != int(value["size"])):
                    raise _error(
                        422,
                        "Your push was rejected because an LFS pointer pointed to a file that does "
                        "not exist. For instance, this can happen if you used git push --no-verify "
                        "to push your changes.",
                    )
                tree[value["path"]] = Blob(oid, len(stored), True)
            elif key == "deletedFile":
                tree.pop(value["path"], None)
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                for p in [p for p in tree if p.startswith(prefix)]:
                    del tree[p]
            else:
                raise _error(400, f"unknown commit operation {key}")
        with self.hub._lock:
            if create_pr:
                r.prs += 1
                target = f"refs/pr/{r.prs}"
            else:
                target = branch
            sha = self.hub._commit(r, target, tree, summary)
        pr_url = f"{self.hub.url}/{repo}/discussions/{r.prs}" if create_pr else None
        self._send(
            200,
            {
                "success": True,
                "commitOid": sha,
                "commitUrl": f"{self.hub.url}/{repo}/commit/{sha}",
                "pullRequestUrl": pr_url,
            },
        )

    def _branch(self, repo: str, branch: str, body: bytes, **_) -> None:
        r, _who = self._repo_write(repo)
        name = unquote(branch)
        if name in r.branches:
            raise _error(409, "Reference already exists")
        start = json.loads(body or b"{}").get("startingPoint") or "main"
        with self.hub._lock:
            r.branches[name] = self._commit_of(r, start)
        self._send(200, {})
