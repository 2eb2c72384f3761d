"""`quantize --to modelopt` and the ModelOpt side of `--to compressed-tensors`, end to end through the CLI.

Oracles: compressed-tensors' own decompression of the input; the input itself (a ModelOpt -> compressed-tensors ->
ModelOpt round trip returns its bytes); vLLM's reader and ModelOpt's configs (literal, tests/formats/test_modelopt.py);
transformers loading the compressed-tensors output; and, when installed, a checkpoint NVIDIA ModelOpt exported itself.
"""

from __future__ import annotations

import fnmatch
import json
import math
import shutil

import pytest
import torch
import transformers
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from safetensors.torch import load_file, save_file
from transformers import CompressedTensorsConfig

from mtpkit.convert.checkpoint import open_checkpoint
from mtpkit.convert.quantize_scope import CT_IGNORE, CT_TARGETS, matches, quantization_targets
from mtpkit.formats import compressed_tensors as ct
from mtpkit.formats.dequantize import dequantize_weight
from mtpkit.formats.fp8 import fp8_weight_scale, quantize_fp8
from mtpkit.formats.nvfp4 import modelopt_weight_scale_2, nvfp4_global_scale, nvfp4_group_scales, quantize_nvfp4
from mtpkit.formats.quant_math import quantize_weight
from mtpkit.formats.quantization import detect_quantization
from tests.conftest import tree_digest
from tests.convert.test_format_convert import IDS, _modelopt_checkpoint
from tests.formats.test_dequantize import _ct_float32
from tests.formats.test_modelopt import MODELOPT_0_47, VLLM_EXPECTED, _vllm_excluded, _vllm_reads

CT_PRESET = {"fp8": "FP8", "fp8-dynamic": "FP8_DYNAMIC", "fp8-block": "FP8_BLOCK", "nvfp4": "NVFP4",
             "nvfp4a16": "NVFP4A16"}
NVFP4 = ("nvfp4", "nvfp4a16")


def _layout(scheme: str, out: int, inp: int) -> dict:
    """What ModelOpt 0.47.0 exports per Linear (seen running its exporter; see tests/formats/test_modelopt.py)."""
    if scheme in NVFP4:
        layout = {"weight": ("U8", (out, inp // 2)), "weight_scale": ("F8_E4M3", (out, inp // 16)),
                  "weight_scale_2": ("F32", ())}
        return {**layout, "input_scale": ("F32", ())} if scheme == "nvfp4" else layout
    scale = {"fp8": (), "fp8-dynamic": (out,), "fp8-block": (out // 128, 1, inp // 128, 1)}[scheme]
    layout = {"weight": ("F8_E4M3", (out, inp)), "weight_scale": ("F32", scale)}
    return {**layout, "input_scale": ("F32", ())} if scheme == "fp8" else layout


def _big_dense(tiny, tmp_path):
    """A checkpoint whose Linears are whole 128x128 blocks (FP8_PB_WO needs that; the tiny models are smaller)."""
    folder = tmp_path / "big"
    folder.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(tiny("text_only") / name, folder / name)
    g = torch.Generator().manual_seed(0)
    shapes = {"self_attn.q_proj": (256, 384), "self_attn.k_proj": (128, 384), "self_attn.v_proj": (128, 384),
              "self_attn.o_proj": (384, 256), "mlp.gate_proj": (256, 384), "mlp.up_proj": (256, 384),
              "mlp.down_proj": (384, 256)}
    tensors = {f"model.layers.0.{m}.weight": (torch.randn(s, generator=g) * 0.05).bfloat16() for m, s in shapes.items()}
    tensors["model.embed_tokens.weight"] = torch.randn(64, 384, generator=g).bfloat16()
    tensors["model.norm.weight"] = torch.ones(384, dtype=torch.bfloat16)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _linear_targets(folder, tensors):
    """The decoder Linears stored as their own [out, in] weights (MoE experts stay BF16 here)."""
    return [t for t in quantization_targets(open_checkpoint(folder).tensors) if t.weight.name in tensors]


def _group_amax(targets, tensors) -> dict[str, float]:
    """max |weight| per fused group (q/k/v, gate/up share one global scale)."""
    amax: dict[str, float] = {}
    for t in targets:
        amax[t.group] = max(amax.get(t.group, 0.0), float(tensors[t.weight.name].float().abs().max()))
    return amax


def _ct_checkpoint(folder, scheme: str, *, kv: bool = True, ignore: list[str] = CT_IGNORE):
    """`folder` turned into a compressed-tensors checkpoint of `scheme`, as mtpkit's quantizer lays one out."""
    tensors = load_file(folder / "model.safetensors")
    targets = _linear_targets(folder, tensors)
    amax = _group_amax(targets, tensors)
    for i, t in enumerate(targets):
        weight = tensors.pop(t.weight.name)
        tensors.update({f"{t.module}.{s}": v for s, v in quantize_weight(weight, scheme, amax[t.group]).tensors.items()})
        group_index = sorted(amax).index(t.group)  # fused q/k/v and gate/up share their static input scale
        if scheme == "fp8":
            tensors[f"{t.module}.input_scale"] = torch.tensor([0.01 + 0.003 * group_index], dtype=weight.dtype)
        if scheme == "nvfp4":
            tensors[f"{t.module}.input_global_scale"] = nvfp4_global_scale(torch.tensor([2.5 + group_index]))
        if kv and t.module.endswith("self_attn.k_proj"):
            attn = t.module.removesuffix(".k_proj")
            tensors[f"{attn}.k_scale"] = torch.tensor([0.05 + 0.01 * i])
            tensors[f"{attn}.v_scale"] = torch.tensor([0.07 + 0.01 * i])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = ct.quantization_config(scheme, CT_TARGETS, list(ignore), kv_cache=kv)
    (folder / "config.json").write_text(json.dumps(config))
    return folder, tensors, targets


@pytest.mark.parametrize("scheme", ["fp8", "fp8-dynamic", "fp8-block", "nvfp4", "nvfp4a16"])
def test_compressed_tensors_to_modelopt(scheme, tiny, tiny_copy, cli, tmp_path):
    folder = _big_dense(tiny, tmp_path) if scheme == "fp8-block" else tiny_copy("dense_31b_like")
    src, ct_tensors, targets = _ct_checkpoint(folder, scheme)
    before = tree_digest(src)
    out = tmp_path / "modelopt"
    result = cli("quantize", src, out, "--to", "modelopt", "--json")
    assert result.code == 0, result.err
    assert tree_digest(src) == before and json.loads(result.out)["modules"] == len(targets)
    ours = load_file(out / "model.safetensors")
    infos = open_checkpoint(out).tensors

    ct_group = QuantizationConfig.model_validate(json.loads((src / "config.json").read_text())["quantization_config"]
                                                 ).config_groups["group_0"]
    preset = preset_name_to_scheme(CT_PRESET[scheme], ["Linear"])
    for t in targets:
        out_features, in_features = t.shape
        written = {s: (infos[f"{t.module}.{s}"].dtype, infos[f"{t.module}.{s}"].shape)
                   for s in ("weight", "weight_scale", "weight_scale_2", "input_scale") if f"{t.module}.{s}" in infos}
        assert written == _layout(scheme, out_features, in_features), t.module
        mine = {s: ours[f"{t.module}.{s}"] for s in written}
        source = {s: ct_tensors[f"{t.module}.{s}"] for s in ("weight", "weight_packed", "weight_scale", "weight_global_scale")
                  if f"{t.module}.{s}" in ct_tensors}
        if scheme in NVFP4:
            assert torch.equal(mine["weight"], source["weight_packed"])
            assert torch.equal(mine["weight_scale"].view(torch.uint8), source["weight_scale"].view(torch.uint8))
            assert mine["weight_scale_2"] == 1 / source["weight_global_scale"].float()
            # compressed-tensors' decompression math (float32): equal up to the one reciprocal's rounding.
            reference = _ct_float32(source, ct_group, t.shape)
            torch.testing.assert_close(dequantize_weight(mine, torch.float32), reference, rtol=2**-21, atol=0)
        else:
            assert torch.equal(mine["weight"].view(torch.uint8), source["weight"].view(torch.uint8))
            # compressed-tensors' own FP8 decompression; ModelOpt's scale is the same value in float32.
            reference = FloatQuantizationCompressor.decompress(dict(source), preset)["weight"]
            readable = dict(mine)
            if scheme == "fp8-block":  # vLLM's ModelOptFp8PbWoLinearMethod: `scale.squeeze(1).squeeze(-1)`
                readable["weight_scale"] = mine["weight_scale"].squeeze(1).squeeze(-1)
            assert torch.equal(dequantize_weight(readable, reference.dtype), reference)
        if scheme == "fp8":
            assert mine["input_scale"] == ct_tensors[f"{t.module}.input_scale"].float()
        if scheme == "nvfp4":
            assert mine["input_scale"] == 1 / ct_tensors[f"{t.module}.input_global_scale"]
    # KV-cache scales move onto the projections, as float32 0-d values.
    kv = {n: v for n, v in ct_tensors.items() if n.endswith(("k_scale", "v_scale"))}
    assert kv
    for name, value in kv.items():
        attn, _, suffix = name.rpartition(".")
        moved = ours[f"{attn}.{suffix[0]}_proj.{suffix}"]
        assert name not in ours and moved.dtype == torch.float32 and moved.shape == () and moved == value.float()
    # Nothing of compressed-tensors' naming is left, and every other tensor is the input's, byte for byte.
    assert not [n for n in ours if n.endswith(("weight_packed", "weight_global_scale", "input_global_scale"))]
    untouched = {n for n in ct_tensors if not any(n.startswith(t.module + ".") for t in targets) and n not in kv}
    assert all(torch.equal(ours[n], ct_tensors[n]) for n in untouched)

    config = json.loads((out / "config.json").read_text())
    hf = json.loads((out / "hf_quant_config.json").read_text())
    found = detect_quantization(config, hf)
    assert (found["method"], found["scheme"], found["kv_cache"]) == ("modelopt", scheme, "fp8")
    for quant in (hf, config["quantization_config"]):
        method, algo, kv_algo, exclude, group_size, linear = _vllm_reads(quant)
        assert (method, algo, kv_algo, group_size, linear) == VLLM_EXPECTED[scheme]
    original = json.loads((src / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == \
        {k: v for k, v in original.items() if k != "quantization_config"}
    assert (out / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()


def _modelopt_built(folder, scheme: str, *, exact: bool):
    """`folder` as NVIDIA ModelOpt would export it, from NVIDIA's formulas and its literal layouts and configs.

    `exact`: global, input and KV scales whose every conversion is exact (powers of two; bf16-representable KV
    scales), so that the round trip must return every byte. Otherwise NVIDIA's own values (amax / 2688 ...).
    """
    tensors = load_file(folder / "model.safetensors")
    targets = _linear_targets(folder, tensors)
    amax = _group_amax(targets, tensors)
    for i, t in enumerate(targets):
        weight, a = tensors.pop(t.weight.name), amax[t.group]
        m = t.module
        if scheme in NVFP4:
            scale_2 = torch.tensor(2.0 ** math.ceil(math.log2(a / 2688))) if exact else \
                modelopt_weight_scale_2(torch.tensor([a]))  # NVIDIA: amax / (6 * 448), 0-d float32
            group_scales = nvfp4_group_scales(weight, (1 / scale_2).reshape(1))
            tensors[f"{m}.weight"] = quantize_nvfp4(weight, group_scales, (1 / scale_2).reshape(1))
            tensors[f"{m}.weight_scale"], tensors[f"{m}.weight_scale_2"] = group_scales, scale_2
            if scheme == "nvfp4":
                tensors[f"{m}.input_scale"] = torch.tensor(2.0**-9 if exact else 0.003 + 0.001 * i)
        else:
            if scheme == "fp8":
                scale = torch.tensor(a / 448.0)  # `torch.tensor(weight_quantizer.amax.item() / maxbound)`, 0-d
                values = quantize_fp8(weight, scale.reshape(1))
                tensors[f"{m}.input_scale"] = torch.tensor(0.002 + 0.001 * i)
            elif scheme == "fp8-dynamic":
                scale = weight.float().abs().amax(dim=1) / 448.0  # [out]
                values = quantize_fp8(weight, scale.reshape(-1, 1))
            else:
                blocks = fp8_weight_scale(weight, "block")
                scale, values = blocks.reshape(blocks.shape[0], 1, blocks.shape[1], 1), quantize_fp8(weight, blocks)
            tensors[f"{m}.weight"], tensors[f"{m}.weight_scale"] = values, scale
        if m.endswith("k_proj"):
            tensors[f"{m}.k_scale"] = torch.tensor(2.0**-4 * (1 + (i % 8) / 8) if exact else 0.05 + 0.01 * i)
        if m.endswith("v_proj"):
            tensors[f"{m}.v_scale"] = torch.tensor(2.0**-3 * (1 + (i % 8) / 8) if exact else 0.07 + 0.01 * i)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    hf, flat = MODELOPT_0_47[scheme]  # the configs ModelOpt wrote
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = flat
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "hf_quant_config.json").write_text(json.dumps(hf))
    return folder, tensors


def _round_trip(cli, src, tmp_path):
    before = tree_digest(src)
    middle, back = tmp_path / "ct", tmp_path / "back"
    first = cli("quantize", src, middle, "--to", "compressed-tensors")
    assert first.code == 0, first.err
    between = tree_digest(middle)
    second = cli("quantize", middle, back, "--to", "modelopt")
    assert second.code == 0, second.err
    assert tree_digest(src) == before and tree_digest(middle) == between  # inputs never modified
    return middle, back


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _check_configs(src, back, scheme):
    """The configs come back as ModelOpt wrote them, but for the exclusions, which gain the Gemma 4 defaults."""
    hf, flat = MODELOPT_0_47[scheme]
    back_hf = json.loads((back / "hf_quant_config.json").read_text())
    back_flat = json.loads((back / "config.json").read_text())["quantization_config"]
    strip = lambda d, key: {k: v for k, v in d.items() if k != key}  # noqa: E731
    assert strip(back_hf["quantization"], "exclude_modules") == strip(hf["quantization"], "exclude_modules")
    assert strip(back_flat, "ignore") == strip(flat, "ignore")
    assert back_flat["ignore"] == back_hf["quantization"]["exclude_modules"]
    assert "lm_head" in back_flat["ignore"]


@pytest.mark.parametrize("scheme", ["nvfp4", "nvfp4a16", "fp8", "fp8-dynamic", "fp8-block"])
def test_modelopt_round_trip_returns_every_byte(scheme, tiny, tiny_copy, cli, tmp_path):
    folder = _big_dense(tiny, tmp_path) if scheme == "fp8-block" else tiny_copy("dense_31b_like")
    src, original = _modelopt_built(folder, scheme, exact=True)
    middle, back = _round_trip(cli, src, tmp_path)
    returned = load_file(back / "model.safetensors")
    assert returned.keys() == original.keys()
    assert [n for n in original if not _same(returned[n], original[n])] == []
    _check_configs(src, back, scheme)
    found = detect_quantization(json.loads((middle / "config.json").read_text()), None)
    assert (found["method"], found["scheme"], found["kv_cache"]) == ("compressed-tensors", scheme, "fp8")


def test_modelopt_round_trip_moves_only_what_the_formats_cannot_hold(tiny_copy, cli, tmp_path):
    """NVIDIA's own values: a global scale may come back one ulp off (1/(1/x) != x), a KV scale as its bf16."""
    src, original, _ = _modelopt_checkpoint(tiny_copy)
    _, back = _round_trip(cli, src, tmp_path)
    returned = load_file(back / "model.safetensors")
    assert returned.keys() == original.keys()
    moved = 0
    for name, value in original.items():
        suffix = name.rpartition(".")[2]
        if suffix in ("weight_scale_2", "input_scale"):
            assert returned[name].dtype == value.dtype and returned[name].shape == value.shape
            assert returned[name] == 1 / (1 / value)  # the two float32 reciprocals, nothing else
            torch.testing.assert_close(returned[name], value, rtol=2**-23, atol=0)
            moved += int(returned[name] != value)
        elif suffix in ("k_scale", "v_scale"):
            assert returned[name] == value.bfloat16().float()  # compressed-tensors keeps KV scales in bf16
        else:
            assert _same(returned[name], value), name
    assert moved < sum(n.endswith(("weight_scale_2", "input_scale")) for n in original)


def test_modelopt_fp8_to_compressed_tensors_loads_in_transformers(tiny, tiny_copy, cli, tmp_path):
    """ModelOpt FP8 (new in --to compressed-tensors): transformers dequantizes it to exactly ModelOpt's weights."""
    src, original = _modelopt_built(tiny_copy("dense_31b_like"), "fp8", exact=False)
    out = tmp_path / "ct"
    result = cli("quantize", src, out, "--to", "compressed-tensors")
    assert result.code == 0, result.err
    assert detect_quantization(json.loads((out / "config.json").read_text()), None)["scheme"] == "fp8"
    reference = transformers.Gemma4ForCausalLM.from_pretrained(tiny("dense_31b_like"), dtype=torch.float32).eval()
    state = reference.state_dict()
    targets = [t for t in quantization_targets(open_checkpoint(tiny("dense_31b_like")).tensors) if t.weight.name in state]
    with torch.no_grad():
        for t in targets:
            modelopt = {s: original[f"{t.module}.{s}"] for s in ("weight", "weight_scale")}
            state[t.weight.name].copy_(dequantize_weight(modelopt, torch.float32))  # fp8 * scale, exact
        loaded = transformers.Gemma4ForCausalLM.from_pretrained(
            out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
        loaded_state = loaded.state_dict()
        assert all(torch.equal(loaded_state[t.weight.name], state[t.weight.name]) for t in targets)
        assert torch.equal(loaded(input_ids=IDS).logits, reference(input_ids=IDS).logits)


@pytest.mark.parametrize("fixture", ["multimodal", "e2b_like"])
def test_exclusions_cover_what_compressed_tensors_ignored(fixture, tiny_copy, cli, tmp_path):
    src, _, targets = _ct_checkpoint(tiny_copy(fixture), "nvfp4a16", kv=False)
    out = tmp_path / "modelopt"
    assert cli("quantize", src, out, "--to", "modelopt").code == 0
    exclude = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    quantized = {t.module for t in targets}
    dense_linears = [n.removesuffix(".weight") for n, i in open_checkpoint(out).tensors.items()
                     if n.endswith(".weight") and len(i.shape) == 2 and i.dtype == "BF16" and "embed_tokens" not in n]
    assert dense_linears
    for module in dense_linears + sorted(quantized):
        ignored = any(matches(module, p) for p in CT_IGNORE)
        assert _vllm_excluded(module, exclude) == ignored and (module in quantized) != ignored, module


def test_moe_with_bf16_experts(tiny_copy, cli, tmp_path):
    src, ct_tensors, _ = _ct_checkpoint(tiny_copy("moe_26b_like"), "nvfp4a16", kv=False)
    experts = [n for n, v in ct_tensors.items() if ".experts." in n and v.dim() == 3]
    assert experts
    out = tmp_path / "modelopt"
    assert cli("quantize", src, out, "--to", "modelopt").code == 0, "conversion failed"
    ours = load_file(out / "model.safetensors")
    assert all(torch.equal(ours[n], ct_tensors[n]) for n in experts)
    exclude = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    # The experts module by its checkpoint name, and by the name vLLM's Gemma 4 builds (`layers.N.moe.experts`).
    for module in ("model.layers.0.experts", "model.layers.0.moe.experts", "language_model.model.layers.0.moe.experts"):
        assert any(fnmatch.fnmatchcase(module, p) for p in exclude) and _vllm_excluded(module, exclude)
    assert not _vllm_excluded("model.layers.0.mlp.gate_proj", exclude)


def _refused(cli, src, out, text):
    result = cli("quantize", src, out, "--to", "modelopt")
    assert result.code == 2 and len(result.err.strip().splitlines()) == 1 and text in result.err, result.err
    assert not out.exists()


def test_refusals(tiny, tiny_copy, cli, tmp_path):
    _refused(cli, tiny("text_only"), tmp_path / "a", "is not quantized")
    modelopt, _, _ = _modelopt_checkpoint(tiny_copy)
    _refused(cli, modelopt, tmp_path / "b", "already in the ModelOpt format")

    src, tensors, targets = _ct_checkpoint(tiny_copy("multimodal"), "nvfp4a16")
    config = json.loads((src / "config.json").read_text())
    custom = dict(config, quantization_config=dict(config["quantization_config"], config_groups={
        "group_0": preset_name_to_scheme("W4A16", ["Linear"]).model_dump(exclude_none=True)}))
    (src / "config.json").write_text(json.dumps(custom))
    _refused(cli, src, tmp_path / "c", "no quant_algo for the 'custom' scheme")
    bad_ignore = dict(config, quantization_config=dict(config["quantization_config"], ignore=["re:.*(up|down)_proj"]))
    (src / "config.json").write_text(json.dumps(bad_ignore))
    _refused(cli, src, tmp_path / "d", "cannot be written as a ModelOpt wildcard")
    (src / "config.json").write_text(json.dumps(config))
    del tensors[f"{targets[0].module}.weight_global_scale"]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    _refused(cli, src, tmp_path / "e", f"{targets[0].module} lacks weight_global_scale")

    partial, _, _ = _ct_checkpoint(tiny_copy("text_only"), "fp8-block")  # 48-wide: partial 128x128 blocks
    _refused(cli, partial, tmp_path / "f", "is not made of whole 128x128 blocks")


# -- NVIDIA ModelOpt's own export, when installed ----------------------------------------------------------------
@pytest.mark.parametrize(("scheme", "cfg"), [("nvfp4", "NVFP4_DEFAULT_CFG"), ("fp8", "FP8_DEFAULT_CFG")])
def test_round_trip_of_a_checkpoint_modelopt_exported(scheme, cfg, tiny, cli, tmp_path):
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.export import export_hf_checkpoint

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny("dense_31b_like"), dtype=torch.bfloat16).eval()
    base, kv = getattr(mtq, cfg)["quant_cfg"], mtq.FP8_KV_CFG["quant_cfg"]
    config = {**getattr(mtq, cfg), "quant_cfg": base + kv if isinstance(base, list) else {**base, **kv}}
    with torch.no_grad():
        model = mtq.quantize(model, config, lambda m: m(input_ids=IDS))
    src = tmp_path / "exported"
    export_hf_checkpoint(model, export_dir=src)
    theirs = load_file(src / "model.safetensors")
    assert "model.layers.0.self_attn.k_proj.k_scale" in theirs  # ModelOpt's KV naming, as the table says
    _, back = _round_trip(cli, src, tmp_path)
    returned = load_file(back / "model.safetensors")
    assert returned.keys() == theirs.keys()
    for name, value in theirs.items():
        suffix = name.rpartition(".")[2]
        if suffix in ("k_scale", "v_scale"):
            assert returned[name] == value.bfloat16().float()
        elif scheme == "nvfp4" and suffix in ("weight_scale_2", "input_scale"):
            assert returned[name] == 1 / (1 / value) and returned[name].shape == value.shape
        else:
            assert _same(returned[name], value), name
    hf = json.loads((src / "hf_quant_config.json").read_text())
    back_hf = json.loads((back / "hf_quant_config.json").read_text())
    assert {k: v for k, v in back_hf["quantization"].items() if k != "exclude_modules"} == \
        {k: v for k, v in hf["quantization"].items() if k != "exclude_modules"}
    flat = json.loads((src / "config.json").read_text())["quantization_config"]
    back_flat = json.loads((back / "config.json").read_text())["quantization_config"]
    assert {k: v for k, v in back_flat.items() if k not in ("ignore", "producer")} == \
        {k: v for k, v in flat.items() if k not in ("ignore", "producer")}
