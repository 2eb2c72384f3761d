"""`mtp-convert check PAIR` (or `--target T --draft D`): does this assistant fit this target?"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from mtpkit.cli.app import app
from mtpkit.cli.console import out
from mtpkit.cli.options import Json
from mtpkit.convert.check import check_pair
from mtpkit.convert.source import open_source
from mtpkit.errors import SourceNotFoundError


def pair_folders(pair: str | None, target: str | None, draft: str | None) -> tuple[str, str]:
    """PAIR/target and PAIR/draft (what `mtp-convert pair` writes), or the two given explicitly."""
    if pair is not None and (target or draft):
        raise SourceNotFoundError("give either PAIR or --target and --draft, not both", where=pair,
                                  fix="drop PAIR, or drop --target/--draft")
    if pair is not None:
        for sub in ("target", "draft"):
            if not (Path(pair) / sub).is_dir():
                raise SourceNotFoundError(f"has no {sub}/ folder", where=pair,
                                          fix="pass a folder written by `mtp-convert pair`, or use --target and --draft")
        return str(Path(pair) / "target"), str(Path(pair) / "draft")
    if not (target and draft):
        raise SourceNotFoundError("needs PAIR, or both --target and --draft", where="check",
                                  fix="e.g. mtp-convert check --target TARGET_DIR --draft ASSISTANT_DIR")
    return target, draft


@app.command("check")
def check_command(
    pair: Annotated[str | None, typer.Argument(help="A folder written by `mtp-convert pair`.")] = None,
    target: Annotated[str | None, typer.Option("--target", help="Target checkpoint (folder or Hub id).")] = None,
    draft: Annotated[str | None, typer.Option("--draft", help="Assistant checkpoint (folder or Hub id).")] = None,
    as_json: Json = False,
) -> None:
    """Validate a target + assistant pair; exit 1 when an error is found (2: unusable input)."""
    target_src, draft_src = pair_folders(pair, target, draft)
    findings = check_pair(open_source(target_src, weights=False), open_source(draft_src, weights=False))
    errors = [f for f in findings if f.severity == "error"]
    if as_json:
        print(json.dumps({"target": target_src, "draft": draft_src, "ok": not errors,
                          "findings": [f.to_json() for f in findings]}, indent=2))
    else:
        for finding in findings:
            out.print(f"{finding.severity} [{finding.id}] {finding.message}", markup=False, highlight=False)
        verdict = "FAIL" if errors else "OK"
        out.print(f"{verdict}: {len(errors)} error(s), {len(findings) - len(errors)} warning(s) for "
                  f"{target_src} + {draft_src}", markup=False, highlight=False)
    if errors:
        raise typer.Exit(1)
