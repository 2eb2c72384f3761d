"""One Linear weight through a scheme: the tensors compressed-tensors stores for it, and their layout.

Glue over `fp8` and `nvfp4`: which primitive each scheme uses, in which dtype its scales are stored
(llm-compressor stores FP8 scales in the weight's dtype), and the error it leaves in the weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpkit.formats.dequantize import dequantize_weight
from mtpkit.formats.fp8 import FP8_BLOCK_SIZE, block_grid, check_finite, check_float_weight, fp8_weight_scale, quantize_fp8
from mtpkit.formats.nvfp4 import NVFP4_GROUP_SIZE, nvfp4_global_scale, nvfp4_group_scales, quantize_nvfp4

_FP8_STRATEGY = {"fp8-dynamic": "channel", "fp8-block": "block", "fp8": "tensor"}
_NVFP4 = ("nvfp4", "nvfp4a16")


@dataclass
class QuantizedWeight:
    tensors: dict[str, torch.Tensor]  # suffix -> tensor, e.g. {"weight_packed": .., "weight_scale": ..}
    relative_error: float | None  # ||W - dequant(Q(W))|| / ||W||, when the values were computed

    @staticmethod
    def layout(scheme: str, dtype: str, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        """suffix -> (safetensors dtype, shape) of what `quantize_weight` returns for a [out, in] weight."""
        out_features, in_features = shape
        if scheme in _NVFP4:
            return {"weight_packed": ("U8", (out_features, in_features // 2)),
                    "weight_scale": ("F8_E4M3", (out_features, in_features // NVFP4_GROUP_SIZE)),
                    "weight_global_scale": ("F32", (1,))}
        strategy = _FP8_STRATEGY[scheme]
        scale_shape = {"channel": (out_features, 1), "tensor": (1,),
                       "block": block_grid(out_features, in_features)}[strategy]
        return {"weight": ("F8_E4M3", (out_features, in_features)), "weight_scale": (dtype, scale_shape)}

    @staticmethod
    def suffixes(scheme: str) -> tuple[str, ...]:
        return tuple(QuantizedWeight.layout(scheme, "BF16", (NVFP4_GROUP_SIZE, NVFP4_GROUP_SIZE)))


def check_weight(weight: torch.Tensor, scheme: str, name: str) -> float:
    """Refuse what cannot be quantized (ValueError naming `name`); return max |W| for the group scale."""
    check_float_weight(weight, name)
    if scheme in _NVFP4 and weight.shape[1] % NVFP4_GROUP_SIZE:
        raise ValueError(f"{name}: NVFP4 needs in_features divisible by {NVFP4_GROUP_SIZE}, got shape "
                         f"{list(weight.shape)}")
    # vLLM's block-FP8 linears refuse a partition that is not a whole number of 128-blocks, and
    # compressed-tensors' per-token-group activation quantization needs in_features divisible too.
    if scheme == "fp8-block" and any(dim % FP8_BLOCK_SIZE[0] for dim in weight.shape):
        raise ValueError(f"{name}: fp8-block needs both dimensions divisible by {FP8_BLOCK_SIZE[0]}, got shape "
                         f"{list(weight.shape)}; use fp8-dynamic for this model")
    check_finite(weight, name)
    return float(weight.abs().amax()) if weight.numel() else 0.0


def quantize_weight(weight: torch.Tensor, scheme: str, group_amax: float, *, with_values: bool = True,
                    name: str = "weight") -> QuantizedWeight:
    """Quantize one weight. `group_amax` is max |W| over its fused group (q/k/v, gate/up), for a shared scale.

    Without `with_values` only the scales are computed (what a writer asking for a scale tensor needs).
    """
    if scheme in _NVFP4:
        global_scale = nvfp4_global_scale(torch.tensor([group_amax], dtype=torch.float32))
        group_scales = nvfp4_group_scales(weight, global_scale, name=name)
        tensors = {"weight_scale": group_scales, "weight_global_scale": global_scale}
        if with_values:
            tensors["weight_packed"] = quantize_nvfp4(weight, group_scales, global_scale, name=name)
    else:
        strategy = _FP8_STRATEGY[scheme]
        if strategy == "tensor":  # per-tensor: shared by the fused group
            scale = torch.tensor([group_amax / 448.0], dtype=torch.float32).clamp(min=torch.finfo(torch.float32).eps)
        else:
            scale = fp8_weight_scale(weight, strategy, name=name)
        scale = scale.to(weight.dtype)  # stored, and divided by, in the weight's dtype, as llm-compressor does
        tensors = {"weight_scale": scale}
        if with_values:
            tensors["weight"] = quantize_fp8(weight, scale, name=name)
    error = _relative_error(weight, tensors) if with_values else None
    return QuantizedWeight(tensors, error)


def _relative_error(weight: torch.Tensor, tensors: dict[str, torch.Tensor]) -> float:
    reference = weight.to(torch.float32)
    norm = float(reference.norm())
    if norm == 0.0:
        return 0.0
    restored = dequantize_weight(tensors, torch.float32)
    return float((reference - restored).norm()) / norm
