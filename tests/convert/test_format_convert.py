"""ModelOpt NVFP4 -> compressed-tensors, against compressed-tensors' own ModelOpt converter and transformers."""

from __future__ import annotations

import json

import torch
import transformers
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
from safetensors.torch import load_file, save_file
from transformers import CompressedTensorsConfig

from mtpkit.convert.checkpoint import open_checkpoint
from mtpkit.convert.quantize_scope import quantization_targets
from mtpkit.formats.dequantize import dequantize_weight
from mtpkit.formats.nvfp4 import modelopt_weight_scale_2, nvfp4_global_scale, nvfp4_group_scales, quantize_nvfp4
from tests.conftest import tree_digest
from tests.formats.test_dequantize import _ct_float32

IDS = torch.tensor([[5, 17, 33, 2, 99, 64, 7, 8, 120, 3, 44, 45]])
HF_QUANT = {"producer": {"name": "modelopt", "version": "0.35.0"},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                             "exclude_modules": ["lm_head"]}}


def _modelopt_checkpoint(tiny_copy):
    """dense_31b_like in NVIDIA ModelOpt's NVFP4 layout (W4A4, FP8 KV cache), built from ModelOpt's formulas."""
    folder = tiny_copy("dense_31b_like")
    tensors = load_file(folder / "model.safetensors")
    targets = quantization_targets(open_checkpoint(folder).tensors)
    amax: dict[str, float] = {}
    for t in targets:
        amax[t.group] = max(amax.get(t.group, 0.0), float(tensors[t.weight.name].abs().max()))
    for i, t in enumerate(targets):
        weight = tensors.pop(t.weight.name)
        group_amax = torch.tensor([amax[t.group]])
        global_scale = nvfp4_global_scale(group_amax)
        group_scales = nvfp4_group_scales(weight, global_scale)
        tensors[f"{t.module}.weight"] = quantize_nvfp4(weight, group_scales, global_scale)
        tensors[f"{t.module}.weight_scale"] = group_scales
        tensors[f"{t.module}.weight_scale_2"] = modelopt_weight_scale_2(group_amax)  # 0-d, as ModelOpt exports
        tensors[f"{t.module}.input_scale"] = torch.tensor(0.003 + 0.001 * i)
        if t.module.endswith("k_proj"):
            tensors[f"{t.module}.k_scale"] = torch.tensor(0.05 + 0.01 * i)
        if t.module.endswith("v_proj"):
            tensors[f"{t.module}.v_scale"] = torch.tensor(0.07 + 0.01 * i)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "hf_quant_config.json").write_text(json.dumps(HF_QUANT))
    return folder, tensors, targets


def test_modelopt_to_compressed_tensors(tiny, tiny_copy, cli, tmp_path):
    src, modelopt, targets = _modelopt_checkpoint(tiny_copy)
    before = tree_digest(src)
    out = tmp_path / "ct"
    result = cli("quantize", src, out, "--to", "compressed-tensors", "--json")
    assert result.code == 0, result.err
    assert tree_digest(src) == before and not (out / "hf_quant_config.json").exists()
    ours = load_file(out / "model.safetensors")

    # Oracle 1: compressed-tensors' own ModelOpt converter gives the same tensors, byte for byte.
    kv = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
    converter = ModelOptNvfp4Converter(targets=[t.module for t in targets], ignore=["lm_head"], kv_cache_scheme=kv)
    theirs = converter.process(dict(modelopt))
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert value.dtype == ours[name].dtype and value.shape == ours[name].shape, name
        assert torch.equal(value.reshape(-1).view(torch.uint8), ours[name].reshape(-1).view(torch.uint8)), name

    # Oracle 2: compressed-tensors' decompression of the result equals ModelOpt's dequantization (x * s2 vs / (1/s2)).
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    group = QuantizationConfig.model_validate(config).config_groups["group_0"]
    assert config["kv_cache_scheme"] is not None and config["config_groups"]["group_0"]["input_activations"]
    reference = transformers.Gemma4ForCausalLM.from_pretrained(tiny("dense_31b_like"), dtype=torch.float32).eval()
    state = reference.state_dict()
    with torch.no_grad():
        for t in targets:
            source = {s: modelopt[f"{t.module}.{s}"] for s in ("weight", "weight_scale", "weight_scale_2")}
            dense = dequantize_weight(source, torch.float32)
            converted = {s: ours[f"{t.module}.{s}"] for s in ("weight_packed", "weight_scale", "weight_global_scale")}
            # compressed-tensors' decompression math (its unpacker and `dequantize`), run at float32.
            ct_dense = _ct_float32(converted, group, tuple(dense.shape))
            torch.testing.assert_close(ct_dense, dense, rtol=2**-21, atol=0)  # one reciprocal's rounding
            # Its compressor's own (bf16) decompression agrees to bf16 rounding.
            ct_bf16 = NVFP4PackedCompressor.decompress(dict(converted), group)["weight"]
            torch.testing.assert_close(ct_bf16.float(), dense, rtol=2**-7, atol=0)
            state[t.weight.name].copy_(ct_bf16)

        # Oracle 3: transformers loads it (dequantizing through compressed-tensors, to bf16) into exactly those
        # weights, and so gives exactly the logits of that dequantized model.
        loaded = transformers.Gemma4ForCausalLM.from_pretrained(
            out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
        loaded_state = loaded.state_dict()
        assert all(torch.equal(loaded_state[t.weight.name], state[t.weight.name]) for t in targets)
        assert torch.equal(loaded(input_ids=IDS).logits, reference(input_ids=IDS).logits)


def test_refusals(tiny, cli, tmp_path):
    plain = cli("quantize", tiny("text_only"), tmp_path / "a", "--to", "compressed-tensors")
    assert plain.code == 2 and "is not quantized" in plain.err
    both = cli("quantize", tiny("text_only"), tmp_path / "b", "--to", "compressed-tensors", "--scheme", "nvfp4a16")
    assert both.code == 2 and "exactly one of --scheme" in both.err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
