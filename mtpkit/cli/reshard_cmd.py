"""`mtp-convert reshard SRC OUT`: the same tensors in shards of a new size (atomic, verified, deterministic)."""

from __future__ import annotations

import json

from mtpkit.cli.app import app
from mtpkit.cli.console import byte_progress, out
from mtpkit.cli.options import Force, Json, MaxShardSize, Out, Revision, Src
from mtpkit.convert.reshard import reshard
from mtpkit.convert.source import open_source
from mtpkit.convert.writer import DEFAULT_MAX_SHARD_SIZE


@app.command("reshard")
def reshard_command(
    src: Src,
    dest: Out,
    max_shard_size: MaxShardSize = DEFAULT_MAX_SHARD_SIZE,
    revision: Revision = None,
    force: Force = False,
    as_json: Json = False,
) -> None:
    """Rewrite a checkpoint's safetensors shards with a new maximum shard size."""
    checkpoint = open_source(src, revision=revision)
    with byte_progress("re-sharding", checkpoint.total_bytes) as advance:
        result = reshard(checkpoint, dest, max_shard_size=max_shard_size, force=force,
                         on_tensor=lambda spec: advance(spec.nbytes))
    summary = {"output": str(result.folder), "shards": result.shards, "tensors": result.tensors,
               "total_bytes": result.total_bytes, "copied_files": result.copied_files}
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        out.print(f"wrote {result.folder}: {result.tensors} tensors in {result.shards} shard(s), "
                  f"{result.total_bytes:,} bytes; copied {len(result.copied_files)} other file(s)", highlight=False)
