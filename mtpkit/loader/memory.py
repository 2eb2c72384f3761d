"""How much memory a target and its assistant need once loaded, and how much the device has.

Estimated from the tensor headers before anything is read: floating tensors in the compute dtype, quantized
ones (FP8 / FP4 codes and their scales) as stored, except MoE experts stored per expert, which the runtime
holds dense (runtime.moe.fuse_expert_tensors); vision and audio towers are not loaded. The KV cache and
activations come on top: a margin covers a modest context.
"""

from __future__ import annotations

import math
import re

import torch

from mtpkit.convert.checkpoint import Checkpoint
from mtpkit.errors import InsufficientMemoryError
from mtpkit.formats.dequantize import ACTIVATION_SCALE_SUFFIXES, WEIGHT_SCALE_SUFFIXES

_TOWERS = ("vision_tower.", "embed_vision.", "audio_tower.", "embed_audio.")
_PER_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.(\w+)$")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}
MARGIN = 1.1  # activations, the KV cache of a short context, allocator slack


def model_bytes(checkpoint: Checkpoint, dtype: torch.dtype) -> int:
    size = 0
    for name, info in checkpoint.tensors.items():
        if any(tower in name for tower in _TOWERS) or name.rpartition(".")[2] in ACTIVATION_SCALE_SUFFIXES:
            continue
        count = math.prod(info.shape)
        expert = _PER_EXPERT.search(name)
        if expert:  # dequantized into the fused dense experts, which keep none of the scales
            if expert[2] in ("weight", "weight_packed"):
                size += count * (2 if info.dtype == "U8" else 1) * dtype.itemsize
        elif info.dtype in ("BF16", "F16", "F32") and name.rpartition(".")[2] not in WEIGHT_SCALE_SUFFIXES:
            size += count * dtype.itemsize
        else:  # quantized codes, and weight scales (kept as stored, whatever their dtype)
            size += info.nbytes
    embed = checkpoint.tensors.get("model.embed_tokens.weight")
    if checkpoint.config.get("use_ordered_embeddings") is True and embed is not None:
        size += math.prod(embed.shape) * dtype.itemsize  # the assistant's ordered_rows: a second copy of the table
    return size


def parse_bytes(text: str | int) -> int:
    """'8GB' / '512MiB' / 1000 -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(text))
    unit = (match[2] or "B").upper() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size such as 8GB or 512MiB")
    return int(float(match[1]) * _UNITS[unit])


def available_bytes(device: torch.device) -> int | None:
    """Free memory on the device (CUDA: free device memory; CPU: MemAvailable), or None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} TiB"


def check_memory(needed: int, device: torch.device, max_memory: str | int | None, where: str) -> None:
    budget = parse_bytes(max_memory) if max_memory is not None else available_bytes(device)
    if budget is not None and needed * MARGIN > budget:
        what = "the --max-memory budget" if max_memory is not None else f"free on {device}"
        raise InsufficientMemoryError(
            f"needs about {human(needed * MARGIN)} on {device} (weights {human(needed)} + 10%), {human(budget)} "
            f"{what}", where=where,
            fix="use a quantized target (`mtp-convert quantize --scheme nvfp4`), another --device, or free memory")
