"""The ModelOpt schema against what NVIDIA ModelOpt writes, what vLLM reads, and compressed-tensors' own tensors.

Oracles: the configs NVIDIA ModelOpt 0.47.0's exporter wrote for a tiny Gemma 4 (run on the CPU:
`mtq.quantize(model, mtq.<ALGO>_CFG + FP8_KV_CFG)`, then `export_hf_checkpoint`), copied here literally; vLLM's
reader, transcribed line by line from vllm/model_executor/layers/quantization/modelopt.py with each line quoted;
compressed-tensors' own compressors and matcher; and, when nvidia-modelopt is installed, ModelOpt itself.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import math
import re

import pytest
import torch
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.utils.match import match_name

from mtpkit.convert.quantize_scope import CT_IGNORE
from mtpkit.formats import modelopt as mo
from mtpkit.formats.dequantize import dequantize_weight
from mtpkit.formats.quantization import detect_quantization
from tests.formats.test_dequantize import _ct_float32, _ct_fp8, _ct_nvfp4

SCHEMES = list(mo.QUANT_ALGOS)
_FP8_ARGS = {"dynamic": False, "num_bits": 8, "type": "float"}
_FP4_ARGS = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
_KV = {"dynamic": False, "num_bits": 8, "type": "float"}
_PRODUCER = {"name": "modelopt", "version": "0.47.0"}
# What ModelOpt 0.47.0 wrote (hf_quant_config.json, config.json quantization_config), with an FP8 KV cache and
# its default exclusion of lm_head.
MODELOPT_0_47 = {
    "fp8": ({"producer": _PRODUCER, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                                     "exclude_modules": ["lm_head"]}},
            {"config_groups": {"group_0": {"input_activations": _FP8_ARGS, "weights": _FP8_ARGS, "targets": ["Linear"]}},
             "ignore": ["lm_head"], "quant_algo": "FP8", "kv_cache_scheme": _KV, "producer": _PRODUCER,
             "quant_method": "modelopt"}),
    "fp8-dynamic": ({"producer": _PRODUCER, "quantization": {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN",
                                                             "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}},
                    {"ignore": ["lm_head"], "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN", "kv_cache_scheme": _KV,
                     "producer": _PRODUCER, "quant_method": "modelopt"}),
    "fp8-block": ({"producer": _PRODUCER, "quantization": {"quant_algo": "fp8_pb_wo", "kv_cache_quant_algo": "FP8",
                                                           "exclude_modules": ["lm_head"]}},
                  {"ignore": ["lm_head"], "quant_algo": "fp8_pb_wo", "kv_cache_scheme": _KV, "producer": _PRODUCER,
                   "quant_method": "modelopt"}),
    "nvfp4": ({"producer": _PRODUCER, "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8",
                                                       "group_size": 16, "exclude_modules": ["lm_head"]}},
              {"config_groups": {"group_0": {"input_activations": _FP4_ARGS, "weights": _FP4_ARGS, "targets": ["Linear"]}},
               "ignore": ["lm_head"], "quant_algo": "NVFP4", "kv_cache_scheme": _KV, "producer": _PRODUCER,
               "quant_method": "modelopt"}),
    "nvfp4a16": ({"producer": _PRODUCER, "quantization": {"quant_algo": "W4A16_NVFP4", "kv_cache_quant_algo": "FP8",
                                                          "group_size": 16, "exclude_modules": ["lm_head"]}},
                 {"config_groups": {"group_0": {"weights": _FP4_ARGS, "targets": ["Linear"]}}, "ignore": ["lm_head"],
                  "quant_algo": "W4A16_NVFP4", "kv_cache_scheme": _KV, "producer": _PRODUCER,
                  "quant_method": "modelopt"}),
}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_configs_are_what_modelopt_writes(scheme):
    hf, flat = MODELOPT_0_47[scheme]
    ours_hf = mo.hf_quant_config(scheme, ["lm_head"], kv_cache=True, producer_version="0.47.0")
    ours_flat = mo.config_quantization_config(scheme, ["lm_head"], kv_cache=True, producer_version="0.47.0")
    # Equal as JSON, key order included (ModelOpt writes insertion order).
    assert json.dumps(ours_hf) == json.dumps(hf) and json.dumps(ours_flat) == json.dumps(flat)
    # Without a KV cache: get_quant_config keeps kv_cache_quant_algo None; convert_hf_quant_config_format only
    # adds kv_cache_scheme `if kv_cache_quant_algo:` (modelopt/torch/export/convert_hf_config.py).
    no_kv = mo.hf_quant_config(scheme, ["lm_head"], kv_cache=False, producer_version="0.47.0")
    assert no_kv["quantization"]["kv_cache_quant_algo"] is None
    assert "kv_cache_scheme" not in mo.config_quantization_config(scheme, ["lm_head"], kv_cache=False)


# -- vLLM's reader, transcribed from vllm/model_executor/layers/quantization/modelopt.py -------------------------
VLLM_QUANT_ALGOS = ["FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8", "MIXED_PRECISION"]
VLLM_LINEAR_METHOD = {"FP8": "ModelOptFp8LinearMethod", "FP8_PER_CHANNEL_PER_TOKEN": "ModelOptFp8PcPtLinearMethod",
                      "FP8_PB_WO": "ModelOptFp8PbWoLinearMethod", "NVFP4": "ModelOptNvFp4LinearMethod",
                      "W4A16_NVFP4": "ModelOptNvFp4W4A16LinearMethod"}


def _vllm_reads(config: dict) -> tuple:
    """(quantization method, quant_algo, kv algo, exclude_modules, group_size, linear method) as vLLM reads them."""
    if "quantization" in config:
        quant_config = config["quantization"]  # `quant_config = cls.get_from_keys(config, ["quantization"])`
        quant_method = quant_config.get("quant_algo")  # `quant_method = quant_config.get("quant_algo")`
        kv = quant_config.get("kv_cache_quant_algo")  # `kv_cache_quant_method = quant_config.get("kv_cache_quant_algo")`
        group_size = quant_config.get("group_size")  # `group_size_raw = quant_config.get("group_size")`
        exclude = quant_config.get("exclude_modules", [])  # `exclude_modules = quant_config.get("exclude_modules", [])`
    else:
        quant_method = config.get("quant_algo")  # `quant_method = config.get("quant_algo")`
        kv_scheme = config.get("kv_cache_scheme")  # `kv_cache_scheme = config.get("kv_cache_scheme")`
        # `if isinstance(kv_cache_scheme, dict) and (kv_cache_scheme.get("type") == "float"
        #      and kv_cache_scheme.get("num_bits") == 8): kv_cache_quant_method = "FP8"`
        kv = "FP8" if isinstance(kv_scheme, dict) and kv_scheme.get("type") == "float" and kv_scheme.get("num_bits") == 8 else None
        exclude = config.get("ignore", [])  # `exclude_modules = config.get("ignore", [])`
        group_size = config.get("group_size")  # `group_size_raw = config.get("group_size")`
    quant_method = str(quant_method).upper()  # `quant_method = str(quant_method).upper()`
    assert quant_method in VLLM_QUANT_ALGOS  # `if quant_method not in QUANT_ALGOS: raise ValueError(...)`
    assert isinstance(exclude, list)  # `if not isinstance(exclude_modules, list): raise ValueError(...)`
    # override_quantization_method: ModelOptNvFp4Config `if algo is not None and ("NVFP4" in algo or "FP4" in algo):
    # return "modelopt_fp4"`; ModelOptFp8Config `if algo is not None and algo == "FP8": return "modelopt"`; otherwise
    # config.json's quant_method "modelopt" stands, which is ModelOptFp8Config.
    method = "modelopt_fp4" if "FP4" in quant_method else "modelopt"
    if method == "modelopt_fp4":
        group_size = 16 if group_size is None else group_size  # `if group_size is None: group_size = 16`
        if "quantization" in config:  # `required_fields = ["group_size", "kv_cache_quant_algo", "exclude_modules"]`
            assert {"group_size", "kv_cache_quant_algo", "exclude_modules"} <= set(config["quantization"])
    return method, quant_method, kv, exclude, group_size, VLLM_LINEAR_METHOD[quant_method]


VLLM_EXPECTED = {  # literal: what each scheme must make vLLM select
    "fp8": ("modelopt", "FP8", "FP8", None, "ModelOptFp8LinearMethod"),
    "fp8-dynamic": ("modelopt", "FP8_PER_CHANNEL_PER_TOKEN", "FP8", None, "ModelOptFp8PcPtLinearMethod"),
    "fp8-block": ("modelopt", "FP8_PB_WO", "FP8", None, "ModelOptFp8PbWoLinearMethod"),
    "nvfp4": ("modelopt_fp4", "NVFP4", "FP8", 16, "ModelOptNvFp4LinearMethod"),
    "nvfp4a16": ("modelopt_fp4", "W4A16_NVFP4", "FP8", 16, "ModelOptNvFp4W4A16LinearMethod"),
}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_vllm_reads_both_configs(scheme):
    exclude = mo.exclude_modules_from_ct_ignore(CT_IGNORE)
    for config in (mo.hf_quant_config(scheme, exclude, kv_cache=True),
                   mo.config_quantization_config(scheme, exclude, kv_cache=True)):
        method, algo, kv, read_exclude, group_size, linear = _vllm_reads(config)
        assert (method, algo, kv, group_size, linear) == VLLM_EXPECTED[scheme] and read_exclude == exclude
    # vLLM's _normalize_quantization_config rewrites quant_method only for a config.json quantization_config with a
    # nested "quantization" dict (`quant_cfg.get("quantization", {}).get("quant_algo")`), and raises for algorithms
    # it does not list there (W4A16_NVFP4 among them); ModelOpt's flat config.json form never takes that branch.
    assert "quantization" not in mo.config_quantization_config(scheme, exclude, kv_cache=True)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("kv", [True, False])
def test_detect_quantization_reads_back_what_we_write(scheme, kv):
    exclude = mo.exclude_modules_from_ct_ignore(CT_IGNORE)
    hf = mo.hf_quant_config(scheme, exclude, kv_cache=kv)
    flat = {"model_type": "gemma4", "quantization_config": mo.config_quantization_config(scheme, exclude, kv_cache=kv)}
    group = 16 if scheme in ("nvfp4", "nvfp4a16") else None
    for found, source in ((detect_quantization(flat, hf), "config.json"),
                          (detect_quantization({"model_type": "gemma4"}, hf), "hf_quant_config.json")):
        assert (found["method"], found["scheme"], found["kv_cache"], found["group_size"], found["source"]) == (
            "modelopt", scheme, "fp8" if kv else None, group, source)
        assert found["ignore"] == exclude


# -- exclusions --------------------------------------------------------------------------------------------------
# vLLM's Gemma4ForConditionalGeneration.hf_to_vllm_mapper (vllm/model_executor/models/gemma4_mm.py), in order.
GEMMA4_MM_PREFIXES = {"model.vision_tower": "vision_tower", "model.embed_vision": "embed_vision",
                      "model.audio_tower.": "audio_tower.", "model.embed_audio.": "embed_audio.",
                      "model.language_model.": "language_model.model.", "lm_head.": "language_model.lm_head.",
                      "model": "language_model.model"}
# Linears of the Gemma 4 checkpoints (checkpoint names; the tiny fixtures have these, the real ones the same).
GEMMA4_LINEARS = [
    "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "model.layers.0.per_layer_input_gate",
    "model.layers.0.per_layer_projection", "model.per_layer_model_projection", "model.layers.0.router.proj",
    "model.language_model.layers.3.self_attn.k_proj", "model.language_model.layers.3.per_layer_input_gate",
    "model.language_model.per_layer_model_projection", "model.vision_tower.encoder.layers.0.mlp.gate_proj.linear",
    "model.vision_tower.patch_embedder.input_proj", "model.embed_vision.embedding_projection",
    "model.audio_tower.layers.0.feed_forward1.ffw_layer_1", "model.embed_audio.embedding_projection",
]


def _map_prefix(name: str) -> str:
    for old, new in GEMMA4_MM_PREFIXES.items():  # WeightsMapper: the first matching prefix is replaced
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _vllm_excluded(module: str, exclude_modules: list[str]) -> bool:
    """ModelOptQuantConfigBase.apply_vllm_mapper, then is_layer_excluded, for an unfused module."""
    rewritten = []
    for exclude in exclude_modules:
        # `if len(exclude) >= 2 and exclude[-1] == "*" and exclude[-2] != ".":
        #      new_exclude_modules.append(exclude[:-1]); new_exclude_modules.append(exclude[:-1] + ".*")`
        if len(exclude) >= 2 and exclude[-1] == "*" and exclude[-2] != ".":
            rewritten += [exclude[:-1], exclude[:-1] + ".*"]
        else:
            rewritten.append(exclude)
    patterns = [_map_prefix(p) for p in rewritten]  # `hf_to_vllm_mapper.apply_list(new_exclude_modules)`
    prefix = _map_prefix(module)
    return (prefix in patterns  # is_layer_skipped: `prefix in ignored_layers`
            or any(p != prefix and p in prefix for p in patterns)  # `exclude_module in prefix`
            or any(fnmatch.fnmatch(prefix, p) for p in patterns))  # `if fnmatch(prefix, wildcard_pattern)`


def test_ct_ignore_as_modelopt_wildcards():
    exclude = mo.exclude_modules_from_ct_ignore(CT_IGNORE)
    assert exclude == ["lm_head", "*per_layer", "*per_layer*?", "*router", "*router*?", "*vision_tower",
                       "*vision_tower*?", "*embed_vision", "*embed_vision*?", "*audio_tower", "*audio_tower*?",
                       "*embed_audio", "*embed_audio*?"]
    for module in GEMMA4_LINEARS + ["lm_head"]:
        ignored = any(match_name(module, pattern) for pattern in CT_IGNORE)  # compressed-tensors' own matcher
        assert any(fnmatch.fnmatchcase(module, p) for p in exclude) == ignored, module  # ModelOpt / TRT-LLM
        assert _vllm_excluded(module, exclude) == ignored, module  # vLLM, through its rewrite
    # Why not the obvious `*per_layer*`: vLLM's rewrite turns it into `*per_layer` and `*per_layer.*`, which miss
    # the per-layer Linears, so vLLM would build them as quantized.
    assert not _vllm_excluded("model.layers.0.per_layer_input_gate", ["*per_layer*"])


@pytest.mark.parametrize(("ignore", "expected"), [
    (["re:model\\.vision_tower.*"], ["model.vision_tower", "model.vision_tower*?"]),
    (["re:.*layers\\.0\\.mlp\\.down_proj$"], ["*layers.0.mlp.down_proj"]),
    (["re:(?s:model\\.embed_vision.*)\\Z"], ["model.embed_vision", "model.embed_vision*?"]),  # fnmatch.translate's form
    (["re:^model.layers.1.self_attn.q_proj$"], ["model?layers?1?self_attn?q_proj"]),  # an unescaped '.' is any char
    (["model.layers.0.mlp.up_proj", "lm_head", "lm_head"], ["model.layers.0.mlp.up_proj", "lm_head"]),
])
def test_ct_ignore_translations_mean_the_same(ignore, expected):
    exclude = mo.exclude_modules_from_ct_ignore(ignore)
    assert exclude == expected
    names = GEMMA4_LINEARS + ["model.layers.1.self_attn.q_proj", "model.layers.10.self_attn.q_proj", "lm_head",
                              "model.layers.0.mlp.up_proj", "model.vision_tower", "model.embed_visionX"]
    for module in names:
        assert any(fnmatch.fnmatchcase(module, p) for p in exclude) == any(match_name(module, i) for i in ignore), module
    # And back: ModelOpt -> compressed-tensors keeps the meaning too (compressed-tensors' matcher on our regexes).
    for module in names:
        back = mo.ct_ignore_from_exclude_modules(exclude)
        assert any(match_name(module, i) for i in back) == any(fnmatch.fnmatchcase(module, p) for p in exclude), module


@pytest.mark.parametrize("entry", ["re:.*(router|gate).*", "re:.*", "re:[ab]_proj", "re:.*proj\\d+", "x*y"])
def test_untranslatable_ignore_entries_are_refused(entry):
    with pytest.raises(ValueError, match="^" + re.escape(entry) + ": "):  # one line, naming the entry
        mo.exclude_modules_from_ct_ignore([entry])
    with pytest.raises(ValueError, match="character classes"):
        mo.ct_ignore_from_exclude_modules(["model.layers.[0-3].mlp*"])


# -- tensors -----------------------------------------------------------------------------------------------------
# The layouts ModelOpt 0.47.0's exporter produced for a [256, 384] Linear (mtq.quantize + _export_quantized_weight).
MODELOPT_LAYOUT_256x384 = {
    "fp8": {"weight": ("F8_E4M3", (256, 384)), "weight_scale": ("F32", ()), "input_scale": ("F32", ())},
    "fp8-dynamic": {"weight": ("F8_E4M3", (256, 384)), "weight_scale": ("F32", (256,))},
    "fp8-block": {"weight": ("F8_E4M3", (256, 384)), "weight_scale": ("F32", (2, 1, 3, 1))},
    "nvfp4": {"weight": ("U8", (256, 192)), "weight_scale": ("F8_E4M3", (256, 24)), "weight_scale_2": ("F32", ()),
              "input_scale": ("F32", ())},
    "nvfp4a16": {"weight": ("U8", (256, 192)), "weight_scale": ("F8_E4M3", (256, 24)), "weight_scale_2": ("F32", ())},
}
_CT_LAYOUT = {  # compressed-tensors' stored layout of the same Linear (QuantizedWeight.layout, bf16 model)
    "fp8": {"weight": ("F8_E4M3", (256, 384)), "weight_scale": ("BF16", (1,)), "input_scale": ("BF16", (1,))},
    "fp8-dynamic": {"weight": ("F8_E4M3", (256, 384)), "weight_scale": ("BF16", (256, 1))},
    "fp8-block": {"weight": ("F8_E4M3", (256, 384)), "weight_scale": ("BF16", (2, 3))},
    "nvfp4": {"weight_packed": ("U8", (256, 192)), "weight_scale": ("F8_E4M3", (256, 24)),
              "weight_global_scale": ("F32", (1,)), "input_global_scale": ("F32", (1,))},
    "nvfp4a16": {"weight_packed": ("U8", (256, 192)), "weight_scale": ("F8_E4M3", (256, 24)),
                 "weight_global_scale": ("F32", (1,))},
}


# ...and what a ModelOpt tensor becomes in compressed-tensors: FP8 scales in its shapes, kept float32 (exact);
# NVFP4 global scales in ModelOpt's shape, as compressed-tensors' ModelOptNvfp4Converter leaves them.
_CT_FROM_MODELOPT = {
    "fp8": {"weight": ("F8_E4M3", (256, 384)), "weight_scale": ("F32", (1,)), "input_scale": ("F32", (1,))},
    "fp8-dynamic": {"weight": ("F8_E4M3", (256, 384)), "weight_scale": ("F32", (256, 1))},
    "fp8-block": {"weight": ("F8_E4M3", (256, 384)), "weight_scale": ("F32", (2, 3))},
    "nvfp4": {"weight_packed": ("U8", (256, 192)), "weight_scale": ("F8_E4M3", (256, 24)),
              "weight_global_scale": ("F32", ()), "input_global_scale": ("F32", ())},
    "nvfp4a16": {"weight_packed": ("U8", (256, 192)), "weight_scale": ("F8_E4M3", (256, 24)),
                 "weight_global_scale": ("F32", ())},
}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_layouts_are_modelopts(scheme):
    ct_layout = _CT_LAYOUT[scheme]
    assert tuple(ct_layout) == mo.ct_suffixes(scheme)
    mapped = {mo.modelopt_name("m", s).removeprefix("m."): mo.modelopt_layout(scheme, s, *ct_layout[s]) for s in ct_layout}
    assert mapped == MODELOPT_LAYOUT_256x384[scheme] and tuple(mapped) == mo.modelopt_suffixes(scheme)
    back = {mo.ct_name("m", s, scheme).removeprefix("m."): mo.ct_layout(scheme, s, *layout) for s, layout in mapped.items()}
    assert back == _CT_FROM_MODELOPT[scheme]


@pytest.mark.parametrize(("preset", "scheme"), [("FP8", "fp8"), ("FP8_DYNAMIC", "fp8-dynamic"), ("FP8_BLOCK", "fp8-block")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_mapping_dequantizes_to_compressed_tensors_decompression(preset, scheme, dtype):
    compressed, reference = _ct_fp8(preset, (256, 384), dtype)  # compressed-tensors' compress and decompress
    ours = {mo.modelopt_name("m", s).removeprefix("m."): mo.modelopt_value(scheme, s, t) for s, t in compressed.items()}
    assert {s: (t.dtype, tuple(t.shape)) for s, t in ours.items()} == {
        s: (torch.float8_e4m3fn if d == "F8_E4M3" else torch.float32, shape)
        for s, (d, shape) in MODELOPT_LAYOUT_256x384[scheme].items() if s != "input_scale"}
    assert torch.equal(ours["weight"].view(torch.uint8), compressed["weight"].view(torch.uint8))
    # The scale keeps its value exactly (bf16 -> float32), so ModelOpt's W = fp8 * scale is compressed-tensors' W.
    # A ModelOpt reader takes the per-block scale as [out/128, in/128]: vLLM's ModelOptFp8PbWoLinearMethod does
    # `scale = scale.squeeze(1).squeeze(-1)` (mtpkit's dequantize_weight knows only that 2-D form).
    readable = {**ours, "weight_scale": ours["weight_scale"].squeeze(1).squeeze(-1)} if scheme == "fp8-block" else ours
    restored = dequantize_weight(readable, reference.dtype)
    assert torch.equal(restored, reference)
    back = {s: mo.ct_value(scheme, s, t) for s, t in ours.items()}
    assert torch.equal(back["weight_scale"], compressed["weight_scale"].float())


def test_nvfp4_mapping_dequantizes_to_compressed_tensors_decompression():
    compressed, scheme_args = _ct_nvfp4((256, 384))  # compressed-tensors' NVFP4 compressor
    ours = {mo.modelopt_name("m", s).removeprefix("m."): mo.modelopt_value("nvfp4a16", s, t)
            for s, t in compressed.items()}
    assert torch.equal(ours["weight"], compressed["weight_packed"])
    assert torch.equal(ours["weight_scale"].view(torch.uint8), compressed["weight_scale"].view(torch.uint8))
    assert ours["weight_scale_2"].shape == () and ours["weight_scale_2"] == 1 / compressed["weight_global_scale"].float()
    restored = dequantize_weight(ours, torch.float32)
    # compressed-tensors' decompression math at float32: equal up to the one reciprocal's rounding.
    torch.testing.assert_close(restored, _ct_float32(compressed, scheme_args, (256, 384)), rtol=2**-21, atol=0)
    ct_bf16 = NVFP4PackedCompressor.decompress(dict(compressed), scheme_args)["weight"]
    torch.testing.assert_close(restored.bfloat16(), ct_bf16, rtol=2**-7, atol=0)


def test_kv_scale_names_and_values():
    assert mo.kv_scale_name("model.language_model.layers.2.self_attn", "k") == \
        "model.language_model.layers.2.self_attn.k_proj.k_scale"
    assert mo.kv_scale_name("model.layers.2.self_attn", "v") == "model.layers.2.self_attn.v_proj.v_scale"
    assert mo.kv_scale_name("model.layers.2.self_attn.k_proj", "k") == "model.layers.2.self_attn.k_proj.k_scale"
    value = mo.kv_scale_value(torch.tensor([0.0517578125], dtype=torch.bfloat16))
    assert value.dtype == torch.float32 and value.shape == () and value.item() == 0.0517578125
    for bad in (lambda: mo.kv_scale_name("a", "q"), lambda: mo.kv_scale_value(torch.tensor([0.0])),
                lambda: mo.kv_scale_value(torch.ones(2))):
        with pytest.raises(ValueError):
            bad()


def test_unexpressible_schemes_and_tensors_are_refused():
    for scheme in ("custom", "mixed:fp8+nvfp4", "w4a16"):
        with pytest.raises(ValueError) as info:
            mo.quant_algo(scheme)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="must be U8"):
        mo.modelopt_layout("nvfp4", "weight_packed", "BF16", (4, 8))
    with pytest.raises(ValueError, match="not part of"):
        mo.modelopt_layout("fp8-dynamic", "input_scale", "BF16", (1,))
    with pytest.raises(ValueError, match="one value"):
        mo.modelopt_layout("fp8", "weight_scale", "BF16", (4, 1))
    with pytest.raises(ValueError, match="finite and > 0"):
        mo.modelopt_value("nvfp4", "weight_global_scale", torch.tensor([0.0]))


def test_reciprocal_round_trip_is_exact_below_sqrt2_only():
    """Why a ModelOpt -> compressed-tensors -> ModelOpt round trip can move a global scale by one ulp."""
    bits = torch.arange(0x3F800000, 0x40000000, 41_943, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32) * 2.0**-14  # 200 significands across [1, 2), at an amax/2688-like magnitude
    twice = torch.stack([mo.modelopt_value("nvfp4", "weight_global_scale", mo.ct_value("nvfp4", "weight_scale_2", v))
                         for v in x])
    moved = twice != x
    assert not bool(moved[x < math.sqrt(2) * 2.0**-14].any()) and bool(moved.any())
    assert bool(((twice - x).abs() <= torch.finfo(torch.float32).eps * x).all())  # never more than one ulp


# -- ModelOpt itself, when installed -----------------------------------------------------------------------------
def _modelopt_export(weight: torch.Tensor, cfg_name: str):
    """ModelOpt's own export of one Linear: mtq.quantize, then the exporter's per-module step."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    export = pytest.importorskip("modelopt.torch.export.unified_export_hf")
    model = torch.nn.Sequential(torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)).to(weight.dtype)
    with torch.no_grad():
        model[0].weight.copy_(weight)
    calib = torch.randn(4, weight.shape[1], generator=torch.Generator().manual_seed(1)).to(weight.dtype)
    model = mtq.quantize(model, copy.deepcopy(getattr(mtq, cfg_name)), lambda m: m(calib))
    export._export_quantized_weight(model[0], weight.dtype)
    return model[0]


MODELOPT_CFGS = {"fp8": "FP8_DEFAULT_CFG", "fp8-dynamic": "FP8_PER_CHANNEL_PER_TOKEN_CFG",
                 "fp8-block": "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}


@pytest.mark.parametrize("scheme", list(MODELOPT_CFGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_same_bytes_as_modelopt_for_float32_weights(scheme, seed):
    """mtpkit's quantizer, mapped into ModelOpt's layout, gives ModelOpt's exported bytes for a float32 weight.

    (For a bf16 weight they differ now and then by design: ModelOpt divides a bf16 weight by a 0-d float32 scale,
    which does not promote, so it rounds each quotient to bf16 before the FP8 / FP4 rounding; llm-compressor, whose
    bytes mtpkit reproduces, divides by a bf16 scale. Both read each other's tensors the same way, below.)
    """
    pytest.importorskip("modelopt")
    from mtpkit.formats.nvfp4 import modelopt_weight_scale_2
    from mtpkit.formats.quant_math import quantize_weight

    weight = torch.randn(256, 384, generator=torch.Generator().manual_seed(seed)) * 0.05
    theirs = _modelopt_export(weight, MODELOPT_CFGS[scheme])
    amax = float(weight.abs().amax())
    ours = {mo.modelopt_name("m", s).removeprefix("m."): mo.modelopt_value(scheme, s, t)
            for s, t in quantize_weight(weight, scheme, amax).tensors.items()}
    for suffix in ("weight", "weight_scale"):
        mine, their = ours[suffix], getattr(theirs, suffix)
        assert (mine.dtype, mine.shape) == (their.dtype, their.shape), suffix
        assert torch.equal(mine.view(torch.uint8) if mine.dtype == torch.float8_e4m3fn else mine,
                           their.view(torch.uint8) if their.dtype == torch.float8_e4m3fn else their), suffix
    if scheme == "nvfp4":
        # NVIDIA's own weight_scale_2 = amax / 2688 is what mtpkit's modelopt_weight_scale_2 computes, bit for bit;
        # the reciprocal of compressed-tensors' global scale is within one float32 rounding of it.
        assert torch.equal(modelopt_weight_scale_2(torch.tensor([amax])), theirs.weight_scale_2)
        torch.testing.assert_close(ours["weight_scale_2"], theirs.weight_scale_2, rtol=2**-23, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_modelopt_dequantizes_our_tensors_as_we_do(dtype):
    """ModelOpt's own NVFP4 dequantizer reads what we write the way mtpkit's dequantize_weight does."""
    pytest.importorskip("modelopt")
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    from mtpkit.formats.quant_math import quantize_weight

    weight = (torch.randn(64, 96, generator=torch.Generator().manual_seed(3)) * 0.05).to(dtype)
    tensors = {mo.modelopt_name("m", s).removeprefix("m."): mo.modelopt_value("nvfp4a16", s, t)
               for s, t in quantize_weight(weight, "nvfp4a16", float(weight.abs().amax())).tensors.items()}
    qtensor = NVFP4QTensor(torch.Size((64, 96)), torch.float32, tensors["weight"])
    theirs = qtensor.dequantize(dtype=torch.float32, scale=tensors["weight_scale"],
                                double_scale=tensors["weight_scale_2"], block_sizes={-1: 16})
    assert torch.equal(theirs, dequantize_weight(tensors, torch.float32))
