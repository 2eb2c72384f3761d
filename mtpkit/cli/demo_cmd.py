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
    out_dir: Annotated[Path | None, typer.Option("--out", help="Keep the three pairs (bf16/, fp8/, nvfp4/) in this "
                                                 "new folder, each with its pair.json and vLLM launch line.")] = None,
    num_prompts: Annotated[int, typer.Option("--prompts", min=1, help="Held-out prompts to run.")] = 4,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1)] = 48,
    k: Annotated[int, typer.Option("--k", min=1, max=16, help="Speculative tokens per round.")] = 4,
    target: Annotated[Path | None, typer.Option("--target", help="Another BF16 target (default: the shipped "
                                                "one).")] = None,
    draft: Annotated[Path | None, typer.Option("--draft", help="Its assistant.")] = None,
    prompts_file: Annotated[Path | None, typer.Option("--prompt-file", help="JSONL prompts (default: the shipped "
                                                      "held-out set).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON on stdout.")] = False,
) -> None:
    """Quantize, pair and run mtpkit's shipped trained pair: acceptance and speed, BF16 vs FP8 vs NVFP4."""
    from mtpkit import demo

    target, draft = target or demo.TARGET, draft or demo.ASSISTANT
    prompts = _heldout(prompts_file or demo.HELDOUT, num_prompts)
    if out_dir is not None and out_dir.exists():
        raise ConfigError("already exists", where=out_dir, fix="choose a new folder for --out")
    # The pairs are written where they stay (their pair.json launch lines name their real paths); a failed
    # run removes the whole folder, so nothing partial is left.
    root = out_dir if out_dir is not None else Path(tempfile.mkdtemp(prefix="mtpkit-demo-"))
    try:
        pairs = _build_pairs(target, draft, root)
        rows = _run_pairs(pairs, prompts, k, max_new_tokens)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    if out_dir is None:
        shutil.rmtree(root, ignore_errors=True)
    base = rows["bf16"]["mean_length"]
    for row in rows.values():
        row["acceptance_change_vs_bf16"] = row["mean_length"] - base
    launch = {name: json.loads((folder / "pair.json").read_text())["launch"]["vllm_serve"]
              for name, folder in pairs.items()} if out_dir is not None else None
    if as_json:
        print(json.dumps({"k": k, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "results": rows,
                          "pairs": str(out_dir) if out_dir else None, "vllm_serve": launch}, indent=2))
        return
    _print_report(rows, prompts, k, launch)


def _build_pairs(target: Path, draft: Path, root: Path) -> dict[str, Path]:
    """root/bf16 (the pair as shipped), root/fp8 and root/nvfp4 (the target quantized on the way in, calibrated,
    with FP8 KV-cache scales), each through `mtp-convert pair`'s own path and checks."""
    from mtpkit.calibrate.pipeline import pair_summary, quantize_calibrated
    from mtpkit.convert.checkpoint import open_checkpoint
    from mtpkit.convert.pair import pair

    target_ck, draft_ck = open_checkpoint(target), open_checkpoint(draft)
    root.mkdir(parents=True, exist_ok=True)
    pair(target_ck, draft_ck, root / "bf16")
    for scheme in SCHEMES:
        err.print(f"pairing the assistant with the target quantized to {scheme} (calibrated, FP8 KV-cache scales)",
                  highlight=False)

        def quantized(folder: Path, scheme: str = scheme) -> dict:
            with phase_progress() as progress:
                result = quantize_calibrated(target_ck, folder, scheme=scheme, kv_cache=True, progress=progress)
            return pair_summary(result.report)

        pair(target_ck, draft_ck, root / scheme, write_target=quantized)
    return {"bf16": root / "bf16", **{scheme: root / scheme for scheme in SCHEMES}}


def _run_pairs(pairs: dict[str, Path], prompts: list, k: int, max_new_tokens: int) -> dict[str, dict]:
    from mtpkit.loader import load_pair

    rows = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # `pair` has checked each pair above
        for name, folder in pairs.items():
            err.print(f"running the {name} pair (k = 0 and k = {k}, {len(prompts)} prompts)", highlight=False)
            # The BF16 reference keeps a BF16 cache; the quantized targets use FP8 with their written scales.
            loaded = load_pair(folder, device="cpu", dtype="float32",
                               kv_cache_dtype="bf16" if name == "bf16" else "fp8")
            rows[name] = _measure(loaded, prompts, k, max_new_tokens)
            rows[name]["kv_cache"] = str(loaded.kv_cache_dtype).removeprefix("torch.")
            rows[name]["text"] = loaded.tokenizer.decode(rows[name]["sample"]) if loaded.tokenizer else ""
    return rows


def _print_report(rows: dict[str, dict], prompts: list, k: int, launch: dict | None) -> None:
    first = prompts[0] if isinstance(prompts[0], str) else "(token ids)"
    out.print(f"prompt (held out from training):\n{first}\n--- greedy continuation, BF16 pair, k = {k} (a 6M-parameter "
              f"model trained for an hour on a CPU: Python-shaped, often repetitive) ---\n{rows['bf16']['text']}\n",
              highlight=False, markup=False)
    header = (f"{'target':<7} {'KV cache':<14} {'acceptance by position':<26} {'mean len':>8} {'tok/s k=0':>9} "
              f"{f'tok/s k={k}':>9} {'speedup':>7} {'vs BF16':>8}")
    out.print(header, highlight=False)
    for name, row in rows.items():
        acceptance = " ".join(f"{100 * a:3.0f}%" for a in row["acceptance"])
        out.print(f"{name:<7} {row['kv_cache']:<14} {acceptance:<26} {row['mean_length']:>8.2f} "
                  f"{row['target_only_tps']:>9.1f} {row['speculative_tps']:>9.1f} {row['speedup']:>6.2f}x "
                  f"{row['acceptance_change_vs_bf16']:>+8.2f}", highlight=False)
    if not all(row["exact"] for row in rows.values()):
        out.print("warning: a speculative output differs from its target-only output", highlight=False)
    if launch is not None:
        out.print("serve the NVFP4 pair with vLLM (its pair.json has the Python form):\n  " + launch["nvfp4"],
                  markup=False, highlight=False)
