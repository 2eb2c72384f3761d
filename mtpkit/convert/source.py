"""Turn what the user typed (a folder, or a Hub repo id) into a local checkpoint folder.

Hub repos are resolved with huggingface_hub's `snapshot_download`, so its cache, `HF_TOKEN`,
`HF_HOME`/`HF_HUB_CACHE` and `HF_HUB_OFFLINE` behave as everywhere else in the ecosystem.
Pickle weights are never fetched: mtpkit would refuse them anyway.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from mtpkit.convert.checkpoint import Checkpoint, open_checkpoint
from mtpkit.errors import SourceNotFoundError

# Files a conversion needs besides the weights; everything else in a repo (pickles, ONNX, GGUF) is skipped.
CONFIG_PATTERNS = ["*.json", "*.jinja", "*.model", "*.txt", "*.md", "*.tiktoken", "LICENSE*"]
WEIGHT_PATTERNS = ["*.safetensors"]
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class Source:
    folder: Path
    repo_id: str | None = None  # set when it came from the Hub
    revision: str | None = None
    allowed_root: Path | None = None  # where its symlinks may point (the Hub cache keeps blobs beside snapshots)


def looks_like_repo_id(text: str) -> bool:
    return bool(_REPO_ID.fullmatch(text)) and ".." not in text


def resolve_source(src: str | Path, *, revision: str | None = None, weights: bool = True,
                   local_files_only: bool = False) -> Source:
    """A local folder is used as it is; OWNER/NAME that is not a local folder is fetched from the Hub.

    `weights=False` fetches only configs and tokenizer files (enough to inspect a repo without
    downloading gigabytes).
    """
    path = Path(src)
    if path.exists():
        if revision is not None:
            raise SourceNotFoundError("is a local folder; --revision applies to Hub repos only", where=path,
                                      fix="drop --revision, or pass a Hub repo id")
        return Source(path)
    text = str(src)
    if not looks_like_repo_id(text):
        raise SourceNotFoundError("no such folder", where=path, fix="check the path, or pass a Hub repo id as OWNER/NAME")
    return _from_hub(text, revision, weights, local_files_only)


def _from_hub(repo_id: str, revision: str | None, weights: bool, local_files_only: bool) -> Source:
    # Imported here: huggingface_hub's import is slow and most commands work on local folders.
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}@{revision}" if revision else repo_id
    patterns = CONFIG_PATTERNS + (WEIGHT_PATTERNS if weights else [])
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                   local_files_only=local_files_only)
    except GatedRepoError as e:
        raise SourceNotFoundError("is gated: your token has no access", where=where,
                                  fix="accept the licence on the repo page, then set HF_TOKEN or run `hf auth login`") from e
    except RepositoryNotFoundError as e:
        raise SourceNotFoundError("is not a local folder nor a Hub repo you can see", where=where,
                                  fix="check the spelling; for a private repo set HF_TOKEN or run `hf auth login`") from e
    except RevisionNotFoundError as e:
        raise SourceNotFoundError(f"has no revision {revision!r}", where=repo_id, fix="check the branch, tag or commit") from e
    except LocalEntryNotFoundError as e:
        why = "HF_HUB_OFFLINE is set" if constants.is_offline_mode() else "the Hub cannot be reached"
        raise SourceNotFoundError(f"is not a local folder, and not in the Hub cache ({why})", where=where,
                                  fix="download it once with network access, or pass a local folder") from e
    except (HfHubHTTPError, OSError) as e:
        raise SourceNotFoundError(f"could not be fetched ({type(e).__name__})", where=where,
                                  fix="check your network and try again") from e
    folder = Path(folder)
    # snapshots/<commit>/file -> ../../blobs/<hash>: links may point anywhere inside the repo's cache folder.
    return Source(folder, repo_id, revision, allowed_root=folder.parent.parent)


def open_source(src: str | Path, *, revision: str | None = None, weights: bool = True,
                local_files_only: bool = False) -> Checkpoint:
    """Resolve `src` and open it. With `weights`, a Hub snapshot must hold its safetensors.

    A local folder is read as it is (config-only when it has no weights); a Hub repo without
    `weights` is opened config-only, without fetching gigabytes.
    """
    source = resolve_source(src, revision=revision, weights=weights, local_files_only=local_files_only)
    from_hub = source.repo_id is not None
    checkpoint = open_checkpoint(source.folder, allowed_root=source.allowed_root, read_tensors=weights or not from_hub)
    if from_hub and weights and checkpoint.config_only:
        # Offline, huggingface_hub returns whatever part of the snapshot is cached (e.g. the configs an
        # earlier config-only inspect fetched).
        raise SourceNotFoundError("the cached snapshot holds no safetensors weights", where=source.repo_id,
                                  fix="run again with network access (HF_HUB_OFFLINE unset) to download them")
    if from_hub:
        checkpoint.origin = {"repo_id": source.repo_id, "revision": source.revision, "commit": source.folder.name}
    return checkpoint
