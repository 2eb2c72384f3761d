"""Linear layers whose weight stays quantized in memory (FP8, NVFP4) and is dequantized for each matmul.

Memory holds the checkpoint's bytes (FP8: 1 byte a weight; NVFP4: half a byte plus one FP8 scale per 16),
not a BF16 copy; each forward builds the dense weight of one layer in the activation dtype, multiplies, and
drops it. The math (layouts, conventions, rounding) is mtpkit.formats.dequantize's, so a model with these
layers computes exactly what the same model loaded with `dequantize_weight`'s dense weights computes.

Only the weights are quantized: activation and KV-cache scales (`input_scale`, `input_global_scale`,
`k_scale`, `v_scale`) play no part in a weight-only dequantize-then-matmul, and load_text_state_dict drops them.

CUDA follow-up: on GPUs with FP8 tensor cores, `torch._scaled_mm` (and an FP4 GEMM on Blackwell) can skip the
dense weight; it needs activation quantization, so its results differ from this module's and it is not used here.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from mtpkit.formats.dequantize import WEIGHT_SCALE_SUFFIXES, WEIGHT_SUFFIXES, dequantize_weight, \
    detect_weight_format, plan_modules

# What a QuantizedLinear stores: the quantized weight and its scales, under the checkpoint's suffixes.
STORED_SUFFIXES = WEIGHT_SUFFIXES + WEIGHT_SCALE_SUFFIXES


class QuantizedLinear(nn.Module):
    """y = x W^T (+ b) with W kept as the checkpoint stores it; a drop-in for a bias-free or biased nn.Linear.

    `stored` maps suffix -> a tensor of the checkpoint's shape and dtype (only those are read; loading fills
    the buffers): `weight` FP8 + `weight_scale` (per tensor, per channel or 128x128 blocks);
    `weight_packed` uint8 + `weight_scale` FP8 + `weight_global_scale` (compressed-tensors NVFP4); or
    `weight` uint8 + `weight_scale` FP8 + `weight_scale_2` (ModelOpt NVFP4). The format is
    detect_weight_format's reading of them; ValueError if they do not make an [out, in] weight.
    """

    def __init__(self, in_features: int, out_features: int, stored: Mapping[str, torch.Tensor], *,
                 bias: bool = False, name: str = ""):
        super().__init__()
        self.in_features, self.out_features, self.name = in_features, out_features, name
        kept = {s: t for s, t in stored.items() if s in STORED_SUFFIXES}
        self.format = detect_weight_format(kept, name)
        if self.format == "dense":
            raise ValueError(f"{name or 'weight'} is not quantized ({kept['weight'].dtype}); use nn.Linear")
        # Dequantize meta stand-ins once: every shape check of the formats code runs now, not at the first call.
        shape = dequantize_weight({s: t.to("meta") for s, t in kept.items()}, torch.float32, name=name).shape
        if tuple(shape) != (out_features, in_features):
            raise ValueError(f"quantized weight of {name or 'a linear'} is {list(shape)}, "
                             f"the model expects [{out_features}, {in_features}]")
        self.suffixes = tuple(sorted(kept))
        for suffix, tensor in kept.items():
            self.register_buffer(suffix, torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The [out, in] weight in `dtype`, rounded once from the stored values."""
        return dequantize_weight({s: getattr(self, s) for s in self.suffixes}, dtype, name=self.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.dense_weight(x.dtype), bias)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) / .float() / .half() cast every floating tensor, FP8 included, which would rewrite
        # the stored codes and scales; keep their dtypes and take only the device move.
        before = {s: getattr(self, s) for s in self.suffixes}
        super()._apply(fn, recurse)
        for suffix, tensor in before.items():
            moved = getattr(self, suffix)
            if moved.dtype != tensor.dtype:
                setattr(self, suffix, tensor.to(moved.device))
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}, "
                f"bias={self.bias is not None}")


def _layout(tensors: Mapping[str, torch.Tensor]) -> dict:
    return {s: (tuple(t.shape), t.dtype) for s, t in tensors.items() if s in STORED_SUFFIXES}


def swap_quantized_linears(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Replace each nn.Linear of `model` whose tensors in `tensors` are quantized by a QuantizedLinear.

    `tensors` are named as the model names its state (load_text_state_dict strips the checkpoint's prefix
    first and calls this); only names, shapes and dtypes are read. Returns the replaced module names.
    ValueError for a quantized module that is not a Linear of the model (including an untied lm_head:
    Gemma4TextModel.logits reads its weight directly), so no quantized tensor goes unused silently.
    """
    swapped = []
    for prefix, plan in plan_modules(tensors).items():
        if not plan.quantized:
            continue  # activation / KV scales only
        try:
            module = model.get_submodule(prefix)
        except AttributeError:
            module = None
        stored = {suffix: tensors[full] for suffix, full in plan.sources.items() if suffix in STORED_SUFFIXES}
        if isinstance(module, QuantizedLinear) and _layout(module.state_dict()) == _layout(stored):
            continue  # swapped by an earlier load of the same checkpoint layout
        if not isinstance(module, nn.Linear) or prefix == "lm_head":
            raise ValueError(f"{prefix} holds a quantized weight, but is not a linear layer the runtime can "
                             f"run quantized")
        quantized = QuantizedLinear(module.in_features, module.out_features, stored,
                                    bias=module.bias is not None, name=prefix)
        # Same device, and the bias in the model's dtype (the stored tensors keep theirs: see _apply).
        quantized.to(module.weight.device, module.weight.dtype)
        parent, _, child = prefix.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, quantized)
        swapped.append(prefix)
    return swapped
