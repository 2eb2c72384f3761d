"""`quantize --format modelopt`: ModelOpt's names, layouts and formulas, streamed from the same quantization.

Oracles: ModelOpt's formulas (weight_scale_2 = amax / (6 * 448), input_scale = amax / (6 * 448) for NVFP4 and
amax / 448 for FP8, KV scales amax / 448 on k_proj / v_proj, all float32 0-d), compressed-tensors' decompression
of the same run written as compressed-tensors (equal dequantized weights), and our reader of the configs.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mtpkit.convert.checkpoint import open_checkpoint
from mtpkit.formats.dequantize import dequantize_weight, plan_modules
from mtpkit.formats.quantization import detect_quantization
from mtpkit.loader.text_parts import TextCheckpoint
from tests.calibrate.test_observe import _transformers_ranges
from tests.calibrate.test_pipeline import _group_max
from tests.conftest import tree_digest


@pytest.fixture
def calib(calib_file):
    return calib_file((7, 6, 5), 13)


@pytest.mark.parametrize(("name", "scheme"), [("e2b_like", "nvfp4"), ("dense_31b_like", "fp8"),
                                              ("multimodal", "nvfp4a16"), ("dense_31b_like", "fp8-dynamic")])
def test_modelopt_output_follows_modelopts_formulas(tiny, cli, calib, tmp_path, name, scheme):
    path, sequences = calib
    src = tiny(name)
    before = tree_digest(src)
    args = ("--scheme", scheme, "--kv-cache", "fp8", "--calib", path)
    assert cli("quantize", src, tmp_path / "mo", *args, "--format", "modelopt").code == 0
    assert cli("quantize", src, tmp_path / "ct", *args).code == 0
    assert tree_digest(src) == before
    mo, ct = load_file(tmp_path / "mo" / "model.safetensors"), load_file(tmp_path / "ct" / "model.safetensors")
    config = json.loads((tmp_path / "mo" / "config.json").read_text())
    hf_quant = json.loads((tmp_path / "mo" / "hf_quant_config.json").read_text())
    found = detect_quantization(config, hf_quant, "config.json")
    assert (found["method"], found["scheme"], found["kv_cache"]) == ("modelopt", scheme, "fp8")
    ranges, kv, _ = _transformers_ranges(src, sequences, torch.bfloat16)
    ct_plans, mo_plans = plan_modules(ct), plan_modules(mo)
    quantized = [m for m, plan in ct_plans.items() if plan.quantized]
    assert quantized and sorted(quantized) == sorted(m for m, p in mo_plans.items() if p.quantized)
    for module in quantized:
        ours = {s: mo[n] for s, n in mo_plans[module].sources.items()}
        theirs = {s: ct[n] for s, n in ct_plans[module].sources.items()}
        # The same weight, whichever format holds it: the same codes and group scales; only NVFP4's global scale
        # changes form (ModelOpt multiplies by 1/x where compressed-tensors divides by x), one float32 rounding.
        torch.testing.assert_close(dequantize_weight(ours, torch.float32), dequantize_weight(theirs, torch.float32),
                                   rtol=2e-7, atol=0)
        amax = _group_max(ranges, module)
        if scheme.startswith("nvfp4"):
            assert "weight_packed" not in ours and ours["weight"].dtype == torch.uint8
            assert ours["weight_scale_2"].shape == () and ours["weight_scale_2"].dtype == torch.float32
            if scheme == "nvfp4":
                assert ours["input_scale"].shape == ()
                assert float(ours["input_scale"]) == pytest.approx(amax / (6 * 448), rel=1e-6)
        elif scheme == "fp8":
            assert ours["weight_scale"].shape == () and ours["input_scale"].shape == ()
            assert float(ours["input_scale"]) == pytest.approx(amax / 448, rel=2**-8)  # from the bf16 CT value
        else:
            assert ours["weight_scale"].shape == (ours["weight"].shape[0],) and "input_scale" not in ours
    text = TextCheckpoint(open_checkpoint(src))
    for layer in range(text.config.num_hidden_layers):
        for kind, amax in zip("kv", kv[text.config.kv_source[layer]]):
            scale = mo[f"{text.prefix}layers.{layer}.self_attn.{kind}_proj.{kind}_scale"]
            assert scale.shape == () and float(scale) == pytest.approx(amax / 448, rel=1e-6)
            assert f"{text.prefix}layers.{layer}.self_attn.{kind}_scale" not in mo
    # Everything else is the same bytes as the compressed-tensors run copies.
    for key, value in load_file(src / "model.safetensors").items():
        if key.removesuffix(".weight") not in quantized:
            assert torch.equal(mo[key], value), key


def test_modelopt_refuses_a_selection_it_cannot_express(tiny, cli, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n"
                      "      targets: ['re:.*self_attn\\.q_proj$']\n      scheme: NVFP4A16\n")
    result = cli("quantize", tiny("dense_31b_like"), tmp_path / "out", "--recipe", recipe, "--format", "modelopt")
    assert result.code == 2 and "has no `targets`" in result.err and not (tmp_path / "out").exists()
