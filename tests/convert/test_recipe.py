"""Recipes (llm-compressor's YAML schema) against compressed-tensors' own presets, parser and matcher.

Oracles: compressed-tensors' `preset_name_to_scheme` says what each preset a recipe names means, and
`QuantizationArgs` / `QuantizationScheme` parse a user's config_groups; the mapped mtpkit scheme must
hold the same arguments in SCHEMES. `match_named_modules`, on a Gemma 4 MoE whose experts are unpacked
the way llm-compressor unpacks them, says which modules the experts-only recipe quantizes. The bad-input
YAML copies the shapes of real llm-compressor recipes (paths in mtpkit/convert/recipe.py).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme
from compressed_tensors.utils import match_named_modules
from setuptools import find_packages

from mtpkit.convert.quantize_scope import CT_IGNORE, CT_TARGETS
from mtpkit.convert.recipe import MATCHED, PRESETS, list_recipes, load_recipe, normalized_args
from mtpkit.errors import ConfigError
from mtpkit.formats.compressed_tensors import FP8_KV_CACHE, SCHEMES

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ["fp8", "fp8-block", "fp8-dynamic", "kv-fp8", "nvfp4", "nvfp4-experts-only", "nvfp4a16"]


def _fields(args) -> dict | None:
    """The fields that decide what is written, from a compressed-tensors QuantizationArgs or a SCHEMES dict."""
    if args is None:
        return None
    d = args.model_dump(mode="json") if hasattr(args, "model_dump") else dict(args)
    out = {k: d.get(k) for k in MATCHED}
    if out["strategy"] not in ("group", "tensor_group"):
        out["group_size"] = None  # compressed-tensors keeps -1 for "channel"; it carries no group size
    return out


def _preset_fields(preset: str) -> tuple:
    scheme = preset_name_to_scheme(preset, ["Linear"])
    return _fields(scheme.weights), _fields(scheme.input_activations)


def _write(tmp_path: Path, text: str, name: str = "mine.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_every_shipped_recipe_loads():
    assert list_recipes() == SHIPPED
    for name in SHIPPED:
        recipe = load_recipe(name)
        assert recipe.name == name and recipe.scheme in SCHEMES and Path(recipe.source).is_file()
        assert recipe.kv_cache is (name == "kv-fp8")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_preset_means_what_mtpkit_writes(name):
    """compressed-tensors' own preset for the `scheme:` in the file has mtpkit's SCHEMES arguments."""
    recipe = load_recipe(name)
    raw = yaml.safe_load(Path(recipe.source).read_text())["quant_stage"]["quant_modifiers"]["QuantizationModifier"]
    _, weights, inputs = SCHEMES[recipe.scheme]
    assert _preset_fields(raw["scheme"]) == (_fields(weights), _fields(inputs))


@pytest.mark.parametrize(("preset", "scheme"), sorted(PRESETS.items()))
def test_preset_table_against_compressed_tensors(tmp_path, preset, scheme):
    _, weights, inputs = SCHEMES[scheme]
    assert _preset_fields(preset) == (_fields(weights), _fields(inputs))
    # Preset names are case-insensitive in compressed-tensors (is_preset_scheme upper-cases them).
    text = f"q_stage:\n  q_modifiers:\n    QuantizationModifier:\n      scheme: {preset.lower()}\n"
    assert load_recipe(_write(tmp_path, text)).scheme == scheme


def test_shipped_recipes_keep_the_gemma4_exclusions():
    for name in SHIPPED:
        recipe = load_recipe(name)
        if name == "nvfp4-experts-only":
            assert recipe.ignore == CT_IGNORE + ["re:.*self_attn.*", r"re:.*mlp\..*"]
        else:
            assert (recipe.targets, recipe.ignore) == (CT_TARGETS, CT_IGNORE)


def test_kv_cache_scheme_is_the_fp8_kv_cache_mtpkit_writes():
    raw = yaml.safe_load(Path(load_recipe("kv-fp8").source).read_text())
    kv = raw["quant_stage"]["quant_modifiers"]["QuantizationModifier"]["kv_cache_scheme"]
    assert _fields(QuantizationArgs.model_validate(kv)) == _fields(QuantizationArgs.model_validate(FP8_KV_CACHE))


def test_experts_only_selects_exactly_the_unpacked_experts(tiny):
    """llm-compressor turns Gemma 4's fused experts into layers.N.experts.E.{gate,up,down}_proj Linears
    (src/llmcompressor/modeling/gemma4.py); compressed-tensors' matcher must pick those and nothing else."""
    model = transformers.Gemma4ForCausalLM.from_pretrained(tiny("moe_26b_like"))
    config, expected = model.config, set()
    for i, layer in enumerate(model.model.layers):
        unpacked = torch.nn.Module()
        for e in range(config.num_experts):
            unpacked.add_module(str(e), transformers.models.gemma4.modeling_gemma4.Gemma4TextMLP(config, 0))
            expected |= {f"model.layers.{i}.experts.{e}.{p}_proj" for p in ("gate", "up", "down")}
        layer.experts = unpacked
    recipe = load_recipe("nvfp4-experts-only")
    matched = {name for name, _ in match_named_modules(model, recipe.targets, recipe.ignore)}
    assert matched == expected and recipe.scheme == "nvfp4"


@pytest.mark.parametrize("raw", [
    {}, {"num_bits": 4, "type": "float", "group_size": 16}, {"group_size": -1}, {"strategy": "channel"},
    {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
    {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
    {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "dynamic": "local"},
])
def test_argument_defaults_follow_compressed_tensors(raw):
    assert normalized_args(raw) == _fields(QuantizationArgs.model_validate(raw))


# The shape of llm-compressor's tests/e2e/recipes/FP8/recipe_fp8_dynamic.yaml.
FP8_DYNAMIC_GROUPS = """\
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: ["lm_head", "re:vision_tower.*"]
      config_groups:
        group_0:
          weights: {num_bits: 8, type: "float", symmetric: true, strategy: "channel", dynamic: false}
          input_activations: {num_bits: 8, type: "float", symmetric: true, strategy: "token", dynamic: true}
          targets: ["Linear"]
"""
# The NVFP4 group of llm-compressor's tests/e2e/recipes/NVFP4_FP8/recipe_moe_nvfp4_fp8_rtn.yaml.
NVFP4_GROUP = """\
        group_nvfp4:
          weights: {num_bits: 4, actorder: "weight", type: float, strategy: tensor_group, dynamic: false,
                    symmetric: true, group_size: 16, scale_dtype: float8_e4m3fn, zp_dtype: float8_e4m3fn}
          input_activations: {num_bits: 4, type: float, strategy: tensor_group, dynamic: local, symmetric: true,
                              group_size: 16, scale_dtype: float8_e4m3fn, zp_dtype: float8_e4m3fn}
          targets: ["re:.*experts.*\\\\.(gate|up|down)_proj$"]
"""
FP8_BLOCK_GROUP = """\
        group_fp8_block:
          weights: {num_bits: 8, type: float, strategy: block, block_structure: [128, 128], dynamic: false}
          input_activations: {num_bits: 8, type: float, strategy: group, group_size: 128, dynamic: true}
          targets: ["re:.*self_attn\\\\.(k|o|q|v)_proj$"]
"""
GROUPS_HEAD = "quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      ignore: [lm_head]\n      config_groups:\n"


def _ct_preset(group: dict) -> str:
    """The preset whose compressed-tensors arguments equal compressed-tensors' parse of `group`."""
    parsed = QuantizationScheme.model_validate(group)
    found = [p for p in PRESETS if _preset_fields(p) == (_fields(parsed.weights), _fields(parsed.input_activations))]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("text", [FP8_DYNAMIC_GROUPS, GROUPS_HEAD + NVFP4_GROUP, GROUPS_HEAD + FP8_BLOCK_GROUP])
def test_config_groups_map_to_the_preset_compressed_tensors_sees(tmp_path, text):
    modifier = yaml.safe_load(text)["quant_stage"]["quant_modifiers"]["QuantizationModifier"]
    (group,) = modifier["config_groups"].values()
    recipe = load_recipe(_write(tmp_path, text))
    assert recipe.scheme == PRESETS[_ct_preset(group)]
    assert (recipe.targets, recipe.ignore) == (group["targets"], modifier["ignore"])


def test_recipes_as_llm_compressor_writes_them(tmp_path):
    # A recipe.yaml as llm-compressor saves it beside a model (stage names upper-case, targets a string).
    saved = "DEFAULT_stage:\n  DEFAULT_modifiers:\n    QuantizationModifier:\n      ignore: [lm_head]\n" \
            "      targets: Linear\n      scheme: FP8\n"
    recipe = load_recipe(_write(tmp_path, saved))
    assert (recipe.scheme, recipe.targets, recipe.ignore, recipe.kv_cache) == ("fp8", ["Linear"], ["lm_head"], False)
    as_dict = "s_stage:\n  s_modifiers:\n    QuantizationModifier:\n      scheme: {NVFP4A16: [Linear]}\n"
    assert load_recipe(_write(tmp_path, as_dict, "d.yaml")).scheme == "nvfp4a16"


MOD = "quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n"
BAD = {
    "unknown preset": (MOD + "      scheme: W4A16\n", "scheme is 'W4A16'"),
    # The shape of llm-compressor's examples/quantization_w8a8_int8/recipe.yaml.
    "calibrating modifiers": ("quant_stage:\n  quant_modifiers:\n    SmoothQuantModifier:\n      smoothing_strength: 0.8\n"
                              "    GPTQModifier:\n      ignore: [lm_head]\n      scheme: W8A8\n", "SmoothQuantModifier"),
    "gptq": ("quant_stage:\n  quant_modifiers:\n    GPTQModifier:\n      scheme: NVFP4A16\n", "GPTQModifier"),
    "invalid yaml": ("quant_stage: [unclosed\n", "not plain YAML"),
    "missing modifier": ("quant_stage:\n  quant_modifiers: {}\n", "no QuantizationModifier"),
    "bare modifier": ("QuantizationModifier:\n  scheme: FP8\n", "top-level QuantizationModifier"),
    "not a mapping": ("- just\n- a list\n", "not a mapping"),
    "empty": ("", "is empty"),
    "two schemes": (MOD + "      scheme: FP8_DYNAMIC\nother_stage:\n  other_modifiers:\n    QuantizationModifier:\n"
                    "      scheme: NVFP4A16\n", "other_stage.other_modifiers.QuantizationModifier"),
    "scheme and groups": (FP8_DYNAMIC_GROUPS + "      scheme: FP8\n", "both scheme and config_groups"),
    "two group schemes": (GROUPS_HEAD + NVFP4_GROUP + FP8_BLOCK_GROUP, "config_groups.group_fp8_block"),
    "int8 group": (GROUPS_HEAD + "        g:\n          weights: {num_bits: 8, type: int, strategy: channel}\n"
                   "          targets: [Linear]\n", "config_groups.g"),
    "int kv cache": (MOD + "      scheme: FP8_DYNAMIC\n      kv_cache_scheme: {num_bits: 8, type: int}\n",
                     "kv_cache_scheme is type int"),
    "kv cache only": (MOD + "      kv_cache_scheme: {num_bits: 8, type: float, strategy: tensor}\n", "sets no scheme"),
    "typo": (MOD + "      scheme: FP8\n      ignores: [lm_head]\n", "QuantizationModifier.ignores"),
    "mse observer": (MOD + "      scheme: NVFP4A16\n      weight_observer: mse\n", "mse weight observer"),
    "ignore not a list": (MOD + "      scheme: FP8\n      ignore: {lm_head: 1}\n", "QuantizationModifier.ignore"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_recipes_are_refused_with_the_file_and_key(tmp_path, case):
    text, fragment = BAD[case]
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and fragment in message and "\n" not in message, message


def test_python_tags_are_refused_not_run(tmp_path):
    marker = tmp_path / "ran"
    path = _write(tmp_path, f"quant_stage: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match="python/object"):
        load_recipe(path)
    assert not marker.exists()


def test_missing_file_and_unknown_name(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"^{missing}: no such recipe file; use one of fp8,"):
        load_recipe(missing)
    with pytest.raises(ConfigError, match="'fp9' is not a shipped recipe; use one of fp8, fp8-block"):
        load_recipe("fp9")


def test_pyproject_packages_every_subpackage_and_maps_the_recipes():
    """The package list is explicit (a mapped package cannot join packages.find): a new subpackage must be added."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(find_packages(str(ROOT), include=["mtpkit*"])) | {"mtpkit.examples"} <= set(tool["packages"])
    assert tool["package-dir"] == {"mtpkit.recipes": "recipes"} and "mtpkit.recipes" in tool["packages"]
    assert tool["package-data"]["mtpkit.recipes"] == ["*.yaml"]


def test_the_wheel_ships_the_recipes(tmp_path):
    """A real (non-editable) wheel build: every recipes/*.yaml lands in mtpkit/recipes/."""
    src, out = tmp_path / "src", tmp_path / "dist"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                                             ".pytest_cache", ".hypothesis", "tests", "bench"))
    out.mkdir()
    build = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", build, str(out)], cwd=src, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    names = zipfile.ZipFile(out / done.stdout.strip().splitlines()[-1]).namelist()
    assert sorted(n for n in names if n.startswith("mtpkit/recipes/") and n.endswith(".yaml")) == \
        [f"mtpkit/recipes/{p.name}" for p in sorted((ROOT / "recipes").glob("*.yaml"))]
