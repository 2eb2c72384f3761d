"""NVFP4 weight math: the E2M1 code table, nibble unpacking, and dequantization in both on-disk conventions.

An NVFP4 weight [out, in] is stored as uint8 [out, in/2] holding two 4-bit E2M1 codes per byte, one FP8 E4M3
scale per 16 consecutive inputs ([out, in/16]) and one float32 per-tensor scale. The producers disagree on
which way the per-tensor scale points:

* compressed-tensors (`weight_packed`, `weight_scale`, `weight_global_scale`) stores a *divisor*:
  W = code * (scale_fp8 / weight_global_scale), with weight_global_scale = 448 * 6 / amax;
* ModelOpt (`weight`, `weight_scale`, `weight_scale_2`) stores a *multiplier*:
  W = code * (scale_fp8 * weight_scale_2), with weight_scale_2 = amax / (448 * 6).

So weight_scale_2 == 1 / weight_global_scale for the same codes and group scales. Quantization follows
compressed-tensors' NVFP4 preset (calculate_qparams, then NVFP4PackedCompressor.compress) byte for byte; see
tests/formats/test_quantize_math.py.
"""

from __future__ import annotations

from typing import Literal

import torch

from mtpkit.formats.fp8 import FP8_DTYPE, FP8_E4M3_MAX, check_finite, check_float_weight

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

# What compressed-tensors stores for a group scale that is 0 after the FP8 cast (all-zero group, or one so
# small next to the tensor's amax that it underflows): `calculate_qparams`' eps for an FP8 scale_dtype.
NVFP4_ZERO_GROUP_SCALE = 0.125
# The midpoints between neighbouring E2M1 magnitudes, each with whether the midpoint itself rounds UP: a tie goes
# to the even code (mantissa bit 0), as compressed-tensors' cast_to_fp4 does (|x| <= 0.25 -> 0.0, 0.75 <= |x| <= 1.25
# -> 1.0, 1.75 <= |x| <= 2.5 -> 2.0, 3.5 <= |x| <= 5 -> 4.0) and ModelOpt's _cast_fp4 does too.
E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))

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


def _amax_f32(amax: torch.Tensor) -> torch.Tensor:
    if not isinstance(amax, torch.Tensor) or amax.numel() != 1 or not amax.is_floating_point():
        raise ValueError(f"NVFP4 amax must be a one-element float tensor (max |W| of the fused group), got {amax!r}")
    value = amax.to(torch.float32).reshape(1)
    if not bool(torch.isfinite(value).all()) or bool((value < 0).any()):
        raise ValueError(f"NVFP4 amax must be finite and >= 0 (it is max |W|), got {value.item()}")
    return value


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' `weight_global_scale` = 448 * 6 / amax, float32, shape [1].

    Takes the amax a fused group (q/k/v, gate/up) shares, because vLLM needs one global scale per fused weight.
    Same ops as `generate_gparam` on a float32 amax: 2688 / max(amax, float32 tiny), with the Inf that an
    amax of 0 (or below ~8e-36) gives replaced by 1.0. The quotient is taken in float32 even for a bf16 amax
    (llm-compressor's observer would take it in bf16): one float32 rounding keeps
    `modelopt_weight_scale_2(amax) * nvfp4_global_scale(amax)` within float32 rounding of 1.
    """
    value = _amax_f32(amax)
    global_scale = NVFP4_SCALE_RANGE / value.clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(global_scale, nan=1.0, posinf=1.0, neginf=1.0)


def modelopt_weight_scale_2(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's `weight_scale_2` = amax / (6 * 448), a 0-d float32: the multiplier form of the global scale.

    NVIDIA's definition is `reduce_amax(input).float() / (6.0 * 448.0)` (NVIDIA/Model-Optimizer,
    modelopt/torch/quantization/qtensor/nvfp4_tensor.py, NVFP4QTensor.get_weights_scaling_factor_2). Where
    compressed-tensors falls back to a global scale of 1.0 (amax 0 or so small 2688/amax overflows), this gives
    1.0 as well, instead of ModelOpt's 0 (which its own group-scale division would turn into NaN): so it stays
    the reciprocal of `nvfp4_global_scale`, and the codes and group scales computed with that serve both layouts.
    """
    value = _amax_f32(amax)
    fallback = ~torch.isfinite(NVFP4_SCALE_RANGE / value.clamp(min=torch.finfo(torch.float32).tiny))
    scale_2 = value / NVFP4_SCALE_RANGE
    return torch.where(fallback, torch.ones_like(scale_2), scale_2).reshape(())


def _check_nvfp4_weight(weight: torch.Tensor, name: str) -> int:
    check_float_weight(weight, name)
    if weight.shape[1] % NVFP4_GROUP_SIZE:
        raise ValueError(f"{name}: NVFP4 needs in_features divisible by {NVFP4_GROUP_SIZE}, got shape "
                         f"{list(weight.shape)}")
    check_finite(weight, name)
    return weight.shape[1] // NVFP4_GROUP_SIZE


def _global_f32(global_scale: torch.Tensor, name: str) -> torch.Tensor:
    if global_scale.numel() != 1 or not global_scale.is_floating_point():
        raise ValueError(f"NVFP4 global scale for {name} must be one float value, got {global_scale.dtype} "
                         f"shape {list(global_scale.shape)}")
    # Shape [1], not 0-d, as compressed-tensors stores it: a 0-d tensor would lose type promotion to a bf16 operand.
    value = global_scale.to(torch.float32).reshape(1)
    if not (bool(torch.isfinite(value).all()) and bool((value > 0).all())):
        raise ValueError(f"NVFP4 global scale for {name} must be finite and > 0, got {value.item()}")
    return value


def nvfp4_group_scales(weight: torch.Tensor, global_scale: torch.Tensor, *, name: str = "weight") -> torch.Tensor:
    """float8_e4m3fn [out, in/16]: global_scale * (group amax / 6), clamped to +-448, 0 -> 0.125.

    compressed-tensors' `calculate_qparams` for the NVFP4 preset, fed as llm-compressor's min-max observer feeds
    it: with the group min/max in the WEIGHT'S dtype. So `amax / 6` is divided (and rounded) in that dtype - bf16
    for a bf16 weight - and only then multiplied by the float32 global scale; dividing in float32 instead gives a
    different FP8 byte now and then. The zero check comes after the FP8 cast, as there, so a scale that underflows
    in FP8 is replaced as well.
    """
    groups = _check_nvfp4_weight(weight, name)
    global_f32 = _global_f32(global_scale, name)
    amax = weight.unflatten(-1, (groups, NVFP4_GROUP_SIZE)).abs().amax(dim=-1)
    local = amax / E2M1_MAX  # weight dtype: same rounding as `max_val_pos / (bit_range.to(dtype) / 2)`
    scale = (global_f32 * local.to(torch.float32)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE).to(torch.float32)
    return torch.where(scale == 0, NVFP4_ZERO_GROUP_SCALE, scale).to(FP8_DTYPE)


def e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to E2M1 codes (uint8, 0..15): nearest magnitude, ties to the even code.

    The sign bit is `x < 0`, so a small negative value that rounds to 0 keeps it (code 8, -0.0) while -0.0
    itself becomes code 0: compressed-tensors multiplies the rounded magnitude by torch.sign(x), which is +0 for
    -0.0, and packs signbit() of the product. Magnitudes past 6 saturate to code 7 (what its clamp to 6 does).
    """
    magnitude = scaled.abs()
    codes = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for midpoint, tie_rounds_up in E2M1_MIDPOINTS:
        codes += (magnitude >= midpoint if tie_rounds_up else magnitude > midpoint).to(torch.uint8)
    return codes | ((scaled < 0).to(torch.uint8) << 3)


def pack_fp4_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [out, in] -> uint8 [out, in/2], the even column in the LOW nibble (inverse of unpack_fp4_codes)."""
    pairs = codes.reshape(codes.shape[0], codes.shape[1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def quantize_nvfp4(weight: torch.Tensor, group_scales: torch.Tensor, global_scale: torch.Tensor, *,
                   name: str = "weight") -> torch.Tensor:
    """Packed uint8 [out, in/2] of W / (group_scale / global_scale), rounded to E2M1.

    compressed-tensors' NVFP4PackedCompressor.compress on CPU (quantize_and_pack_fp4 -> `_quantize`): the
    effective scale is formed first in float32 (`scale = scale / global_scale`), then W is DIVIDED by it
    (`scaled = x / scale`, in torch's promoted dtype, float32 for a bf16 weight), never multiplied by a
    reciprocal; the two orders round differently and move float32 quotients across E2M1 midpoints (see
    test_nvfp4_quotients_at_midpoints_follow_compressed_tensors_division).
    """
    groups = _check_nvfp4_weight(weight, name)
    out_features = weight.shape[0]
    if group_scales.dtype != FP8_DTYPE or tuple(group_scales.shape) != (out_features, groups):
        raise ValueError(f"NVFP4 group scales for {name} must be float8_e4m3fn [{out_features}, {groups}], got "
                         f"{group_scales.dtype} {list(group_scales.shape)}")
    scale = group_scales.to(torch.float32) / _global_f32(global_scale, name)
    if not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise ValueError(f"NVFP4 group scales for {name} must be finite and > 0 (FP8 NaN or 0 found)")
    scaled = weight.unflatten(-1, (groups, NVFP4_GROUP_SIZE)) / scale.unsqueeze(-1)
    return pack_fp4_codes(e2m1_codes(scaled).reshape(out_features, weight.shape[1]))
