"""The `mtp-convert` command: a typer app with one file per command, and the one place that prints.

Library errors become one line on stderr and exit code 2; `MTPKIT_DEBUG=1` shows the traceback.
Results go to stdout, diagnostics to stderr.
"""

from __future__ import annotations

import os
import sys
import traceback

import typer

from mtpkit.errors import MtpkitError

app = typer.Typer(
    name="mtp-convert",
    help="Make Gemma 4 target + assistant (MTP) pairs right before they reach a GPU, and run them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        from mtpkit import __version__

        print(f"mtp-convert {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Make Gemma 4 target + assistant (MTP) pairs right before they reach a GPU, and run them."""


def _register() -> None:
    # Importing a command module registers it on `app`.
    from mtpkit.cli import (bench_cmd, check_cmd, demo_cmd, draft_cmd, inspect_cmd, pair_cmd,  # noqa: F401
                            push_cmd, quantize_cmd, reshard_cmd, run_cmd)


def _debug() -> bool:
    return os.environ.get("MTPKIT_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def main(argv: list[str] | None = None) -> None:
    _register()
    try:
        app(args=argv, prog_name="mtp-convert")
    except MtpkitError as e:
        if _debug():
            traceback.print_exc()
        for finding in getattr(e, "findings", []):
            print(f"{finding.severity} [{finding.id}] {finding.message}", file=sys.stderr)
        print(f"mtp-convert: error: {e.one_line()}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("mtp-convert: interrupted; no partial output is left (outputs are written atomically; an interrupted "
              "push resumes when run again)", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # a bug in mtpkit, not bad input
        if _debug():
            traceback.print_exc()
        print(f"mtp-convert: internal error: {type(e).__name__}: {e} (set MTPKIT_DEBUG=1 for the traceback, "
              "and please report it)", file=sys.stderr)
        sys.exit(1)
