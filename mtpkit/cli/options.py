"""Options shared by several commands, so each reads the same everywhere."""

from __future__ import annotations

from typing import Annotated

import typer

Revision = Annotated[str | None, typer.Option("--revision", help="Branch, tag or commit of a Hub repo.")]
Force = Annotated[bool, typer.Option("--force", help="Replace OUT if it exists.")]
MaxShardSize = Annotated[str, typer.Option("--max-shard-size", help="Largest shard file, e.g. 5GB, 500MB, 2GiB.")]
Json = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
Src = Annotated[str, typer.Argument(help="Checkpoint folder, or a Hub repo id OWNER/NAME.")]
Out = Annotated[str, typer.Argument(metavar="OUT", help="Output folder (must not exist unless --force).")]
