"""`mtp-convert pair --target T --draft D OUT`: a validated pair folder with its launch lines."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from mtpkit.cli.app import app
from mtpkit.cli.console import byte_progress, out, warn
from mtpkit.cli.draft_cmd import Dialect, format_rule
from mtpkit.cli.options import Force, Json, Out
from mtpkit.convert.draft_rules import RuleApplication
from mtpkit.convert.pair import pair
from mtpkit.convert.source import open_source


@app.command("pair")
def pair_command(
    dest: Out,
    target: Annotated[str, typer.Option("--target", help="Target checkpoint (folder or Hub id).")],
    draft: Annotated[str, typer.Option("--draft", help="Assistant checkpoint (folder or Hub id).")],
    target_revision: Annotated[str | None, typer.Option("--target-revision", help="Hub revision of the target.")] = None,
    draft_revision: Annotated[str | None, typer.Option("--draft-revision", help="Hub revision of the draft.")] = None,
    dialect: Annotated[Dialect, typer.Option("--dialect", help="Head-dim dialect of the draft config.")] = Dialect.flat,
    force: Force = False,
    as_json: Json = False,
) -> None:
    """Write OUT/target, OUT/draft (canonical) and OUT/pair.json, after validating the pair."""
    target_ck = open_source(target, revision=target_revision)
    draft_ck = open_source(draft, revision=draft_revision)
    with byte_progress("pairing", target_ck.total_bytes + draft_ck.total_bytes) as advance:
        result = pair(target_ck, draft_ck, dest, dialect=dialect.value, force=force, on_bytes=advance)
    if as_json:
        print(json.dumps({"output": str(result.folder), **result.manifest}, indent=2))
        return
    for rule in result.manifest["draft_rules"]:
        out.print("draft " + format_rule(RuleApplication(**rule)), markup=False, highlight=False)
    for finding in result.findings:
        warn(f"[{finding.id}] {finding.message}")
    tokens = result.manifest["num_speculative_tokens"]
    out.print(f"wrote {result.folder}: target/, draft/, pair.json; num_speculative_tokens {tokens['value']} "
              f"({tokens['why']})", highlight=False)
    out.print("serve it with:\n  " + result.manifest["launch"]["vllm_serve"], markup=False, highlight=False)
