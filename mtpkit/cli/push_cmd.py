"""`mtp-convert push PAIR --repo-id OWNER/NAME`: the target and its assistant as two Hub repos, with model cards."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mtpkit.cli.app import _debug, app
from mtpkit.cli.console import err, out, warn
from mtpkit.hub import plan_push, push, token_source
from mtpkit.hub.plan import human_size


@app.command("push")
def push_command(
    pair: Annotated[Path, typer.Argument(metavar="PAIR", help="A folder written by `mtp-convert pair`.")],
    repo_id: Annotated[str, typer.Option("--repo-id", help="Hub repo of the target, OWNER/NAME.")],
    draft_repo_id: Annotated[str | None, typer.Option("--draft-repo-id", help="Hub repo of the assistant "
                                                      "(default OWNER/NAME-assistant).")] = None,
    private: Annotated[bool, typer.Option("--private", help="Create the repos private (refused if one exists and "
                                          "is public).")] = False,
    revision: Annotated[str | None, typer.Option("--revision", help="Branch to push to, created when missing "
                                                 "(default main).")] = None,
    commit_message: Annotated[str | None, typer.Option("--commit-message", help="Message of the two commits.")] = None,
    bench: Annotated[Path | None, typer.Option("--bench", help="Acceptance numbers for the cards: the output of "
                                               "`mtp-convert bench PAIR --json` (default: PAIR/bench.json if "
                                               "present).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the repos, files, sizes and cards; send "
                                          "nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Push a pair that fails `check`, and leave out files that "
                                        "should not be published instead of refusing (they are never sent).")] = False,
) -> None:
    """Publish PAIR/target and PAIR/draft as two Hub repos (NAME and NAME-assistant) with model cards."""
    plan = plan_push(pair, repo_id, draft_repo_id=draft_repo_id, revision=revision, private=private,
                     commit_message=commit_message, bench=bench, force=force)
    if dry_run:
        out.print("dry run: nothing is sent", markup=False, highlight=False)
        out.print(plan.describe(token_source=token_source()), end="", markup=False, highlight=False)
        return
    for item in plan.left_out:
        warn(f"left out (--force): {item.path}: {item.reason}")
    for finding in plan.check_errors:
        warn(f"pushing despite a failed check (--force): [{finding.id}] {finding.message}")

    def on_file(repo: str, path: str, size: int) -> None:
        if err.is_terminal:
            err.print(f"uploading {repo}: {path} ({human_size(size)})", markup=False, highlight=False)

    # huggingface_hub's own progress bars and warnings: on a terminal, or with MTPKIT_DEBUG.
    results = push(plan, on_file=on_file, on_retry=warn, library_output=err.is_terminal or _debug())
    for r in results:
        if r.commit_url is None:
            line = f"{r.repo_id}: already up to date ({len(r.unchanged)} files unchanged)"
        else:
            line = (f"{r.repo_id}: uploaded {len(r.uploaded)} file(s) ({human_size(r.uploaded_bytes)}), "
                    f"{len(r.unchanged)} unchanged; {r.commit_url}")
        out.print(line, markup=False, highlight=False)
        if r.extra_remote:
            warn(f"{r.repo_id} also holds files this pair does not have: {', '.join(r.extra_remote[:5])}"
                 f"{', ...' if len(r.extra_remote) > 5 else ''}; delete them on the Hub if they are stale")
    for note in plan.notes:
        warn(note)
    out.print(f"serve it with:\n  {plan.serve}", markup=False, highlight=False)
