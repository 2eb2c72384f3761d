"""`mtp-convert quantize SRC OUT --scheme S`: a BF16 target to FP8 / NVFP4 weights, streamed on the CPU."""

from __future__ import annotations

import json
import statistics
from enum import Enum
from typing import Annotated

import typer

from mtpkit.cli.app import app
from mtpkit.cli.console import byte_progress, out
from mtpkit.cli.options import Force, Json, Out, Revision, Src
from mtpkit.convert.format_convert import convert_to_compressed_tensors
from mtpkit.convert.quantize import quantize
from mtpkit.convert.recipe import load_recipe
from mtpkit.convert.source import open_source
from mtpkit.errors import ConfigError


class Scheme(str, Enum):
    fp8_dynamic = "fp8-dynamic"
    fp8 = "fp8"
    fp8_block = "fp8-block"
    nvfp4 = "nvfp4"
    nvfp4a16 = "nvfp4a16"


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
                                              "format, losslessly (ModelOpt NVFP4 -> compressed-tensors).")] = None,
    revision: Revision = None,
    force: Force = False,
    as_json: Json = False,
) -> None:
    """Quantize a target's decoder Linear weights (--scheme), or convert a quantized one's format (--to)."""
    if sum(x is not None for x in (scheme, recipe, to)) != 1:
        raise ConfigError("give exactly one of --scheme or --recipe (quantize a BF16 target) and --to (convert a "
                          "quantized one)", where="quantize", fix="e.g. --scheme nvfp4a16, or --to compressed-tensors")
    ignore: list[str] = []
    if recipe is not None:
        loaded = load_recipe(recipe)
        if loaded.needs_calibration:
            raise ConfigError(f"recipe {loaded.name} needs calibration (static activation or KV-cache scales), which "
                              "this mtpkit cannot compute yet", where=loaded.source,
                              fix="use fp8-dynamic, fp8-block or nvfp4a16")
        if loaded.targets != ["Linear"]:
            raise ConfigError(f"recipe targets {loaded.targets} are not supported (mtpkit quantizes the decoder "
                              "Linears, less `ignore`)", where=loaded.source, fix="use targets: [Linear] and ignore")
        scheme, ignore = Scheme(loaded.scheme), loaded.ignore
    checkpoint = open_source(src, revision=revision)
    if to is not None:
        if to is not Format.compressed_tensors:
            raise ConfigError(f"--to {to.value} is not supported yet", where="quantize", fix="use --to compressed-tensors")
        with byte_progress("converting", checkpoint.total_bytes) as advance:
            converted = convert_to_compressed_tensors(checkpoint, dest, force=force, on_bytes=advance)
        summary = {"output": str(converted.folder), "from": converted.source, "modules": converted.modules}
        if as_json:
            print(json.dumps(summary, indent=2))
        else:
            out.print(f"wrote {converted.folder}: {converted.modules} {converted.source['method']} "
                      f"{converted.source['scheme']} modules in the compressed-tensors format", highlight=False)
        return
    # Two passes over the quantized weights (check + amax, then write) and one over the rest.
    with byte_progress("quantizing", 2 * checkpoint.total_bytes) as advance:
        result = quantize(checkpoint, dest, scheme=scheme.value, fmt=fmt.value, ignore=ignore, force=force,
                          on_bytes=advance)
    if as_json:
        print(json.dumps({"output": str(result.folder), **result.report}, indent=2))
        return
    errors = list(result.report["relative_weight_error"].values())
    out.print(f"wrote {result.folder}: {result.quantized} Linear weights as {result.scheme} (compressed-tensors); "
              f"relative weight error median {statistics.median(errors):.4f}, max {max(errors):.4f}", highlight=False)
    experts = result.report["kept_unquantized"]["moe_experts"]
    if experts:
        out.print(f"kept {len(experts)} MoE expert tensors unquantized (expert quantization is not supported yet)",
                  highlight=False)
