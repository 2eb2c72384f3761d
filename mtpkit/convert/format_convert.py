"""`quantize --to FORMAT`: a quantized checkpoint in the other on-disk format (compressed-tensors <-> ModelOpt).

No re-quantization, for any of the five mtpkit schemes (the tensor table is in mtpkit.formats.modelopt): FP8
values, packed FP4 codes and FP8 group scales are copied byte for byte, and the other scales change only dtype
(ModelOpt stores float32) and shape, except the two NVFP4 global scales, which change form, since
compressed-tensors divides by them where ModelOpt multiplies (weight_global_scale = 1 / weight_scale_2,
input_global_scale = 1 / input_scale), exactly as compressed-tensors' own model-free converter
(`ModelOptNvfp4Converter`) maps them. That float32 reciprocal is the one step that can move a value (by one ulp).
KV-cache scales go to bf16 in compressed-tensors, as that converter stores them, and to float32 (exact) in
ModelOpt, which keeps them on the projections (`self_attn.k_proj.k_scale`).
"""

from __future__ import annotations

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
from mtpkit.errors import CheckpointError, ConfigError
from mtpkit.formats import compressed_tensors as ct
from mtpkit.formats import modelopt as mo
from mtpkit.formats.quantization import detect_quantization

# compressed-tensors' converter stores KV scales in its default scale dtype (bf16) when the scheme names none.
_KV_SCALE_DTYPE = "BF16"
_KV_SUFFIXES = ("k_scale", "v_scale")
# Tensors that make a module a quantized Linear in either format (or in one we refuse: zero points, AWQ's
# pre_quant_scale). Such a module must hold exactly its scheme's set, so nothing quantized is copied blindly.
_QUANT_SUFFIXES = frozenset({"weight_packed", "weight_scale", "weight_global_scale", "input_global_scale",
                             "weight_scale_2", "input_scale", "weight_zero_point", "pre_quant_scale"})
# MoE experts kept in BF16 (mtpkit stores them as 3-D `layers.N.experts.{gate_up,down}_proj`): ModelOpt must
# exclude them, or vLLM builds its fused MoE (`layers.N.moe.experts` there) as quantized. One wildcard names both.
_DENSE_EXPERTS = "*.experts"

Produce = TensorInfo | Callable[[], object]


@dataclass(frozen=True)
class ConvertResult:
    folder: Path
    source: dict
    modules: int


def _source(checkpoint: Checkpoint, where: str) -> dict:
    if checkpoint.config_only:
        raise CheckpointError("has no weights to convert", where=checkpoint.folder,
                              fix="point at a folder with model.safetensors or an index and its shards")
    source = detect_quantization(checkpoint.config, checkpoint.read_json_file(HF_QUANT_CONFIG), where)
    if source is None:
        raise ConfigError("is not quantized; there is nothing to convert", where=where,
                          fix="quantize it with `mtp-convert quantize SRC OUT --scheme ...`")
    return source


def _ct_ignore(exclude_modules: list[str], where: str) -> list[str]:
    """ModelOpt's fnmatch-style exclusions as compressed-tensors patterns, plus the Gemma 4 defaults."""
    try:
        patterns = mo.ct_ignore_from_exclude_modules(exclude_modules)
    except ValueError as exc:
        raise ConfigError(f"exclude_modules entry {exc}", where=where, fix="list the excluded modules by name") from None
    return list(dict.fromkeys(CT_IGNORE + patterns))


def _plan(checkpoint: Checkpoint, scheme: str, to: str, kv_cache: bool) -> tuple[list[TensorSpec], dict, int]:
    """Every output tensor (input order) and how to make it, plus the number of quantized Linears.

    `to` is the output format. A module holding any quantization tensor must hold exactly the scheme's set in
    the input format; anything else is refused here, before a byte is written.
    """
    to_modelopt = to == "modelopt"
    suffixes = mo.ct_suffixes(scheme) if to_modelopt else mo.modelopt_suffixes(scheme)
    layout, value = (mo.modelopt_layout, mo.modelopt_value) if to_modelopt else (mo.ct_layout, mo.ct_value)
    present: dict[str, set[str]] = {}
    for name in checkpoint.tensors:
        module, _, suffix = name.rpartition(".")
        if suffix in _QUANT_SUFFIXES:
            present[module] = set()
    for name in checkpoint.tensors:
        module, _, suffix = name.rpartition(".")
        if module in present:
            present[module].add(suffix)
    source_format = "compressed-tensors" if to_modelopt else "ModelOpt"
    for module, found in sorted(present.items()):
        missing = [s for s in suffixes if s not in found]
        stray = sorted((found & (_QUANT_SUFFIXES | {"weight"})) - set(suffixes))
        if missing or stray:
            problem = f"lacks {', '.join(missing)}" if missing else f"also holds {', '.join(stray)}"
            raise CheckpointError(f"{module} {problem}; a {source_format} {scheme} Linear holds exactly "
                                  f"{', '.join(suffixes)}", where=checkpoint.folder,
                                  fix="convert only a checkpoint written whole by one quantizer")

    specs: list[TensorSpec] = []
    produce: dict[str, Produce] = {}
    for name, info in checkpoint.tensors.items():
        module, _, suffix = name.rpartition(".")
        source: Produce = info
        if module in present and suffix in suffixes:
            try:
                dtype, shape = layout(scheme, suffix, info.dtype, info.shape)
            except ValueError as exc:
                raise CheckpointError(f"{name}: {exc}", where=info.file, fix="convert an unmodified checkpoint") from None
            if to_modelopt and scheme == "fp8-block" and suffix == "weight" and not mo.block_weight_ok(info.shape):
                raise CheckpointError(f"{name} {list(info.shape)} is not made of whole 128x128 blocks, which vLLM's "
                                      f"ModelOpt FP8_PB_WO needs", where=info.file, fix="keep it in compressed-tensors")
            target = mo.modelopt_name(module, suffix) if to_modelopt else mo.ct_name(module, suffix, scheme)
            if (dtype, shape) != (info.dtype, info.shape) or mo.is_reciprocal(scheme, suffix):
                source = lambda info=info, suffix=suffix: value(scheme, suffix, load_tensor(info))  # noqa: E731
        elif suffix in _KV_SUFFIXES and to_modelopt:
            if not kv_cache:
                raise CheckpointError(f"{name} is a KV-cache scale, but quantization_config has no kv_cache_scheme",
                                      where=info.file, fix="restore the kv_cache_scheme the quantizer wrote")
            target, dtype, shape = mo.kv_scale_name(module, suffix[0]), "F32", ()
            source = lambda info=info: mo.kv_scale_value(load_tensor(info))  # noqa: E731
        elif suffix in _KV_SUFFIXES and kv_cache:
            target, dtype, shape = name, _KV_SCALE_DTYPE, info.shape
            source = lambda info=info: load_tensor(info).bfloat16()  # noqa: E731
        else:
            target, dtype, shape = name, info.dtype, info.shape
        if target in produce:
            raise CheckpointError(f"two tensors would both become {target} (one of them is {name})", where=info.file,
                                  fix="remove the duplicate KV-cache scale")
        specs.append(TensorSpec(target, dtype, tuple(shape)))
        produce[target] = source
    return specs, produce, len(present)


def _write(checkpoint: Checkpoint, out: str | Path, specs: list[TensorSpec], produce: dict[str, Produce],
           files: dict[str, dict], *, force: bool, on_bytes: Callable[[int], None] | None) -> None:
    with atomic_output_dir(out, force=force, sources=(checkpoint.folder,)) as tmp:
        write_checkpoint_tensors(tmp, specs, lambda spec: p if isinstance(p := produce[spec.name], TensorInfo) else p(),
                                 on_tensor=(lambda s: on_bytes(s.nbytes)) if on_bytes else None)
        for filename, content in files.items():
            (tmp / filename).write_text(dump_json(content), encoding="utf-8")
        copy_other_files(checkpoint, tmp, skip={"config.json", HF_QUANT_CONFIG})


def convert_to_compressed_tensors(checkpoint: Checkpoint, out: str | Path, *, force: bool = False,
                                  on_bytes: Callable[[int], None] | None = None) -> ConvertResult:
    """A ModelOpt checkpoint (FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO, NVFP4, W4A16_NVFP4) in compressed-tensors."""
    where = str(checkpoint.folder / "config.json")
    source = _source(checkpoint, where)
    if source["method"] == "compressed-tensors":
        raise ConfigError("is already in the compressed-tensors format", where=where, fix="use it as it is")
    if source["method"] != "modelopt" or source["scheme"] not in mo.QUANT_ALGOS:
        raise ConfigError(f"{source['method']} {source.get('quant_algo') or source['scheme']} cannot be converted "
                          f"(only ModelOpt {', '.join(mo.QUANT_ALGOS.values())})",
                          where=where, fix="convert it with the tool that produced it")
    scheme = source["scheme"]
    if scheme == "nvfp4" and not any(name.endswith(".input_scale") for name in checkpoint.tensors):
        scheme = "nvfp4a16"  # NVFP4 weights without the static input scales W4A4 needs: weight-only
    if source.get("kv_cache") not in (None, "fp8"):
        raise ConfigError(f"KV-cache quantization {source['kv_cache']} cannot be converted (only FP8)", where=where,
                          fix="convert it with the tool that produced it")
    kv_cache = source.get("kv_cache") == "fp8"
    specs, produce, modules = _plan(checkpoint, scheme, "compressed-tensors", kv_cache)
    config = {k: v for k, v in checkpoint.config.items() if k != "quantization_config"}
    config["quantization_config"] = ct.quantization_config(scheme, CT_TARGETS, _ct_ignore(source["ignore"], where),
                                                           kv_cache=kv_cache)
    _write(checkpoint, out, specs, produce, {"config.json": config}, force=force, on_bytes=on_bytes)
    return ConvertResult(Path(out), source, modules)


def _exclude_modules(checkpoint: Checkpoint, ignore: list[str], where: str) -> list[str]:
    """compressed-tensors' ignore as ModelOpt exclude_modules, plus the BF16 MoE experts it leaves implicit."""
    try:
        exclude = mo.exclude_modules_from_ct_ignore(ignore)
    except ValueError as exc:
        raise ConfigError(f"quantization_config.ignore entry {exc}", where=where,
                          fix="keep it in compressed-tensors, or list the ignored modules by name") from None
    dense = [n for n, i in checkpoint.tensors.items() if ".experts." in n and len(i.shape) == 3 and i.dtype in ("BF16", "F16", "F32")]
    if dense:
        quantized = [n for n in checkpoint.tensors if ".experts." in n and n.endswith(".weight_scale")]
        if quantized:
            raise CheckpointError(f"holds BF16 experts ({dense[0]}) next to quantized ones ({quantized[0]}); a "
                                  f"ModelOpt exclusion cannot tell them apart", where=checkpoint.folder,
                                  fix="keep it in compressed-tensors")
        exclude.append(_DENSE_EXPERTS)
    return exclude


def convert_to_modelopt(checkpoint: Checkpoint, out: str | Path, *, force: bool = False,
                        on_bytes: Callable[[int], None] | None = None) -> ConvertResult:
    """A compressed-tensors checkpoint of one mtpkit scheme in NVIDIA ModelOpt's format, as vLLM reads it.

    Writes hf_quant_config.json and the quantization_config ModelOpt puts into config.json.
    """
    where = str(checkpoint.folder / "config.json")
    source = _source(checkpoint, where)
    if source["method"] == "modelopt":
        raise ConfigError("is already in the ModelOpt format", where=where, fix="use it as it is")
    if source["method"] != "compressed-tensors":
        raise ConfigError(f"{source['method']} checkpoints cannot be converted (only compressed-tensors)", where=where,
                          fix="convert it with the tool that produced it")
    scheme = source["scheme"]
    try:
        mo.quant_algo(scheme)
    except ValueError as exc:
        raise ConfigError(f"quantization_config.config_groups: {exc}", where=where,
                          fix="keep it in compressed-tensors") from None
    expected_format = ct.SCHEMES[scheme][0]
    status = checkpoint.config["quantization_config"].get("quantization_status", "compressed")
    if source.get("format") != expected_format or status != "compressed":
        raise ConfigError(f"quantization_config holds format {source.get('format')!r} ({status}), not the "
                          f"{expected_format!r} (compressed) that a {scheme} checkpoint stores", where=where,
                          fix="convert a checkpoint as llm-compressor or mtp-convert quantize saved it")
    if source.get("kv_cache") not in (None, "fp8"):
        raise ConfigError(f"KV-cache quantization {source['kv_cache']} has no ModelOpt form here (only FP8)",
                          where=where, fix="keep it in compressed-tensors")
    kv_cache = source.get("kv_cache") == "fp8"
    exclude = _exclude_modules(checkpoint, source["ignore"], where)
    specs, produce, modules = _plan(checkpoint, scheme, "modelopt", kv_cache)
    config = {k: v for k, v in checkpoint.config.items() if k != "quantization_config"}
    config["quantization_config"] = mo.config_quantization_config(scheme, exclude, kv_cache)
    files = {"config.json": config, HF_QUANT_CONFIG: mo.hf_quant_config(scheme, exclude, kv_cache)}
    _write(checkpoint, out, specs, produce, files, force=force, on_bytes=on_bytes)
    return ConvertResult(Path(out), source, modules)
