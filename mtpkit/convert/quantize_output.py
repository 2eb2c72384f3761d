"""The on-disk format of `quantize`'s output: compressed-tensors as made, or ModelOpt mapped tensor by tensor.

quantize computes every tensor in compressed-tensors' layout. For `--format modelopt` each one is renamed,
reshaped and (for the NVFP4 global scales, which the two formats store as reciprocals) converted as it
streams out, using mtpkit.formats.modelopt's schema, so the ModelOpt output costs no second pass. ModelOpt
has no `targets`: every Linear not in `exclude_modules` counts as quantized, so a selection that leaves a
decoder Linear in BF16 without excluding it is refused rather than written wrong.
"""

from __future__ import annotations

import re

import torch

from mtpkit.convert.quantize_scope import QuantTarget, quantization_targets
from mtpkit.convert.safetensors_file import TensorInfo
from mtpkit.convert.writer import TensorSpec
from mtpkit.errors import ConfigError
from mtpkit.formats import modelopt as mo

_KV_SCALE = re.compile(r"^(?P<attn>.+\.self_attn)\.(?P<kind>[kv])_scale$")
# Unquantized 3-D MoE experts: the exclusion that covers them (checkpoint and vLLM names alike).
_DENSE_EXPERTS = "*.experts"


class ModelOptOutput:
    """Maps the compressed-tensors tensors quantize produces to ModelOpt's names, layouts and values."""

    def __init__(self, scheme: str, targets: list[QuantTarget], tensors: dict[str, TensorInfo], ignore: list[str],
                 dense_experts: list[str], kv_cache: bool, where: str):
        try:
            mo.quant_algo(scheme)
            exclude = mo.exclude_modules_from_ct_ignore(ignore)
        except ValueError as e:
            raise ConfigError(f"--format modelopt: {e}", where=where, fix="use --format compressed-tensors") from None
        # What ModelOpt's "every Linear not excluded" would quantize must be what the targets selected.
        implied = {t.module for t in quantization_targets(tensors, ignore)}
        chosen = {t.module for t in targets}
        if implied - chosen:
            example = sorted(implied - chosen)[0]
            raise ConfigError(f"--format modelopt has no `targets`: {example} is left BF16 by the targets but not "
                              "excluded, so vLLM would read it as quantized", where=where,
                              fix="add the modules left out to the recipe's ignore, or use --format compressed-tensors")
        if dense_experts:
            exclude.append(_DENSE_EXPERTS)
        self.scheme, self.kv_cache, self.exclude = scheme, kv_cache, exclude
        self.modules = chosen
        self._ct_names: dict[str, str] = {}

    def _split(self, name: str) -> tuple[str, str] | None:
        module, _, suffix = name.rpartition(".")
        return (module, suffix) if module in self.modules else None

    def spec(self, spec: TensorSpec) -> TensorSpec:
        """The ModelOpt spec for one compressed-tensors output spec (remembered, to map values back)."""
        if (split := self._split(spec.name)) is not None:
            module, suffix = split
            dtype, shape = mo.modelopt_layout(self.scheme, suffix, spec.dtype, spec.shape)
            mapped = TensorSpec(mo.modelopt_name(module, suffix), dtype, shape)
        elif self.kv_cache and (kv := _KV_SCALE.match(spec.name)):
            mapped = TensorSpec(mo.kv_scale_name(kv["attn"], kv["kind"]), "F32", ())
        else:
            return spec
        self._ct_names[mapped.name] = spec.name
        return mapped

    def ct_name(self, name: str) -> str:
        return self._ct_names.get(name, name)

    def value(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The ModelOpt value of a tensor produced under its compressed-tensors `name`."""
        if (split := self._split(name)) is not None:
            return mo.modelopt_value(self.scheme, split[1], tensor)
        if self.kv_cache and _KV_SCALE.match(name):
            return mo.kv_scale_value(tensor)
        return tensor

    def configs(self) -> tuple[dict, dict]:
        """(config.json's quantization_config, hf_quant_config.json), as ModelOpt writes them."""
        return (mo.config_quantization_config(self.scheme, self.exclude, self.kv_cache),
                mo.hf_quant_config(self.scheme, self.exclude, self.kv_cache))
