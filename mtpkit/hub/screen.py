"""Which files of a pair folder must not be published: pickles, secrets, editor and OS litter, hidden files.

By name (pickles, `.env`, keys and token files, `*~`, `*.swp`, `.DS_Store`, anything hidden), and by content
for the small files (a Hugging Face token, the caller's own token, a private key). The reason never quotes the
secret it found.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
KEY_SUFFIXES = (".pem", ".key", ".p12", ".pfx", ".jks", ".keystore")
CREDENTIAL_NAMES = frozenset({".netrc", "_netrc", ".git-credentials", ".pypirc", ".npmrc", "credentials",
                              "credentials.json"})
SSH_KEY_PREFIXES = ("id_rsa", "id_dsa", "id_ecdsa", "id_ed25519")
TOKEN_NAMES = frozenset({"token", "token.txt", "hf_token", "hf_token.txt", "stored_tokens", "access_token"})
BACKUP_SUFFIXES = (".swp", ".swo", ".swx", ".bak", ".orig", ".rej")
OS_LITTER = frozenset({".ds_store", "thumbs.db", "desktop.ini"})
# Files larger than this are weights or tokenizers; only smaller ones are read for secrets.
CONTENT_SCAN_LIMIT = 64 * 1024 * 1024
_HF_TOKEN = re.compile(rb"(?<![A-Za-z0-9_])hf_[A-Za-z0-9]{30,}(?![A-Za-z0-9])")
_PRIVATE_KEY = re.compile(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----")


@dataclass(frozen=True)
class Unpublishable:
    path: Path  # the file in the pair folder
    reason: str  # what it is, e.g. "a pickle file"
    secret: bool  # a credential: never sent, whatever the options


def classify_name(rel: PurePosixPath) -> tuple[str, bool] | None:
    """(reason, secret) for a file that must not be published, judged by its path; None when it may be."""
    name = rel.name
    lower = name.lower()
    suffix = PurePosixPath(lower).suffix
    stem = lower[: -len(suffix)] if suffix else lower
    if lower == ".env" or lower.startswith(".env.") or lower.endswith(".env"):
        return "an environment file (they hold secrets)", True
    if lower in CREDENTIAL_NAMES:
        return "a credentials file", True
    if lower.startswith(SSH_KEY_PREFIXES):
        return "an SSH key", True
    if suffix in KEY_SUFFIXES:
        return "a key or certificate file", True
    if lower in TOKEN_NAMES or suffix == ".token" or stem.endswith(("_token", "-token")):
        return "a token file", True
    if suffix in PICKLE_SUFFIXES:
        return "a pickle file (loading one can run code; mtpkit publishes safetensors only)", False
    if lower.endswith("~") or suffix in BACKUP_SUFFIXES or lower.startswith(".#") or \
            (lower.startswith("#") and lower.endswith("#")):
        return "an editor backup or swap file", False
    if lower in OS_LITTER:
        return "an operating-system file", False
    if any(part.startswith(".") for part in rel.parts):
        return "a hidden file", False
    return None


def classify_content(path: Path, secrets: tuple[str, ...]) -> str | None:
    """A reason when a small file holds a secret (never the secret itself); None otherwise."""
    if path.suffix == ".safetensors" or path.stat().st_size > CONTENT_SCAN_LIMIT:
        return None
    data = path.read_bytes()
    if any(secret and secret.encode() in data for secret in secrets):
        return "a file that holds your Hugging Face token"
    if _HF_TOKEN.search(data):
        return "a file that holds what looks like a Hugging Face token (hf_...)"
    if _PRIVATE_KEY.search(data):
        return "a file that holds a private key"
    return None


def screen_folder(folder: Path, secrets: tuple[str, ...] = ()) -> list[Unpublishable]:
    """Every file under `folder` that must not be published, sorted by path."""
    found = []
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        rel = PurePosixPath(path.relative_to(folder).as_posix())
        by_name = classify_name(rel)
        if by_name is not None:
            found.append(Unpublishable(path, *by_name))
            continue
        by_content = classify_content(path, secrets)
        if by_content is not None:
            found.append(Unpublishable(path, by_content, True))
    return found
