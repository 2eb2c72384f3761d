"""`mtp-convert draft SRC OUT`: rewrite an assistant checkpoint into canonical form."""

from __future__ import annotations

import json
from enum import Enum
from typing import Annotated

import typer

from mtpkit.cli.app import app
from mtpkit.cli.console import byte_progress, out
from mtpkit.cli.options import Force, Json, Out, Revision, Src
from mtpkit.convert.draft import draft
from mtpkit.convert.draft_rules import RuleApplication
from mtpkit.convert.source import open_source


class Dialect(str, Enum):
    flat = "flat"
    per_layer = "per-layer"


class DType(str, Enum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


def format_rule(rule: RuleApplication) -> str:
    before = json.dumps(rule.before) if not isinstance(rule.before, str) else rule.before
    after = json.dumps(rule.after) if not isinstance(rule.after, str) else rule.after
    return f"[{rule.rule}] {rule.path}: {before} -> {after} ({rule.reason})"


@app.command("draft")
def draft_command(
    src: Src,
    dest: Out,
    dialect: Annotated[Dialect, typer.Option("--dialect", help="Head-dim dialect: flat (global_head_dim, as "
                                             "published) or per-layer (per_layer_config).")] = Dialect.flat,
    dtype: Annotated[DType, typer.Option("--dtype", help="dtype of the written weights.")] = DType.bfloat16,
    dequantize: Annotated[bool, typer.Option("--dequantize", help="Make FP8 / NVFP4 weights dense again "
                                             "(an assistant must not be quantized).")] = False,
    revision: Revision = None,
    force: Force = False,
    as_json: Json = False,
) -> None:
    """Canonicalize an assistant: nest text_config, fix model_type and dialect, drop inherited quantization."""
    checkpoint = open_source(src, revision=revision)
    with byte_progress("drafting", checkpoint.total_bytes) as advance:
        result = draft(checkpoint, dest, dialect=dialect.value, dtype=dtype.value, dequantize=dequantize, force=force,
                       on_tensor=lambda spec: advance(spec.nbytes))
    if as_json:
        print(json.dumps({"output": str(result.folder), "rules": [r.to_json() for r in result.rules],
                          "tensors": result.tensors, "cast": result.cast, "dequantized": result.dequantized},
                         indent=2))
        return
    for rule in result.rules:
        out.print(format_rule(rule), markup=False, highlight=False)
    summary = f"{len(result.rules)} rule(s) applied" if result.rules else "already canonical: no rule applied"
    out.print(f"wrote {result.folder}: {summary}; {result.tensors} tensors ({result.cast} cast, "
              f"{result.dequantized} dequantized)", highlight=False)
