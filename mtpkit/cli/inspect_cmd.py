"""`mtp-convert inspect SRC`: what a checkpoint is, from its configs and tensor headers."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from mtpkit.cli.app import app
from mtpkit.cli.console import out, warn
from mtpkit.cli.options import Json, Revision, Src
from mtpkit.convert.describe import Description, describe
from mtpkit.convert.source import open_source


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError


def _quantization(q: dict | None) -> str:
    if q is None:
        return "none"
    text = f"{q['method']} {q['scheme']}"
    if q.get("kv_cache"):
        text += f", {q['kv_cache']} KV cache"
    return text + f" (from {q['source']})"


def _table(d: Description) -> Table:
    table = Table(title=d.path, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("family / role", f"{d.family} {d.role} ({d.model_type}; {', '.join(d.architectures) or '-'})")
    table.add_row("quantization", _quantization(d.quantization))
    if d.config_only:
        table.add_row("weights", "none read (config-only)")
    else:
        table.add_row("parameters", f"{d.num_parameters:,}")
        table.add_row("tensors", f"{d.num_tensors:,} in {d.shards} shard(s), {_size(d.total_bytes)}")
        table.add_row("dtypes", ", ".join(f"{k} {v['tensors']} ({_size(v['bytes'])})" for k, v in d.dtypes.items()))
    table.add_row("config form", f"text_config {d.config_form['text_config']}, head dims as {d.config_form['head_dims']}")
    table.add_row("layers", ", ".join(f"{n} {t}" for t, n in d.layer_types.items()))
    arch = d.architecture
    table.add_row("hidden / vocab", f"{arch.get('hidden_size')} / {arch.get('vocab_size')}")
    if d.kv_producers is not None:
        table.add_row("KV producers", ", ".join(f"{t} {i}" for t, i in d.kv_producers.items()))
    if d.assistant is not None:
        table.add_row("assistant", ", ".join(f"{k}={v}" for k, v in d.assistant.items()))
    return table


@app.command("inspect")
def inspect_command(
    src: Src,
    revision: Revision = None,
    weights: Annotated[bool, typer.Option("--weights", help="For a Hub repo: also fetch the weights and read "
                                          "their headers (default: configs only).")] = False,
    as_json: Json = False,
) -> None:
    """Describe a checkpoint: role, quantization, parameters, dtypes and the KV-producer map."""
    checkpoint = open_source(src, revision=revision, weights=weights)
    description = describe(checkpoint, path=src)
    if as_json:
        print(json.dumps(description.to_json(), indent=2))
    else:
        out.print(_table(description))
    for message in description.warnings:
        warn(message)
