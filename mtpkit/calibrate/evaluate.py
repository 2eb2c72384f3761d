"""The end-to-end effect of a quantization: the quantized checkpoint against its original, on sample text.

Both run layer by layer in lockstep (two layers in memory, one of each). The quantized one computes as a
serving engine would: weights dequantized from the written tensors, each quantized Linear's input passed
through its scheme's activation quantization (static scales as written), and, with an FP8 KV cache, K/V
stored as FP8 with the written k_scale / v_scale. Reported: max and mean |logit difference|, perplexity
of each model on the samples (next-token), and how often their top-1 tokens agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mtpkit.calibrate.data import CalibrationSet
from mtpkit.calibrate.layerwise import LayerwiseStream
from mtpkit.convert.safetensors_file import load_tensor
from mtpkit.formats.activation_quant import fake_quantize_input
from mtpkit.loader.text_parts import TextCheckpoint
from mtpkit.runtime import QuantizedLinear

FP8 = torch.float8_e4m3fn


def _activation_hooks(quantized: TextCheckpoint, scheme: str) -> Callable[[int, nn.Module], list]:
    tensors = quantized.checkpoint.tensors

    def install(i: int, layer: nn.Module) -> list:
        handles = []
        for name, module in layer.named_modules():
            if not isinstance(module, QuantizedLinear):
                continue
            kwargs = _input_scales(tensors, f"{quantized.prefix}layers.{i}.{name}", scheme)

            def hook(_module, args, kwargs=kwargs):
                return (fake_quantize_input(args[0], scheme, **kwargs),)
            handles.append(module.register_forward_pre_hook(hook))
        return handles
    return install


def _input_scales(tensors: dict, module: str, scheme: str) -> dict[str, torch.Tensor]:
    """The static input scale of one Linear, as fake_quantize_input takes it, from either format."""
    if f"{module}.input_global_scale" in tensors:  # compressed-tensors NVFP4
        return {"input_global_scale": load_tensor(tensors[f"{module}.input_global_scale"])}
    if f"{module}.input_scale" not in tensors:
        return {}
    value = load_tensor(tensors[f"{module}.input_scale"])
    if scheme == "nvfp4":  # ModelOpt multiplies by its input_scale where compressed-tensors divides
        return {"input_global_scale": 1 / value.float()}
    return {"input_scale": value}


def evaluate_quantization(original: TextCheckpoint, quantized: TextCheckpoint, scheme: str,
                          calibration: CalibrationSet, on_layer: Callable[[int], None] | None = None) -> dict:
    """Compare `quantized` with `original` on the calibration samples; plain numbers for the report."""
    reference = LayerwiseStream(original, calibration.sequences)
    kv = quantized.kv_scales()
    cache_kwargs = {"dtype": FP8, **kv} if kv else None
    candidate = LayerwiseStream(quantized, calibration.sequences, cache_kwargs=cache_kwargs)
    install = _activation_hooks(quantized, scheme)
    for i in range(reference.num_layers):
        reference.run_layer(i)
        candidate.run_layer(i, install)
        if on_layer:
            on_layer(i)
    max_error, error_sum, count, agree = 0.0, 0.0, 0, 0
    nll = {"original": 0.0, "quantized": 0.0}
    predicted = 0
    for b, tokens in enumerate(calibration.sequences):
        ref, cand = reference.logits(b), candidate.logits(b)
        diff = (ref - cand).abs()
        max_error = max(max_error, float(diff.max()))
        error_sum += float(diff.sum())
        count += diff.numel()
        agree += int((ref.argmax(-1) == cand.argmax(-1)).sum())
        nll["original"] += float(F.cross_entropy(ref[:-1], tokens[1:], reduction="sum"))
        nll["quantized"] += float(F.cross_entropy(cand[:-1], tokens[1:], reduction="sum"))
        predicted += len(tokens) - 1
    if scheme == "nvfp4a16":
        activations = "unquantized (weight-only scheme)"
    elif any(".experts." in name and name.endswith(("input_scale", "input_global_scale", "weight_packed", ".weight"))
             for name in quantized.checkpoint.tensors):
        # The runtime runs a layer's experts fused and dense: there is no per-expert Linear to quantize inputs at.
        activations = "quantized as served, except the MoE experts' inputs"
    else:
        activations = "quantized as served"
    return {
        "samples": len(calibration.sequences), "tokens": calibration.tokens,
        "activations": activations,
        "kv_cache": "fp8 with the written scales" if kv else "unquantized",
        "max_abs_logit_error": max_error, "mean_abs_logit_error": error_sum / count,
        "top1_agreement": agree / calibration.tokens,
        "perplexity": {name: math.exp(total / predicted) for name, total in nll.items()},
    }
