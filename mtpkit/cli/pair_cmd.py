"""`mtp-convert pair --target T --draft D OUT`: a validated pair folder with its launch lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from mtpkit.cli.app import app
from mtpkit.calibrate.pipeline import pair_summary, quantize_calibrated
from mtpkit.cli.console import byte_progress, out, phase_progress, warn
from mtpkit.cli.draft_cmd import Dialect, format_rule
from mtpkit.cli.quantize_cmd import KVCache, Scheme
from mtpkit.cli.options import Force, Json, Out
from mtpkit.convert.draft_rules import RuleApplication
from mtpkit.convert.pair import pair
from mtpkit.convert.source import open_source
from mtpkit.errors import ConfigError


@app.command("pair")
def pair_command(
    dest: Out,
    target: Annotated[str, typer.Option("--target", help="Target checkpoint (folder or Hub id).")],
    draft: Annotated[str, typer.Option("--draft", help="Assistant checkpoint (folder or Hub id).")],
    target_revision: Annotated[str | None, typer.Option("--target-revision", help="Hub revision of the target.")] = None,
    draft_revision: Annotated[str | None, typer.Option("--draft-revision", help="Hub revision of the draft.")] = None,
    dialect: Annotated[Dialect, typer.Option("--dialect", help="Head-dim dialect of the draft config.")] = Dialect.flat,
    quantize: Annotated[Scheme | None, typer.Option("--quantize", help="Quantize the BF16 target on the way in "
                                                    "(as `mtp-convert quantize --scheme`); the draft stays "
                                                    "BF16.")] = None,
    kv_cache: Annotated[KVCache | None, typer.Option("--kv-cache", help="With --quantize: fp8 adds calibrated "
                                                     "k/v scales for an FP8 KV cache.")] = None,
    calib: Annotated[Path | None, typer.Option("--calib", help="With --quantize: calibration text or JSONL "
                                               "(see `mtp-convert quantize --help`).")] = None,
    force: Force = False,
    as_json: Json = False,
) -> None:
    """Write OUT/target, OUT/draft (canonical) and OUT/pair.json, after validating the pair."""
    if quantize is None and (kv_cache is not None or calib is not None):
        raise ConfigError("--kv-cache and --calib go with --quantize", where="pair",
                          fix="add --quantize SCHEME, or quantize the target first with `mtp-convert quantize`")
    target_ck = open_source(target, revision=target_revision)
    draft_ck = open_source(draft, revision=draft_revision)

    def quantized_target(folder: Path) -> dict:
        with phase_progress() as progress:
            result = quantize_calibrated(target_ck, folder, scheme=quantize.value, kv_cache=kv_cache is KVCache.fp8,
                                         calib=calib, progress=progress)
        return pair_summary(result.report)
    with byte_progress("pairing", target_ck.total_bytes + draft_ck.total_bytes) as advance:
        result = pair(target_ck, draft_ck, dest, dialect=dialect.value, force=force, write_target=quantized_target if quantize else None,
                      on_bytes=advance)
    if as_json:
        print(json.dumps({"output": str(result.folder), **result.manifest}, indent=2))
        return
    for rule in result.manifest["draft_rules"]:
        out.print("draft " + format_rule(RuleApplication(**rule)), markup=False, highlight=False)
    for finding in result.findings:
        warn(f"[{finding.id}] {finding.message}")
    quantized = result.manifest["target_quantized_by"]
    if quantized:
        evaluation = quantized.get("evaluation") or {}
        line = f"target quantized to {quantized['scheme']}{' with an FP8 KV cache' if quantized['kv_cache'] else ''}"
        if "perplexity" in evaluation:
            ppl = evaluation["perplexity"]
            line += (f"; vs BF16 on {evaluation['tokens']} tokens: max |logit error| "
                     f"{evaluation['max_abs_logit_error']:.4f}, perplexity {ppl['original']:.3f} -> {ppl['quantized']:.3f}")
        out.print(line, highlight=False)
    tokens = result.manifest["num_speculative_tokens"]
    out.print(f"wrote {result.folder}: target/, draft/, pair.json; num_speculative_tokens {tokens['value']} "
              f"({tokens['why']})", highlight=False)
    out.print("serve it with:\n  " + result.manifest["launch"]["vllm_serve"], markup=False, highlight=False)
