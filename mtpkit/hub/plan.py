"""What `push` would send, decided on files alone: the two repos, their files and sizes, and the two cards.

Planning sends no request. It refuses (PushRefusedError, nothing sent) a pair that fails `check` and a pair
folder holding files that should not be published; with `force` a failing pair is pushed anyway (its cards
say so) and the flagged files are left out: a flagged file is never sent, whatever the options.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from mtpkit.convert.check import Finding, check_pair
from mtpkit.convert.checkpoint import open_checkpoint, read_json
from mtpkit.convert.draft import HF_QUANT_CONFIG
from mtpkit.convert.pair import PAIR_FILE, has_kv_scales, recommended_tokens
from mtpkit.errors import ConfigError, SourceNotFoundError
from mtpkit.formats.quantization import detect_quantization
from mtpkit.hub.card import CardContext, Side, draft_card, license_of, normalize_acceptance, read_front_matter, \
    target_card, vllm_lines
from mtpkit.hub.errors import PushRefusedError
from mtpkit.hub.screen import Unpublishable, screen_folder

CARD_FILE = "README.md"
BENCH_FILE = "bench.json"  # `mtp-convert bench PAIR --json > PAIR/bench.json` is picked up
DEFAULT_ENDPOINT = "https://huggingface.co"
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")


@dataclass(frozen=True)
class UploadFile:
    path_in_repo: str
    size: int
    local: Path | None = None  # a file of the pair folder, sent byte for byte
    content: bytes | None = None  # generated (the model card)


@dataclass
class RepoPlan:
    role: str  # "target" or "draft"
    repo_id: str
    folder: Path
    files: list[UploadFile]
    card: str

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def title(self) -> str:
        return "target" if self.role == "target" else "assistant"


@dataclass
class PushPlan:
    pair: Path
    target: RepoPlan
    draft: RepoPlan
    revision: str
    private: bool
    commit_message: str | None
    left_out: list[Unpublishable] = field(default_factory=list)  # flagged files, skipped because of --force
    check_errors: list[Finding] = field(default_factory=list)  # pushed anyway because of --force
    notes: list[str] = field(default_factory=list)  # things the user should know (no license, no base_model...)
    serve: str = ""  # the `vllm serve` line for the two repos

    @property
    def repos(self) -> tuple[RepoPlan, RepoPlan]:
        """In push order: the small assistant first, so the target's card never links to a missing repo for long."""
        return self.draft, self.target

    def describe(self, *, token_source: str | None = None) -> str:
        """The plan as text: repos, files and sizes, what is left out, and the two cards."""
        lines = [f"push plan for {self.pair}: revision {self.revision}, "
                 f"{'private' if self.private else 'public'} repos (visibility applies to new repos)"]
        for repo in self.repos:
            lines.append(f"{repo.repo_id} ({repo.title}): {len(repo.files)} files, {human_size(repo.total_bytes)}")
            width = max(len(f.path_in_repo) for f in repo.files)
            for f in repo.files:
                what = "  (model card, generated)" if f.content is not None else ""
                lines.append(f"  {f.path_in_repo:<{width}}  {human_size(f.size):>10}{what}")
        for item in self.left_out:
            lines.append(f"left out (--force): {self._rel(item.path)}: {item.reason}")
        for finding in self.check_errors:
            lines.append(f"pushed despite --force: {finding.severity} [{finding.id}] {finding.message}")
        lines.extend(f"note: {note}" for note in self.notes)
        if token_source is not None:
            lines.append(f"token: {token_source}")
        lines.append(f"serve it with: {self.serve}")
        for repo in self.repos:
            lines.append(f"--- {CARD_FILE} of {repo.repo_id} ---")
            lines.append(repo.card.rstrip("\n"))
        return "\n".join(lines) + "\n"

    def _rel(self, path: Path) -> str:
        try:
            return path.relative_to(self.pair).as_posix()
        except ValueError:
            return str(path)


def human_size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"  # unreachable


def check_repo_id(text: str, option: str) -> str:
    parts = text.split("/")
    if len(parts) != 2 or not all(_NAME.fullmatch(p) for p in parts) or "--" in text or ".." in text:
        raise ConfigError(f"{text!r} is not a Hub repo id OWNER/NAME", where=option,
                          fix="e.g. your-name/gemma-4-E2B-it-nvfp4 (letters, digits, '-', '_' and '.'; at most 96 "
                              "characters each side)")
    return text


def check_revision(revision: str | None) -> str:
    if revision is None or revision == "":
        return "main"
    if re.fullmatch(r"[0-9a-f]{40}", revision) or revision.startswith("refs/") or any(c.isspace() for c in revision) \
            or ".." in revision or revision.startswith(("-", "/")) or revision.endswith("/"):
        raise ConfigError(f"{revision!r} is not a branch name that can be pushed to", where="--revision",
                          fix="give a branch name, e.g. --revision nvfp4 (it is created when missing)")
    return revision


def local_tokens() -> tuple[str, ...]:
    """The token values this machine would push with (HF_TOKEN, the stored login), read without any request."""
    values = [os.environ.get("HF_TOKEN"), os.environ.get("HUGGING_FACE_HUB_TOKEN")]
    path = _token_path()
    if path is not None and path.is_file():
        try:
            values.append(path.read_text(encoding="utf-8").strip())
        except (OSError, UnicodeDecodeError):
            pass
    return tuple(v.strip() for v in values if v and len(v.strip()) >= 8)


def token_source() -> str:
    """Where the push would take its token from (never the token itself)."""
    if os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN"):
        return "from HF_TOKEN"
    path = _token_path()
    if path is not None and path.is_file():
        return "from the huggingface_hub login (`hf auth login`)"
    return "none found: set HF_TOKEN or run `hf auth login` before pushing"


def _token_path() -> Path | None:
    if os.environ.get("HF_TOKEN_PATH"):
        return Path(os.environ["HF_TOKEN_PATH"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                     os.path.expanduser("~/.cache"), "huggingface")
    return Path(home) / "token"


def _refuse_files(pair: Path, found: list[Unpublishable]) -> None:
    first = found[0]
    rel = first.path.relative_to(pair).as_posix()
    more = f" ({len(found) - 1} more: {', '.join(f.path.relative_to(pair).as_posix() for f in found[1:4])}" \
           f"{', ...' if len(found) > 4 else ''})" if len(found) > 1 else ""
    fix = (f"delete {rel} or move it out of {pair.name}/" + (", and remove the secret from the file"
                                                            if first.reason.startswith("a file that holds") else "")
           + ", or pass --force to push without it (a flagged file is never sent)")
    raise PushRefusedError(f"is {first.reason}, which should not be published{more}", where=first.path, fix=fix)


def _source_card(folder: Path, origin: dict) -> dict:
    """The source's model-card metadata: the copy `pair` made, the local source folder, or the Hub cache."""
    candidates = [folder / CARD_FILE]
    if isinstance(origin.get("path"), str):
        candidates.append(Path(origin["path"]) / CARD_FILE)
    for path in candidates:
        if path.is_file():
            return read_front_matter(path)
    if isinstance(origin.get("repo_id"), str):
        try:
            from huggingface_hub import try_to_load_from_cache  # the cache only: no request

            cached = try_to_load_from_cache(origin["repo_id"], CARD_FILE, revision=origin.get("commit") or None)
        except Exception:  # a malformed cache is no reason to stop a push
            cached = None
        if isinstance(cached, str) and Path(cached).is_file():
            return read_front_matter(Path(cached))
    return {}


def _side(repo_id: str, folder: Path, origin: dict) -> Side:
    license_ = license_of(_source_card(folder, origin))
    local = origin.get("path")
    return Side(repo_id=repo_id, source_repo_id=origin.get("repo_id") if isinstance(origin.get("repo_id"), str) else None,
                source_commit=origin.get("commit") if isinstance(origin.get("commit"), str) else None,
                source_name=Path(local).name if isinstance(local, str) else folder.name, license=license_)


def _acceptance(pair: Path, manifest: dict, bench: Path | None) -> dict | None:
    sources: list[tuple[dict, str]] = []
    if bench is not None:
        sources.append((read_json(bench, what="JSON (mtp-convert bench --json output)"), str(bench)))
    elif (pair / BENCH_FILE).is_file():
        sources.append((read_json(pair / BENCH_FILE, what="JSON (mtp-convert bench --json output)"), str(pair / BENCH_FILE)))
    for key in ("bench", "acceptance"):
        if isinstance(manifest.get(key), dict):
            sources.append((manifest[key], f"{pair / PAIR_FILE}: {key}"))
    for data, where in sources:
        try:
            numbers = normalize_acceptance(data, where)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"is not `mtp-convert bench --json` or `run --json` output ({type(e).__name__}: {e})",
                              where=where, fix="write it with `mtp-convert bench PAIR --json > FILE`") from e
        if numbers is None and where == str(bench):
            raise ConfigError("holds no acceptance numbers", where=where,
                              fix="write it with `mtp-convert bench PAIR --json > FILE`")
        if numbers is not None:
            return numbers
    return None


def _files(folder: Path, skip: set[Path], card: str) -> list[UploadFile]:
    files = []
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or path in skip:
            continue
        rel = path.relative_to(folder).as_posix()
        if rel == CARD_FILE:
            continue  # replaced by the generated card (its license is carried over)
        files.append(UploadFile(rel, path.stat().st_size, local=path))
    data = card.encode("utf-8")
    files.append(UploadFile(CARD_FILE, len(data), content=data))
    return files


def plan_push(pair: str | Path, repo_id: str, *, draft_repo_id: str | None = None, revision: str | None = None,
              private: bool = False, commit_message: str | None = None, bench: str | Path | None = None,
              force: bool = False, endpoint: str | None = None) -> PushPlan:
    """Everything `push` will send, checked; no request is made."""
    pair = Path(pair)
    target_id = check_repo_id(repo_id, "--repo-id")
    owner, name = target_id.split("/")
    if draft_repo_id is None:
        draft_id = f"{owner}/{name}-assistant"
        if len(name) + len("-assistant") > 96:
            raise ConfigError(f"{draft_id!r} would be longer than the Hub allows", where="--repo-id",
                              fix="name the assistant's repo with --draft-repo-id")
    else:
        draft_id = check_repo_id(draft_repo_id, "--draft-repo-id")
    if draft_id.lower() == target_id.lower():
        raise ConfigError("the target and the assistant need two repos", where="--draft-repo-id",
                          fix="give the assistant another repo id (the default is NAME-assistant)")
    revision = check_revision(revision)
    if not pair.is_dir():
        raise SourceNotFoundError("no such folder" if not pair.exists() else "is not a folder", where=pair,
                                  fix="pass a folder written by `mtp-convert pair`")
    for sub in ("target", "draft"):
        if not (pair / sub).is_dir():
            raise SourceNotFoundError(f"has no {sub}/ folder", where=pair, fix="pass a folder written by `mtp-convert pair`")
    if not (pair / PAIR_FILE).is_file():
        raise SourceNotFoundError(f"has no {PAIR_FILE}", where=pair,
                                  fix="pass a folder written by `mtp-convert pair` (it records what the cards say)")
    manifest = read_json(pair / PAIR_FILE, what="JSON (written by mtp-convert pair)")

    # Files first: a secret must be found before anything else is read or reported.
    secrets = local_tokens()
    found = screen_folder(pair / "target", secrets) + screen_folder(pair / "draft", secrets)
    if found and not force:
        _refuse_files(pair, found)

    target_ck, draft_ck = open_checkpoint(pair / "target"), open_checkpoint(pair / "draft")
    for ck in (target_ck, draft_ck):
        if ck.config_only:
            raise PushRefusedError("holds no safetensors weights (a config-only pair)", where=ck.folder,
                                   fix="pair full checkpoints; vLLM cannot load a repo without weights")
    findings = check_pair(target_ck, draft_ck)
    errors = [f for f in findings if f.severity == "error"]
    if errors and not force:
        raise PushRefusedError(f"fails `mtp-convert check` ({len(errors)} error(s); first: [{errors[0].id}] "
                               f"{errors[0].message})", where=pair,
                               fix=f"run `mtp-convert check {pair}` and fix what it reports (or pair again), or pass "
                                   "--force to publish it anyway")

    tokens = manifest.get("num_speculative_tokens")
    if isinstance(tokens, dict) and isinstance(tokens.get("value"), int):
        n_tokens, why = tokens["value"], str(tokens.get("why") or "")
    else:
        n_tokens, why = recommended_tokens(target_ck.config)
    target_origin = manifest.get("target") if isinstance(manifest.get("target"), dict) else {}
    draft_origin = manifest.get("draft") if isinstance(manifest.get("draft"), dict) else {}
    scrub = {str(pair.resolve()): pair.name}
    for key, origin in (("the target's source folder", target_origin), ("the assistant's source folder", draft_origin)):
        if isinstance(origin.get("path"), str):
            scrub[origin["path"]] = f"<{key}>"
    quantized_by = manifest.get("target_quantized_by") if isinstance(manifest.get("target_quantized_by"), dict) else None
    rules = [r for r in manifest.get("draft_rules") or [] if isinstance(r, dict)]
    ctx = CardContext(
        target=_side(target_id, pair / "target", target_origin),
        draft=_side(draft_id, pair / "draft", draft_origin),
        endpoint=(endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/"),
        revision=revision, num_speculative_tokens=n_tokens, tokens_why=why,
        quantization=detect_quantization(target_ck.config, target_ck.read_json_file(HF_QUANT_CONFIG),
                                         str(target_ck.folder / "config.json")),
        quantized_by=quantized_by, kv_scales=has_kv_scales(target_ck), draft_rules=rules, findings=findings,
        acceptance=_acceptance(pair, manifest, Path(bench) if bench is not None else None), scrub=scrub)

    skip = {item.path for item in found}
    target_text, draft_text = target_card(ctx), draft_card(ctx)
    notes = []
    no_base = [role for side, role in ((ctx.target, "target"), (ctx.draft, "assistant")) if not side.source_repo_id]
    no_license = [role for side, role in ((ctx.target, "target"), (ctx.draft, "assistant")) if not side.license]
    if no_base:
        notes.append(f"no base_model in the {' and '.join(no_base)} card(s): {PAIR_FILE} records no Hub id for the "
                     "source (a local folder); add it on the Hub if you know it")
    replaced = [f"{sub}/{CARD_FILE}" for sub in ("target", "draft") if (pair / sub / CARD_FILE).is_file()]
    if replaced:
        notes.append(f"{' and '.join(replaced)} (the source's model card) is replaced by the generated card; its "
                     "license is carried over")
    if no_license:
        notes.append(f"no license in the {' and '.join(no_license)} card(s): the source has no model card with one; "
                     "add it on the Hub")
    return PushPlan(
        pair=pair,
        target=RepoPlan("target", target_id, pair / "target", _files(pair / "target", skip, target_text), target_text),
        draft=RepoPlan("draft", draft_id, pair / "draft", _files(pair / "draft", skip, draft_text), draft_text),
        revision=revision, private=private, commit_message=commit_message, left_out=found, check_errors=errors,
        notes=notes, serve=vllm_lines(ctx)[0])

