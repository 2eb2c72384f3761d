"""`mtp-convert demo`: the whole pipeline on mtpkit's shipped trained pair, in about a minute on a CPU.

Quantizes the shipped BF16 target to FP8 and NVFP4 through the real `quantize` path (calibrated, with FP8
KV-cache scales), pairs each with the shipped assistant through the real `pair` path (its checks included),
then runs speculative decoding on held-out prompts for the BF16, FP8 and NVFP4 targets, and prints the text
and a table: acceptance by draft position, mean acceptance length, tokens/s with and without speculation, and
how acceptance moves from the BF16 target to the quantized ones.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Annotated

import typer

from mtpkit.cli.app import app
from mtpkit.cli.console import err, out, phase_progress
from mtpkit.errors import ConfigError

SCHEMES = ("fp8", "nvfp4")


def _heldout(path: Path, count: int) -> list:
    prompts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            prompts.append(record.get("input_ids", record.get("prompt")))
    if not prompts:
        raise ConfigError("holds no prompts", where=path, fix='write {"prompt": "..."} per line')
    return prompts[:count]


def _measure(pair, prompts: list, k: int, max_new_tokens: int) -> dict:
    from mtpkit.loader.bench import bench_pair

    result = bench_pair(pair, prompts, [k], max_new_tokens)
    spec = result.by_k[0]
    return {"acceptance": spec.acceptance_per_position, "mean_length": spec.mean_acceptance_length,
            "target_only_tps": result.target_only.tokens_per_second, "speculative_tps": spec.tokens_per_second,
            "speedup": spec.speedup, "exact": spec.matches_target_only, "sample": result.outputs[0]}


@app.command("demo")
def demo_command(
    out_dir: Annotated[Path | None, typer.Option("--out", help="Keep the converted pairs in this folder.")] = None,
    num_prompts: Annotated[int, typer.Option("--prompts", help="Held-out prompts to run.")] = 4,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 48,
    k: Annotated[int, typer.Option("--k", help="Speculative tokens per round.")] = 4,
    target: Annotated[Path | None, typer.Option("--target", help="Another BF16 target (default: the shipped "
                                                "one).")] = None,
    draft: Annotated[Path | None, typer.Option("--draft", help="Its assistant.")] = None,
    prompts_file: Annotated[Path | None, typer.Option("--prompt-file", help="JSONL prompts (default: the shipped "
                                                      "held-out set).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON on stdout.")] = False,
) -> None:
    """Quantize, pair and run mtpkit's shipped trained pair: acceptance and speed, BF16 vs FP8 vs NVFP4."""
    from mtpkit import demo
    from mtpkit.calibrate.pipeline import quantize_calibrated
    from mtpkit.convert.checkpoint import open_checkpoint
    from mtpkit.convert.pair import pair as make_pair
    from mtpkit.loader import load_pair

    target, draft = target or demo.TARGET, draft or demo.ASSISTANT
    prompts = _heldout(prompts_file or demo.HELDOUT, num_prompts)
    if out_dir is not None and out_dir.exists():
        raise ConfigError("already exists", where=out_dir, fix="choose a new folder for --out")
    work = Path(tempfile.mkdtemp(prefix="mtpkit-demo-"))
    rows: dict[str, dict] = {}
    try:
        target_ck, draft_ck = open_checkpoint(target), open_checkpoint(draft)
        pairs = {}
        for scheme in SCHEMES:
            err.print(f"quantizing the target to {scheme} (calibrated, FP8 KV cache) and pairing it", highlight=False)
            with phase_progress() as progress:
                quantized = quantize_calibrated(target_ck, work / f"target-{scheme}", scheme=scheme, kv_cache=True,
                                                progress=progress)
            pairs[scheme] = make_pair(open_checkpoint(quantized.folder), draft_ck, work / f"pair-{scheme}").folder
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # check findings are part of `pair`'s output above
            runs = [("bf16", dict(target=target, draft=draft, kv_cache_dtype="bf16"))]
            runs += [(scheme, dict(pair_dir_or_repo=pairs[scheme])) for scheme in SCHEMES]
            for name, kwargs in runs:
                err.print(f"running the {name} target (k = 0 and k = {k}, {len(prompts)} prompts)", highlight=False)
                loaded = load_pair(device="cpu", dtype="float32", **kwargs)
                rows[name] = _measure(loaded, prompts, k, max_new_tokens)
                rows[name]["kv_cache"] = str(loaded.kv_cache_dtype).removeprefix("torch.")
                rows[name]["text"] = loaded.tokenizer.decode(rows[name]["sample"]) if loaded.tokenizer else ""
        if out_dir is not None:
            shutil.copytree(work, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = rows["bf16"]["mean_length"]
    for row in rows.values():
        row["acceptance_change_vs_bf16"] = row["mean_length"] - base
    if as_json:
        print(json.dumps({"k": k, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "results": rows,
                          "pairs": str(out_dir) if out_dir else None}, indent=2))
        return
    first = prompts[0] if isinstance(prompts[0], str) else "(token ids)"
    out.print(f"prompt: {first!r}\nBF16 target + assistant (k={k}):\n{rows['bf16']['text']}\n", highlight=False,
              markup=False)
    header = (f"{'target':<7} {'KV cache':<14} {'acceptance by position':<26} {'mean len':>8} {'tok/s k=0':>9} "
              f"{f'tok/s k={k}':>9} {'speedup':>7} {'vs BF16':>8}")
    out.print(header, highlight=False)
    for name, row in rows.items():
        acceptance = " ".join(f"{100 * a:3.0f}%" for a in row["acceptance"])
        out.print(f"{name:<7} {row['kv_cache']:<14} {acceptance:<26} {row['mean_length']:>8.2f} "
                  f"{row['target_only_tps']:>9.1f} {row['speculative_tps']:>9.1f} {row['speedup']:>6.2f}x "
                  f"{row['acceptance_change_vs_bf16']:>+8.2f}", highlight=False)
    if out_dir is not None:
        out.print(f"converted pairs kept in {out_dir} (serve one with the line in its pair.json)", highlight=False)
