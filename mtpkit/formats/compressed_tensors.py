"""The compressed-tensors on-disk schema: the `quantization_config` that llm-compressor writes.

The argument dicts are those of compressed-tensors' own presets (FP8_DYNAMIC, FP8, FP8_BLOCK, NVFP4,
NVFP4A16); tests check that compressed-tensors parses what we write back into exactly its presets,
and that transformers and vLLM read it. Plain dicts: no dependency on compressed-tensors at run time.
"""

from __future__ import annotations

_FP8 = {"num_bits": 8, "type": "float", "symmetric": True}
_FP4 = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
        "scale_dtype": "torch.float8_e4m3fn"}

# mtpkit scheme -> (compressed-tensors format, weight args, input-activation args or None)
SCHEMES: dict[str, tuple[str, dict, dict | None]] = {
    "fp8-dynamic": ("float-quantized", {**_FP8, "strategy": "channel", "dynamic": False},
                    {**_FP8, "strategy": "token", "dynamic": True}),
    "fp8": ("float-quantized", {**_FP8, "strategy": "tensor", "dynamic": False},
            {**_FP8, "strategy": "tensor", "dynamic": False, "observer": "static_minmax"}),
    "fp8-block": ("float-quantized", {**_FP8, "strategy": "block", "block_structure": [128, 128], "dynamic": False},
                  {**_FP8, "strategy": "group", "group_size": 128, "dynamic": True}),
    "nvfp4": ("nvfp4-pack-quantized", {**_FP4, "dynamic": False},
              {**_FP4, "dynamic": "local", "observer": "static_minmax"}),
    "nvfp4a16": ("nvfp4-pack-quantized", {**_FP4, "dynamic": False}, None),
}
# Schemes whose activation scales are static, so they need calibration data.
CALIBRATED = ("fp8", "nvfp4")
FP8_KV_CACHE = {**_FP8, "strategy": "tensor", "dynamic": False}


def quantization_config(scheme: str, targets: list[str], ignore: list[str], *, kv_cache: bool = False) -> dict:
    fmt, weights, inputs = SCHEMES[scheme]
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": list(targets), "weights": dict(weights),
                                      "input_activations": dict(inputs) if inputs else None,
                                      "output_activations": None, "format": fmt}},
        "ignore": list(ignore),
        "kv_cache_scheme": dict(FP8_KV_CACHE) if kv_cache else None,
        "global_compression_ratio": None,
    }
