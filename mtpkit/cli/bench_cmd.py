"""`mtp-convert bench PAIR`: acceptance and speedup for each k, the recommended k, and a plot of both."""

from __future__ import annotations

import json
import re
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from mtpkit.cli.app import app
from mtpkit.cli.console import out
from mtpkit.cli.run_cmd import KVCacheDtype, _prompts, load_for_cli
from mtpkit.errors import ConfigError


class Baseline(str, Enum):
    transformers = "transformers"


def parse_ks(text: str) -> list[int]:
    """'1..8', '1-4', '1,2,4' or '4' -> sorted k values in 1..16."""
    if match := re.fullmatch(r"\s*(\d+)\s*(?:\.\.|-)\s*(\d+)\s*", text):
        ks = list(range(int(match[1]), int(match[2]) + 1))
    elif re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", text):
        ks = sorted({int(k) for k in text.split(",")})
    else:
        ks = []
    if not ks or not all(1 <= k <= 16 for k in ks):
        raise ConfigError(f"--k {text!r} is not a range or list of 1..16", where="--k", fix="e.g. --k 1..8 or --k 1,2,4")
    return ks


def plot(result, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in result.by_k:
        left.plot(range(1, r.k + 1), [100 * a for a in r.acceptance_per_position], marker="o", label=f"k = {r.k}")
    left.set(title="Acceptance by draft position", xlabel="draft position", ylabel="accepted (% of rounds)",
             ylim=(0, 100), xticks=range(1, max(r.k for r in result.by_k) + 1))
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    ks = [r.k for r in result.by_k]
    right.bar(ks, [r.speedup for r in result.by_k], color=["tab:green" if k == result.recommended_k else "tab:blue"
                                                           for k in ks])
    right.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    for r in result.by_k:
        right.annotate(f"{r.speedup:.2f}x\nlen {r.mean_acceptance_length:.2f}", (r.k, r.speedup), ha="center",
                       va="bottom", fontsize=8)
    right.set(title=f"Speedup over target-only (best k = {result.recommended_k})", xlabel="k (speculative tokens)",
              ylabel="tokens/s ratio", xticks=ks, ylim=(0, 1.3 * max(1.0, *(r.speedup for r in result.by_k))))
    right.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@app.command("bench")
def bench_command(
    pair: Annotated[str | None, typer.Argument(help="A pair folder (`mtp-convert pair` output) or Hub repo.")] = None,
    target: Annotated[str | None, typer.Option("--target", help="Target (instead of PAIR).")] = None,
    draft: Annotated[str | None, typer.Option("--draft", help="Assistant (instead of PAIR).")] = None,
    ks: Annotated[str, typer.Option("--k", help="k values: a range 1..8 or a list 1,2,4.")] = "1..8",
    prompts_file: Annotated[Path | None, typer.Option("--prompts", help="One prompt per line, or JSONL with "
                                                      "\"prompt\" or \"input_ids\".")] = None,
    prompt: Annotated[list[str], typer.Option("--prompt", help="A prompt (repeatable).")] = [],  # noqa: B006
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 64,
    kv_cache_dtype: Annotated[KVCacheDtype, typer.Option("--kv-cache-dtype")] = KVCacheDtype.auto,
    device: Annotated[str, typer.Option("--device")] = "auto",
    dtype: Annotated[str, typer.Option("--dtype")] = "bfloat16",
    plot_file: Annotated[Path | None, typer.Option("--plot", help="Write acceptance and speedup plots (PNG).")] = None,
    baseline: Annotated[Baseline | None, typer.Option("--baseline", help="Also run transformers' assisted "
                                                      "generation at the recommended k.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON on stdout.")] = False,
) -> None:
    """Sweep the number of speculative tokens: acceptance, speedup over target-only, the best k."""
    from mtpkit.loader.bench import bench_pair, transformers_baseline

    k_values = parse_ks(ks)
    prompts = _prompts(prompt, prompts_file, command="bench", file_option="--prompts")
    loaded = load_for_cli(pair, target=target, draft=draft, device=device, dtype=dtype,
                          kv_cache_dtype=kv_cache_dtype.value)

    def progress(r) -> None:
        if not as_json:
            typer.echo(f"k={r.k}: {r.tokens_per_second:.1f} tokens/s", err=True)

    result = bench_pair(loaded, prompts, k_values, max_new_tokens, on_k=progress)
    if baseline is Baseline.transformers:
        result.transformers = transformers_baseline(loaded, prompts, result.recommended_k, max_new_tokens,
                                                    result.outputs)
    if plot_file is not None:
        name = Path(pair).name if pair else f"{Path(target).name} + {Path(draft).name}"
        plot(result, plot_file, f"{name}: {result.prompts} prompts, {max_new_tokens} new tokens, "
                                f"KV cache {str(loaded.kv_cache_dtype).removeprefix('torch.')}")
    rows = [result.target_only, *result.by_k]
    if as_json:
        print(json.dumps({
            "prompts": result.prompts, "max_new_tokens": max_new_tokens, "recommended_k": result.recommended_k,
            "kv_cache_dtype": str(loaded.kv_cache_dtype).removeprefix("torch."),
            "results": [{"k": r.k, "tokens": r.tokens, "seconds": r.seconds, "tokens_per_second": r.tokens_per_second,
                         "speedup": r.speedup, "acceptance_per_position": r.acceptance_per_position,
                         "mean_acceptance_length": r.mean_acceptance_length,
                         "matches_target_only": r.matches_target_only} for r in rows],
            "transformers": result.transformers, "plot": str(plot_file) if plot_file else None}, indent=2))
        return
    out.print(f"{'k':>3}  {'tokens/s':>9}  {'speedup':>7}  {'mean len':>8}  acceptance by position", highlight=False)
    for r in rows:
        acceptance = " ".join(f"{100 * a:3.0f}%" for a in r.acceptance_per_position) or "(target only)"
        flag = "" if r.matches_target_only else "  TOKENS DIFFER FROM TARGET-ONLY"
        out.print(f"{r.k:>3}  {r.tokens_per_second:>9.1f}  {r.speedup:>6.2f}x  {r.mean_acceptance_length:>8.2f}  "
                  f"{acceptance}{flag}", highlight=False)
    out.print(f"recommended k: {result.recommended_k}", highlight=False)
    if result.transformers:
        t = result.transformers
        out.print(f"transformers assisted generation (k={t['k']}): {t['tokens_per_second']:.1f} tokens/s; ours "
                  f"{result.by_k[[r.k for r in result.by_k].index(t['k'])].tokens_per_second:.1f}; tokens "
                  f"{ {True: 'match', False: 'DIFFER', None: 'not compared (our KV cache is FP8)'}[t['tokens_match']]}",
                  highlight=False)
    if plot_file is not None:
        out.print(f"plot: {plot_file}", highlight=False)
