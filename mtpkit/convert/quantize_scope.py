"""Which tensors of a Gemma 4 target are quantized, and which must share a scale.

Candidates: the Linear layers of the text decoder, i.e. the attention projections, the dense MLP and,
on MoE targets (26B-A4B), each expert's gate/up/down projection. Everything else (lm_head, embeddings and
per-layer embeddings, vision and audio towers and their projections, the MoE router, norms) stays as it
is. Among the candidates, `targets` and `ignore` select as compressed-tensors does (see `selected`).

transformers stores the experts fused, as 3-D parameters `layers.N.experts.gate_up_proj` [E, 2I, H]
(gate = rows [0:I], up = rows [I:2I] of each expert) and `layers.N.experts.down_proj` [E, H, I].
Quantized checkpoints (llm-compressor, vLLM's loader) hold them unpacked, one 2-D Linear per expert
projection: `layers.N.experts.<e>.{gate,up,down}_proj`. Each expert projection is a target of its own,
read from its byte range of the 3-D tensor, so quantizing one never loads more than one expert matrix.

vLLM fuses q/k/v of one attention, gate/up of one MLP and w1/w3 (gate/up) of one expert into one layer
that keeps one global (NVFP4) or per-tensor (FP8) scale, so those groups get a shared scale here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from mtpkit.convert.safetensors_file import TensorInfo, load_tensor
from mtpkit.errors import CheckpointError, ConfigError
from mtpkit.formats.dtypes import itemsize

# `model.layers.N.` (text-only) or `model.language_model.layers.N.` (the multimodal wrapper).
_LAYER = r"(?P<layer>(?:model\.)?(?:language_model\.)?layers\.\d+)"
_DECODER_LINEAR = re.compile(
    rf"^{_LAYER}\.(?P<block>self_attn|mlp)\.(?P<proj>q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$"
)
_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
# MoE experts as transformers stores them: fused 3-D parameters.
_EXPERTS = re.compile(rf"^{_LAYER}\.experts\.(?P<param>gate_up_proj|down_proj)$")

# compressed-tensors `targets` / `ignore`, as llm-compressor writes them: every Linear except those
# ignored. The ignore list names every other Linear a Gemma 4 checkpoint has (transformers and vLLM
# would otherwise expect them quantized); tests check it against compressed-tensors' own matcher.
CT_TARGETS = ["Linear"]
CT_IGNORE = ["lm_head", "re:.*per_layer.*", "re:.*router.*", "re:.*vision_tower.*", "re:.*embed_vision.*",
             "re:.*audio_tower.*", "re:.*embed_audio.*"]
# Class names compressed-tensors matches against a module's classes (`_match_class`). Every candidate here
# is a Linear (the experts once unpacked, as llm-compressor unpacks them), so only this one can match.
_LINEAR_CLASS = "Linear"


@dataclass(frozen=True)
class QuantTarget:
    module: str  # e.g. model.layers.3.self_attn.q_proj or model.layers.3.experts.5.gate_proj
    weight: TensorInfo  # the bytes the [out, in] weight is read from (a slice of `source` for an expert)
    group: str  # modules of one fused group share a global / per-tensor scale
    source: str = field(default="")  # the checkpoint tensor holding the weight; `weight.name` when empty

    def __post_init__(self):
        if not self.source:
            object.__setattr__(self, "source", self.weight.name)

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


def selected(module: str, targets: str | Iterable[str] = ("Linear",), ignore: str | Iterable[str] = ()) -> bool:
    """Whether compressed-tensors (`is_match`) quantizes the Linear `module`: a target names it or is the
    class `Linear`, and no ignore entry does."""
    def hit(pattern: str) -> bool:
        return pattern == _LINEAR_CLASS or matches(module, pattern)

    return any(hit(t) for t in _listed(targets)) and not any(hit(i) for i in _listed(ignore))


def _listed(patterns: str | Iterable[str]) -> list[str]:
    return [patterns] if isinstance(patterns, str) else list(patterns)  # compressed-tensors takes either


def _slice(info: TensorInfo, label: str, offset: int, shape: tuple[int, int]) -> TensorInfo:
    """The contiguous row range of `info` that starts `offset` elements in and has `shape`."""
    size = itemsize(info.dtype)
    return replace(info, name=f"{info.name}[{label}]", shape=shape, start=info.start + offset * size,
                   nbytes=shape[0] * shape[1] * size)


def _check_experts(params: dict[str, TensorInfo]) -> None:
    """Shapes that make transformers' [E, 2I, H] / [E, H, I] pair; CheckpointError naming the tensor otherwise."""
    fix = "start from the BF16 checkpoint transformers writes"
    for info in params.values():
        if len(info.shape) != 3:
            raise CheckpointError(f"{info.name} is {info.dtype}{list(info.shape)}; a 3-D [experts, out, in] "
                                  f"tensor is needed", where=info.file, fix=fix)
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    if gate_up is not None and gate_up.shape[1] % 2:
        raise CheckpointError(f"{gate_up.name} {list(gate_up.shape)} has an odd number of rows; gate and up "
                              f"of each expert are two equal halves", where=gate_up.file, fix=fix)
    if gate_up is not None and down is not None:
        experts, rows, hidden = gate_up.shape
        if tuple(down.shape) != (experts, hidden, rows // 2):
            raise CheckpointError(f"{down.name} is {list(down.shape)}, but {gate_up.name} {list(gate_up.shape)} "
                                  f"needs [{experts}, {hidden}, {rows // 2}]", where=down.file, fix=fix)


def _expert_targets(layer: str, params: dict[str, TensorInfo]) -> list[QuantTarget]:
    """One target per expert projection of one layer, in expert order (gate, up, down)."""
    _check_experts(params)
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    num_experts = (gate_up if gate_up is not None else down).shape[0]
    targets = []
    for e in range(num_experts):
        module = f"{layer}.experts.{e}"
        if gate_up is not None:
            _, rows, hidden = gate_up.shape
            inner = rows // 2
            first = e * rows * hidden  # expert e's [2I, H] slab; gate is its first I rows, up the next I
            for proj, lo in (("gate_proj", 0), ("up_proj", inner)):
                info = _slice(gate_up, f"{e}, {lo}:{lo + inner}", first + lo * hidden, (inner, hidden))
                targets.append(QuantTarget(f"{module}.{proj}", info, f"{module}.gate_up", gate_up.name))
        if down is not None:
            _, hidden, inner = down.shape
            info = _slice(down, str(e), e * hidden * inner, (hidden, inner))
            targets.append(QuantTarget(f"{module}.down_proj", info, f"{module}.down_proj", down.name))
    return targets


def _expert_params(tensors: dict[str, TensorInfo]) -> dict[str, dict[str, TensorInfo]]:
    """layer -> {"gate_up_proj" | "down_proj": the 3-D tensor}."""
    layers: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        match = _EXPERTS.match(name)
        if match:
            layers.setdefault(match["layer"], {})[match["param"]] = info
    return layers


def _selected_experts(layer: str, params: dict[str, TensorInfo], targets, ignore) -> list[QuantTarget]:
    """The layer's expert targets if `targets`/`ignore` select all of them, [] if none; ConfigError if some.

    A layer's experts run as one fused MoE layer (vLLM's FusedMoE, this runtime's Experts) in one scheme,
    and the 3-D tensor they are read from is either copied or replaced as a whole, so a selection that
    splits them cannot be written or served.
    """
    candidates = _expert_targets(layer, params)
    chosen = [t for t in candidates if selected(t.module, targets, ignore)]
    if chosen and len(chosen) != len(candidates):
        left = sorted({t.module for t in candidates} - {t.module for t in chosen})
        raise ConfigError(f"targets/ignore select {len(chosen)} of the {len(candidates)} expert projections of "
                          f"{layer} (not {', '.join(left[:3])}{', ...' if len(left) > 3 else ''}); a MoE layer's "
                          f"experts run fused in one scheme", where=f"{layer}.experts",
                          fix="select all of a layer's experts or none (e.g. ignore 're:.*experts.*')")
    return chosen


def quantization_targets(tensors: dict[str, TensorInfo], ignore: str | Iterable[str] = (),
                         targets: str | Iterable[str] = ("Linear",)) -> list[QuantTarget]:
    """The decoder Linears (expert projections included) that `targets` select and `ignore` does not.

    Patterns are compressed-tensors': "Linear" selects every candidate (llm-compressor unpacks the experts
    into Linears, so they are included), `re:` patterns match module names with re.match, other names match
    exactly. Expert targets come per layer, all or none (ConfigError otherwise: see _selected_experts).
    """
    targets, ignore = _listed(targets), _listed(ignore)
    experts = _expert_params(tensors)
    found, done = [], set()
    for name, info in tensors.items():
        match = _DECODER_LINEAR.match(name)
        if match is not None:
            module = name.removesuffix(".weight")
            if selected(module, targets, ignore):
                fused = _FUSED.get(match["proj"])
                group = f"{match['layer']}.{match['block']}.{fused}" if fused else module
                found.append(QuantTarget(module, info, group))
            continue
        match = _EXPERTS.match(name)
        if match is not None and match["layer"] not in done:  # a layer's experts at its first 3-D tensor
            done.add(match["layer"])
            found += _selected_experts(match["layer"], experts[match["layer"]], targets, ignore)
    return found


def replaced_tensors(targets: Iterable[QuantTarget]) -> set[str]:
    """Checkpoint tensors the targets' quantized tensors replace (2-D weights and whole 3-D expert tensors):
    a writer must not copy them."""
    return {t.source for t in targets}


def moe_expert_tensors(tensors: dict[str, TensorInfo], ignore: str | Iterable[str] = (),
                       targets: str | Iterable[str] = ("Linear",)) -> list[str]:
    """The 3-D expert tensors that stay unquantized (copied as they are) under these `targets` / `ignore`."""
    chosen = replaced_tensors(quantization_targets(tensors, ignore, targets))
    return [name for name in tensors if _EXPERTS.match(name) and name not in chosen]
