"""The safetensors dtype strings mtpkit reads and writes, their sizes, and their torch equivalents.

Sizes are known without torch so that listing, planning and raw copying (inspect, reshard) never pay
for importing it; torch is imported only when a tensor is actually materialised.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# On-disk name (safetensors' Rust `Dtype` enum) -> (bytes per element, torch attribute name).
_DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (1, "bool"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "U16": (2, "uint16"),
    "I16": (2, "int16"),
    "U32": (4, "uint32"),
    "I32": (4, "int32"),
    "U64": (8, "uint64"),
    "I64": (8, "int64"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "F32": (4, "float32"),
    "F64": (8, "float64"),
    "C64": (8, "complex64"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
    "F8_E8M0": (1, "float8_e8m0fnu"),
}
SAFETENSORS_DTYPES = tuple(_DTYPES)


def itemsize(dtype: str) -> int:
    """Bytes per element of an on-disk dtype name (KeyError for an unknown one)."""
    return _DTYPES[dtype][0]


@cache
def _torch_tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    import torch

    to_torch = {name: getattr(torch, attr) for name, (_, attr) in _DTYPES.items()}
    return to_torch, {v: k for k, v in to_torch.items()}


def torch_dtype(dtype: str) -> torch.dtype:
    return _torch_tables()[0][dtype]


def safetensors_dtype(dtype: torch.dtype) -> str:
    try:
        return _torch_tables()[1][dtype]
    except KeyError:
        raise ValueError(f"torch dtype {dtype} has no safetensors name") from None
