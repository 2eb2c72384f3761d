"""`draft --dequantize` on an assistant whose linears were NVFP4-quantized by compressed-tensors itself.

Oracle: compressed-tensors' own decompression of the same tensors.
"""

from __future__ import annotations

import json

import torch
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from safetensors.torch import load_file, save_file

from tests.formats.test_dequantize import _ct_nvfp4

LINEARS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _quantized_assistant(tiny_copy):
    """assistant_plain with every decoder linear replaced by compressed-tensors NVFP4 tensors."""
    folder = tiny_copy("assistant_plain")
    tensors = load_file(folder / "model.safetensors")
    expected = {}
    for layer in range(2):
        for linear in LINEARS:
            name = f"model.layers.{layer}.{linear}"
            shape = tuple(tensors.pop(f"{name}.weight").shape)
            compressed, scheme = _ct_nvfp4(shape, seed=layer * 10 + LINEARS.index(linear))
            for suffix, value in compressed.items():
                tensors[f"{name}.{suffix}"] = value
            expected[f"{name}.weight"] = NVFP4PackedCompressor.decompress(compressed, scheme)["weight"]
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                                     "config_groups": {}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, expected


def test_dequantize_matches_compressed_tensors(tiny, tiny_copy, cli, tmp_path):
    src, expected = _quantized_assistant(tiny_copy)
    refused = cli("draft", src, tmp_path / "refused")
    assert refused.code == 2 and "--dequantize" in refused.err and not (tmp_path / "refused").exists()

    out = tmp_path / "draft"
    result = cli("draft", src, out, "--dequantize", "--json")
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert report["dequantized"] == len(expected)
    assert {"dequantize", "strip-quantization"} <= {r["rule"] for r in report["rules"]}
    written = load_file(out / "model.safetensors")
    assert not [n for n in written if n.endswith(("weight_packed", "weight_scale", "weight_global_scale"))]
    for name, reference in expected.items():
        assert written[name].dtype == torch.bfloat16 and torch.equal(written[name], reference.to(torch.bfloat16)), name
    # Everything else is the original assistant, byte for byte; and the pair validates.
    original = load_file(tiny("assistant_plain") / "model.safetensors")
    for name, value in written.items():
        if name not in expected:
            assert torch.equal(value, original[name]), name
    assert cli("check", "--target", tiny("dense_31b_like"), "--draft", out).code == 0
