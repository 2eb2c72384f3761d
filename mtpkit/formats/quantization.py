"""Which quantization a checkpoint carries, read from its configs (never from file names).

Two producers matter for Gemma 4 pairs: compressed-tensors (llm-compressor; `quantization_config`
with `quant_method: compressed-tensors` in config.json) and NVIDIA ModelOpt (`hf_quant_config.json`,
and the flat `quantization_config` with `quant_method: modelopt` that ModelOpt writes into config.json).
"""

from __future__ import annotations

from typing import Any

from mtpkit.errors import ConfigError
from mtpkit.formats import modelopt

# compressed-tensors preset name -> mtpkit scheme name (the `--scheme` values of `quantize`).
CT_PRESET_TO_SCHEME = {"FP8_DYNAMIC": "fp8-dynamic", "FP8": "fp8", "FP8_BLOCK": "fp8-block", "NVFP4": "nvfp4",
                       "NVFP4A16": "nvfp4a16"}
# ModelOpt quant_algo (upper-cased: ModelOpt writes fp8_pb_wo, vLLM upper-cases before matching) -> mtpkit scheme.
MODELOPT_ALGO_TO_SCHEME = {algo.upper(): scheme for scheme, algo in modelopt.QUANT_ALGOS.items()}
# The fields that tell schemes apart; the rest (observer, scale dtype) do not change the on-disk layout.
_ARG_FIELDS = ("num_bits", "type", "strategy", "group_size", "block_structure", "dynamic")


def _args_key(args: dict | None) -> tuple | None:
    if not args:
        return None
    return tuple(str(args.get(field)) for field in _ARG_FIELDS)


def _ct_scheme(group: dict) -> str:
    """Match one config group against compressed-tensors' own presets; 'custom' when none fits."""
    from compressed_tensors.quantization import preset_name_to_scheme  # slow import: only for such checkpoints

    key = (_args_key(group.get("weights")), _args_key(group.get("input_activations")))
    for preset, scheme in CT_PRESET_TO_SCHEME.items():
        reference = preset_name_to_scheme(preset, ["Linear"]).model_dump(exclude_none=True)
        if key == (_args_key(reference.get("weights")), _args_key(reference.get("input_activations"))):
            return scheme
    return "custom"


def _compressed_tensors(qc: dict, where: str) -> dict[str, Any]:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
        raise ConfigError("quantization_config.config_groups is missing or not an object of groups", where=where,
                          fix="restore the quantization_config written by the quantizer")
    schemes = sorted({_ct_scheme(g) for g in groups.values()})
    kv = qc.get("kv_cache_scheme")
    return {
        "method": "compressed-tensors",
        "scheme": schemes[0] if len(schemes) == 1 else "mixed:" + "+".join(schemes),
        "format": qc.get("format"),
        "kv_cache": _kv_name(kv.get("type"), kv.get("num_bits")) if isinstance(kv, dict) else None,
        "ignore": list(qc.get("ignore") or []),
        "source": "config.json",
    }


def _kv_name(kind: Any, bits: Any) -> str:
    return "fp8" if (kind, bits) == ("float", 8) else f"{kind}{bits}"


def _modelopt_kv(section: dict) -> str | None:
    """hf_quant_config's `kv_cache_quant_algo` string, or the `kv_cache_scheme` ModelOpt writes into config.json
    instead (a {type, num_bits} dict for FP8; for other algorithms it passes the string through)."""
    kv = section.get("kv_cache_quant_algo") or section.get("kv_cache_scheme")
    if isinstance(kv, dict):
        return _kv_name(kv.get("type"), kv.get("num_bits"))
    return str(kv).lower() if kv else None


def _modelopt_group_size(section: dict) -> Any:
    """hf_quant_config's `group_size`; config.json carries it only inside its config groups' weight arguments."""
    if section.get("group_size") is not None:
        return section["group_size"]
    groups = section.get("config_groups")
    for group in groups.values() if isinstance(groups, dict) else ():
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict) and weights.get("group_size") is not None:
            return weights["group_size"]
    return None


def _modelopt(section: dict, source: str) -> dict[str, Any]:
    algo = section.get("quant_algo")
    return {
        "method": "modelopt",
        "scheme": MODELOPT_ALGO_TO_SCHEME.get(str(algo).upper(), str(algo).lower() if algo else "unknown"),
        "quant_algo": algo,
        "group_size": _modelopt_group_size(section),
        "kv_cache": _modelopt_kv(section),
        "ignore": list(section.get("exclude_modules") or section.get("ignore") or []),
        "source": source,
    }


def detect_quantization(config: dict, hf_quant_config: dict | None, where: str = "config.json") -> dict | None:
    """A summary dict (method, scheme, kv_cache, ignore, source), or None for an unquantized checkpoint."""
    qc = config.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ConfigError("quantization_config is not an object", where=where, fix="restore it or remove it")
    if qc:
        method = qc.get("quant_method")
        if method == "compressed-tensors":
            return _compressed_tensors(qc, where)
        if method == "modelopt":
            # Newer ModelOpt nests the hf_quant_config form under "quantization"; older ones write it flat.
            return _modelopt(qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc, "config.json")
        return {"method": str(method), "scheme": "unknown", "kv_cache": None, "ignore": [], "source": "config.json"}
    if hf_quant_config:
        section = hf_quant_config.get("quantization")
        if not isinstance(section, dict):
            raise ConfigError("has no 'quantization' object", where="hf_quant_config.json",
                              fix="restore the file written by ModelOpt")
        return _modelopt(section, "hf_quant_config.json")
    return None
