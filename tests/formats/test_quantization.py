"""Quantization detection on configs written by compressed-tensors itself and in ModelOpt's published layout."""

from __future__ import annotations

import json

import pytest
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, preset_name_to_scheme

from mtpkit.errors import ConfigError
from mtpkit.formats.quantization import detect_quantization

FP8_KV = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)


def _ct_config(preset: str, fmt: str, kv: bool) -> dict:
    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, format=fmt,
                            ignore=["lm_head"], kv_cache_scheme=FP8_KV if kv else None)
    # Through JSON, as it lies in config.json.
    return {"model_type": "gemma4", "quantization_config": json.loads(json.dumps(qc.to_dict(), default=str))}


@pytest.mark.parametrize(("preset", "fmt", "scheme"), [
    ("FP8_DYNAMIC", "float-quantized", "fp8-dynamic"),
    ("FP8", "float-quantized", "fp8"),
    ("FP8_BLOCK", "float-quantized", "fp8-block"),
    ("NVFP4", "nvfp4-pack-quantized", "nvfp4"),
    ("NVFP4A16", "nvfp4-pack-quantized", "nvfp4a16"),
    ("W4A16", "pack-quantized", "custom"),
])
@pytest.mark.parametrize("kv", [True, False])
def test_compressed_tensors_presets(preset, fmt, scheme, kv):
    found = detect_quantization(_ct_config(preset, fmt, kv), None)
    assert found["method"] == "compressed-tensors" and found["scheme"] == scheme and found["format"] == fmt
    assert found["kv_cache"] == ("fp8" if kv else None) and found["ignore"] == ["lm_head"]


def test_modelopt_hf_quant_config_and_flat_config():
    # The layout of NVIDIA's published NVFP4 checkpoints (hf_quant_config.json).
    hf_quant = {"producer": {"name": "modelopt", "version": "0.35.0"},
                "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                                 "exclude_modules": ["lm_head", "model.vision_tower*"]}}
    found = detect_quantization({"model_type": "gemma4"}, hf_quant)
    assert (found["method"], found["scheme"], found["kv_cache"], found["group_size"]) == ("modelopt", "nvfp4", "fp8", 16)
    assert found["source"] == "hf_quant_config.json" and found["ignore"] == ["lm_head", "model.vision_tower*"]
    flat = {"model_type": "gemma4", "quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8",
                                                             "kv_cache_quant_algo": "FP8", "exclude_modules": []}}
    found = detect_quantization(flat, hf_quant)  # config.json wins: it is what loaders read first
    assert (found["scheme"], found["source"]) == ("fp8", "config.json")


def test_unquantized_and_malformed():
    assert detect_quantization({"model_type": "gemma4"}, None) is None
    with pytest.raises(ConfigError, match="config_groups"):
        detect_quantization({"quantization_config": {"quant_method": "compressed-tensors"}}, None)
    with pytest.raises(ConfigError, match="'quantization'"):
        detect_quantization({}, {"producer": {"name": "modelopt"}})
