"""NVFP4 weight math: the E2M1 code table, nibble unpacking, and dequantization in both on-disk conventions.

An NVFP4 weight [out, in] is stored as uint8 [out, in/2] holding two 4-bit E2M1 codes per byte, one FP8 E4M3
scale per 16 consecutive inputs ([out, in/16]) and one float32 per-tensor scale. The producers disagree on
which way the per-tensor scale points:

* compressed-tensors (`weight_packed`, `weight_scale`, `weight_global_scale`) stores a *divisor*:
  W = code * (scale_fp8 / weight_global_scale), with weight_global_scale = 448 * 6 / amax;
* ModelOpt (`weight`, `weight_scale`, `weight_scale_2`) stores a *multiplier*:
  W = code * (scale_fp8 * weight_scale_2), with weight_scale_2 = amax / (448 * 6).

So weight_scale_2 == 1 / weight_global_scale for the same codes and group scales. Quantization (added later)
builds on the same table and group size.
"""

from __future__ import annotations

from typing import Literal

import torch

from mtpkit.formats.fp8 import FP8_E4M3_MAX

# One FP8 group scale covers this many consecutive input-dimension elements.
NVFP4_GROUP_SIZE = 16
# Largest E2M1 magnitude (exponent 11, mantissa 1: 2^(3-1) * 1.5); the quantizer maps a group's amax here.
E2M1_MAX = 6.0
# Code bit 3 is the sign; bits 2-1 the exponent (bias 1); bit 0 the mantissa.
E2M1_SIGN_BIT = 0x8
# The 16 code values. Exponent 0 is subnormal (0 and 0.5); code 8 is negative zero, kept as -0.0 because
# that is what the sign bit means (compressed-tensors decodes it the same way).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# What global scale maps a tensor's amax onto: the full FP8 range of the group scales times the FP4 range.
NVFP4_SCALE_RANGE = FP8_E4M3_MAX * E2M1_MAX

Convention = Literal["compressed-tensors", "modelopt"]
CONVENTIONS: tuple[Convention, ...] = ("compressed-tensors", "modelopt")


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """The code -> value table as float32 (index with a code tensor)."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def unpack_fp4_codes(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """uint8 [out, in/2] -> uint8 codes [out, in]: the LOW nibble is the even column, the high nibble the odd.

    Both producers pack the same way (compressed-tensors: `idx[:, 0] | idx[:, 1] << 4`; ModelOpt:
    `q[..., 1::2] << 4 | q[..., 0::2]`), so one unpacker serves both.
    """
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed FP4 weight must be uint8, got {packed.dtype}")
    if in_features % 2:
        raise ValueError(f"in_features must be even to pack two FP4 codes per byte, got {in_features}")
    if tuple(packed.shape) != (out_features, in_features // 2):
        raise ValueError(f"packed FP4 weight has shape {list(packed.shape)}, "
                         f"expected [{out_features}, {in_features // 2}] for a [{out_features}, {in_features}] weight")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(out_features, in_features)


def unpack_fp4(packed: torch.Tensor, out_features: int, in_features: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [out, in/2] -> E2M1 values [out, in] (unscaled), low nibble first."""
    codes = unpack_fp4_codes(packed, out_features, in_features)
    return e2m1_table(packed.device)[codes.long()].to(dtype)


def dequantize_nvfp4(packed: torch.Tensor, group_scale_fp8: torch.Tensor, global_scale: torch.Tensor, *,
                     convention: Convention, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantize a packed [out, in/2] NVFP4 weight with [out, in/16] FP8 group scales to [out, in] `dtype`.

    `global_scale` is compressed-tensors' `weight_global_scale` (divided by) or ModelOpt's `weight_scale_2`
    (multiplied by), per `convention`. The effective per-group scale is formed first, in float32, and then
    multiplied into the codes: that is the order both reference implementations use (compressed-tensors
    `scale / global_scale` in `_dequantize`; ModelOpt `q_per_block_scale * double_scale`), so the float32
    roundings, and therefore the results, are the same as theirs.
    """
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    if packed.ndim != 2:
        raise ValueError(f"packed FP4 weight must be 2-D [out, in/2], got shape {list(packed.shape)}")
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    if in_features % NVFP4_GROUP_SIZE:
        raise ValueError(f"NVFP4 input dimension {in_features} is not a multiple of the group size "
                         f"{NVFP4_GROUP_SIZE}")
    groups = in_features // NVFP4_GROUP_SIZE
    if tuple(group_scale_fp8.shape) != (out_features, groups):
        raise ValueError(f"NVFP4 weight_scale has shape {list(group_scale_fp8.shape)}, expected "
                         f"[{out_features}, {groups}] (one per {NVFP4_GROUP_SIZE} inputs of a "
                         f"[{out_features}, {in_features}] weight)")
    if not group_scale_fp8.is_floating_point():
        raise ValueError(f"NVFP4 weight_scale must be float8_e4m3fn (or a float dtype), got {group_scale_fp8.dtype}")
    if global_scale.numel() != 1 or not global_scale.is_floating_point():
        name = "weight_global_scale" if convention == "compressed-tensors" else "weight_scale_2"
        raise ValueError(f"NVFP4 {name} must be one float value, got {global_scale.dtype} "
                         f"shape {list(global_scale.shape)}")

    scale = group_scale_fp8.to(torch.float32)
    tensor_scale = global_scale.to(torch.float32).reshape(())
    scale = scale / tensor_scale if convention == "compressed-tensors" else scale * tensor_scale
    values = unpack_fp4(packed, out_features, in_features).reshape(out_features, groups, NVFP4_GROUP_SIZE)
    return (values * scale.unsqueeze(-1)).reshape(out_features, in_features).to(dtype)
