"""`mtp-convert quantize` against transformers' and compressed-tensors' own loaders of the format."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.utils import match_named_modules
from safetensors.torch import load_file, save_file
from transformers import CompressedTensorsConfig

from mtpkit.formats.dequantize import dequantize_weight, plan_modules
from tests.conftest import tree_digest

IDS = torch.tensor([[5, 17, 33, 2, 99, 64, 7, 8, 120, 3, 44, 45]])
CLASS = {"multimodal": transformers.Gemma4ForConditionalGeneration, "e2b_like": transformers.Gemma4ForCausalLM,
         "wide": transformers.Gemma4ForCausalLM}


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A tiny target whose dimensions are multiples of 128, as fp8-block needs."""
    torch.manual_seed(0)
    config = transformers.Gemma4TextConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, global_head_dim=128, layer_types=["sliding_attention", "full_attention"],
        sliding_window=8, max_position_embeddings=256, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
    folder = tmp_path_factory.mktemp("wide") / "wide"
    transformers.Gemma4ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def _source(name, tiny, wide):
    return wide if name == "wide" else tiny(name)


def _dequantized_reference(name, src, out):
    """The BF16 model with each quantized weight replaced by our dequantization of the written tensors."""
    model = CLASS[name].from_pretrained(src, dtype=torch.bfloat16).eval()
    tensors = load_file(out / "model.safetensors")
    state = model.state_dict()
    with torch.no_grad():
        for plan in plan_modules(tensors).values():
            if plan.quantized:
                loaded = {suffix: tensors[full] for suffix, full in plan.sources.items()}
                state[plan.weight_name].copy_(dequantize_weight(loaded, torch.bfloat16))
    return model, tensors


@pytest.mark.parametrize(("name", "scheme"), [("multimodal", "fp8-dynamic"), ("multimodal", "nvfp4a16"),
                                              ("e2b_like", "nvfp4a16"), ("wide", "fp8-block")])
def test_transformers_loads_it_and_matches_the_dequantized_reference(tiny, wide, cli, tmp_path, name, scheme):
    src, out = _source(name, tiny, wide), tmp_path / "q"
    result = cli("quantize", src, out, "--scheme", scheme, "--json")
    assert result.code == 0, result.err
    reference, tensors = _dequantized_reference(name, src, out)
    loaded = CLASS[name].from_pretrained(out, dtype=torch.bfloat16,
                                         quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=IDS).logits, reference(input_ids=IDS).logits)
    # compressed-tensors' own decompression, driven by the config we wrote, equals our dequantization.
    config = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    group = config.config_groups["group_0"]
    compressor = NVFP4PackedCompressor if scheme.startswith("nvfp4") else FloatQuantizationCompressor
    for plan in plan_modules(tensors).values():
        if plan.quantized:
            loaded_tensors = {suffix: tensors[full] for suffix, full in plan.sources.items()}
            theirs = compressor.decompress(dict(loaded_tensors), group)["weight"]
            assert torch.equal(theirs.to(torch.bfloat16), dequantize_weight(loaded_tensors, torch.bfloat16))
    # Everything that is not a quantized Linear is untouched, byte for byte.
    original = load_file(src / "model.safetensors")
    quantized = {p.weight_name for p in plan_modules(tensors).values() if p.quantized}
    for key, value in original.items():
        if key not in quantized:
            assert torch.equal(tensors[key], value), key
    report = json.loads(result.out)
    assert set(report["relative_weight_error"]) == {k.removesuffix(".weight") for k in quantized}
    assert max(report["relative_weight_error"].values()) < (0.15 if scheme.startswith("nvfp4") else 0.05)


def test_our_targets_and_ignore_select_exactly_the_quantized_linears(tiny, cli, tmp_path):
    """compressed-tensors' own matcher, on the real module tree, picks the modules we quantized."""
    for name in ("multimodal", "e2b_like"):
        out = tmp_path / name
        assert cli("quantize", tiny(name), out, "--scheme", "nvfp4a16").code == 0
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        model = CLASS[name].from_pretrained(tiny(name))
        matched = {n for n, _ in match_named_modules(model, qc["config_groups"]["group_0"]["targets"], qc["ignore"])}
        written = {p.prefix for p in plan_modules(load_file(out / "model.safetensors")).values() if p.quantized}
        assert matched == written and written


def test_fused_groups_share_their_global_scale(tiny, cli, tmp_path):
    out = tmp_path / "q"
    assert cli("quantize", tiny("e2b_like"), out, "--scheme", "nvfp4a16").code == 0
    tensors = load_file(out / "model.safetensors")
    for layer in range(4):  # layers 0-3 compute K/V (4-6 are KV-shared: q only)
        base = f"model.layers.{layer}."
        qkv = [tensors[base + f"self_attn.{p}.weight_global_scale"] for p in ("q_proj", "k_proj", "v_proj")]
        gate_up = [tensors[base + f"mlp.{p}.weight_global_scale"] for p in ("gate_proj", "up_proj")]
        assert torch.equal(qkv[0], qkv[1]) and torch.equal(qkv[0], qkv[2]) and torch.equal(*gate_up)
        # The shared value is 448 * 6 / amax over the group (compressed-tensors' global scale formula).
        group = torch.cat([load_file(tiny("e2b_like") / "model.safetensors")[base + f"self_attn.{p}.weight"].flatten()
                           for p in ("q_proj", "k_proj", "v_proj")])
        assert torch.allclose(qkv[0], 448 * 6 / group.float().abs().max(), rtol=0, atol=0)


def test_deterministic(tiny, cli, tmp_path):
    for run in ("a", "b"):
        assert cli("quantize", tiny("dense_31b_like"), tmp_path / run, "--scheme", "nvfp4a16").code == 0
    assert tree_digest(tmp_path / "a") == tree_digest(tmp_path / "b")


@pytest.mark.parametrize(("damage", "scheme", "message"), [
    ("nan", "fp8-dynamic", "NaN"),
    ("odd", "nvfp4a16", "divisible by 16"),
    ("none", "fp8-block", "divisible by 128"),
    ("none", "fp8", "calibration"),
    ("quantized", "nvfp4a16", "already quantized"),
])
def test_refusals(tiny_copy, cli, tmp_path, damage, scheme, message):
    src = tiny_copy("text_only")
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    if damage == "nan":
        tensors[name][0, 3] = float("nan")
    elif damage == "odd":
        tensors[name] = tensors[name][:, :40].clone()
    save_file(tensors, src / "model.safetensors")
    if damage == "quantized":
        config = json.loads((src / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
        (src / "config.json").write_text(json.dumps(config))
    before = tree_digest(src)
    result = cli("quantize", src, tmp_path / "out", "--scheme", scheme)
    assert result.code == 2 and message in result.err and len(result.err.strip().splitlines()) == 1
    if damage in ("nan", "odd"):
        assert name in result.err
    assert not (tmp_path / "out").exists() and tree_digest(src) == before


def test_a_users_recipe_with_more_ignores(tiny, cli, tmp_path):
    """A recipe in llm-compressor's schema that keeps layer 0 in BF16: its ignore list is honoured and written."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      targets: [Linear]\n"
                      "      scheme: NVFP4A16\n      ignore: [lm_head, 're:.*layers\\.0\\..*']\n")
    out = tmp_path / "q"
    result = cli("quantize", tiny("dense_31b_like"), out, "--recipe", recipe)
    assert result.code == 0, result.err
    tensors, original = load_file(out / "model.safetensors"), load_file(tiny("dense_31b_like") / "model.safetensors")
    assert torch.equal(tensors["model.layers.0.mlp.down_proj.weight"], original["model.layers.0.mlp.down_proj.weight"])
    assert "model.layers.1.mlp.down_proj.weight_packed" in tensors
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "re:.*layers\\.0\\..*" in qc["ignore"]
    model = transformers.Gemma4ForCausalLM.from_pretrained(tiny("dense_31b_like"))
    matched = {n for n, _ in match_named_modules(model, qc["config_groups"]["group_0"]["targets"], qc["ignore"])}
    assert matched == {p.prefix for p in plan_modules(tensors).values() if p.quantized}
