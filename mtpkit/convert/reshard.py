"""Re-shard a checkpoint: same tensors, new shard size, written atomically and verified.

The simplest files-in, files-out command, and the template for the others: validate the whole
input first, plan the output, stream it into a temporary folder, verify, rename.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mtpkit.convert.atomic import atomic_output_dir
from mtpkit.convert.checkpoint import Checkpoint
from mtpkit.convert.describe import describe
from mtpkit.convert.writer import DEFAULT_MAX_SHARD_SIZE, TensorSpec, parse_shard_size, write_checkpoint_tensors
from mtpkit.errors import CheckpointError


@dataclass(frozen=True)
class ReshardResult:
    folder: Path
    shards: int
    tensors: int
    total_bytes: int
    copied_files: list[str]


def copy_other_files(checkpoint: Checkpoint, out: Path, *, skip: set[str] = frozenset()) -> list[str]:
    """Copy tokenizer, chat template, generation and processor configs byte for byte; returns their names."""
    copied = []
    for path in checkpoint.other_files():
        rel = path.relative_to(checkpoint.folder).as_posix()
        if rel in skip:
            continue
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        copied.append(rel)
    return copied


def reshard(checkpoint: Checkpoint, out: str | Path, *, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
            force: bool = False, on_tensor: Callable[[TensorSpec], None] | None = None) -> ReshardResult:
    if checkpoint.config_only:
        raise CheckpointError("has no safetensors weights to re-shard", where=checkpoint.folder,
                              fix="point at a folder with model.safetensors or an index and its shards")
    describe(checkpoint)  # a Gemma 4 config that mtpkit can read, checked before anything is written
    parse_shard_size(max_shard_size)  # refuse a bad size before creating anything
    out = Path(out)
    specs = [TensorSpec.of(info) for info in checkpoint.tensors.values()]
    with atomic_output_dir(out, force=force, sources=(checkpoint.folder,)) as tmp:
        weight_map = write_checkpoint_tensors(
            tmp, specs, lambda spec: checkpoint.tensors[spec.name],  # unchanged: copy raw bytes
            max_shard_size=max_shard_size, on_tensor=on_tensor,
        )
        copied = copy_other_files(checkpoint, tmp)
    return ReshardResult(out, len(set(weight_map.values())), len(specs), checkpoint.total_bytes, copied)
