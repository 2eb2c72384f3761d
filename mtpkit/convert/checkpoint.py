"""A Hugging Face checkpoint folder: its config, its tensor files, and the files that travel with them.

Opening a folder validates all of it up front (every shard header, the index against the shards,
no tensor twice), as compressed-tensors' model-free converter does, so a command fails before it
writes anything rather than half way through.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mtpkit.convert.safetensors_file import SafetensorsHeader, TensorInfo, load_tensor, read_header
from mtpkit.errors import CheckpointError, ConfigError, PickleRefusedError, SourceNotFoundError

if TYPE_CHECKING:
    import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def read_json(path: Path, *, what: str = "JSON") -> dict:
    """Read a JSON object, rejecting non-UTF-8 bytes, invalid JSON, duplicate keys and non-objects."""

    def no_duplicates(pairs: list[tuple[str, object]]) -> dict:
        keys = [k for k, _ in pairs]
        for key in keys:
            if keys.count(key) > 1:
                raise ValueError(f"duplicate key {key!r}")
        return dict(pairs)

    try:
        value = json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=no_duplicates)
    except FileNotFoundError:
        raise ConfigError(f"no {path.name}", where=path.parent, fix=f"point at a folder that has {path.name}") from None
    except OSError as e:
        raise ConfigError(f"cannot be read ({e.strerror})", where=path) from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"is not UTF-8 text (byte {e.start})", where=path, fix=f"rewrite it as UTF-8 {what}") from e
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser's stack
        raise ConfigError(f"is not valid {what} ({type(e).__name__}: {e})", where=path,
                          fix="fix the syntax or restore the original file") from e
    if not isinstance(value, dict):
        raise ConfigError(f"holds a JSON {type(value).__name__}, not an object", where=path, fix="restore the original file")
    return value


def check_inside(path: Path, root: Path) -> None:
    """Refuse a file that is (or links to) something outside the checkpoint: it would leak into outputs."""
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        raise CheckpointError(f"points outside the checkpoint folder (to {path.resolve()})", where=path,
                              fix="replace the link with the file itself, or remove it") from None


@dataclass
class Checkpoint:
    """A validated checkpoint folder. `tensors` is empty for a config-only folder."""

    folder: Path
    config: dict
    shards: list[SafetensorsHeader] = field(default_factory=list)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)  # sorted by name
    index_metadata: dict | None = None
    allowed_root: Path | None = None  # where symlinks may point; None: inside `folder`
    origin: dict | None = None  # for a Hub source: repo_id, revision, commit

    @property
    def config_only(self) -> bool:
        return not self.shards

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def read_json_file(self, name: str) -> dict | None:
        path = self.folder / name
        return read_json(path) if path.is_file() else None

    def iter_tensors(self, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) one at a time; each tensor maps only its own bytes."""
        for name in self.tensors if names is None else names:
            yield name, load_tensor(self.tensors[name])

    def other_files(self) -> list[Path]:
        """Files that travel with the weights (tokenizer, chat template, generation and processor configs).

        Not the weights or their index, no pickles (never passed on), nothing hidden (.git, caches).
        """
        weight_files = {s.path.name for s in self.shards} | {INDEX_FILE}
        keep = []
        for path in sorted(self.folder.rglob("*")):
            rel = path.relative_to(self.folder)
            if any(part.startswith(".") for part in rel.parts) or not path.is_file():
                continue
            if rel.as_posix() in weight_files or path.suffix in PICKLE_SUFFIXES or path.suffix == ".safetensors":
                continue
            keep.append(path)
        return keep


def open_checkpoint(folder: str | Path, *, allowed_root: Path | None = None, read_tensors: bool = True) -> Checkpoint:
    """Open and validate `folder`. Symlinks must stay inside `allowed_root` (default: the folder itself).

    `read_tensors=False` opens it config-only (for a Hub repo whose weights were not fetched).
    """
    folder = Path(folder)
    if not folder.exists():
        raise SourceNotFoundError("no such folder", where=folder, fix="check the path, or pass a Hub repo id as OWNER/NAME")
    if not folder.is_dir():
        raise SourceNotFoundError("is a file, not a checkpoint folder", where=folder, fix="pass the folder that holds config.json")
    root = allowed_root or folder
    _check_links(folder, root)
    config = read_json(folder / "config.json", what="JSON config")
    if not read_tensors:
        return Checkpoint(folder, config, allowed_root=allowed_root)
    shard_names, index_metadata = _shard_names(folder)
    shards = []
    for name in shard_names:
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"names shard {name!r}, which is missing", where=folder / INDEX_FILE,
                                  fix="download the missing shard, or regenerate the index")
        shards.append(read_header(path))
    tensors = _merge(folder, shards)
    if index_metadata is not None:
        _check_index(folder, index_metadata, tensors)
    if not shards:
        _refuse_pickles(folder)
    ordered = dict(sorted(tensors.items()))
    return Checkpoint(folder, config, shards, ordered, index_metadata.get("metadata") if index_metadata else None,
                      allowed_root)


def _check_links(folder: Path, root: Path) -> None:
    # Every file a command may read or copy must stay inside the checkpoint (the Hub cache: inside the
    # repo's cache folder), so a link to /etc/... or another user's files never leaks into an output.
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.is_symlink() and not any(part.startswith(".") for part in rel.parts):
            check_inside(path, root)


def _shard_names(folder: Path) -> tuple[list[str], dict | None]:
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        index = read_json(index_path, what="JSON index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError("has no 'weight_map' of tensor name -> shard file", where=index_path,
                                  fix="regenerate the index")
        for shard in set(weight_map.values()):
            if Path(shard).is_absolute() or ".." in Path(shard).parts:
                raise CheckpointError(f"names shard {shard!r} outside the folder", where=index_path,
                                      fix="shard names must be plain file names inside the folder")
        return sorted(set(weight_map.values())), index
    single = folder / SINGLE_FILE
    if single.is_file():
        return [SINGLE_FILE], None
    if single.exists() or single.is_symlink():
        raise CheckpointError("is not a readable file (a folder, or a broken link)", where=single,
                              fix="restore model.safetensors")
    # No index and no model.safetensors: take any top-level safetensors files (some tools name them freely).
    return sorted(p.name for p in folder.glob("*.safetensors")), None


def _merge(folder: Path, shards: list[SafetensorsHeader]) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for shard in shards:
        for name, info in shard.tensors.items():
            if name in tensors:
                raise CheckpointError(
                    f"tensor {name!r} is in both {tensors[name].file.name} and {shard.path.name}",
                    where=folder, fix="remove the stale shard, or regenerate the checkpoint",
                )
            tensors[name] = info
    return tensors


def _check_index(folder: Path, index: dict, tensors: dict[str, TensorInfo]) -> None:
    index_path = folder / INDEX_FILE
    for name, shard in index["weight_map"].items():
        if name not in tensors:
            raise CheckpointError(f"lists tensor {name!r} in {shard}, which does not hold it", where=index_path,
                                  fix="regenerate the index or restore the shard")
        if tensors[name].file.name != Path(shard).name:
            raise CheckpointError(f"puts tensor {name!r} in {shard}, but it is in {tensors[name].file.name}",
                                  where=index_path, fix="regenerate the index")
    unlisted = sorted(set(tensors) - set(index["weight_map"]))
    if unlisted:
        raise CheckpointError(f"does not list tensor {unlisted[0]!r} ({len(unlisted)} unlisted)", where=index_path,
                              fix="regenerate the index")


def _refuse_pickles(folder: Path) -> None:
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise PickleRefusedError(
            f"has only pickle weights ({', '.join(pickles[:3])}), no safetensors",
            where=folder,
            fix="mtpkit never unpickles; convert them to safetensors with a tool you trust, or use the safetensors revision",
        )
