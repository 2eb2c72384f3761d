"""What a W8A8 / W4A4 kernel does to a Linear's input: quantize, then dequantize (fake quantization).

mtpkit's runtime multiplies by dequantized weights with unquantized activations; the quantization report
measures what a serving engine computes, so its evaluation passes each quantized Linear's input through
this first. The activations reuse the weight primitives, viewing the input as a 2-D [tokens, features]
matrix: per-token FP8 is the per-channel weight layout of that matrix, FP8 per-group-of-128 the per-channel
layout of [tokens * features / 128, 128], NVFP4 the weight's group-16 layout with the calibrated global scale.
"""

from __future__ import annotations

import torch

from mtpkit.formats.fp8 import dequantize_fp8, fp8_weight_scale, quantize_fp8
from mtpkit.formats.nvfp4 import dequantize_nvfp4, nvfp4_group_scales, quantize_nvfp4

ACTIVATION_GROUP = 128  # fp8-block: dynamic scales per token and group of 128 features


def _fp8_roundtrip(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # The scale in the activation's dtype, as compressed-tensors computes and applies it (a bf16 division
    # rounds the quotient before the FP8 cast); the dequantized product is exact in float32, rounded once.
    scale = scale.to(rows.dtype)
    return dequantize_fp8(quantize_fp8(rows, scale, name="activation"), scale, rows.dtype)


def fake_quantize_input(x: torch.Tensor, scheme: str, *, input_scale: torch.Tensor | None = None,
                        input_global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x `[..., in]` after the activation quantization of `scheme`, in x's dtype.

    fp8: static per-tensor `input_scale`; fp8-dynamic: per token; fp8-block: per token and group of 128;
    nvfp4: group-16 FP8 scales computed on the fly under the static `input_global_scale`; nvfp4a16: unchanged.
    """
    if scheme == "nvfp4a16":
        return x
    rows = x.reshape(-1, x.shape[-1])
    if scheme == "fp8-dynamic":
        out = _fp8_roundtrip(rows, fp8_weight_scale(rows, "channel", name="activation"))
    elif scheme == "fp8-block":
        groups = rows.reshape(-1, ACTIVATION_GROUP)
        out = _fp8_roundtrip(groups, fp8_weight_scale(groups, "channel", name="activation")).reshape(rows.shape)
    elif scheme == "fp8":
        if input_scale is None:
            raise ValueError("fp8 (static) needs the calibrated input_scale")
        out = _fp8_roundtrip(rows, input_scale.reshape(1))
    elif scheme == "nvfp4":
        if input_global_scale is None:
            raise ValueError("nvfp4 (W4A4) needs the calibrated input_global_scale")
        global_scale = input_global_scale.float().reshape(1)
        scales = nvfp4_group_scales(rows, global_scale, name="activation")
        packed = quantize_nvfp4(rows, scales, global_scale, name="activation")
        out = dequantize_nvfp4(packed, scales, global_scale, convention="compressed-tensors", dtype=x.dtype)
    else:
        raise ValueError(f"unknown scheme {scheme!r}")
    return out.reshape(x.shape)
