"""`quantize`: a BF16 Gemma 4 target to FP8 or NVFP4 weights in the compressed-tensors format, streamed.

Two passes over the decoder Linear weights: the first checks every weight (finite, shapes) and takes
the amax of each fused group (q/k/v, gate/up), which fixes the shared global scale; the second writes
each output tensor as the writer asks for it, recomputing a module's scales rather than holding its
other outputs, so memory stays bounded by one weight. Everything else is copied byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mtpkit.convert.atomic import atomic_output_dir, check_destination
from mtpkit.convert.checkpoint import Checkpoint
from mtpkit.convert.describe import describe
from mtpkit.convert.draft import HF_QUANT_CONFIG, dump_json
from mtpkit.convert.quantize_scope import CT_IGNORE, CT_TARGETS, QuantTarget, moe_expert_tensors, quantization_targets, \
    replaced_tensors
from mtpkit.convert.quantize_output import ModelOptOutput
from mtpkit.convert.quantize_static import StaticScales, input_scale_tensors, kv_scale_tensors
from mtpkit.convert.reshard import copy_other_files
from mtpkit.convert.safetensors_file import TensorInfo
from mtpkit.convert.writer import TensorSpec, write_checkpoint_tensors
from mtpkit.errors import CheckpointError, ConfigError
from mtpkit.formats import compressed_tensors as ct
from mtpkit.formats.fp8 import check_finite
from mtpkit.formats.gemma4 import text_prefix
from mtpkit.formats.quant_math import QuantizedWeight, check_weight, quantize_weight

REPORT_FILE = "mtpkit_quantize.json"
FORMATS = ("compressed-tensors", "modelopt")
WEIGHT_ONLY_OR_DYNAMIC = ("fp8-dynamic", "fp8-block", "nvfp4a16")
FLOAT_DTYPES = ("F16", "BF16", "F32")


@dataclass(frozen=True)
class QuantizeResult:
    folder: Path
    scheme: str
    quantized: int
    report: dict


def _refuse_unsupported(checkpoint: Checkpoint, scheme: str, fmt: str, where: str) -> None:
    if scheme not in ct.SCHEMES:
        raise ConfigError(f"--scheme {scheme!r} is not one of {', '.join(ct.SCHEMES)}", where=where,
                          fix="pick a scheme from `mtp-convert quantize --help`")
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}", where=where,
                          fix="use --format compressed-tensors or --format modelopt")
    description = describe(checkpoint)
    if description.role != "target":
        raise ConfigError("is an assistant; only targets are quantized (vLLM serves the assistant in BF16)",
                          where=where, fix="quantize the target, then `mtp-convert pair` it with this assistant")
    if description.quantization is not None:
        q = description.quantization
        raise ConfigError(f"is already quantized ({q['method']} {q['scheme']})", where=where,
                          fix="start from the BF16 checkpoint; mtpkit does not quantize twice")


def _checked_groups(targets: list[QuantTarget], scheme: str, on_bytes: Callable[[int], None] | None) -> dict[str, float]:
    """Pass 1: validate every weight and return the amax of each fused group."""
    amax: dict[str, float] = {}
    for target in targets:
        name, file = target.module + ".weight", target.weight.file
        if target.dtype not in FLOAT_DTYPES or len(target.shape) != 2:
            raise CheckpointError(f"{name} is {target.dtype}{list(target.shape)}; a 2-D float weight is needed",
                                  where=file, fix="start from the BF16 checkpoint")
        weight = target.load()
        try:
            check_finite(weight, name)
        except ValueError as e:
            raise CheckpointError(str(e), where=file, fix="repair or re-download the checkpoint") from e
        try:
            value = check_weight(weight, scheme, name)
        except ValueError as e:  # a shape the scheme cannot take; the message says what to use instead
            raise CheckpointError(str(e), where=file) from e
        amax[target.group] = max(amax.get(target.group, 0.0), value)
        if on_bytes:
            on_bytes(target.nbytes)
    return amax


class _Producer:
    """Produces each output tensor on request from the source weight (nothing held between requests)."""

    def __init__(self, targets: list[QuantTarget], amax: dict[str, float], scheme: str):
        self.scheme, self.amax = scheme, amax
        self.by_output: dict[str, tuple[QuantTarget, str]] = {}
        self.errors: dict[str, float] = {}
        for target in targets:
            for suffix in QuantizedWeight.suffixes(scheme):
                self.by_output[f"{target.module}.{suffix}"] = (target, suffix)

    def specs(self, targets: list[QuantTarget]) -> list[TensorSpec]:
        return [TensorSpec(f"{t.module}.{suffix}", dtype, shape) for t in targets
                for suffix, (dtype, shape) in QuantizedWeight.layout(self.scheme, t.dtype, t.shape).items()]

    def __call__(self, name: str):
        target, suffix = self.by_output[name]
        quantized = quantize_weight(target.load(), self.scheme, self.amax[target.group],
                                    with_values=suffix in ("weight", "weight_packed"))
        if quantized.relative_error is not None:
            self.errors[target.module] = quantized.relative_error
        return quantized.tensors[suffix]


@dataclass
class QuantizePlan:
    """A checked quantization: every refusal done and every weight read once (pass 1), before any output."""

    checkpoint: Checkpoint
    out: Path
    scheme: str
    fmt: str
    ignore: list[str]  # the written `ignore`: mtpkit's own exclusions and the caller's
    ct_targets: list[str]  # the written `targets` (compressed-tensors syntax)
    targets: list[QuantTarget]
    amax: dict[str, float]  # fused group -> max |W|
    kv_cache: bool
    force: bool
    modelopt: ModelOptOutput | None  # the mapping to ModelOpt's format, for --format modelopt

    @property
    def needs_calibration(self) -> bool:
        return self.scheme in ct.CALIBRATED or self.kv_cache


def plan_quantization(checkpoint: Checkpoint, out: str | Path, *, scheme: str, fmt: str = "compressed-tensors",
                      ignore: list[str] = (), targets: list[str] = tuple(CT_TARGETS), kv_cache: bool = False,
                      force: bool = False, on_bytes: Callable[[int], None] | None = None) -> QuantizePlan:
    """Refuse what cannot be quantized, then validate every weight and take the fused groups' amax.

    `targets` / `ignore`: which modules to quantize, in compressed-tensors' syntax (e.g. from a recipe):
    "Linear" is every decoder Linear, MoE experts included (one per expert projection, as llm-compressor
    unpacks them); `re:` patterns and exact names select modules; `ignore` adds to mtpkit's exclusions.
    """
    ct_targets = list(targets)
    where = str(checkpoint.folder / "config.json")
    if checkpoint.config_only:
        raise CheckpointError("has no weights to quantize", where=checkpoint.folder,
                              fix="point at a folder with model.safetensors or an index and its shards")
    check_destination(Path(out), force=force, sources=(checkpoint.folder,))
    _refuse_unsupported(checkpoint, scheme, fmt, where)
    targets = quantization_targets(checkpoint.tensors, ignore, ct_targets)
    if not targets:
        raise CheckpointError(f"holds no decoder Linear weights that targets {ct_targets} select "
                              "(layers.N.self_attn/mlp.*_proj.weight, layers.N.experts.*)",
                              where=checkpoint.folder, fix="point at a Gemma 4 target checkpoint, or widen the targets")
    ignore = list(dict.fromkeys(CT_IGNORE + list(ignore)))  # ours always: those Linears are never quantized
    modelopt = None
    if fmt == "modelopt":
        dense_experts = moe_expert_tensors(checkpoint.tensors, ignore, ct_targets)
        modelopt = ModelOptOutput(scheme, targets, checkpoint.tensors, ignore, dense_experts, kv_cache, where)
    amax = _checked_groups(targets, scheme, on_bytes)
    return QuantizePlan(checkpoint, Path(out), scheme, fmt, ignore, ct_targets, targets, amax, kv_cache, force,
                        modelopt)


def write_quantized(plan: QuantizePlan, *, scales: StaticScales | None = None,
                    evaluate: Callable[[Path], dict] | None = None,
                    on_bytes: Callable[[int], None] | None = None) -> QuantizeResult:
    """Pass 2: write the output atomically.

    `scales`: calibration results, needed by the static schemes (fp8, nvfp4) and by an FP8 KV cache.
    `evaluate(folder)`: called on the finished output before it is moved into place; what it returns goes
    into the report (the CLI runs the quantized model against the original there).
    """
    checkpoint, scheme, targets = plan.checkpoint, plan.scheme, plan.targets
    where = str(checkpoint.folder / "config.json")
    if plan.needs_calibration and scales is None:
        raise ConfigError(f"--scheme {scheme}{' with an FP8 KV cache' if plan.kv_cache else ''} needs static scales "
                          "from calibration", where=where, fix="calibrate first (the CLI does: --calib FILE, or the "
                          "default sample set with the target's tokenizer.json)")
    producer = _Producer(targets, plan.amax, scheme)
    replaced = replaced_tensors(targets)  # a 3-D expert tensor is replaced by its per-expert Linears
    specs = [TensorSpec.of(info) for name, info in checkpoint.tensors.items() if name not in replaced]
    specs += producer.specs(targets)
    static: dict[str, object] = {}
    if scheme in ct.CALIBRATED:
        static.update(input_scale_tensors(targets, scheme, scales))
    if plan.kv_cache:
        prefix = text_prefix(checkpoint.tensors)
        static.update(kv_scale_tensors(checkpoint.config, prefix, scales, where))
    specs += [TensorSpec.of_tensor(name, tensor) for name, tensor in static.items()]
    experts = moe_expert_tensors(checkpoint.tensors, plan.ignore, plan.ct_targets)
    config = dict(checkpoint.config)
    config["quantization_config"] = ct.quantization_config(scheme, plan.ct_targets, plan.ignore, kv_cache=plan.kv_cache)
    side_files = {}
    if plan.modelopt is not None:
        specs = [plan.modelopt.spec(spec) for spec in specs]
        config["quantization_config"], side_files[HF_QUANT_CONFIG] = plan.modelopt.configs()

    def produce_ct(name: str) -> TensorInfo | object:
        # FP8 keeps the name `weight`: ask the producer first, and copy only what it does not make.
        if name in producer.by_output:
            return producer(name)
        return static[name] if name in static else checkpoint.tensors[name]

    def produce(spec: TensorSpec) -> TensorInfo | object:
        if plan.modelopt is None:
            return produce_ct(spec.name)
        name = plan.modelopt.ct_name(spec.name)
        value = produce_ct(name)
        return value if isinstance(value, TensorInfo) else plan.modelopt.value(name, value)

    with atomic_output_dir(plan.out, force=plan.force, sources=(checkpoint.folder,)) as tmp:
        write_checkpoint_tensors(tmp, specs, produce, on_tensor=(lambda s: on_bytes(s.nbytes)) if on_bytes else None)
        (tmp / "config.json").write_text(dump_json(config), encoding="utf-8")
        for file, content in side_files.items():
            (tmp / file).write_text(dump_json(content), encoding="utf-8")
        copy_other_files(checkpoint, tmp, skip={"config.json", REPORT_FILE, HF_QUANT_CONFIG})
        report = {
            "tool": "mtp-convert quantize", "scheme": scheme, "format": plan.fmt,
            "quantized_modules": len(targets),
            "relative_weight_error": {module: producer.errors[module] for module in sorted(producer.errors)},
            "kept_unquantized": {"moe_experts": experts, "ignore": plan.ignore},
            "calibration": scales.inputs if scales is not None else None,
            "kv_cache": "fp8" if plan.kv_cache else None,
        }
        if evaluate is not None:
            report["evaluation"] = evaluate(tmp)
        (tmp / REPORT_FILE).write_text(dump_json(report), encoding="utf-8")
    return QuantizeResult(plan.out, scheme, len(targets), report)


def quantize(checkpoint: Checkpoint, out: str | Path, *, scheme: str, fmt: str = "compressed-tensors",
             ignore: list[str] = (), targets: list[str] = tuple(CT_TARGETS), force: bool = False,
             scales: StaticScales | None = None, kv_cache: bool = False,
             on_bytes: Callable[[int], None] | None = None) -> QuantizeResult:
    """plan_quantization + write_quantized, for callers that have their scales (or need none)."""
    plan = plan_quantization(checkpoint, out, scheme=scheme, fmt=fmt, ignore=ignore, targets=targets,
                             kv_cache=kv_cache, force=force, on_bytes=on_bytes)
    return write_quantized(plan, scales=scales, on_bytes=on_bytes)
