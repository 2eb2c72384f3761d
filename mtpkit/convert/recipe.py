"""Quantization recipes: llm-compressor's recipe YAML, read into the one mtpkit scheme it asks for.

The schema is llm-compressor's, so a user can bring a recipe written for it. `Recipe.from_dict`
(src/llmcompressor/recipe/recipe.py) reads only top-level keys ending in `_stage`, each holding keys
ending in `_modifiers`, each mapping a modifier class name to its arguments; a bare top-level
`QuantizationModifier` yields no modifier there, so it is refused here rather than guessed at:

    quant_stage:
      quant_modifiers:
        QuantizationModifier: {targets: [Linear], ignore: [lm_head], scheme: FP8_DYNAMIC}

QuantizationModifier's arguments (src/llmcompressor/modifiers/quantization/quantization/mixin.py):
`targets` (a string or list, default [Linear]), `ignore`, `scheme` (a compressed-tensors preset name,
case-insensitive, or {preset: targets}) or `config_groups` (QuantizationScheme dicts), never both, and
`kv_cache_scheme` (QuantizationArgs). Real examples in vllm-project/llm-compressor:
tests/e2e/recipes/FP8/recipe_fp8_dynamic.yaml (config_groups), tests/e2e/recipes/kv_cache/default.yaml
(kv_cache_scheme), tests/e2e/recipes/NVFP4_FP8/recipe_moe_nvfp4_fp8_rtn.yaml (expert regex targets),
examples/quantization_w8a8_int8/recipe.yaml (SmoothQuantModifier + GPTQModifier in one stage).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import yaml

from mtpkit.errors import ConfigError
from mtpkit.formats.compressed_tensors import CALIBRATED, FP8_KV_CACHE, SCHEMES

# compressed-tensors preset -> mtpkit scheme (tests check both sides hold the same arguments).
PRESETS = {"FP8_DYNAMIC": "fp8-dynamic", "FP8": "fp8", "FP8_BLOCK": "fp8-block", "NVFP4": "nvfp4",
           "NVFP4A16": "nvfp4a16"}
MODIFIER = "QuantizationModifier"
# Every argument QuantizationModifier takes (its mixin's fields and Modifier's scheduling fields):
# anything else is a typo that llm-compressor would also reject.
_ARGS = {"targets", "ignore", "scheme", "config_groups", "kv_cache_scheme", "weight_observer", "input_observer",
         "output_observer", "observer", "bypass_divisibility_checks", "index", "group", "start", "end", "update"}
# The QuantizationArgs fields that decide what is written; observers, actorder, zp/scale dtypes do not.
MATCHED = ("num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "dynamic")
_SHIPPED_PACKAGE = "mtpkit.recipes"  # pyproject maps the repository's recipes/ folder to it
_FIX_NESTING = "nest it as `quant_stage: quant_modifiers: QuantizationModifier: {...}` (llm-compressor's schema)"


@dataclass(frozen=True)
class Recipe:
    name: str
    scheme: str  # a key of mtpkit.formats.compressed_tensors.SCHEMES
    targets: list[str]
    ignore: list[str]
    kv_cache: bool  # FP8 kv cache (FP8_KV_CACHE)
    source: str  # the YAML file it was read from

    @property
    def needs_calibration(self) -> bool:
        """Static activation or k/v scales, which only sample data can fix."""
        return self.scheme in CALIBRATED or self.kv_cache


def list_recipes() -> list[str]:
    """Names of the shipped recipes, for `--recipe NAME`."""
    try:
        return sorted(e.name.removesuffix(".yaml") for e in _shipped().iterdir() if e.name.endswith(".yaml"))
    except (FileNotFoundError, NotADirectoryError):
        return []


def load_recipe(name_or_path: str | os.PathLike) -> Recipe:
    """A shipped recipe by name ("fp8-dynamic") or a recipe YAML file by path (has a / or ends .yaml/.yml)."""
    text = os.fspath(name_or_path)
    if os.sep in text or "/" in text or text.endswith((".yaml", ".yml")):
        path = Path(text).expanduser()
        if not path.is_file():
            raise ConfigError("no such recipe file", where=path, fix=_fix_choose())
        entry: Traversable = path
    else:
        entry = _shipped() / f"{text}.yaml"
        if not entry.is_file():
            raise ConfigError(f"--recipe {text!r} is not a shipped recipe", fix=_fix_choose())
    source = str(entry)
    try:
        doc = yaml.safe_load(entry.read_bytes().decode("utf-8"))  # never yaml.load: no Python objects
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot be read ({e})", where=source, fix="give a readable UTF-8 YAML file") from e
    except yaml.YAMLError as e:  # syntax errors, and the python/* tags safe_load refuses
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(f"is not plain YAML{at}: {problem}", where=source,
                          fix="fix the YAML; tags such as !!python/object are refused") from e
    return _recipe(doc, Path(source).stem, source)


def _shipped() -> Traversable:
    try:
        return resources.files(_SHIPPED_PACKAGE)
    except ModuleNotFoundError:
        # A source checkout on sys.path, or an editable install made before pyproject mapped recipes/:
        # the folder then sits beside the package, where the mapping takes it from.
        return Path(__file__).resolve().parents[2] / "recipes"


def _fix_choose() -> str:
    return f"use one of {', '.join(list_recipes()) or '(none shipped)'}, or a path to a recipe .yaml file"


@dataclass(frozen=True)
class _Part:
    key: str  # where in the file, e.g. quant_stage.quant_modifiers.QuantizationModifier
    scheme: str
    targets: list[str]
    ignore: list[str]
    kv_cache: bool


def _recipe(doc: object, name: str, source: str) -> Recipe:
    if doc is None:
        raise ConfigError("is empty", where=source, fix=_FIX_NESTING)
    if not isinstance(doc, dict):
        raise ConfigError(f"holds a {type(doc).__name__}, not a mapping of stages", where=source, fix=_FIX_NESTING)
    found = [(f"{stage}.{group}.{kind}", str(kind), args)
             for stage, groups in doc.items() if str(stage).endswith("_stage") and isinstance(groups, dict)
             for group, mods in groups.items() if str(group).endswith("_modifiers") and isinstance(mods, dict)
             for kind, args in mods.items()]
    if not found:
        what = (f"has a top-level {MODIFIER}, which llm-compressor would ignore" if MODIFIER in doc
                else f"has no {MODIFIER} under a `<name>_stage: <name>_modifiers:` key")
        raise ConfigError(what, where=source, fix=_FIX_NESTING)
    parts = [_modifier(key, kind, args, source) for key, kind, args in found]
    first = parts[0]
    for other in parts[1:]:
        if other.scheme != first.scheme:
            raise ConfigError(f"{first.key} asks for {first.scheme} but {other.key} for {other.scheme}", where=source,
                              fix="mtpkit writes one scheme per checkpoint: keep one QuantizationModifier")
        if other.ignore != first.ignore:
            raise ConfigError(f"{first.key} and {other.key} ignore different modules", where=source,
                              fix="merge them into one QuantizationModifier")
    targets = list(dict.fromkeys(t for p in parts for t in p.targets))
    return Recipe(name, first.scheme, targets, first.ignore, any(p.kv_cache for p in parts), source)


def _modifier(key: str, kind: str, args: object, source: str) -> _Part:
    if kind != MODIFIER:
        raise ConfigError(f"{key}: mtpkit runs only {MODIFIER} (round-to-nearest); {kind} sets weights with "
                          "calibration data or an optimizer, an engine mtpkit does not have", where=source,
                          fix=f"drop {kind}, or run this recipe with llm-compressor itself")
    args = {} if args is None else args
    if not isinstance(args, dict):
        raise ConfigError(f"{key} is a {type(args).__name__}, not a mapping of arguments", where=source,
                          fix="give it targets, ignore and scheme")
    unknown = sorted(str(k) for k in args if k not in _ARGS)
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]} is not a {MODIFIER} argument", where=source,
                          fix=f"use {', '.join(sorted(_ARGS))}")
    _check_observers(key, args, source)
    targets = _strings(args.get("targets", ["Linear"]), f"{key}.targets", source)
    ignore = _strings(args.get("ignore", []), f"{key}.ignore", source)
    if args.get("scheme") is not None and args.get("config_groups") is not None:
        raise ConfigError(f"{key} sets both scheme and config_groups", where=source,
                          fix="keep one (llm-compressor refuses both as well)")
    if args.get("scheme") is not None:
        scheme, targets = _from_scheme(args["scheme"], targets, f"{key}.scheme", source)
    elif args.get("config_groups") is not None:
        scheme, targets = _from_groups(args["config_groups"], f"{key}.config_groups", source)
    else:
        raise ConfigError(f"{key} sets no scheme or config_groups, so no weight is quantized", where=source,
                          fix=f"add `scheme:` with one of {', '.join(PRESETS)}")
    kv = args.get("kv_cache_scheme")
    if kv is not None:
        _check_kv(kv, f"{key}.kv_cache_scheme", source)
    return _Part(key, scheme, targets, ignore, kv is not None)


def _check_observers(key: str, args: dict, source: str) -> None:
    # mtpkit's weight scales are min-max; an MSE (or other) weight observer would give other weights.
    observer = args.get("observer") if isinstance(args.get("observer"), dict) else {}
    chosen = args.get("weight_observer") or observer.get("weights")
    if chosen is not None and "minmax" not in str(chosen).lower():
        raise ConfigError(f"{key} asks for the {chosen} weight observer; mtpkit computes min-max scales only",
                          where=source, fix="drop the weight observer setting")


def _strings(value: object, key: str, source: str) -> list[str]:
    if isinstance(value, str):  # llm-compressor turns a single target into a list too
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ConfigError(f"{key} is {value!r}, not a list of module names or re: patterns", where=source,
                      fix='write it as a list, e.g. ["Linear"]')


def _preset(name: object, key: str, source: str) -> str:
    scheme = PRESETS.get(str(name).upper())
    if scheme is None:
        raise ConfigError(f"{key} is {name!r}, not a preset mtpkit writes", where=source,
                          fix=f"use one of {', '.join(PRESETS)}, or a config_groups entry with their arguments")
    return scheme


def _from_scheme(value: object, targets: list[str], key: str, source: str) -> tuple[str, list[str]]:
    if not isinstance(value, dict):  # a preset name applied to the modifier's targets
        return _preset(value, key, source), targets
    if not value:
        raise ConfigError(f"{key} is an empty mapping", where=source, fix="give {PRESET: [targets]}")
    # {preset: targets}, as QuantizationMixin.validate_scheme accepts
    schemes = {_preset(name, f"{key}.{name}", source) for name in value}
    if len(schemes) > 1:
        raise ConfigError(f"{key} mixes {', '.join(sorted(schemes))}", where=source,
                          fix="mtpkit writes one scheme per checkpoint: keep one preset")
    merged = [t for name, ts in value.items() for t in _strings(ts, f"{key}.{name}", source)]
    return schemes.pop(), list(dict.fromkeys(merged))


def _from_groups(groups: object, key: str, source: str) -> tuple[str, list[str]]:
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{key} is not a mapping of named groups", where=source,
                          fix="write config_groups: {group_0: {targets: [...], weights: {...}}}")
    found: dict[str, str] = {}  # mtpkit scheme -> first group that asked for it
    targets: list[str] = []
    for name, group in groups.items():
        gkey = f"{key}.{name}"
        if not isinstance(group, dict):
            raise ConfigError(f"{gkey} is not a mapping", where=source, fix="give it targets and weights")
        if group.get("output_activations") is not None:
            raise ConfigError(f"{gkey}.output_activations is set; mtpkit quantizes no outputs", where=source,
                              fix="drop output_activations")
        scheme = _match(group, gkey, source)
        found.setdefault(scheme, gkey)
        if len(found) > 1:
            (a, ka), (b, kb) = list(found.items())[:2]
            raise ConfigError(f"{ka} is {a} but {kb} is {b}", where=source,
                              fix="mtpkit writes one scheme per checkpoint: make the groups alike or keep one")
        if "targets" not in group:
            raise ConfigError(f"{gkey} has no targets", where=source, fix='add targets: ["Linear"]')
        targets += _strings(group["targets"], f"{gkey}.targets", source)
    return next(iter(found)), list(dict.fromkeys(targets))


def _match(group: dict, key: str, source: str) -> str:
    weights = normalized_args(group.get("weights"), f"{key}.weights", source)
    inputs = group.get("input_activations")
    inputs = None if inputs is None else normalized_args(inputs, f"{key}.input_activations", source)
    for scheme, (_, w, i) in SCHEMES.items():
        if weights == normalized_args(w) and inputs == (None if i is None else normalized_args(i)):
            return scheme
    raise ConfigError(f"{key} (weights {weights}, input_activations {inputs}) matches no scheme mtpkit writes",
                      where=source, fix=f"use the arguments of one of the presets {', '.join(PRESETS)}")


def normalized_args(raw: object, key: str = "", source: str | None = None) -> dict:
    """The MATCHED fields of a QuantizationArgs dict, with compressed-tensors' defaults and strategy inference."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{key} is {raw!r}, not a mapping of quantization arguments", where=source,
                          fix="give num_bits, type, strategy (as compressed-tensors' QuantizationArgs)")
    group_size, strategy = raw.get("group_size"), raw.get("strategy")
    try:
        if strategy is None:  # QuantizationArgs.validate_model_after infers it the same way
            strategy = "tensor" if group_size is None else "group" if int(group_size) > 0 else "channel"
        strategy = str(strategy).lower()
        dynamic = raw.get("dynamic", False)
        block = raw.get("block_structure")
        return {"num_bits": int(raw.get("num_bits", 8)), "type": str(raw.get("type", "int")).lower(),
                "symmetric": bool(raw.get("symmetric", True)), "strategy": strategy,
                # only group strategies carry a group size (-1 just spelled "channel")
                "group_size": int(group_size) if strategy in ("group", "tensor_group") else None,
                "block_structure": None if block is None else [int(b) for b in block],
                "dynamic": dynamic.lower() if isinstance(dynamic, str) else bool(dynamic)}
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key} has a malformed value ({e})", where=source,
                          fix="num_bits and group_size are integers, block_structure a list of two") from e


def _check_kv(raw: object, key: str, source: str) -> None:
    args = normalized_args(raw, key, source)
    if args["type"] != "float":
        raise ConfigError(f"{key} is type {args['type']}; mtpkit writes only an FP8 (float) kv cache",
                          where=source, fix="use {num_bits: 8, type: float, strategy: tensor}")
    if args != normalized_args(FP8_KV_CACHE):
        raise ConfigError(f"{key} is {args}; mtpkit writes only a per-tensor static FP8 kv cache", where=source,
                          fix="use {num_bits: 8, type: float, strategy: tensor, dynamic: false, symmetric: true}")
