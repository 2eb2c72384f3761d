"""FP8 E4M3 weight math: the format's constants and dequantization for the three scale layouts.

Both producers mtpkit reads store an FP8 weight as `weight` (float8_e4m3fn) plus `weight_scale`, with
W = fp8_value * scale broadcast over the weight. Only the scale's shape tells the layouts apart:

* per-tensor:  one value (shape [], [1] or [1, 1]) - compressed-tensors FP8, ModelOpt FP8;
* per-channel: one value per output row ([out, 1] or [out]) - compressed-tensors FP8_DYNAMIC, ModelOpt FP8_PC_PT;
* per-block:   one value per 128x128 tile ([ceil(out/128), ceil(in/128)]) - compressed-tensors FP8_BLOCK,
  ModelOpt FP8_PB_WO; the last row/column of tiles may be partial (the quantizer pads, then truncates).

Quantization (a later addition) reuses the constants and `scale_layout` so both directions agree.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

FP8_DTYPE = torch.float8_e4m3fn
# Largest finite E4M3 value (S.1111.110 = 1.75 * 2^8); E4M3 "fn" has no infinities, so the quantizer must clamp here.
FP8_E4M3_MAX = 448.0
# Smallest positive subnormal (2^-9): ModelOpt clamps block scales here so that tiny ones do not flush to 0.
FP8_E4M3_MIN_SUBNORMAL = 2.0**-9
# The DeepSeek-style tile that compressed-tensors' FP8_BLOCK preset and ModelOpt's FP8_PB_WO both use.
FP8_BLOCK_SIZE = (128, 128)

ScaleLayout = Literal["tensor", "channel", "block"]


def block_grid(out_features: int, in_features: int, block: tuple[int, int] = FP8_BLOCK_SIZE) -> tuple[int, int]:
    """Shape of the block-scale tensor: ceil on both axes because edge tiles are partial, not dropped."""
    return math.ceil(out_features / block[0]), math.ceil(in_features / block[1])


def scale_layout(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...],
                 block: tuple[int, int] = FP8_BLOCK_SIZE) -> ScaleLayout:
    """Which layout a scale of `scale_shape` is for a 2-D weight of `weight_shape`; ValueError if none fits.

    One element is always "tensor": a single tile or a single row makes the other layouts the same math.
    """
    if len(weight_shape) != 2:
        raise ValueError(f"FP8 weight must be 2-D [out, in], got shape {list(weight_shape)}")
    out_features, in_features = weight_shape
    if math.prod(scale_shape) == 1 and len(scale_shape) <= 2:
        return "tensor"
    if tuple(scale_shape) in ((out_features,), (out_features, 1)):
        return "channel"
    if tuple(scale_shape) == block_grid(out_features, in_features, block):
        return "block"
    rows, cols = block_grid(out_features, in_features, block)
    raise ValueError(
        f"weight_scale shape {list(scale_shape)} fits no FP8 layout for weight [{out_features}, {in_features}]: "
        f"expected [1] (per-tensor), [{out_features}, 1] (per-channel) or [{rows}, {cols}] "
        f"({block[0]}x{block[1]} blocks)")


def expand_block_scale(scale: torch.Tensor, out_features: int, in_features: int,
                       block: tuple[int, int] = FP8_BLOCK_SIZE) -> torch.Tensor:
    """Repeat each tile's scale over its tile, then cut the padding off the partial edge tiles."""
    full = scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[:out_features, :in_features]


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
                   block: tuple[int, int] = FP8_BLOCK_SIZE) -> torch.Tensor:
    """W = fp8 * scale for a [out, in] float8_e4m3fn weight, with the scale's layout read from its shape.

    The product is taken in float32 and rounded to `dtype`. An E4M3 value has a 4-bit significand and a
    bf16/fp16 scale at most 11 bits, so that float32 product is exact and only the final cast rounds; with
    a float32 scale the one rounding is the float32 multiply itself. Either way this is the single rounding
    compressed-tensors does when it multiplies in the scale's dtype, so the results agree bit for bit.
    """
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    if not weight_scale.is_floating_point() or weight_scale.dtype in (FP8_DTYPE, torch.float8_e5m2):
        raise ValueError(f"FP8 weight_scale must be a float16/bfloat16/float32 tensor, got {weight_scale.dtype}")
    layout = scale_layout(tuple(weight.shape), tuple(weight_scale.shape), block)
    scale = weight_scale.to(torch.float32)
    if layout == "tensor":
        scale = scale.reshape(())
    elif layout == "channel":
        scale = scale.reshape(-1, 1)
    else:
        scale = expand_block_scale(scale, weight.shape[0], weight.shape[1], block)
    return (weight.to(torch.float32) * scale).to(dtype)
