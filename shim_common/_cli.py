"""What the two console scripts share: the error type, validators, and how a command is run.

Both commands follow one rule: an invalid flag or variable stops the process with exit code 2 and
one line on stderr naming it and the value given. :func:`invoke` turns every cyclopts error into a
:class:`CliError` carrying that line, and :func:`exit_invalid` prints it and exits.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import NoReturn

import cyclopts
from cyclopts import App, Token, validators

__all__ = [
    "CliError",
    "exit_invalid",
    "finite",
    "invoke",
    "positive",
    "strict_int",
    "valid_port",
]


class CliError(Exception):
    """An invalid flag or variable; the message is the one line printed before exit 2."""


def finite(type_: type, value: float | None) -> None:
    """A cyclopts validator refusing NaN and infinities (which pass range checks unnoticed)."""
    if value is not None and not math.isfinite(value):
        raise ValueError("Must be a finite number.")


def strict_int(type_: object, tokens: Sequence[Token]) -> int:
    """A cyclopts converter for whole numbers that refuses "1.5" instead of rounding it."""
    raw = tokens[0].value
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f'"{raw}" is not a whole number') from None


def valid_port() -> validators.Number:
    """A cyclopts validator for a TCP port, ``0`` (pick a free one) included."""
    return validators.Number(gte=0, lte=65535)


def positive() -> validators.Number:
    """A cyclopts validator for a count of at least one."""
    return validators.Number(gte=1)


def invoke(command_app: App, argv: Sequence[str]) -> object:
    """Run a cyclopts app's command on ``argv`` and return what the command returned.

    Raises:
        CliError: an invalid flag or variable (cyclopts' message, on one line).
        SystemExit: with code 0, after ``--help`` or ``--version`` printed.
    """
    try:
        result = command_app(
            list(argv), exit_on_error=False, print_error=False, result_action="return_value"
        )
    except cyclopts.CycloptsError as exc:
        raise CliError(str(exc).strip().replace("\n", " ")) from None
    if result is None:  # --help or --version ran and printed
        raise SystemExit(0)
    return result


def exit_invalid(program: str, message: str) -> NoReturn:
    """Print ``PROGRAM: error: MESSAGE`` on stderr and exit with code 2."""
    print(f"{program}: error: {message}", file=sys.stderr)
    raise SystemExit(2)
