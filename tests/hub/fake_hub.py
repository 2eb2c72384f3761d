"""A fake Hugging Face Hub on 127.0.0.1: the endpoints huggingface_hub 2.4 calls to publish a model, in memory.

Endpoints (what `mtp-convert push` and huggingface_hub's create_repo / create_branch / repo_info /
list_repo_tree / get_paths_info / preupload_lfs_files / create_commit send):

    POST /api/repos/create                                   create_repo (409 when it exists)
    GET  /api/models/{repo}  and  /api/models/{repo}/revision/{rev}   repo_info
    POST /api/models/{repo}/branch/{branch}                  create_branch (409 when it exists)
    GET  /api/models/{repo}/tree/{rev}[/{path}]              list_repo_tree (recursive, LFS oids)
    POST /api/models/{repo}/paths-info/{rev}                 get_paths_info
    POST /api/validate-yaml                                  README.md metadata check in create_commit
    POST /api/models/{repo}/preupload/{rev}                  upload modes + remote oids
    POST /{repo}.git/info/lfs/objects/batch                  LFS batch: upload actions, none when stored
    PUT  /lfs-upload/{repo}/{oid}                            the LFS upload URL the batch hands out
    POST /lfs-verify/{repo}                                  the LFS verify action
    POST /api/models/{repo}/commit/{rev}                     NDJSON commit (file / lfsFile / deletedFile)
    GET  /api/whoami-v2                                      whoami

Anything else is answered 404 and kept in `unknown`. Every request is logged in `requests`; the token each
one carried in `tokens`. Faults: `fail_next[kind] = [status, ...]` answers the next requests of a kind
("create", "commit", "preupload", "batch", "upload", "tree") with those statuses ("commit-lost": commits,
then answers the status); `drop_uploads` (True: all,
n: the next n) and `drop_oids` (these blobs) close the socket in the middle of an LFS upload, unanswered.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"
LFS_THRESHOLD = 10 * 1000 * 1000
_REPO_API = re.compile(r"^/api/models/([^/]+/[^/]+?)(?:/(revision|branch|tree|paths-info|preupload|commit)/([^/]+)(/.*)?)?$")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    repo_id: str
    private: bool
    branches: dict[str, dict[str, bytes]] = field(default_factory=dict)  # branch -> path -> content
    lfs_paths: dict[str, set[str]] = field(default_factory=dict)  # branch -> paths stored as LFS
    commits: list[dict] = field(default_factory=list)


class FakeHub:
    def __init__(self, token: str | None = None):
        self.token = token  # when set, requests without it get 401
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}  # oid -> content (uploaded, committed or not)
        self.uploads: Counter = Counter()  # oid -> completed uploads
        self.upload_attempts: Counter = Counter()  # oid -> PUT requests, dropped ones included
        self.requests: list[tuple[str, str]] = []
        self.tokens: list[str | None] = []
        self.unknown: list[tuple[str, str]] = []
        self.errors: list[str] = []  # exceptions in the fake itself
        self.commit_payloads: list[list[dict]] = []
        self.fail_next: dict[str, list[int]] = {}
        self.drop_uploads: bool | int = False  # True: drop every LFS upload; n: drop the next n
        self.drop_oids: set[str] = set()  # drop every upload of these blobs
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- what the tests read -----------------------------------------------------------------------------------

    def files(self, repo_id: str, branch: str = "main") -> dict[str, bytes]:
        """The committed files of a branch, LFS content resolved (without the .gitattributes the Hub adds)."""
        return {p: c for p, c in self.repos[repo_id].branches[branch].items() if p != ".gitattributes"}

    def lfs_files(self, repo_id: str, branch: str = "main") -> set[str]:
        return set(self.repos[repo_id].lfs_paths[branch])

    # -- the server --------------------------------------------------------------------------------------------

    def _take_fault(self, kind: str) -> int | None:
        with self.lock:
            queue = self.fail_next.get(kind)
            return queue.pop(0) if queue else None

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                self._dispatch("GET")

            def do_POST(self):
                self._dispatch("POST")

            def do_PUT(self):
                self._dispatch("PUT")

            # -- plumbing --
            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    data = b""
                    while True:
                        size = int(self.rfile.readline().strip().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return data
                        data += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _send(self, status: int, payload=None, *, error_code: str | None = None, headers: dict | None = None):
                data = b"" if payload is None else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if error_code:
                    self.send_header("X-Error-Code", error_code)
                    self.send_header("X-Error-Message", str((payload or {}).get("error", error_code)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def _error(self, status: int, message: str, code: str | None = None):
                self._send(status, {"error": message}, error_code=code)

            def _dispatch(self, method: str):
                split = urlsplit(self.path)
                path, query = unquote(split.path), parse_qs(split.query)
                auth = self.headers.get("Authorization")
                token = auth.removeprefix("Bearer ") if auth else None
                with hub.lock:
                    hub.requests.append((method, split.path))
                    hub.tokens.append(token)
                # The LFS upload URL stands for a pre-signed storage URL: it carries no Authorization header.
                if hub.token is not None and token != hub.token and not split.path.startswith("/lfs-upload/"):
                    self._body()
                    return self._error(401, "Invalid credentials in Authorization header")
                try:
                    self._route(method, split.path, path, query)
                except ConnectionError:
                    pass
                except Exception as e:  # a bug of the fake: answer it, and let the test see it
                    with hub.lock:
                        hub.errors.append(f"{method} {split.path}: {type(e).__name__}: {e}")
                    self._error(500, f"fake hub bug: {type(e).__name__}")

            def _route(self, method: str, raw_path: str, path: str, query: dict):
                if method == "POST" and path == "/api/repos/create":
                    return self._create(json.loads(self._body()))
                if method == "POST" and path == "/api/validate-yaml":
                    return self._validate_yaml(json.loads(self._body()))
                if method == "GET" and path == "/api/whoami-v2":
                    return self._send(200, {"type": "user", "name": "me", "orgs": [],
                                            "auth": {"type": "access_token", "accessToken": {"role": "write"}}})
                if method == "POST" and path.endswith(".git/info/lfs/objects/batch"):
                    return self._batch(path[1:-len(".git/info/lfs/objects/batch")], json.loads(self._body()))
                if method == "PUT" and path.startswith("/lfs-upload/"):
                    repo_id, oid = path[len("/lfs-upload/"):].rsplit("/", 1)
                    return self._upload(repo_id, oid)
                if method == "POST" and path.startswith("/lfs-verify/"):
                    body = json.loads(self._body())
                    return self._send(200 if body["oid"] in hub.lfs else 404, {})
                # Repo ids and revisions arrive URL-quoted: match on the raw path, unquote the parts.
                match = _REPO_API.match(raw_path.split("?")[0])
                if match:
                    repo_id, action, rev, rest = (unquote(g) if g else g for g in match.groups())
                    return self._repo(method, repo_id, action, rev, rest, query)
                self._body()
                with hub.lock:
                    hub.unknown.append((method, raw_path))
                self._error(404, f"fake hub: no route for {method} {raw_path}")

            # -- endpoints --
            def _create(self, body: dict):
                if (status := hub._take_fault("create")) is not None:
                    return self._error(status, "fake outage")
                repo_id = f"{body['organization']}/{body['name']}" if body.get("organization") else f"me/{body['name']}"
                with hub.lock:
                    if repo_id in hub.repos:  # the Hub names the repo in its 409 answer; create_repo reads it
                        return self._send(409, {"error": "You already created this model repo",
                                                "url": f"{hub.url}/{repo_id}"})
                    repo = Repo(repo_id, body.get("visibility") == "private")
                    repo.branches["main"] = {".gitattributes": GITATTRIBUTES}
                    repo.lfs_paths["main"] = set()
                    repo.commits.append({"oid": hashlib.sha1(repo_id.encode()).hexdigest(), "branch": "main"})
                    hub.repos[repo_id] = repo
                self._send(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id, "id": repo_id})

            def _validate_yaml(self, body: dict):
                text = body.get("content", "")
                if text.startswith("---\n"):
                    try:
                        yaml.safe_load(text[4:text.index("\n---", 4)])
                    except (ValueError, yaml.YAMLError) as e:
                        return self._send(400, {"errors": [{"message": str(e)}], "warnings": []})
                self._send(200, {"errors": [], "warnings": []})

            def _repo(self, method, repo_id, action, rev, rest, query):
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self._body()
                    return self._error(404, "Repository not found", "RepoNotFound")
                if action is None or action == "revision":
                    branch = rev or "main"
                    if branch not in repo.branches:
                        return self._error(404, "Invalid rev id", "RevisionNotFound")
                    files = repo.branches[branch]
                    return self._send(200, {"id": repo_id, "private": repo.private, "sha": self._head(repo, branch),
                                            "siblings": [{"rfilename": p} for p in sorted(files)]})
                if action == "branch":
                    self._body()
                    if rev in repo.branches:
                        return self._error(409, "Reference already exists")
                    repo.branches[rev] = dict(repo.branches["main"])
                    repo.lfs_paths[rev] = set(repo.lfs_paths["main"])
                    repo.commits.append({"oid": self._head(repo, "main"), "branch": rev})
                    return self._send(200, {})
                if rev not in repo.branches:
                    self._body()
                    return self._error(404, "Invalid rev id", "RevisionNotFound")
                if action == "tree":
                    if (status := hub._take_fault("tree")) is not None:
                        return self._error(status, "fake outage")
                    prefix = (rest or "").strip("/")
                    recursive = query.get("recursive", ["false"])[0].lower() == "true"
                    return self._send(200, self._tree(repo, rev, prefix, recursive))
                if action == "paths-info":
                    body = parse_qs(self._body().decode())
                    wanted = set(body.get("paths", []))
                    return self._send(200, [e for e in self._tree(repo, rev, "", True) if e["path"] in wanted])
                if action == "preupload":
                    return self._preupload(repo, rev, json.loads(self._body()))
                if action == "commit":
                    return self._commit(repo, rev, self._body())
                self._error(404, "fake hub: unknown action")

            def _head(self, repo: Repo, branch: str) -> str:
                return next(c["oid"] for c in reversed(repo.commits) if c["branch"] == branch)

            def _entry(self, repo: Repo, branch: str, path: str) -> dict:
                content = repo.branches[branch][path]
                entry = {"type": "file", "path": path, "size": len(content), "oid": git_blob_id(content)}
                if path in repo.lfs_paths[branch]:
                    entry["lfs"] = {"oid": hashlib.sha256(content).hexdigest(), "size": len(content), "pointerSize": 134}
                    entry["oid"] = git_blob_id(b"version https://git-lfs.github.com/spec/v1\n")  # a pointer's id
                return entry

            def _tree(self, repo: Repo, branch: str, prefix: str, recursive: bool) -> list[dict]:
                entries, folders = [], set()
                for path in sorted(repo.branches[branch]):
                    if prefix and not path.startswith(prefix + "/"):
                        continue
                    rel = path[len(prefix) + 1:] if prefix else path
                    if "/" in rel:
                        folder = (prefix + "/" if prefix else "") + rel.split("/", 1)[0]
                        folders.add(folder)
                        if not recursive:
                            continue
                    entries.append(self._entry(repo, branch, path))
                entries += [{"type": "directory", "path": f, "oid": hashlib.sha1(f.encode()).hexdigest()}
                            for f in sorted(folders)]
                return entries

            def _preupload(self, repo: Repo, branch: str, body: dict):
                if (status := hub._take_fault("preupload")) is not None:
                    return self._error(status, "fake outage")
                files = []
                for f in body["files"]:
                    sample = base64.b64decode(f["sample"])
                    lfs = f["path"].endswith((".safetensors", ".bin")) or f["size"] > LFS_THRESHOLD or b"\0" in sample
                    oid = None
                    if f["path"] in repo.branches[branch]:
                        entry = self._entry(repo, branch, f["path"])
                        oid = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
                    files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                                  "oid": oid})
                self._send(200, {"files": files, "commitOid": self._head(repo, branch)})

            def _batch(self, repo_id: str, body: dict):
                if (status := hub._take_fault("batch")) is not None:
                    return self._error(status, "fake outage")
                objects = []
                for obj in body["objects"]:
                    item = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
                    if obj["oid"] not in hub.lfs:  # stored (committed or not): nothing to send
                        item["actions"] = {
                            "upload": {"href": f"{hub.url}/lfs-upload/{repo_id}/{obj['oid']}", "header": {}},
                            "verify": {"href": f"{hub.url}/lfs-verify/{repo_id}", "header": {}},
                        }
                    objects.append(item)
                self._send(200, {"transfer": "basic", "objects": objects})

            def _upload(self, repo_id: str, oid: str):
                with hub.lock:
                    hub.upload_attempts[oid] += 1
                    drop = oid in hub.drop_oids or hub.drop_uploads is True
                    if not drop and hub.drop_uploads:
                        hub.drop_uploads -= 1
                        drop = True
                if drop:  # read part of the body, then hang up without an answer
                    length = int(self.headers.get("Content-Length") or 0)
                    self.rfile.read(max(1, length // 2)) if length else self.rfile.readline()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                data = self._body()
                if (status := hub._take_fault("upload")) is not None:
                    return self._error(status, "fake outage")
                if hashlib.sha256(data).hexdigest() != oid:
                    return self._error(400, "sha256 mismatch")
                with hub.lock:
                    hub.lfs[oid] = data
                    hub.uploads[oid] += 1
                self._send(200, {})

            def _commit(self, repo: Repo, branch: str, raw: bytes):
                if (status := hub._take_fault("commit")) is not None:
                    return self._error(status, "fake outage")
                lines = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
                with hub.lock:
                    hub.commit_payloads.append(lines)
                    files = dict(repo.branches[branch])
                    lfs_paths = set(repo.lfs_paths[branch])
                    for line in lines:
                        key, value = line["key"], line["value"]
                        if key == "file":
                            files[value["path"]] = base64.b64decode(value["content"])
                            lfs_paths.discard(value["path"])
                        elif key == "lfsFile":
                            if value["oid"] not in hub.lfs:
                                return self._error(422, f"LFS object {value['oid']} was never uploaded")
                            files[value["path"]] = hub.lfs[value["oid"]]
                            lfs_paths.add(value["path"])
                        elif key == "deletedFile":
                            files.pop(value["path"], None)
                            lfs_paths.discard(value["path"])
                    repo.branches[branch], repo.lfs_paths[branch] = files, lfs_paths
                    oid = hashlib.sha1(f"{repo.repo_id}{len(repo.commits)}".encode()).hexdigest()
                    repo.commits.append({"oid": oid, "branch": branch, "summary": lines[0]["value"]["summary"]})
                if (status := hub._take_fault("commit-lost")) is not None:  # committed, but the answer is lost
                    return self._error(status, "fake outage after the commit")
                self._send(200, {"commitUrl": f"{hub.url}/{repo.repo_id}/commit/{oid}", "commitOid": oid,
                                 "pullRequestUrl": None})

        return Handler
