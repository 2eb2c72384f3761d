"""NVIDIA ModelOpt's Hugging Face checkpoint format, for writing: its two configs, tensor names and scale forms.

What NVIDIA ModelOpt 0.47.0 exports (NVIDIA/Model-Optimizer modelopt/torch/export: unified_export_hf.py
`_export_quantized_weight` and `_write_hf_export_config`; quant_utils.py `get_quant_config`,
`process_layer_quant_config` and `postprocess_state_dict`; convert_hf_config.py `convert_hf_quant_config_format`),
confirmed by running that exporter on a tiny Gemma 4 on the CPU, and what vLLM reads
(vllm/model_executor/layers/quantization/modelopt.py, `ModelOptQuantConfigBase.from_config` and the linear methods):

| mtpkit scheme | quant_algo                | weight             | weight_scale                 | more                   |
|---------------|---------------------------|--------------------|------------------------------|------------------------|
| fp8           | FP8                       | F8_E4M3 [o, i]     | F32 []                       | input_scale F32 []     |
| fp8-dynamic   | FP8_PER_CHANNEL_PER_TOKEN | F8_E4M3 [o, i]     | F32 [o]                      |                        |
| fp8-block     | fp8_pb_wo                 | F8_E4M3 [o, i]     | F32 [o/128, 1, i/128, 1]     |                        |
| nvfp4         | NVFP4                     | U8 [o, i/2]        | F8_E4M3 [o, i/16]            | weight_scale_2, input_scale F32 [] |
| nvfp4a16      | W4A16_NVFP4               | U8 [o, i/2]        | F8_E4M3 [o, i/16]            | weight_scale_2 F32 []  |

FP8 KV cache: `<attn>.k_proj.k_scale` and `<attn>.v_proj.v_scale`, F32 [] (ModelOpt renames its
`k_bmm_quantizer._amax` so; compressed-tensors keeps them on the attention module, `<attn>.k_scale`).

Against compressed-tensors only two values change form: its NVFP4 global scales are divisors where ModelOpt's are
multipliers (weight_global_scale = 1 / weight_scale_2, input_global_scale = 1 / input_scale). Everything else
keeps its value; ModelOpt just stores every FP8 scale as float32 (llm-compressor uses the weight's dtype, so the
cast is exact) and in its own shapes. Torch only: no mtpkit.convert or runtime imports, so any writer can use it.
"""

from __future__ import annotations

import math
import re

import torch

from mtpkit.formats.dtypes import safetensors_dtype
from mtpkit.formats.fp8 import FP8_BLOCK_SIZE, FP8_DTYPE
from mtpkit.formats.nvfp4 import NVFP4_GROUP_SIZE

PRODUCER = "modelopt"
# The ModelOpt release whose exporter output this module reproduces (checked by running it); the producer
# version written when a caller has no better one. vLLM does not read it.
SCHEMA_VERSION = "0.47.0"
# mtpkit scheme -> quant_algo, spelled as ModelOpt writes it: its per-block FP8 is the one it writes in lower
# case (process_layer_quant_config passes the format name through); vLLM upper-cases quant_algo before matching.
QUANT_ALGOS = {"fp8": "FP8", "fp8-dynamic": "FP8_PER_CHANNEL_PER_TOKEN", "fp8-block": "fp8_pb_wo",
               "nvfp4": "NVFP4", "nvfp4a16": "W4A16_NVFP4"}
KV_CACHE_QUANT_ALGO = "FP8"
_NVFP4 = ("nvfp4", "nvfp4a16")
_FP8_KV_SCHEME = {"dynamic": False, "num_bits": 8, "type": "float"}  # convert_hf_quant_config_format's form
# The config groups ModelOpt puts into config.json: only these three algorithms get one (the others a bare quant_algo).
_FP8_ARGS = {"dynamic": False, "num_bits": 8, "type": "float"}
_FP4_ARGS = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_GROUP_SIZE}
_CONFIG_GROUPS = {"fp8": {"input_activations": _FP8_ARGS, "weights": _FP8_ARGS},
                  "nvfp4": {"input_activations": _FP4_ARGS, "weights": _FP4_ARGS},
                  "nvfp4a16": {"weights": _FP4_ARGS}}

# compressed-tensors suffix -> ModelOpt suffix, and back (per scheme: `weight` is packed only for NVFP4).
_CT_TO_MO = {"weight_packed": "weight", "weight_global_scale": "weight_scale_2", "input_global_scale": "input_scale"}
_F32 = "F32"


def quant_algo(scheme: str) -> str:
    """ModelOpt's quant_algo for an mtpkit scheme; ValueError (one line, why) for what it cannot express."""
    if scheme in QUANT_ALGOS:
        return QUANT_ALGOS[scheme]
    if scheme.startswith("mixed:"):
        raise ValueError(f"ModelOpt writes one quant_algo for all Linears (its MIXED_PRECISION form needs a "
                         f"per-layer table mtpkit does not write), but this checkpoint mixes {scheme[6:]}")
    raise ValueError(f"ModelOpt has no quant_algo for the {scheme!r} scheme; it expresses {', '.join(QUANT_ALGOS)}")


def scheme_of(algo: object) -> str | None:
    """The mtpkit scheme of a quant_algo as any ModelOpt (or vLLM, which upper-cases it) spells it, else None."""
    return {a.upper(): s for s, a in QUANT_ALGOS.items()}.get(str(algo).upper())


def hf_quant_config(scheme: str, exclude_modules: list[str], kv_cache: bool,
                    producer_version: str = SCHEMA_VERSION) -> dict:
    """hf_quant_config.json, key for key as ModelOpt's get_quant_config writes it (group_size only for NVFP4).

    vLLM requires group_size, kv_cache_quant_algo (null allowed) and exclude_modules in it for NVFP4.
    """
    section: dict = {"quant_algo": quant_algo(scheme), "kv_cache_quant_algo": KV_CACHE_QUANT_ALGO if kv_cache else None}
    if scheme in _NVFP4:
        section["group_size"] = NVFP4_GROUP_SIZE
    section["exclude_modules"] = list(exclude_modules)
    return {"producer": {"name": PRODUCER, "version": producer_version}, "quantization": section}


def config_quantization_config(scheme: str, exclude_modules: list[str], kv_cache: bool,
                               producer_version: str = SCHEMA_VERSION) -> dict:
    """config.json's quantization_config: what ModelOpt's convert_hf_quant_config_format makes of hf_quant_config.

    Flat, with `ignore` for exclude_modules and `kv_cache_scheme` for the KV algorithm; vLLM reads either form.
    """
    out: dict = {}
    if scheme in _CONFIG_GROUPS:
        group = {key: dict(args) for key, args in _CONFIG_GROUPS[scheme].items()}
        out["config_groups"] = {"group_0": {**group, "targets": ["Linear"]}}
    out["ignore"] = list(exclude_modules)
    out["quant_algo"] = quant_algo(scheme)
    if kv_cache:
        out["kv_cache_scheme"] = dict(_FP8_KV_SCHEME)
    out["producer"] = {"name": PRODUCER, "version": producer_version}
    out["quant_method"] = PRODUCER
    return out


# ---------------------------------------------------------------------------------------------- tensors


def ct_suffixes(scheme: str) -> tuple[str, ...]:
    """What compressed-tensors stores for one quantized Linear of `scheme` (mtpkit's quantizer writes these)."""
    quant_algo(scheme)
    if scheme in _NVFP4:
        return ("weight_packed", "weight_scale", "weight_global_scale") + (("input_global_scale",) if scheme == "nvfp4" else ())
    return ("weight", "weight_scale") + (("input_scale",) if scheme == "fp8" else ())


def modelopt_suffixes(scheme: str) -> tuple[str, ...]:
    """What ModelOpt stores for one quantized Linear of `scheme`."""
    return tuple(_CT_TO_MO.get(s, s) for s in ct_suffixes(scheme))


def modelopt_name(module: str, ct_suffix: str) -> str:
    """`<module>.<ModelOpt suffix>` for a compressed-tensors tensor `<module>.<ct_suffix>` of a quantized Linear."""
    return f"{module}.{_CT_TO_MO.get(ct_suffix, ct_suffix)}"


def ct_name(module: str, modelopt_suffix: str, scheme: str) -> str:
    """`<module>.<compressed-tensors suffix>` for a ModelOpt tensor of a `scheme` Linear (inverse of modelopt_name)."""
    back = {mo: ct for ct, mo in _CT_TO_MO.items() if ct in ct_suffixes(scheme)}
    return f"{module}.{back.get(modelopt_suffix, modelopt_suffix)}"


# The stored dtype of the quantized values and group scales, which both formats share byte for byte.
_STORED = {"weight_packed": "U8", "weight_scale": "F8_E4M3"}


def _check_stored(scheme: str, suffix: str, dtype: str, shape: tuple[int, ...]) -> None:
    expected = "U8" if scheme in _NVFP4 and suffix in ("weight", "weight_packed") else _STORED.get(suffix, "F8_E4M3")
    if dtype != expected:
        raise ValueError(f"{suffix} of a {scheme} Linear must be {expected}, got {dtype}")
    if len(shape) != 2:
        raise ValueError(f"{suffix} must be 2-D, got shape {list(shape)}")


def _one_value(shape: tuple[int, ...], what: str) -> None:
    if math.prod(shape) != 1:
        raise ValueError(f"{what} must hold one value (per-tensor), got shape {list(shape)}")


def modelopt_layout(scheme: str, ct_suffix: str, dtype: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """(safetensors dtype, shape) of the ModelOpt tensor made from a compressed-tensors `ct_suffix` of `dtype`/`shape`.

    Enough for a streaming writer to lay out its shards before any value exists. ValueError for a tensor that
    does not belong to `scheme` or has a shape the scheme does not store.
    """
    shape = tuple(shape)
    if ct_suffix not in ct_suffixes(scheme):
        raise ValueError(f"{ct_suffix} is not part of a compressed-tensors {scheme} Linear "
                         f"({', '.join(ct_suffixes(scheme))})")
    if ct_suffix in ("weight_packed", "weight") or (ct_suffix == "weight_scale" and scheme in _NVFP4):
        _check_stored(scheme, ct_suffix, dtype, shape)
        return dtype, shape
    if ct_suffix == "weight_scale" and scheme == "fp8-dynamic":
        if len(shape) not in (1, 2) or math.prod(shape) != shape[0]:
            raise ValueError(f"per-channel weight_scale must be [out, 1], got shape {list(shape)}")
        return _F32, (shape[0],)  # vLLM's FP8_PER_CHANNEL_PER_TOKEN parameter is 1-D [out]
    if ct_suffix == "weight_scale" and scheme == "fp8-block":
        if len(shape) != 2:
            raise ValueError(f"block weight_scale must be 2-D [out/128, in/128], got shape {list(shape)}")
        return _F32, (shape[0], 1, shape[1], 1)  # ModelOpt's per-block scale keeps the reduced block axes
    _one_value(shape, ct_suffix)  # fp8 weight_scale / input_scale and the NVFP4 global scales: 0-d in ModelOpt
    return _F32, ()


def ct_layout(scheme: str, modelopt_suffix: str, dtype: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """(safetensors dtype, shape) of the compressed-tensors tensor made from a ModelOpt one (inverse direction).

    Scales stay float32; FP8 ones take compressed-tensors' shapes ([1], [out, 1], [out/128, in/128]), while the
    NVFP4 global scales keep ModelOpt's shape, as compressed-tensors' own ModelOptNvfp4Converter leaves them.
    """
    shape = tuple(shape)
    if modelopt_suffix not in modelopt_suffixes(scheme):
        raise ValueError(f"{modelopt_suffix} is not part of a ModelOpt {quant_algo(scheme)} Linear "
                         f"({', '.join(modelopt_suffixes(scheme))})")
    if modelopt_suffix == "weight" or (modelopt_suffix == "weight_scale" and scheme in _NVFP4):
        _check_stored(scheme, modelopt_suffix, dtype, shape)
        return dtype, shape
    if is_reciprocal(scheme, modelopt_suffix):
        _one_value(shape, modelopt_suffix)
        return _F32, shape
    if modelopt_suffix == "weight_scale" and scheme == "fp8-dynamic":
        if len(shape) not in (1, 2) or math.prod(shape) != shape[0]:
            raise ValueError(f"per-channel weight_scale must be [out], got shape {list(shape)}")
        return _F32, (shape[0], 1)
    if modelopt_suffix == "weight_scale" and scheme == "fp8-block":
        if len(shape) == 4 and shape[1] == shape[3] == 1:
            return _F32, (shape[0], shape[2])
        if len(shape) == 2:
            return _F32, shape
        raise ValueError(f"block weight_scale must be [out/128, 1, in/128, 1], got shape {list(shape)}")
    _one_value(shape, modelopt_suffix)
    return _F32, (1,)


def _scale_f32(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if not tensor.is_floating_point() or tensor.dtype in (FP8_DTYPE, torch.float8_e5m2):
        raise ValueError(f"{what} must be a 16/32-bit float scale, got {tensor.dtype}")
    value = tensor.to(torch.float32)
    if not bool((torch.isfinite(value) & (value > 0)).all()):
        raise ValueError(f"{what} must be finite and > 0")
    return value


def is_reciprocal(scheme: str, suffix: str) -> bool:
    """Whether a tensor (by its compressed-tensors or ModelOpt suffix) is an NVFP4 global scale, whose value the
    two formats store as reciprocals: compressed-tensors divides by weight_global_scale / input_global_scale where
    ModelOpt multiplies by weight_scale_2 / input_scale (ModelOpt's FP8 input_scale is the same in both)."""
    return suffix in ("weight_global_scale", "input_global_scale", "weight_scale_2") or (
        suffix == "input_scale" and scheme == "nvfp4")


def modelopt_value(scheme: str, ct_suffix: str, tensor: torch.Tensor) -> torch.Tensor:
    """The ModelOpt tensor for a compressed-tensors one: the same bytes, or a float32 scale in ModelOpt's shape.

    The NVFP4 global scales become their float32 reciprocals. That is the one lossy step: in float32
    1/(1/x) != x for 17% of significands (all of them above sqrt(2)), so a round trip can move such a scale by
    one ulp.
    """
    dtype, shape = modelopt_layout(scheme, ct_suffix, safetensors_dtype(tensor.dtype), tuple(tensor.shape))
    return _map_value(tensor, ct_suffix, dtype, shape, reciprocal=is_reciprocal(scheme, ct_suffix))


def ct_value(scheme: str, modelopt_suffix: str, tensor: torch.Tensor) -> torch.Tensor:
    """The compressed-tensors tensor for a ModelOpt one (inverse of modelopt_value, the same one lossy step)."""
    dtype, shape = ct_layout(scheme, modelopt_suffix, safetensors_dtype(tensor.dtype), tuple(tensor.shape))
    return _map_value(tensor, modelopt_suffix, dtype, shape, reciprocal=is_reciprocal(scheme, modelopt_suffix))


def _map_value(tensor: torch.Tensor, suffix: str, dtype: str, shape: tuple[int, ...], *, reciprocal: bool) -> torch.Tensor:
    if dtype != _F32 or suffix in ("weight", "weight_packed"):
        return tensor.reshape(shape)  # quantized values and NVFP4 group scales: the same bytes
    value = _scale_f32(tensor, suffix)
    return (1 / value if reciprocal else value).reshape(shape)


def block_weight_ok(shape: tuple[int, ...]) -> bool:
    """Whether vLLM's FP8_PB_WO linear takes a weight of this shape (whole 128x128 blocks on both axes)."""
    return len(shape) == 2 and all(dim % block == 0 for dim, block in zip(shape, FP8_BLOCK_SIZE))


def kv_scale_name(attn_module: str, kind: str) -> str:
    """ModelOpt's name for an FP8 KV-cache scale: `<attn>.k_proj.k_scale` / `<attn>.v_proj.v_scale`.

    `attn_module` is where compressed-tensors keeps it (`...self_attn`); a name already on the projection (as
    compressed-tensors' ModelOpt converter leaves it) stays as it is.
    """
    if kind not in ("k", "v"):
        raise ValueError(f"KV-cache scale kind must be 'k' or 'v', got {kind!r}")
    proj = f"{kind}_proj"
    if attn_module.endswith("." + proj):
        return f"{attn_module}.{kind}_scale"
    return f"{attn_module}.{proj}.{kind}_scale"


def kv_scale_value(tensor: torch.Tensor) -> torch.Tensor:
    """A KV-cache scale as ModelOpt stores it: one float32 value, 0-d (the bf16 of compressed-tensors is exact in it)."""
    _one_value(tuple(tensor.shape), "k_scale / v_scale")
    return _scale_f32(tensor, "k_scale / v_scale").reshape(())


# ---------------------------------------------------------------------------------------------- exclusions

# Characters a module name is made of; anything else in a pattern would need fnmatch brackets or regex classes.
_NAME_CHARS = re.compile(r"[A-Za-z0-9_\-/]")


def _vllm_safe(pattern: str, source: str) -> list[str]:
    """`pattern` as fnmatch patterns that keep their meaning through vLLM's rewrite of ModelOpt exclusions.

    vLLM (ModelOptQuantConfigBase.apply_vllm_mapper, applied to every model class with an hf_to_vllm_mapper, such
    as Gemma4ForConditionalGeneration) rewrites each `X*` whose X does not end in '.' into `X` and `X.*`, since
    ModelOpt itself only writes module-prefix wildcards. An infix wildcard like `*per_layer*` would so lose
    `layers.0.per_layer_input_gate`. `X*` is the union of `X` and `X*?` (X plus at least one character), and
    neither of those ends in `*`, so that pair means the same before and after.
    """
    pattern = re.sub(r"\*+", "*", pattern)
    if pattern.strip("*") == "":
        raise ValueError(f"{source}: would exclude every module")
    if pattern.endswith("*") and not pattern.endswith(".*"):
        return [pattern[:-1], pattern[:-1] + "*?"]
    return [pattern]


def _regex_to_wildcard(regex: str, source: str) -> str:
    """A compressed-tensors `re:` pattern (matched with re.match: anchored at the start only) as one fnmatch pattern.

    Takes the regular expressions a wildcard can say: literal name characters, `\\.` and other escaped
    punctuation, `.` (one character), `.*`, `.+`, an optional leading `^`, a trailing `$` or `\\Z`, and the
    `(?s:...)\\Z` wrapper of fnmatch.translate. Anything else (classes, groups, alternation, repeats) is refused.
    """
    body, anchored = regex, False
    if body.startswith("(?s:") and body.endswith(")\\Z"):
        body, anchored = body[4:-3], True
    elif body.endswith("\\Z"):
        body, anchored = body[:-2], True
    elif body.endswith("$") and not body.endswith("\\$"):
        body, anchored = body[:-1], True
    body = body.removeprefix("^")
    out, i = [], 0
    while i < len(body):
        char, after = body[i], body[i + 1:i + 2]
        if char == "\\" and after and not after.isalnum() and after not in "*?[]":
            out.append(after)
            i += 2
        elif char == "." and after in ("*", "+"):
            out.append("*" if after == "*" else "?*")
            i += 2
        elif char == ".":
            out.append("?")
            i += 1
        elif _NAME_CHARS.fullmatch(char):
            out.append(char)
            i += 1
        else:
            raise ValueError(f"{source}: the regular expression cannot be written as a ModelOpt wildcard "
                             f"(at {body[i:]!r}); list the modules, or use re:.*NAME.* / re:PREFIX.*")
    # re.match stops wherever the pattern ends, so an unanchored end matches any rest of the name.
    return "".join(out) + ("" if anchored else "*")


def exclude_modules_from_ct_ignore(ignore: list[str]) -> list[str]:
    """compressed-tensors `ignore` entries as ModelOpt `exclude_modules` (fnmatch wildcards), meaning the same.

    A plain name stays as it is (both match it exactly); `re:` patterns become wildcards (`re:.*router.*` ->
    `*router` and `*router*?`, see _vllm_safe). ValueError naming the entry for a regex no wildcard can say.
    """
    out: list[str] = []
    for entry in ignore:
        if entry.startswith("re:"):
            out += _vllm_safe(_regex_to_wildcard(entry[3:], entry), entry)
        elif any(c in entry for c in "*?["):
            raise ValueError(f"{entry}: a plain compressed-tensors name with wildcard characters has no ModelOpt "
                             f"equivalent")
        else:
            out.append(entry)
    return list(dict.fromkeys(out))


def ct_ignore_from_exclude_modules(exclude_modules: list[str]) -> list[str]:
    """ModelOpt `exclude_modules` as compressed-tensors `ignore` entries (the inverse translation).

    A name without wildcards stays a plain (exact) name; a wildcard becomes `re:` + its regex with a closing `$`,
    since compressed-tensors matches with re.match, which does not anchor the end. Written with `.*`, `.` and
    `\\.` only, so exclude_modules_from_ct_ignore reads it back. ValueError for fnmatch's `[...]` classes,
    which ModelOpt does not write.
    """
    out = []
    for entry in exclude_modules:
        if "[" in entry or "]" in entry:
            raise ValueError(f"{entry}: fnmatch character classes are not supported; list the modules instead")
        if "*" not in entry and "?" not in entry:
            out.append(entry)
            continue
        regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in entry)
        out.append(f"re:{regex}$")
    return out
