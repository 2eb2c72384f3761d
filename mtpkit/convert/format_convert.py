"""`quantize --to compressed-tensors`: a ModelOpt NVFP4 checkpoint in the compressed-tensors format, losslessly.

No re-quantization: the packed FP4 codes and FP8 group scales are copied byte for byte; only the two
global scales change form, since compressed-tensors divides by them where ModelOpt multiplies
(weight_global_scale = 1 / weight_scale_2, input_global_scale = 1 / input_scale), exactly as
compressed-tensors' own model-free converter (`ModelOptNvfp4Converter`) maps them.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mtpkit.convert.atomic import atomic_output_dir
from mtpkit.convert.checkpoint import Checkpoint
from mtpkit.convert.draft import HF_QUANT_CONFIG, dump_json
from mtpkit.convert.quantize_scope import CT_IGNORE, CT_TARGETS
from mtpkit.convert.reshard import copy_other_files
from mtpkit.convert.safetensors_file import TensorInfo, load_tensor
from mtpkit.convert.writer import TensorSpec, write_checkpoint_tensors
from mtpkit.errors import ConfigError
from mtpkit.formats import compressed_tensors as ct
from mtpkit.formats.quantization import detect_quantization

# ModelOpt name -> (compressed-tensors name, how the value changes)
_RENAMES = {"weight_scale_2": "weight_global_scale", "input_scale": "input_global_scale"}
# compressed-tensors' converter stores KV scales in its default scale dtype (bf16) when the scheme names none.
_KV_SCALE_DTYPE = "BF16"


@dataclass(frozen=True)
class ConvertResult:
    folder: Path
    source: dict
    modules: int


def _ct_ignore(exclude_modules: list[str]) -> list[str]:
    """ModelOpt's fnmatch-style exclusions as compressed-tensors `re:` patterns, plus the Gemma 4 defaults."""
    patterns = [m if "*" not in m and "?" not in m else "re:" + fnmatch.translate(m) for m in exclude_modules]
    return list(dict.fromkeys(CT_IGNORE + patterns))


def convert_to_compressed_tensors(checkpoint: Checkpoint, out: str | Path, *, force: bool = False,
                                  on_bytes: Callable[[int], None] | None = None) -> ConvertResult:
    where = str(checkpoint.folder / "config.json")
    source = detect_quantization(checkpoint.config, checkpoint.read_json_file(HF_QUANT_CONFIG), where)
    if source is None:
        raise ConfigError("is not quantized; there is nothing to convert", where=where,
                          fix="quantize it with `mtp-convert quantize SRC OUT --scheme ...`")
    if source["method"] == "compressed-tensors":
        raise ConfigError("is already in the compressed-tensors format", where=where, fix="use it as it is")
    if (source["method"], source["scheme"]) != ("modelopt", "nvfp4"):
        raise ConfigError(f"{source['method']} {source['scheme']} cannot be converted yet (only ModelOpt NVFP4)",
                          where=where, fix="convert it with the tool that produced it")
    packed = {name for name, info in checkpoint.tensors.items() if name.endswith(".weight") and info.dtype == "U8"}
    modules = {name.removesuffix(".weight") for name in packed}
    w4a4 = any(f"{m}.input_scale" in checkpoint.tensors for m in modules)
    kv_cache = source.get("kv_cache") == "fp8"

    specs: list[TensorSpec] = []
    produce: dict[str, TensorInfo | Callable[[], object]] = {}
    for name, info in checkpoint.tensors.items():
        module, _, suffix = name.rpartition(".")
        if name in packed:
            specs.append(TensorSpec(f"{module}.weight_packed", "U8", info.shape))
            produce[f"{module}.weight_packed"] = info
        elif module in modules and suffix in _RENAMES:
            target = f"{module}.{_RENAMES[suffix]}"
            specs.append(TensorSpec(target, "F32", info.shape))
            produce[target] = lambda info=info: 1 / load_tensor(info).float()
        elif kv_cache and suffix in ("k_scale", "v_scale"):
            specs.append(TensorSpec(name, _KV_SCALE_DTYPE, info.shape))
            produce[name] = lambda info=info: load_tensor(info).bfloat16()
        else:
            specs.append(TensorSpec.of(info))
            produce[name] = info

    config = {k: v for k, v in checkpoint.config.items() if k != "quantization_config"}
    config["quantization_config"] = ct.quantization_config("nvfp4" if w4a4 else "nvfp4a16", CT_TARGETS,
                                                           _ct_ignore(source["ignore"]), kv_cache=kv_cache)
    with atomic_output_dir(out, force=force, sources=(checkpoint.folder,)) as tmp:
        write_checkpoint_tensors(tmp, specs, lambda spec: p if isinstance(p := produce[spec.name], TensorInfo) else p(),
                                 on_tensor=(lambda s: on_bytes(s.nbytes)) if on_bytes else None)
        (tmp / "config.json").write_text(dump_json(config), encoding="utf-8")
        copy_other_files(checkpoint, tmp, skip={"config.json", HF_QUANT_CONFIG})
    return ConvertResult(Path(out), source, len(modules))
