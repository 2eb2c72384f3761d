"""Write a sharded safetensors checkpoint one tensor at a time.

Every shard's header is computed from the plan (names, dtypes, shapes) before any data exists, so a
shard is written front to back with each tensor streamed in as it is produced: memory holds one
tensor, never a shard. Unchanged tensors are copied byte for byte inside the kernel.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from huggingface_hub import split_state_dict_into_shards_factory

from mtpkit.convert.checkpoint import INDEX_FILE
from mtpkit.convert.safetensors_file import TensorInfo, copy_tensor_bytes, read_header
from mtpkit.errors import OutputError
from mtpkit.formats.dtypes import itemsize, safetensors_dtype

if TYPE_CHECKING:
    import torch

DEFAULT_MAX_SHARD_SIZE = "5GB"
FILENAME_PATTERN = "model{suffix}.safetensors"


@dataclass(frozen=True)
class TensorSpec:
    """What one output tensor will be: enough to lay out its shard before it is computed."""

    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    @classmethod
    def of(cls, info: TensorInfo) -> TensorSpec:
        return cls(info.name, info.dtype, info.shape)

    @classmethod
    def of_tensor(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, safetensors_dtype(tensor.dtype), tuple(tensor.shape))


# A producer returns the tensor to write, or the TensorInfo of an unchanged source tensor to copy raw.
Producer = Callable[[TensorSpec], "torch.Tensor | TensorInfo"]


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_shard_size(size: str | int) -> int:
    """'5GB' -> 5_000_000_000 (decimal units, as transformers counts; GiB and MiB are binary)."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", size.upper())
        if not match:
            raise OutputError(f"max shard size {size!r} is not a size", fix="write it like 5GB, 500MB, 2GiB or 2000000")
        value = int(float(match.group(1)) * _UNITS[match.group(2) or ""])
    if value <= 0:
        raise OutputError(f"max shard size {size!r} must be positive", fix="write it like 5GB, 500MB, 2GiB or 2000000")
    return value


def plan_shards(specs: list[TensorSpec], max_shard_size: str | int) -> dict[str, list[TensorSpec]]:
    """Group tensors into shard files in order, as transformers does (a tensor over the limit sits alone)."""
    by_name = {s.name: s for s in specs}
    split = split_state_dict_into_shards_factory(
        by_name,
        get_storage_size=lambda spec: spec.nbytes,
        filename_pattern=FILENAME_PATTERN,
        max_shard_size=parse_shard_size(max_shard_size),
    )
    return {
        filename: _data_order([by_name[n] for n in names])
        for filename, names in split.filename_to_tensors.items()
    }


def _data_order(specs: list[TensorSpec]) -> list[TensorSpec]:
    # Wider dtypes first, as safetensors itself orders data: with the 8-byte padded header this keeps
    # every tensor aligned to its element size, so readers can map it without a copy.
    return sorted(specs, key=lambda s: (-itemsize(s.dtype), s.name))


def shard_header(specs: list[TensorSpec], metadata: dict[str, str]) -> bytes:
    """The 8-byte length and the JSON header, padded with spaces to a multiple of 8."""
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)
    return len(raw).to_bytes(8, "little") + raw


def write_checkpoint_tensors(
    folder: Path,
    specs: list[TensorSpec],
    produce: Producer,
    *,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    metadata: dict[str, str] | None = None,
    on_tensor: Callable[[TensorSpec], None] | None = None,
) -> dict[str, str]:
    """Write the shards (and an index when there is more than one) into `folder`; returns the weight map.

    Every shard is re-opened afterwards and its header and size checked against the plan.
    """
    meta = {"format": "pt", **(metadata or {})}
    plan = plan_shards(specs, max_shard_size)
    for filename, shard_specs in plan.items():
        path = folder / filename
        with open(path, "wb", buffering=0) as out:
            _write_all(out, shard_header(shard_specs, meta))
            for spec in shard_specs:
                _write_one(out, spec, produce(spec), path)
                if on_tensor:
                    on_tensor(spec)
            os.fsync(out.fileno())
        _verify_shard(path, shard_specs)
    weight_map = {spec.name: filename for filename, shard_specs in plan.items() for spec in shard_specs}
    if len(plan) > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return weight_map


def _write_one(out, spec: TensorSpec, data: torch.Tensor | TensorInfo, path: Path) -> None:
    if isinstance(data, TensorInfo):
        if (data.dtype, data.shape) != (spec.dtype, spec.shape):
            raise OutputError(f"source tensor {data.name!r} is {data.dtype}{list(data.shape)}, planned {spec.dtype}{list(spec.shape)}", where=path)
        copy_tensor_bytes(data, out)
        return
    if (safetensors_dtype(data.dtype), tuple(data.shape)) != (spec.dtype, spec.shape):
        raise OutputError(
            f"tensor {spec.name!r} came out as {safetensors_dtype(data.dtype)}{list(data.shape)}, "
            f"planned {spec.dtype}{list(spec.shape)}", where=path)
    if spec.nbytes == 0:
        return
    import torch

    _write_all(out, data.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())


def _write_all(out, data) -> None:
    view = memoryview(data).cast("B")
    while view:  # a raw (unbuffered) write may be partial
        written = out.write(view)
        view = view[written:]


def _verify_shard(path: Path, specs: list[TensorSpec]) -> None:
    header = read_header(path)  # also checks the byte count: data must end exactly at the end of the file
    written = {name: (t.dtype, t.shape) for name, t in header.tensors.items()}
    planned = {s.name: (s.dtype, s.shape) for s in specs}
    if written != planned:
        raise OutputError("shard does not hold the planned tensors after writing", where=path,
                          fix="check the disk for errors and run the command again")
