"""Dequantize one module's stored tensors, whichever producer wrote them, and plan which tensors that consumes.

A checkpoint names a quantized linear's tensors `<module>.<suffix>`. The suffix set alone says the format:

| format                     | weight tensor                  | weight scales                              |
|----------------------------|--------------------------------|--------------------------------------------|
| compressed-tensors NVFP4   | `weight_packed` (uint8)        | `weight_scale` (fp8), `weight_global_scale` |
| ModelOpt NVFP4             | `weight` (uint8)               | `weight_scale` (fp8), `weight_scale_2`      |
| FP8 (either producer)      | `weight` (float8_e4m3fn)       | `weight_scale` (tensor / channel / block)   |

Activation and KV-cache scales (`input_scale`, `input_global_scale`, `k_scale`, `v_scale`) mean nothing once
the weights are dense again, so they are dropped along with the weight scales.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from mtpkit.formats.fp8 import FP8_DTYPE, dequantize_fp8
from mtpkit.formats.nvfp4 import dequantize_nvfp4

# Suffixes whose tensors are consumed by dequantization and must not be written next to the dense weight.
WEIGHT_SCALE_SUFFIXES = ("weight_scale", "weight_scale_2", "weight_global_scale")
ACTIVATION_SCALE_SUFFIXES = ("input_scale", "input_global_scale", "k_scale", "v_scale")
CONSUMED_SCALE_SUFFIXES = WEIGHT_SCALE_SUFFIXES + ACTIVATION_SCALE_SUFFIXES
# Stored weights that dequantization replaces with a dense `<module>.weight`.
WEIGHT_SUFFIXES = ("weight", "weight_packed")
# Tensors that would change the math and are not implemented: refuse rather than silently ignore them.
UNSUPPORTED_SUFFIXES = {
    "weight_zero_point": "asymmetric (zero-point) quantization",
    "pre_quant_scale": "AWQ pre_quant_scale (an input-side scale that would have to be folded into W)",
}


def _where(name: str) -> str:
    return f" in {name}" if name else ""


def _require(tensors: Mapping[str, torch.Tensor], needed: tuple[str, ...], kind: str, name: str) -> None:
    missing = [s for s in needed if s not in tensors]
    if missing:
        raise ValueError(f"{kind}{_where(name)} is missing {', '.join(missing)} (has {', '.join(sorted(tensors))})")


def detect_weight_format(tensors: Mapping[str, torch.Tensor], name: str = "") -> str:
    """'ct-nvfp4', 'modelopt-nvfp4', 'fp8' or 'dense', from the suffixes and the stored weight's dtype."""
    for suffix, what in UNSUPPORTED_SUFFIXES.items():
        if suffix in tensors:
            raise ValueError(f"{suffix}{_where(name)}: {what} is not supported")
    if "weight_packed" in tensors:
        if "weight" in tensors:
            raise ValueError(f"both weight and weight_packed{_where(name)}: cannot tell which one is the weight")
        return "ct-nvfp4"
    if "weight" not in tensors:
        raise ValueError(f"no weight or weight_packed{_where(name)} (has {', '.join(sorted(tensors)) or 'nothing'})")
    dtype = tensors["weight"].dtype
    if dtype == torch.uint8:
        return "modelopt-nvfp4"
    if dtype == FP8_DTYPE:
        return "fp8"
    if dtype.is_floating_point and dtype.itemsize > 1:
        present = [s for s in WEIGHT_SCALE_SUFFIXES if s in tensors]
        if present:
            raise ValueError(f"weight{_where(name)} is {dtype}, yet {', '.join(present)} is present: "
                             f"a scale only belongs to a quantized (uint8 / float8_e4m3fn) weight")
        return "dense"
    raise ValueError(f"weight{_where(name)} has dtype {dtype}; expected uint8 (NVFP4), float8_e4m3fn (FP8) "
                     f"or a 16/32-bit float")


def dequantize_weight(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16, *,
                      name: str = "") -> torch.Tensor:
    """The dense [out, in] weight of one module, given its tensors by suffix (`name` only labels errors)."""
    if not dtype.is_floating_point or dtype.itemsize < 2:
        raise ValueError(f"dequantize to a 16/32/64-bit float dtype, not {dtype}")
    kind = detect_weight_format(tensors, name)
    if kind == "dense":
        return tensors["weight"].to(dtype)
    if kind == "fp8":
        _require(tensors, ("weight", "weight_scale"), "FP8 weight", name)
        try:
            return dequantize_fp8(tensors["weight"], tensors["weight_scale"], dtype)
        except ValueError as exc:
            raise ValueError(f"{exc}{_where(name)}") from None
    if kind == "ct-nvfp4":
        _require(tensors, ("weight_packed", "weight_scale", "weight_global_scale"),
                 "compressed-tensors NVFP4 weight", name)
        convention = "compressed-tensors"
        packed, global_scale = tensors["weight_packed"], tensors["weight_global_scale"]
        if "weight_scale_2" in tensors:
            raise ValueError(f"weight_scale_2 next to weight_packed{_where(name)}: mixes ModelOpt and "
                             f"compressed-tensors NVFP4 names")
    else:
        _require(tensors, ("weight", "weight_scale", "weight_scale_2"), "ModelOpt NVFP4 weight", name)
        convention = "modelopt"
        packed, global_scale = tensors["weight"], tensors["weight_scale_2"]
        if "weight_global_scale" in tensors:
            raise ValueError(f"weight_global_scale next to a uint8 weight{_where(name)}: mixes compressed-tensors "
                             f"and ModelOpt NVFP4 names")
    if packed.dtype != torch.uint8:
        raise ValueError(f"NVFP4 packed weight{_where(name)} must be uint8, got {packed.dtype}")
    try:
        return dequantize_nvfp4(packed, tensors["weight_scale"], global_scale, convention=convention, dtype=dtype)
    except ValueError as exc:
        raise ValueError(f"{exc}{_where(name)}") from None


@dataclass
class ModulePlan:
    """One module's stored tensors: `sources` maps suffix -> full checkpoint name."""

    prefix: str
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def quantized(self) -> bool:
        """True when the module carries a weight scale, i.e. its weight must go through dequantize_weight."""
        return any(s in self.sources for s in WEIGHT_SCALE_SUFFIXES) or "weight_packed" in self.sources

    @property
    def weight_name(self) -> str:
        """The dense weight's name in the output (a `weight_packed` becomes `weight`)."""
        return f"{self.prefix}.weight" if self.prefix else "weight"

    @property
    def drop(self) -> list[str]:
        """Full names consumed here and not to be copied: all scales, and `weight_packed` (renamed)."""
        return sorted(self.sources[s] for s in CONSUMED_SCALE_SUFFIXES + ("weight_packed",) if s in self.sources)


def plan_modules(names: Iterable[str]) -> dict[str, ModulePlan]:
    """Group a checkpoint's tensor names into modules that hold a quantized weight or a consumed scale.

    Names of other tensors (biases, norms, dense weights without scales) do not form a plan: they are
    copied as they are. A module with only activation/KV scales (e.g. `self_attn.k_scale`) gets a plan
    with nothing to dequantize and its scales to drop.
    """
    interesting = set(WEIGHT_SUFFIXES) | set(CONSUMED_SCALE_SUFFIXES) | set(UNSUPPORTED_SUFFIXES)
    modules: dict[str, ModulePlan] = {}
    for full in names:
        prefix, _, suffix = full.rpartition(".")
        if suffix in interesting:
            modules.setdefault(prefix, ModulePlan(prefix)).sources[suffix] = full
    # A lone `weight` is an ordinary dense tensor; anything else makes the module worth a plan.
    return {prefix: plan for prefix, plan in sorted(modules.items()) if set(plan.sources) - {"weight"}}
