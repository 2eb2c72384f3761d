"""Static scales from calibration, as the tensors compressed-tensors stores next to the weights.

Calibration (mtpkit.calibrate) hands over plain numbers: max |input| per Linear and max |K|, |V| per
cache-owning attention layer. This module turns them into tensors:
- FP8 static (`fp8`): `input_scale` = amax / 448, shape [1], in the weight's dtype (llm-compressor's layout);
- NVFP4 W4A4 (`nvfp4`): `input_global_scale` = 448 * 6 / amax, float32 [1] (nvfp4_global_scale's formula);
- FP8 KV cache: `<layer>.self_attn.k_scale` / `v_scale` = amax / 448, float32 [1], for every attention layer.
Modules that vLLM fuses (q/k/v, gate/up) share one input scale: the maximum over the group, since
vLLM keeps one value per fused layer. KV-shared layers (E2B / E4B) write nothing to the cache: they read
their producer's, so they carry their producer's scales (vLLM dequantizes with the reading layer's scale).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mtpkit.convert.quantize_scope import QuantTarget
from mtpkit.errors import ConfigError
from mtpkit.formats.fp8 import FP8_E4M3_MAX
from mtpkit.formats.gemma4 import get_int, kv_producers, layer_types_of, text_config_of
from mtpkit.formats.nvfp4 import nvfp4_global_scale

# The scale below which FP8 division would overflow; an all-zero input gets it instead of 0.
_MIN_SCALE = torch.finfo(torch.float32).eps


@dataclass(frozen=True)
class StaticScales:
    """Calibration results, keyed by checkpoint names (the calibrate package fills it)."""

    input_amax: Mapping[str, float]  # Linear module -> max |input|
    kv_amax: Mapping[int, tuple[float, float]]  # cache-owning layer -> (max |K|, max |V|); empty: no FP8 KV cache
    inputs: dict  # what the calibration ran on, for the report


def input_scale_tensors(targets: list[QuantTarget], scheme: str, scales: StaticScales) -> dict[str, torch.Tensor]:
    """`<module>.input_scale` (fp8) or `<module>.input_global_scale` (nvfp4) for each target."""
    group_amax: dict[str, float] = {}
    for target in targets:
        if target.module not in scales.input_amax:
            raise ConfigError(f"calibration recorded no input range for {target.module}", where="calibration",
                              fix="calibrate on the same checkpoint that is quantized")
        group_amax[target.group] = max(group_amax.get(target.group, 0.0), scales.input_amax[target.module])
    out = {}
    for target in targets:
        amax = torch.tensor([group_amax[target.group]], dtype=torch.float32)
        if scheme == "fp8":
            dtype = torch.bfloat16 if target.dtype == "BF16" else torch.float16 if target.dtype == "F16" else torch.float32
            out[f"{target.module}.input_scale"] = (amax / FP8_E4M3_MAX).clamp(min=_MIN_SCALE).to(dtype)
        elif scheme == "nvfp4":
            out[f"{target.module}.input_global_scale"] = nvfp4_global_scale(amax)
    return out


def kv_scale_tensors(config: dict, prefix: str, scales: StaticScales, where: str) -> dict[str, torch.Tensor]:
    """`<prefix>layers.N.self_attn.{k,v}_scale` for every attention layer, shared layers with their producer's."""
    text, text_prefix = text_config_of(config, where)
    layer_types = layer_types_of(text, prefix=text_prefix, where=where)
    first_shared = len(layer_types) - get_int(text, "num_kv_shared_layers", prefix=text_prefix, where=where, default=0)
    producers = kv_producers(config, where)
    out = {}
    for layer, layer_type in enumerate(layer_types):
        source = layer if layer < first_shared else producers[layer_type]
        if source not in scales.kv_amax:
            raise ConfigError(f"calibration recorded no K/V range for layer {source}", where="calibration",
                              fix="calibrate on the same checkpoint that is quantized")
        for kind, amax in zip("kv", scales.kv_amax[source]):
            scale = torch.tensor([amax / FP8_E4M3_MAX], dtype=torch.float32).clamp(min=_MIN_SCALE)
            out[f"{prefix}layers.{layer}.self_attn.{kind}_scale"] = scale
    return out
