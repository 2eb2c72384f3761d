"""`mtp-convert run PAIR`: generate with a pair in the bundled runtime; text streams to stdout, stats to stderr."""

from __future__ import annotations

import json
import warnings
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from mtpkit.cli.app import app
from mtpkit.cli.console import warn
from mtpkit.cli.options import Json, Revision
from mtpkit.errors import ConfigError, PairCheckError


class KVCacheDtype(str, Enum):
    auto = "auto"
    bf16 = "bf16"
    fp8 = "fp8"


def _prompts(prompt: list[str], prompt_file: Path | None, command: str = "run",
             file_option: str = "--prompt-file") -> list:
    """--prompt values, then the file's prompts (one per line, or JSONL); errors name `command`'s own options."""
    prompts: list = list(prompt)
    if prompt_file is not None:
        if not prompt_file.is_file():
            raise ConfigError("does not exist", where=prompt_file, fix=f"give {file_option} a text or JSONL file")
        lines = prompt_file.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if prompt_file.suffix != ".jsonl":
                prompts.append(line)
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"line {number} is not JSON ({e.msg})", where=prompt_file,
                                  fix='write {"prompt": "..."} or {"input_ids": [...]} per line') from None
            if not isinstance(record, dict) or not ({"prompt", "input_ids"} & record.keys()):
                raise ConfigError(f"line {number} has neither \"prompt\" nor \"input_ids\"", where=prompt_file,
                                  fix='write {"prompt": "..."} or {"input_ids": [...]} per line')
            prompts.append(record.get("input_ids", record.get("prompt")))
    if not prompts:
        raise ConfigError("no prompt given", where=command,
                          fix=f"pass --prompt TEXT (repeatable) or {file_option} FILE")
    return prompts


def load_for_cli(pair, **kwargs):
    """load_pair with its check warnings printed once on stderr, and a failing check as one line (exit 1)."""
    from mtpkit.loader import load_pair  # torch and transformers: only for the commands that run a pair

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loaded = load_pair(pair, **kwargs)
        except PairCheckError as e:  # the first failing check; `mtp-convert check` lists them all
            raise PairCheckError(e.what, findings=[], where=e.where, fix=e.fix) from None
    for warning in caught:
        warn(str(warning.message))
    return loaded


def _stats_line(index: int, generation) -> str:
    stats = generation.stats
    per_position = ", ".join(f"{rate:.0%}" for rate in stats.acceptance_rate_per_position) or "-"
    return (f"[prompt {index}] {len(generation.token_ids)} tokens, {stats.tokens_per_second:.1f} tokens/s, mean "
            f"acceptance length {generation.mean_acceptance_length:.2f}, acceptance per draft position "
            f"[{per_position}], KV cache {stats.kv_cache_bytes / 2**20:.1f} MiB")


@app.command("run")
def run_command(
    pair: Annotated[str | None, typer.Argument(help="A pair folder (`mtp-convert pair` output) or Hub repo.")] = None,
    target: Annotated[str | None, typer.Option("--target", help="Target (instead of PAIR).")] = None,
    draft: Annotated[str | None, typer.Option("--draft", help="Assistant (instead of PAIR).")] = None,
    prompt: Annotated[list[str], typer.Option("--prompt", help="A prompt (repeatable).")] = [],  # noqa: B006
    prompt_file: Annotated[Path | None, typer.Option("--prompt-file", help="One prompt per line, or JSONL with "
                                                     "\"prompt\" or \"input_ids\".")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each prompt in the target's chat template.")] = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 256,
    num_speculative_tokens: Annotated[int | None, typer.Option("--num-speculative-tokens", help="Drafts per round "
                                                               "(default: the published setting; 0: target "
                                                               "only).")] = None,
    temperature: Annotated[float, typer.Option("--temperature", help="0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k")] = 0,
    seed: Annotated[int | None, typer.Option("--seed")] = None,
    kv_cache_dtype: Annotated[KVCacheDtype, typer.Option("--kv-cache-dtype", help="auto: fp8 when the target has "
                                                         "k/v scales.")] = KVCacheDtype.auto,
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda, cuda:1 ...")] = "auto",
    dtype: Annotated[str, typer.Option("--dtype", help="Compute dtype: bfloat16, float16, float32.")] = "bfloat16",
    max_memory: Annotated[str | None, typer.Option("--max-memory", help="Refuse to load more than this, e.g. "
                                                   "20GB.")] = None,
    revision: Revision = None,
    as_json: Json = False,
) -> None:
    """Generate with a target + assistant pair (speculative decoding) in mtpkit's PyTorch runtime."""
    prompts = _prompts(prompt, prompt_file)
    loaded = load_for_cli(pair, target=target, draft=draft, revision=revision, device=device, dtype=dtype,
                          kv_cache_dtype=kv_cache_dtype.value, max_memory=max_memory)
    options = dict(max_new_tokens=max_new_tokens, num_speculative_tokens=num_speculative_tokens,
                   temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, chat=chat)
    if as_json:
        generations = loaded.generate(prompts, **options)
        stats = generations[0].stats
        print(json.dumps({"describe": loaded.describe(), "results": [
            {"text": g.text, "token_ids": g.token_ids, "prompt_token_ids": g.prompt_token_ids,
             "accepted_lengths": g.accepted_lengths, "mean_acceptance_length": g.mean_acceptance_length}
            for g in generations],
            "stats": {"tokens_generated": stats.tokens_generated, "tokens_per_second": stats.tokens_per_second,
                      "acceptance_rate_per_position": stats.acceptance_rate_per_position,
                      "mean_acceptance_length": stats.mean_acceptance_length, "rounds": stats.rounds,
                      "prefill_time": stats.prefill_time, "draft_time": stats.draft_time,
                      "verify_time": stats.verify_time, "total_time": stats.total_time,
                      "kv_cache_bytes": stats.kv_cache_bytes}}, indent=2))
        return
    for index, one in enumerate(prompts, 1):  # one at a time, so each streams as it is accepted
        [generation] = loaded.generate([one], on_text=lambda _row, piece: print(piece, end="", flush=True), **options)
        if loaded.tokenizer is None:  # no text to stream: the token ids are the output
            print(" ".join(map(str, generation.token_ids)), end="")
        print(flush=True)
        typer.echo(_stats_line(index, generation), err=True)
