"""Quantizing a MoE target (26B-A4B-like): experts unpacked per expert as vLLM and llm-compressor name them,
calibrated on every token, and read back by compressed-tensors and by our runtime."""

from __future__ import annotations

import json

import pytest
import torch
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.quantization.utils import generate_gparam
from safetensors.torch import load_file
from transformers import Gemma4ForCausalLM

from mtpkit.formats.dequantize import dequantize_weight
from mtpkit.runtime import Gemma4TextModel, KVCache, TextConfig, load_text_state_dict

PER_EXPERT = r"model.layers.{layer}.experts.{e}.{proj}"


@pytest.fixture
def calib(calib_file):
    return calib_file((9, 6, 12), 11)


def _experts_inputs(folder, sequences):
    """transformers (bf16, the checkpoint's dtype): each layer's MoE input, over all samples."""
    model = Gemma4ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, experts_implementation="eager").eval()
    seen: dict[int, list[torch.Tensor]] = {}
    handles = [layer.experts.register_forward_pre_hook(lambda _m, args, i=i: seen.setdefault(i, []).append(args[0]))
               for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        for tokens in sequences:
            model(tokens[None])
    for handle in handles:
        handle.remove()
    return model, {i: torch.cat(xs) for i, xs in seen.items()}


def test_experts_only_recipe(tiny, cli, calib, tmp_path):
    path, sequences = calib
    src, out = tiny("moe_26b_like"), tmp_path / "q"
    result = cli("quantize", src, out, "--recipe", "nvfp4-experts-only", "--calib", path, "--json")
    assert result.code == 0, result.err
    tensors = load_file(out / "model.safetensors")
    original = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config = config.get("text_config", config)
    layers, experts = config["num_hidden_layers"], config["num_experts"]
    # The fused 3-D tensors are gone, replaced by vLLM's per-expert names; attention and the dense MLP untouched.
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in tensors)
    for name, value in original.items():
        if ".experts." not in name:
            assert torch.equal(tensors[name], value), name
    written = json.loads((out / "config.json").read_text())["quantization_config"]
    group = QuantizationConfig.model_validate(written).config_groups["group_0"]
    model, inputs = _experts_inputs(src, sequences)
    for layer in range(layers):
        gate_up = original[f"model.layers.{layer}.experts.gate_up_proj"]
        inner = gate_up.shape[1] // 2
        x = inputs[layer]
        for e in range(experts):
            names = {p: PER_EXPERT.format(layer=layer, e=e, proj=p) for p in ("gate_proj", "up_proj", "down_proj")}
            # gate and up of one expert share a global scale (vLLM's w13 keeps one).
            assert torch.equal(tensors[names["gate_proj"] + ".weight_global_scale"],
                               tensors[names["up_proj"] + ".weight_global_scale"])
            # compressed-tensors' own decompression of each expert equals the source slice within NVFP4 error.
            for proj, source in (("gate_proj", gate_up[e, :inner]), ("up_proj", gate_up[e, inner:]),
                                 ("down_proj", original[f"model.layers.{layer}.experts.down_proj"][e])):
                stored = {s: tensors[f"{names[proj]}.{s}"] for s in ("weight_packed", "weight_scale",
                                                                    "weight_global_scale")}
                theirs = NVFP4PackedCompressor.decompress(dict(stored), group)["weight"]
                assert torch.equal(theirs.to(torch.bfloat16), dequantize_weight(stored, torch.bfloat16))
                error = (theirs.float() - source.float()).norm() / source.float().norm()
                assert error < 0.15, (names[proj], float(error))
            # gate/up inputs: the MoE block's input over every token (all experts calibrated). Within one bf16
            # step: our bf16 MoE layer rounds a few activations differently from transformers' bf16 one.
            amax = x.abs().amax().float().reshape(1)
            for proj in ("gate_proj", "up_proj"):
                torch.testing.assert_close(tensors[names[proj] + ".input_global_scale"], generate_gparam(-amax, amax),
                                           rtol=2**-7, atol=0)
    # Our runtime loads the quantized experts; its logits stay near the BF16 model's.
    ours = Gemma4TextModel(TextConfig.from_dict(json.loads((out / "config.json").read_text()))).eval()
    load_text_state_dict(ours, tensors)
    tokens = sequences[0][None]
    cache = KVCache(ours.config, 1, tokens.shape[1])
    with torch.no_grad():
        logits = ours.logits(ours(tokens, torch.arange(tokens.shape[1])[None], cache))[0].float()
        reference = model.float()(tokens).logits[0]
    assert float((logits - reference).abs().max()) < 0.3
    report = json.loads(result.out)
    assert report["kept_unquantized"]["moe_experts"] == []
    assert report["evaluation"]["activations"] == "quantized as served, except the MoE experts' inputs"
