"""MoE experts stored per expert (llm-compressor's / vLLM's layout), quantized or dense, in the runtime.

Oracles: (1) the same runtime loaded with fused experts that this test builds itself, by dequantize_weight
on each expert and torch.cat / torch.stack into transformers' [E, 2I, H] / [E, H, I] layout (equal bit for
bit: the loader must place every expert, gate and up exactly there); (2) the BF16 model the experts were
quantized from (close: the quantization error only); dense per-expert tensors give it back exactly.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mtpkit.formats.dequantize import dequantize_weight
from mtpkit.formats.nvfp4 import modelopt_weight_scale_2
from mtpkit.formats.quant_math import quantize_weight
from mtpkit.runtime import Gemma4TextModel, KVCache, TextConfig, load_text_state_dict

LAYERS, EXPERTS, INNER = 4, 4, 16  # moe_26b_like
IDS = torch.tensor([[5, 17, 33, 2, 99, 64, 7, 8, 120, 3, 44, 45, 9], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]])
PROJS = ("gate_proj", "up_proj", "down_proj")
LAYOUTS = ["nvfp4a16", "fp8-dynamic", "fp8", "modelopt-nvfp4", "dense"]
# ||logits - BF16 logits|| / ||BF16 logits||. The random 4-layer fixture amplifies weight error: NVFP4 (about
# 10% relative error per expert weight) measured 0.19, FP8 (2-3%) 0.04 per tensor and 0.07 per channel, while
# zeroing every expert's output measured 0.73. Bounds: about 1.5x the measured values, well below that.
CLOSE = {"nvfp4a16": 0.3, "modelopt-nvfp4": 0.3, "fp8-dynamic": 0.12, "fp8": 0.12, "dense": 0.0}


def _stored(weight: torch.Tensor, layout: str, amax: float) -> dict[str, torch.Tensor]:
    """One expert projection's tensors in `layout`; `amax` is max |W| over its scale-sharing group."""
    if layout == "dense":
        return {"weight": weight.clone()}
    if layout == "modelopt-nvfp4":  # uint8 `weight` and a `weight_scale_2` multiplier, as ModelOpt exports
        q = quantize_weight(weight, "nvfp4a16", amax).tensors
        return {"weight": q["weight_packed"], "weight_scale": q["weight_scale"],
                "weight_scale_2": modelopt_weight_scale_2(torch.tensor([amax]))}
    return quantize_weight(weight, layout, amax).tensors


def _per_expert(tensors: dict[str, torch.Tensor], layout: str, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The checkpoint with each layer's fused experts unpacked into experts.<e>.<proj>.<suffix> tensors."""
    out = {}
    for name, tensor in tensors.items():
        out[prefix + name.removeprefix("model.")] = tensor
    for i in range(LAYERS):
        base = f"{prefix}layers.{i}.experts"
        gate_up, down = out.pop(f"{base}.gate_up_proj"), out.pop(f"{base}.down_proj")
        for e in range(EXPERTS):
            weights = {"gate_proj": gate_up[e, :INNER], "up_proj": gate_up[e, INNER:], "down_proj": down[e]}
            # vLLM's FusedMoE keeps one global / per-tensor scale for gate and up (w1, w3) of an expert.
            shared = float(gate_up[e].float().abs().max())
            for proj, weight in weights.items():
                amax = float(weight.float().abs().max()) if proj == "down_proj" else shared
                for suffix, t in _stored(weight.contiguous(), layout, amax).items():
                    out[f"{base}.{e}.{proj}.{suffix}"] = t
                out[f"{base}.{e}.{proj}.input_scale"] = torch.tensor([0.01])  # an activation scale: dropped
    return out


def _fused_reference(per_expert: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Fused experts built here from dequantize_weight on each expert, independently of the loader."""
    out = {n: t for n, t in per_expert.items() if ".experts." not in n}
    for i in range(LAYERS):
        base = f"model.layers.{i}.experts"

        def dense(e: int, proj: str) -> torch.Tensor:
            head = f"{base}.{e}.{proj}."
            stored = {n[len(head):]: t for n, t in per_expert.items() if n.startswith(head)}
            return dequantize_weight({s: t for s, t in stored.items() if s != "input_scale"}, dtype)

        out[f"{base}.gate_up_proj"] = torch.stack([torch.cat([dense(e, "gate_proj"), dense(e, "up_proj")])
                                                   for e in range(EXPERTS)])
        out[f"{base}.down_proj"] = torch.stack([dense(e, "down_proj") for e in range(EXPERTS)])
    return out


def _model(folder, tensors, dtype) -> Gemma4TextModel:
    model = Gemma4TextModel(TextConfig.from_dict(json.loads((folder / "config.json").read_text()))).to(dtype).eval()
    load_text_state_dict(model, tensors)
    return model


@torch.inference_mode()
def _logits(model) -> torch.Tensor:
    positions = torch.arange(IDS.shape[1]).expand(IDS.shape[0], -1)
    return model.logits(model(IDS, positions, KVCache(model.config, IDS.shape[0], IDS.shape[1]))).float()


@pytest.fixture(scope="module")
def source(tiny):
    folder = tiny("moe_26b_like")
    return folder, load_file(folder / "model.safetensors")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_per_expert_tensors_equal_the_fused_reference_and_stay_close_to_bf16(source, layout):
    folder, tensors = source
    per_expert = _per_expert(tensors, layout)
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in per_expert)
    for dtype in (torch.float32, torch.bfloat16):
        ours = _model(folder, per_expert, dtype)
        experts = ours.layers[1].experts
        assert experts.gate_up_proj.dtype == experts.down_proj.dtype == dtype  # held dense (moe.py says why)
        assert torch.equal(_logits(ours), _logits(_model(folder, _fused_reference(per_expert, dtype), dtype)))
    bf16 = _logits(_model(folder, tensors, torch.float32))
    difference = float((_logits(_model(folder, per_expert, torch.float32)) - bf16).norm() / bf16.norm())
    assert difference <= CLOSE[layout], difference
    if layout != "dense":
        assert difference > 0  # the experts really were quantized, not read from the BF16 tensors


def test_multimodal_prefix(source):
    folder, tensors = source
    plain = _logits(_model(folder, _per_expert(tensors, "nvfp4a16"), torch.float32))
    nested = _per_expert(tensors, "nvfp4a16", prefix="model.language_model.")
    assert any(n.startswith("model.language_model.layers.0.experts.0.") for n in nested)
    assert torch.equal(_logits(_model(folder, nested, torch.float32)), plain)


def _load(folder, tensors):
    _model(folder, tensors, torch.float32)


def test_a_missing_expert_tensor_is_named(source):
    folder, tensors = source
    per_expert = _per_expert(tensors, "nvfp4a16")
    gone = {n: per_expert.pop(n) for n in list(per_expert) if n.startswith("model.layers.2.experts.3.up_proj.")}
    assert gone
    with pytest.raises(ValueError, match=r"expert tensors missing: model\.layers\.2\.experts\.3\.up_proj\.weight"):
        _load(folder, per_expert)
    per_expert = _per_expert(tensors, "nvfp4a16")
    del per_expert["model.layers.1.experts.0.down_proj.weight_global_scale"]
    with pytest.raises(ValueError, match=r"in model\.layers\.1\.experts\.0\.down_proj is missing weight_global_scale"):
        _load(folder, per_expert)


@pytest.mark.parametrize(("change", "message"), [
    ("fused too", r"model\.layers\.0\.experts holds both fused \(model\.layers\.0\.experts\.gate_up_proj"),
    ("expert 4", r"beyond the config's 4 experts: model\.layers\.3\.experts\.4\.gate_proj"),
    ("wrong shape", r"model\.layers\.0\.experts\.1\.up_proj is \[16, 16\], the config expects \[16, 32\]"),
    ("a bias", r"unexpected \['model\.layers\.0\.experts\.2\.down_proj\.bias'\]"),
])
def test_refusals(source, change, message):
    folder, tensors = source
    per_expert = _per_expert(tensors, "dense")
    if change == "fused too":
        per_expert["model.layers.0.experts.gate_up_proj"] = tensors["model.layers.0.experts.gate_up_proj"]
    elif change == "expert 4":
        per_expert["model.layers.3.experts.4.gate_proj.weight"] = per_expert["model.layers.3.experts.0.gate_proj.weight"]
    elif change == "wrong shape":
        per_expert["model.layers.0.experts.1.up_proj.weight"] = torch.zeros(INNER, 16, dtype=torch.bfloat16)
    else:
        per_expert["model.layers.0.experts.2.down_proj.bias"] = torch.zeros(32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        _load(folder, per_expert)
