"""Sending a PushPlan: two Hub repos, one commit each, only the files that differ, retried on transient errors.

With huggingface_hub: `create_repo(exist_ok=True)`, `create_branch` for a branch other than main,
`list_repo_tree` to see what each repo already holds, `preupload_lfs_files` one file at a time (the library's
own large-file path: Xet when hf_xet is installed, else LFS, multi-part for big files) and one `create_commit`.

A re-run after an interruption sends nothing twice:
- a file the repo already holds with the same content (LFS sha256, or git blob id for a small file) is not
  uploaded nor committed again; a repo that holds them all gets no commit;
- a large file uploaded by an interrupted run but never committed is not sent again either: the LFS batch
  endpoint reports it as present and huggingface_hub skips it (with Xet, its chunks are deduplicated).

Transient failures (HTTP 408/429/5xx, dropped or refused connections, timeouts) are retried with exponential
backoff, on top of huggingface_hub's own retries of single requests; a commit whose response was lost is
detected by listing the repo again before retrying. The token is handed to huggingface_hub and appears in no
message, log record or file of ours.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mtpkit.errors import MtpkitError
from mtpkit.hub.errors import HubAuthError, HubError, PushRefusedError
from mtpkit.hub.plan import PushPlan, RepoPlan, UploadFile

log = logging.getLogger(__name__)
sleep = time.sleep  # the backoff's clock; tests replace it
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_TRANSPORT_NAMES = frozenset({"TimeoutException", "NetworkError", "RemoteProtocolError", "ProxyError",  # httpx(2)
                              "ConnectionError", "Timeout", "ChunkedEncodingError",  # requests
                              "ProtocolError", "NewConnectionError"})  # urllib3
_TRANSPORT_MODULES = ("httpx", "httpx2", "httpcore", "requests", "urllib3")
_RESUME = "run the same command again: what is already on the Hub is not sent again"


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4  # tries of each step
    first_delay: float = 2.0  # seconds, doubled after each failure
    max_delay: float = 30.0


@dataclass
class RepoResult:
    repo_id: str
    role: str
    url: str
    commit_url: str | None  # None: the repo already held every file, no commit was made
    uploaded: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    extra_remote: list[str] = field(default_factory=list)  # files on the Hub this push does not replace
    uploaded_bytes: int = 0


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _status(exc: BaseException) -> int | None:
    for e in _chain(exc):
        code = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(code, int):
            return code
    return None


def _transport(exc: BaseException) -> BaseException | None:
    """The network error (dropped, refused or timed-out connection) behind `exc`, if any."""
    for e in _chain(exc):
        if isinstance(e, (ConnectionError, TimeoutError)):
            return e
        for cls in type(e).__mro__:
            if cls.__name__ in _TRANSPORT_NAMES and cls.__module__.split(".")[0] in _TRANSPORT_MODULES:
                return e
    return None


def is_transient(exc: BaseException) -> bool:
    status = _status(exc)
    return status in TRANSIENT_STATUS if status is not None else _transport(exc) is not None


def _redact(text: str, secrets: tuple[str, ...]) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


def describe_error(exc: BaseException, secrets: tuple[str, ...] = ()) -> str:
    """A short description (no URL, no header, never the token)."""
    status = _status(exc)
    if status is not None:
        message = next((str(m) for e in _chain(exc) if (m := getattr(e, "server_message", None))), "")
        text = f"HTTP {status}" + (f": {message}" if message else "")
    else:
        e = _transport(exc) or exc
        text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    text = " ".join(text.split())
    return _redact(text[:300] + ("..." if len(text) > 300 else ""), secrets)


def _sha256(f: UploadFile) -> str:
    if f.content is not None:
        return hashlib.sha256(f.content).hexdigest()
    with open(f.local, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _git_blob_id(f: UploadFile) -> str:
    digest = hashlib.sha1(b"blob %d\0" % f.size)
    if f.content is not None:
        digest.update(f.content)
    else:
        with open(f.local, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def same_content(f: UploadFile, remote) -> bool:
    """Whether the Hub's file (a RepoFile) holds exactly `f`; hashes `f` only when the sizes agree."""
    if remote is None or remote.size != f.size:
        return False
    lfs = remote.lfs
    if lfs:
        sha = getattr(lfs, "sha256", None) or (lfs.get("sha256") if isinstance(lfs, dict) else None)
        return sha == _sha256(f)
    return remote.blob_id == _git_blob_id(f)


class _Pusher:
    def __init__(self, api, plan: PushPlan, token: str, retry: RetryPolicy, on_file, on_retry):
        self.api, self.plan, self.retry = api, plan, retry
        self.secrets = (token,)
        self.on_file = on_file or (lambda repo_id, path, size: None)
        self.on_retry = on_retry or (lambda message: None)

    def call(self, what: str, repo_id: str, fn: Callable):
        delay = self.retry.first_delay
        for attempt in range(1, self.retry.attempts + 1):
            try:
                return fn(attempt)
            except MtpkitError:
                raise
            except Exception as e:
                transient = is_transient(e)
                if not transient and _status(e) is None:
                    raise  # not the Hub's answer: a bug, reported as one
                if not transient or attempt == self.retry.attempts:
                    raise self._error(what, repo_id, e, attempt, transient) from e
                message = (f"{repo_id}: {what}: {describe_error(e, self.secrets)}; retrying in {delay:g} s "
                           f"(try {attempt + 1} of {self.retry.attempts})")
                log.warning(message)
                self.on_retry(message)
                sleep(delay)
                delay = min(delay * 2, self.retry.max_delay)
        raise AssertionError("unreachable")

    def _error(self, what: str, repo_id: str, e: Exception, attempts: int, transient: bool) -> MtpkitError:
        status, text = _status(e), describe_error(e, self.secrets)
        if status == 401:
            return HubAuthError(f"the Hub rejected the token while {what} ({text})", where=repo_id,
                                fix="set HF_TOKEN to a valid token with write access, or run `hf auth login`")
        if status == 403:
            return HubAuthError(f"the token may not write to this repo ({what}: {text})", where=repo_id,
                                fix=f"use a token with write access to {repo_id.split('/')[0]}")
        if status == 404:
            return HubAuthError(f"not found while {what} ({text})", where=repo_id,
                                fix="check the repo id and the branch, and that the token can see the repo")
        if transient:
            return HubError(f"{what} failed after {attempts} tries ({text})", where=repo_id,
                            fix=f"check the network (or the Hub's status) and {_RESUME}")
        return HubError(f"the Hub refused {what} ({text})", where=repo_id,
                        fix=f"fix what the Hub names, then {_RESUME}")

    # -- the steps -------------------------------------------------------------------------------------------

    def check_private(self, repo: RepoPlan) -> None:
        from huggingface_hub.errors import RepositoryNotFoundError

        def info(_attempt):
            try:
                return self.api.repo_info(repo.repo_id)
            except RepositoryNotFoundError:
                return None

        existing = self.call("reading the repo's visibility", repo.repo_id, info)
        if existing is not None and existing.private is False:
            raise PushRefusedError("exists and is public, but --private was given (visibility applies to new "
                                   "repos only)", where=repo.repo_id,
                                   fix="make it private in its settings on the Hub first, or drop --private")

    def create(self, repo: RepoPlan) -> None:
        self.call("creating the repo", repo.repo_id,
                  lambda _a: self.api.create_repo(repo.repo_id, exist_ok=True,
                                                  private=True if self.plan.private else None))
        if self.plan.revision != "main":
            self.call(f"creating branch {self.plan.revision!r}", repo.repo_id,
                      lambda _a: self.api.create_branch(repo.repo_id, branch=self.plan.revision, exist_ok=True))

    def remote_files(self, repo: RepoPlan) -> dict:
        from huggingface_hub.hf_api import RepoFile

        def listing(_attempt):
            return {entry.path: entry for entry in self.api.list_repo_tree(repo.repo_id, recursive=True,
                                                                           revision=self.plan.revision)
                    if isinstance(entry, RepoFile)}

        return self.call("listing the repo's files", repo.repo_id, listing)

    def push_repo(self, repo: RepoPlan) -> RepoResult:
        from huggingface_hub import CommitOperationAdd

        revision = self.plan.revision
        url = f"{self.api.endpoint}/{repo.repo_id}" + (f"/tree/{revision}" if revision != "main" else "")
        remote = self.remote_files(repo)
        local = {f.path_in_repo for f in repo.files}
        result = RepoResult(repo.repo_id, repo.role, url, None,
                            extra_remote=sorted(p for p in remote if p not in local and not p.startswith(".")))
        todo = [f for f in repo.files if not same_content(f, remote.get(f.path_in_repo))]
        result.unchanged = [f.path_in_repo for f in repo.files if f not in todo]
        if not todo:
            return result
        ops = []
        for f in todo:
            op = CommitOperationAdd(path_in_repo=f.path_in_repo,
                                    path_or_fileobj=str(f.local) if f.local is not None else f.content)
            self.on_file(repo.repo_id, f.path_in_repo, f.size)
            self.call(f"uploading {f.path_in_repo}", repo.repo_id,
                      lambda _a, op=op: self.api.preupload_lfs_files(repo.repo_id, additions=[op], revision=revision,
                                                                     num_threads=1, free_memory=False))
            ops.append((f, op))
        message = self.plan.commit_message or (
            f"Upload the {'target' if repo.role == 'target' else 'assistant (draft)'} of a Gemma 4 "
            "speculative-decoding pair with mtpkit")
        other = self.plan.draft if repo.role == "target" else self.plan.target
        description = (f"Pushed with `mtp-convert push`; the {other.title} is {other.repo_id}. "
                       f"{len(todo)} file(s) changed, {len(result.unchanged)} unchanged.")
        pending = list(ops)

        def commit(attempt):
            nonlocal pending
            if attempt > 1:  # the previous try may have landed though its answer was lost
                now = self.remote_files(repo)
                pending = [(f, op) for f, op in pending if not same_content(f, now.get(f.path_in_repo))]
                if not pending:
                    return None
            return self.api.create_commit(repo.repo_id, operations=[op for _, op in pending], commit_message=message,
                                          commit_description=description, revision=revision, num_threads=1)

        info = self.call("committing", repo.repo_id, commit)
        result.commit_url = getattr(info, "commit_url", None) or url  # None: an earlier try landed
        result.uploaded = [f.path_in_repo for f in todo]
        result.uploaded_bytes = sum(f.size for f in todo)
        self.verify(repo, ops)
        return result

    def verify(self, repo: RepoPlan, ops: list) -> None:
        """The repo now holds what was sent: sizes, and LFS sha256 (already known: no file is read again)."""
        now = self.remote_files(repo)
        for f, op in ops:
            remote = now.get(f.path_in_repo)
            if remote is not None and remote.size == f.size:
                lfs = remote.lfs
                if not lfs:
                    if remote.blob_id == _git_blob_id(f):
                        continue
                else:
                    sha = getattr(lfs, "sha256", None) or lfs.get("sha256")
                    local = op.upload_info.sha256.hex() if getattr(op.upload_info, "is_hashed", True) else _sha256(f)
                    if sha == local:
                        continue
            raise HubError(f"after the commit, {f.path_in_repo} on the Hub is not the file that was sent "
                           f"({'missing' if remote is None else f'{remote.size} bytes'})", where=repo.repo_id,
                           fix=f"check the repo's history for a concurrent push, then {_RESUME}")


class _LibraryOutput:
    """huggingface_hub's progress bars and warnings off (when stderr is not a terminal), restored after."""

    def __init__(self, show: bool):
        self.show = show

    def __enter__(self):
        if self.show:
            return self
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars

        self.bars_were_disabled = are_progress_bars_disabled()
        disable_progress_bars()
        self.logger = logging.getLogger("huggingface_hub")
        self.level = self.logger.level
        if self.logger.getEffectiveLevel() < logging.ERROR:
            self.logger.setLevel(logging.ERROR)  # its retry warnings: ours say the same, without URLs
        return self

    def __exit__(self, *exc):
        if self.show:
            return
        from huggingface_hub.utils import enable_progress_bars

        if not self.bars_were_disabled:
            enable_progress_bars()
        self.logger.setLevel(self.level)


def push(plan: PushPlan, *, token: str | None = None, endpoint: str | None = None, retry: RetryPolicy = RetryPolicy(),
         on_file: Callable[[str, str, int], None] | None = None, on_retry: Callable[[str], None] | None = None,
         library_output: bool = False) -> list[RepoResult]:
    """Create (or reuse) both repos and commit to each what differs. `endpoint` defaults to HF_ENDPOINT.

    `on_file(repo_id, path_in_repo, size)` is called before each upload, `on_retry(message)` before each wait.
    """
    from huggingface_hub import HfApi, constants, get_token

    if getattr(constants, "is_offline_mode", lambda: constants.HF_HUB_OFFLINE)():
        raise HubError("HF_HUB_OFFLINE is set, so nothing can be pushed", where="push",
                       fix="unset HF_HUB_OFFLINE, or use --dry-run to see what would be sent")
    token = token or get_token()
    if not token:
        raise HubAuthError("no Hugging Face token", where="push",
                           fix="set HF_TOKEN to a token with write access, or run `hf auth login`")
    api = HfApi(endpoint=(endpoint or os.environ.get("HF_ENDPOINT") or None), token=token)
    pusher = _Pusher(api, plan, token, retry, on_file, on_retry)
    with _LibraryOutput(library_output):
        if plan.private:
            for repo in plan.repos:
                pusher.check_private(repo)
        for repo in plan.repos:
            pusher.create(repo)
        return [pusher.push_repo(repo) for repo in plan.repos]
