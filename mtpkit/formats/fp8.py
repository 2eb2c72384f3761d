"""FP8 E4M3 weight math: the format's constants and dequantization for the three scale layouts.

Both producers mtpkit reads store an FP8 weight as `weight` (float8_e4m3fn) plus `weight_scale`, with
W = fp8_value * scale broadcast over the weight. Only the scale's shape tells the layouts apart:

* per-tensor:  one value (shape [], [1] or [1, 1]) - compressed-tensors FP8, ModelOpt FP8;
* per-channel: one value per output row ([out, 1] or [out]) - compressed-tensors FP8_DYNAMIC, ModelOpt FP8_PC_PT;
* per-block:   one value per 128x128 tile ([ceil(out/128), ceil(in/128)]) - compressed-tensors FP8_BLOCK,
  ModelOpt FP8_PB_WO; the last row/column of tiles may be partial (the quantizer pads, then truncates).

Quantization produces exactly the bytes compressed-tensors' own `quantize` produces for its FP8 / FP8_DYNAMIC /
FP8_BLOCK presets (checked against it in tests/formats/test_quantize_math.py): scale = amax / 448 per layout,
q = clamp(W / scale, -448, 448) cast to E4M3, and it reuses `scale_layout` so both directions agree.
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
# What compressed-tensors puts in place of a zero scale (an all-zero tensor/row/block) so that W / scale is not
# 0/0: `calculate_qparams` uses finfo(scale dtype).eps, and our scales are float32.
FP8_ZERO_SCALE = torch.finfo(torch.float32).eps

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
    grid = block_grid(out_features, in_features, block)
    # ModelOpt keeps the reduced block axes: [out/128, 1, in/128, 1] is the same grid.
    if tuple(scale_shape) in (grid, (grid[0], 1, grid[1], 1)):
        return "block"
    rows, cols = block_grid(out_features, in_features, block)
    raise ValueError(
        f"weight_scale shape {list(scale_shape)} fits no FP8 layout for weight [{out_features}, {in_features}]: "
        f"expected [1] (per-tensor), [{out_features}, 1] (per-channel) or [{rows}, {cols}] "
        f"({block[0]}x{block[1]} blocks)")


def expand_block_scale(scale: torch.Tensor, out_features: int, in_features: int,
                       block: tuple[int, int] = FP8_BLOCK_SIZE) -> torch.Tensor:
    """Repeat each tile's scale over its tile, then cut the padding off the partial edge tiles."""
    scale = scale.reshape(block_grid(out_features, in_features, block))  # ModelOpt's 4-D grid too
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


def check_finite(weight: torch.Tensor, name: str) -> None:
    """ValueError naming `name` if `weight` holds a NaN or an Inf.

    One such value would make its tensor's/row's/block's amax, hence its scale, NaN or Inf, and with it every
    quantized value that scale covers; the FP8 cast would even store NaN silently. So refuse, and say how many.
    """
    finite = torch.isfinite(weight)
    if not bool(finite.all()):
        nan = int(torch.isnan(weight).sum())
        inf = weight.numel() - int(finite.sum()) - nan
        raise ValueError(f"{name} has {nan} NaN and {inf} Inf value(s); cannot quantize a non-finite weight")


def check_float_weight(weight: torch.Tensor, name: str) -> None:
    """ValueError naming `name` unless `weight` is a 2-D 16/32/64-bit float tensor (what the quantizers take)."""
    if weight.ndim != 2:
        raise ValueError(f"{name} must be 2-D [out, in] to quantize, got shape {list(weight.shape)}")
    if not weight.is_floating_point() or weight.dtype.itemsize < 2:
        raise ValueError(f"{name} must be a 16/32/64-bit float tensor to quantize, got {weight.dtype}")


def fp8_weight_scale(weight: torch.Tensor, strategy: ScaleLayout, *, block: tuple[int, int] = FP8_BLOCK_SIZE,
                     name: str = "weight") -> torch.Tensor:
    """float32 amax / 448 for a [out, in] weight, in compressed-tensors' stored shape for `strategy`.

    "tensor" -> [1] (FP8), "channel" -> [out, 1] (FP8_DYNAMIC), "block" -> [ceil(out/bh), ceil(in/bw)]
    (FP8_BLOCK); the amax is of |W|, which is what `calculate_qparams`' max(|min(lo, 0)|, |max(hi, 0)|) is.
    Equal to `calculate_qparams` on float32 min/max. llm-compressor runs it on the weight's own dtype and stores
    that (bf16 for a bf16 model): a bf16 division is the float32 one rounded once, so `.to(weight.dtype)` of this
    is its value too (except for a zero amax, where its eps is the bf16 one).
    """
    check_float_weight(weight, name)
    check_finite(weight, name)
    magnitude = weight.to(torch.float32).abs()
    if strategy == "tensor":
        amax = magnitude.amax().reshape(1)
    elif strategy == "channel":
        amax = magnitude.amax(dim=1, keepdim=True)
    elif strategy == "block":
        rows, cols = block_grid(weight.shape[0], weight.shape[1], block)
        # Zero padding, as compressed-tensors pads, cannot raise an |amax|: a partial edge tile uses its own values.
        padded = torch.nn.functional.pad(
            magnitude, (0, cols * block[1] - weight.shape[1], 0, rows * block[0] - weight.shape[0]))
        amax = padded.reshape(rows, block[0], cols, block[1]).amax(dim=(1, 3))
    else:
        raise ValueError(f"FP8 scale strategy for {name} must be 'tensor', 'channel' or 'block', got {strategy!r}")
    scale = amax / FP8_E4M3_MAX
    # After the division, as compressed-tensors does, so an amax that underflows to a zero scale is caught too.
    return torch.where(scale == 0, FP8_ZERO_SCALE, scale)


def quantize_fp8(weight: torch.Tensor, scale: torch.Tensor, *, block: tuple[int, int] = FP8_BLOCK_SIZE,
                 name: str = "weight") -> torch.Tensor:
    """float8_e4m3fn [out, in] = clamp(W / scale, -448, 448), the scale's layout read from its shape.

    The arithmetic is compressed-tensors' `_quantize` (quantization/lifecycle/forward_helpers.py,
    `scaled = x / scale`): a true division, not a multiply by 1/scale, evaluated in torch's promoted dtype of
    weight and scale. So a bf16 weight with a float32 scale divides in float32, and with a bf16 scale (what
    llm-compressor stores for a bf16 model) in bf16, rounding the quotient to bf16 before the FP8 cast, exactly
    as it does. A per-tensor scale is kept 1-D: a 0-d one would not take part in promotion and the division would
    silently run in the weight's dtype. E4M3 "fn" has no Inf, and whether torch's cast saturates an out-of-range
    value (this CPU build does) or makes it NaN has varied by version and device, so clamp first, as
    compressed-tensors does; the cast itself then only rounds to nearest even.
    """
    check_float_weight(weight, name)
    check_finite(weight, name)
    if not scale.is_floating_point() or scale.dtype.itemsize < 2:
        raise ValueError(f"FP8 scale for {name} must be a float16/bfloat16/float32 tensor, got {scale.dtype}")
    try:
        layout = scale_layout(tuple(weight.shape), tuple(scale.shape), block)
    except ValueError as exc:
        raise ValueError(f"{exc} ({name})") from None
    if not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise ValueError(f"FP8 scale for {name} must be finite and > 0 everywhere")
    if layout == "tensor":
        divisor = scale.reshape(1)
    elif layout == "channel":
        divisor = scale.reshape(-1, 1)
    else:
        divisor = expand_block_scale(scale, weight.shape[0], weight.shape[1], block)
    return (weight / divisor).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
