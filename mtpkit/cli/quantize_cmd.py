"""`mtp-convert quantize SRC OUT --scheme S`: a BF16 target to FP8 / NVFP4 weights, streamed on the CPU."""

from __future__ import annotations

import json
import statistics
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from mtpkit.cli.app import app
from mtpkit.calibrate.data import DEFAULT_MAX_TOKENS
from mtpkit.calibrate.pipeline import quantize_calibrated
from mtpkit.cli.console import byte_progress, out, phase_progress
from mtpkit.cli.options import Force, Json, Out, Revision, Src
from mtpkit.convert.format_convert import convert_to_compressed_tensors, convert_to_modelopt
from mtpkit.convert.recipe import load_recipe
from mtpkit.convert.source import open_source
from mtpkit.errors import ConfigError


class Scheme(str, Enum):
    fp8_dynamic = "fp8-dynamic"
    fp8 = "fp8"
    fp8_block = "fp8-block"
    nvfp4 = "nvfp4"
    nvfp4a16 = "nvfp4a16"


class KVCache(str, Enum):
    fp8 = "fp8"


class Format(str, Enum):
    compressed_tensors = "compressed-tensors"
    modelopt = "modelopt"


@app.command("quantize")
def quantize_command(
    src: Src,
    dest: Out,
    scheme: Annotated[Scheme | None, typer.Option("--scheme", help="fp8-dynamic, fp8-block and nvfp4a16 need no "
                                                  "calibration; fp8 and nvfp4 need calibrated activation scales.")] = None,
    fmt: Annotated[Format, typer.Option("--format", help="On-disk format.")] = Format.compressed_tensors,
    recipe: Annotated[str | None, typer.Option("--recipe", help="A shipped recipe name (see recipes/) or a recipe "
                                               "YAML in llm-compressor's schema.")] = None,
    to: Annotated[Format | None, typer.Option("--to", help="Convert an already-quantized checkpoint to this "
                                              "format, losslessly (ModelOpt <-> compressed-tensors).")] = None,
    kv_cache: Annotated[KVCache, typer.Option("--kv-cache", help="fp8: calibrated per-layer k/v scales for an "
                                              "FP8 KV cache (vLLM --kv-cache-dtype fp8).")] = None,
    calib: Annotated[Path | None, typer.Option("--calib", help="Calibration text (.txt, blank-line separated) "
                                               "or JSONL ({\"text\": ...} or {\"input_ids\": [...]}); default: "
                                               "mtpkit's built-in sample set.")] = None,
    calib_samples: Annotated[int | None, typer.Option("--calib-samples", help="Use at most this many samples.")] = None,
    calib_tokens: Annotated[int, typer.Option("--calib-tokens", help="Truncate each sample to this many "
                                              "tokens.")] = DEFAULT_MAX_TOKENS,
    evaluate: Annotated[bool, typer.Option("--evaluate/--no-evaluate", help="Compare the output with the input on "
                                           "the calibration text (logit error, perplexity).")] = True,
    revision: Revision = None,
    force: Force = False,
    as_json: Json = False,
) -> None:
    """Quantize a target's decoder Linear weights (--scheme), or convert a quantized one's format (--to)."""
    if sum(x is not None for x in (scheme, recipe, to)) != 1:
        raise ConfigError("give exactly one of --scheme or --recipe (quantize a BF16 target) and --to (convert a "
                          "quantized one)", where="quantize", fix="e.g. --scheme nvfp4a16, or --to compressed-tensors")
    ignore: list[str] = []
    targets = ["Linear"]
    kv = kv_cache is KVCache.fp8
    if recipe is not None:
        loaded = load_recipe(recipe)
        kv = kv or loaded.kv_cache
        scheme, ignore, targets = Scheme(loaded.scheme), loaded.ignore, loaded.targets
    checkpoint = open_source(src, revision=revision)
    if to is not None:
        convert = convert_to_modelopt if to is Format.modelopt else convert_to_compressed_tensors
        with byte_progress("converting", checkpoint.total_bytes) as advance:
            converted = convert(checkpoint, dest, force=force, on_bytes=advance)
        summary = {"output": str(converted.folder), "from": converted.source, "modules": converted.modules}
        if as_json:
            print(json.dumps(summary, indent=2))
        else:
            out.print(f"wrote {converted.folder}: {converted.modules} {converted.source['method']} "
                      f"{converted.source['scheme']} modules in the {to.value} format", highlight=False)
        return
    with phase_progress() as progress:
        result = quantize_calibrated(checkpoint, dest, scheme=scheme.value, fmt=fmt.value, ignore=ignore, targets=targets,
                                     kv_cache=kv,
                                     calib=calib, calib_samples=calib_samples, calib_tokens=calib_tokens,
                                     evaluate=evaluate, force=force, progress=progress)
    if as_json:
        print(json.dumps({"output": str(result.folder), **result.report}, indent=2))
        return
    report = result.report
    errors = list(report["relative_weight_error"].values())
    out.print(f"wrote {result.folder}: {result.quantized} Linear weights as {result.scheme} ({report['format']}"
              f"{', FP8 KV cache' if kv else ''}); relative weight error median {statistics.median(errors):.4f}, "
              f"max {max(errors):.4f}", highlight=False)
    if report["calibration"]:
        c = report["calibration"]
        out.print(f"calibrated on {c['samples']} samples, {c['tokens']} tokens of {c['source']}", highlight=False)
    evaluation = report.get("evaluation")
    if evaluation and "skipped" in evaluation:
        out.print(f"not evaluated: {evaluation['skipped']}", highlight=False)
    elif evaluation:
        ppl = evaluation["perplexity"]
        out.print(f"vs the original on {evaluation['tokens']} tokens: max |logit error| "
                  f"{evaluation['max_abs_logit_error']:.4f}, mean {evaluation['mean_abs_logit_error']:.5f}, top-1 "
                  f"agreement {evaluation['top1_agreement']:.1%}, perplexity {ppl['original']:.3f} -> "
                  f"{ppl['quantized']:.3f}", highlight=False)
    experts = result.report["kept_unquantized"]["moe_experts"]
    if experts:
        out.print(f"kept {len(experts)} MoE expert tensors unquantized (not selected by the targets / ignore)",
                  highlight=False)
