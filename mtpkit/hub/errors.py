"""Errors of `push`: the typed errors of mtpkit.errors, with the exit codes the CLI gives them.

A refusal (a pair that fails `check`, a file that should not be published, a repo id that is not one) and a
missing or rejected token are input problems: exit code 2, like every other bad input. A Hub that stays
unreachable, or fails, after the retries is not the input's fault: exit code 1, and running the same command
again resumes the push.
"""

from __future__ import annotations

from mtpkit.errors import MtpkitError


class PushRefusedError(MtpkitError):
    """The pair, or a file in it, must not be published as it is (nothing was sent)."""


class HubAuthError(MtpkitError):
    """No token, or the Hub rejected it for this repo."""


class HubError(MtpkitError):
    """The Hub could not be reached, or failed, after the retries; a re-run resumes."""

    exit_code = 1
