"""The safetensors dtype strings mtpkit reads and writes, and their torch equivalents."""

from __future__ import annotations

import torch

# On-disk name -> torch dtype. The names are safetensors' own (its Rust `Dtype` enum).
SAFETENSORS_TO_TORCH: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_TO_TORCH.items()}


def itemsize(dtype: str) -> int:
    """Bytes per element of an on-disk dtype name (KeyError for an unknown one)."""
    return SAFETENSORS_TO_TORCH[dtype].itemsize


def safetensors_dtype(dtype: torch.dtype) -> str:
    try:
        return TORCH_TO_SAFETENSORS[dtype]
    except KeyError:
        raise ValueError(f"torch dtype {dtype} has no safetensors name") from None
