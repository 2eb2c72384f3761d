"""Calibration: the activation ranges that fix static input scales and FP8 KV-cache scales.

One layer-by-layer pass over the calibration samples records, in float32:
- for every Linear of the decoder, max |input| (static FP8: input_scale = amax / 448; NVFP4 W4A4: the
  input global scale = 448 * 6 / amax);
- for every MoE expert (calibrated as llm-compressor's "all experts" mode does: every expert sees every
  token, so an expert the samples rarely route to still gets a range), max |input| of gate/up (the MoE
  block's normed input, shared by all experts) and of down (that expert's act(gate) * up);
- for every cache-owning attention layer, max |K| and max |V| as written to the cache (after k_norm and
  RoPE, after v_norm): the FP8 KV scales are amax / 448.
The results are plain floats keyed by checkpoint names, handed to convert's quantize.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from mtpkit.calibrate.data import CalibrationSet
from mtpkit.calibrate.layerwise import LayerwiseStream
from mtpkit.loader.text_parts import TextCheckpoint
from mtpkit.runtime import KVCache, QuantizedLinear
from mtpkit.runtime.moe import Experts


@dataclass
class Observations:
    linear_input_amax: dict[str, float] = field(default_factory=dict)  # checkpoint module name -> max |x|
    kv_amax: dict[int, tuple[float, float]] = field(default_factory=dict)  # owning layer -> (max |K|, max |V|)
    inputs: dict = field(default_factory=dict)  # the calibration set's description

    def record(self, name: str, value: float) -> None:
        self.linear_input_amax[name] = max(self.linear_input_amax.get(name, 0.0), value)


def _amax(x: torch.Tensor) -> float:
    return float(x.detach().abs().amax().float()) if x.numel() else 0.0


class _ObservedCache(KVCache):
    """A KV cache that records what each owning layer writes."""

    observations: Observations

    def update(self, layer, positions, k, v):
        old_k, old_v = self.observations.kv_amax.get(layer, (0.0, 0.0))
        self.observations.kv_amax[layer] = (max(old_k, _amax(k)), max(old_v, _amax(v)))
        return super().update(layer, positions, k, v)


def _hooks(observations: Observations, prefix: str) -> Callable[[int, nn.Module], list]:
    def install(i: int, layer: nn.Module) -> list:
        base = f"{prefix}layers.{i}."
        handles = []
        for name, module in layer.named_modules():
            if isinstance(module, (nn.Linear, QuantizedLinear)):
                def linear_hook(_module, args, name=base + name):
                    observations.record(name, _amax(args[0]))
                handles.append(module.register_forward_pre_hook(linear_hook))
            elif isinstance(module, Experts):
                handles.append(module.register_forward_pre_hook(_experts_hook(observations, base + name)))
        return handles
    return install


def _experts_hook(observations: Observations, name: str):
    def hook(experts: Experts, args) -> None:
        x = args[0]
        gate, up = torch.matmul(x, experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, N, I]
        inner = (experts.act(gate) * up).abs().float().amax(dim=(1, 2))
        shared = _amax(x)
        for e in range(experts.num_experts):
            observations.record(f"{name}.{e}.gate_proj", shared)
            observations.record(f"{name}.{e}.up_proj", shared)
            observations.record(f"{name}.{e}.down_proj", float(inner[e]))
    return hook


def observe(text: TextCheckpoint, calibration: CalibrationSet,
            on_layer: Callable[[int], None] | None = None) -> Observations:
    """Run the samples through `text` layer by layer and return the ranges; `on_layer(i)` after each layer."""
    observations = Observations(inputs=dict(calibration.description))

    def cache(*args, **kwargs) -> KVCache:
        made = _ObservedCache(*args, **kwargs)
        made.observations = observations
        return made

    stream = LayerwiseStream(text, calibration.sequences, cache_factory=cache)
    install = _hooks(observations, text.prefix)
    for i in range(stream.num_layers):
        stream.run_layer(i, install)
        if on_layer:
            on_layer(i)
    return observations
