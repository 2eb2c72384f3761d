"""Which tensors of a Gemma 4 target are quantized, and which must share a scale.

Quantized: the Linear layers of the text decoder, i.e. the attention projections and the MLPs.
Everything else (lm_head, embeddings and per-layer embeddings, vision and audio towers and their
projections, the MoE router, norms) stays as it is. vLLM fuses q/k/v of one attention and gate/up of
one MLP into one layer that keeps one global (NVFP4) or per-tensor (FP8) scale, so those groups get a
shared scale here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from mtpkit.convert.safetensors_file import TensorInfo, load_tensor

# `model.layers.N.` (text-only) or `model.language_model.layers.N.` (the multimodal wrapper).
_DECODER_LINEAR = re.compile(
    r"^(?P<layer>(?:model\.)?(?:language_model\.)?layers\.\d+)\.(?P<block>self_attn|mlp)\."
    r"(?P<proj>q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$"
)
_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
# MoE experts are stored as fused 3-D parameters (experts.gate_up_proj / experts.down_proj).
_EXPERTS = re.compile(r"^(?:model\.)?(?:language_model\.)?layers\.\d+\.experts\.(gate_up_proj|down_proj)$")

# compressed-tensors `targets` / `ignore`, as llm-compressor writes them: every Linear except those
# ignored. The ignore list names every other Linear a Gemma 4 checkpoint has (transformers and vLLM
# would otherwise expect them quantized); tests check it against compressed-tensors' own matcher.
CT_TARGETS = ["Linear"]
CT_IGNORE = ["lm_head", "re:.*per_layer.*", "re:.*router.*", "re:.*vision_tower.*", "re:.*embed_vision.*",
             "re:.*audio_tower.*", "re:.*embed_audio.*"]


@dataclass(frozen=True)
class QuantTarget:
    module: str  # e.g. model.layers.3.self_attn.q_proj
    weight: TensorInfo  # the stored tensor the [out, in] weight is read from
    group: str  # modules of one fused group share a global / per-tensor scale

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    @property
    def dtype(self) -> str:
        return self.weight.dtype

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def load(self) -> torch.Tensor:
        """The [out, in] weight, read from disk now (nothing is cached)."""
        return load_tensor(self.weight)


def matches(module: str, pattern: str) -> bool:
    """compressed-tensors' name matching: `re:` patterns match from the start (re.match), others exactly."""
    return re.match(pattern[3:], module) is not None if pattern.startswith("re:") else module == pattern


def quantization_targets(tensors: dict[str, TensorInfo], ignore: list[str] = ()) -> list[QuantTarget]:
    """The decoder Linears to quantize, less any module an `ignore` pattern (compressed-tensors syntax) names."""
    targets = []
    for name, info in tensors.items():
        match = _DECODER_LINEAR.match(name)
        if match is None:
            continue
        module = name.removesuffix(".weight")
        if any(matches(module, pattern) for pattern in ignore):
            continue
        fused = _FUSED.get(match["proj"])
        group = f"{match['layer']}.{match['block']}.{fused}" if fused else module
        targets.append(QuantTarget(module, info, group))
    return targets


def moe_expert_tensors(tensors: dict[str, TensorInfo]) -> list[str]:
    return [name for name in tensors if _EXPERTS.match(name)]
