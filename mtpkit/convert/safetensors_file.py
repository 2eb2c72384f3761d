"""One safetensors file: a strictly validated header, and tensors read one at a time.

The header is parsed here rather than through `safetensors.safe_open` so that every defect gets a
message naming the file and the tensor, and so that reading stays bounded: `safe_open` maps the whole
file, and every page a stream touches then stays in the process's RSS until the file is closed.
Here each tensor maps only its own byte range, and the mapping lives exactly as long as the tensor.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from mtpkit.errors import CheckpointError
from mtpkit.formats.dtypes import SAFETENSORS_DTYPES, itemsize, torch_dtype

if TYPE_CHECKING:
    import torch

# safetensors' own limit on the JSON header (its Rust MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000
_PAGE = mmap.ALLOCATIONGRANULARITY
_CORRUPT_FIX = "the file is truncated or corrupt: download or write it again"


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie on disk; enough to list, plan and copy it without reading it."""

    name: str
    dtype: str  # safetensors dtype name, e.g. "BF16", "F8_E4M3"
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset of the data in `file`
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    metadata: dict[str, str] | None
    tensors: dict[str, TensorInfo]  # in the order of their data in the file
    data_start: int
    file_size: int


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    seen: dict[str, object] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def looks_like_pickle(prefix: bytes) -> bool:
    """torch.save writes a zip archive (PK..) or, in its legacy form, a raw pickle (0x80 protocol)."""
    return prefix.startswith(b"PK\x03\x04") or (len(prefix) >= 2 and prefix[0] == 0x80 and 2 <= prefix[1] <= 5)


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and validate the header of `path`; raises CheckpointError naming the file and the defect."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if looks_like_pickle(prefix):
                raise CheckpointError(
                    "is a pickle (torch.save) file, not safetensors",
                    where=path,
                    fix="mtpkit never unpickles; convert it to safetensors with a tool you trust",
                )
            if len(prefix) < 8:
                raise CheckpointError(f"is {file_size} bytes, too short for a safetensors header", where=path, fix=_CORRUPT_FIX)
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(MAX_HEADER_BYTES, file_size - 8):
                raise CheckpointError(
                    f"header length {header_len} exceeds the file ({file_size} bytes)", where=path, fix=_CORRUPT_FIX
                )
            raw = f.read(header_len)
    except OSError as e:
        raise CheckpointError(f"cannot be read ({e.strerror})", where=path) from e
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"header is not valid JSON ({type(e).__name__}: {e})", where=path, fix=_CORRUPT_FIX) from e
    if not isinstance(header, dict):
        raise CheckpointError("header is not a JSON object", where=path, fix=_CORRUPT_FIX)
    data_start = 8 + header_len
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise CheckpointError("__metadata__ must map strings to strings", where=path, fix=_CORRUPT_FIX)
    infos = [_tensor_info(path, name, entry, data_start) for name, entry in header.items()]
    infos.sort(key=lambda t: (t.start, t.start + t.nbytes))
    _check_contiguous(path, infos, data_start, file_size)
    return SafetensorsHeader(path, metadata, {t.name: t for t in infos}, data_start, file_size)


def _tensor_info(path: Path, name: str, entry: object, data_start: int) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError("header entry is not an object", where=where, fix=_CORRUPT_FIX)
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPES:
        known = ", ".join(SAFETENSORS_DTYPES)
        raise CheckpointError(f"unknown dtype {dtype!r} (known: {known})", where=where, fix="write it with a current safetensors")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise CheckpointError(f"shape {shape!r} is not a list of non-negative integers", where=where, fix=_CORRUPT_FIX)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
        raise CheckpointError(f"data_offsets {offsets!r} are not two non-negative integers", where=where, fix=_CORRUPT_FIX)
    begin, end = offsets
    expected = math.prod(shape) * itemsize(dtype)
    if end < begin or end - begin != expected:
        raise CheckpointError(
            f"holds {end - begin} bytes but shape {shape} of {dtype} needs {expected}", where=where, fix=_CORRUPT_FIX
        )
    return TensorInfo(name, dtype, tuple(shape), path, data_start + begin, expected)


def _check_contiguous(path: Path, infos: list[TensorInfo], data_start: int, file_size: int) -> None:
    # safetensors requires the data to be covered exactly once, in order, with no gap and no overlap.
    position = data_start
    for info in infos:
        if info.start != position:
            kind = "overlaps the tensor before it" if info.start < position else "leaves a gap before it"
            raise CheckpointError(f"tensor {info.name!r} {kind}", where=path, fix=_CORRUPT_FIX)
        position += info.nbytes
    if position != file_size:
        raise CheckpointError(
            f"data ends at byte {position} but the file has {file_size} bytes", where=path, fix=_CORRUPT_FIX
        )


def load_tensor(info: TensorInfo) -> torch.Tensor:
    """Map just this tensor's bytes and return a tensor over them (copy-on-write: the file is never written).

    The mapping is released when the tensor (and every view of it) is garbage-collected.
    """
    import torch  # here, not at module level: listing and copying never need it

    dtype = torch_dtype(info.dtype)
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=dtype)
    aligned = info.start - info.start % _PAGE
    with open(info.file, "rb") as f:
        mapping = mmap.mmap(f.fileno(), info.start + info.nbytes - aligned, offset=aligned, access=mmap.ACCESS_COPY)
    flat = torch.frombuffer(mapping, dtype=torch.uint8, offset=info.start - aligned, count=info.nbytes)
    if (info.start - aligned) % dtype.itemsize:
        flat = flat.clone()  # a misaligned tensor is legal on disk; give compute an aligned copy
    return flat.view(dtype).reshape(info.shape)


def copy_tensor_bytes(info: TensorInfo, out: BinaryIO) -> None:
    """Append this tensor's raw bytes to `out` inside the kernel (sendfile): no user-space copy, no RSS."""
    out.flush()
    with open(info.file, "rb") as src:
        offset, remaining = info.start, info.nbytes
        while remaining:
            try:
                sent = os.sendfile(out.fileno(), src.fileno(), offset, min(remaining, 1 << 30))
            except OSError:  # a filesystem without sendfile support: plain reads
                src.seek(offset)
                sent = out.write(src.read(min(remaining, 64 << 20)))
            if sent == 0:
                raise CheckpointError(f"tensor {info.name!r} ends early", where=info.file, fix=_CORRUPT_FIX)
            offset += sent
            remaining -= sent
