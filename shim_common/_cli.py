"""What the two console scripts share: the error type, validators, the log level, and how a
command is run.

Both commands follow one rule: an invalid flag or variable stops the process with exit code 2 and
one line on stderr naming it and the value given. :func:`invoke` turns every cyclopts error into a
:class:`CliError` carrying that line, and :func:`exit_invalid` prints it and exits.
"""

from __future__ import annotations

import logging
import math
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NoReturn

import cyclopts
from cyclopts import App, Parameter, Token, validators

from shim_common._numbers import COUNT, Kind

__all__ = [
    "DEFAULT_LOG_FILTER",
    "LOG_LEVELS",
    "LOG_LEVEL_PARAMETER",
    "LOG_OFF",
    "CliError",
    "LogFilter",
    "apply_log_filter",
    "log_filter_converter",
    "parse_log_filter",
    "exit_invalid",
    "finite",
    "invoke",
    "of_kind",
    "positive",
    "strict_int",
    "valid_port",
]


class CliError(Exception):
    """An invalid flag or variable; the message is the one line printed before exit 2."""


def of_kind(kind: Kind[Any], **bounds: float) -> tuple[Callable[..., None], ...]:
    """The validators of a flag whose value is of ``kind`` (see :mod:`shim_common._numbers`),
    narrowed by ``bounds`` (cyclopts' ``Number`` keywords: ``gt``, ``gte``, ``lt``, ``lte``).

    The kind is checked first, so NaN, an infinity or a value past the kind's top is refused with
    the kind's own message, whatever the flag's narrower bounds.
    """
    if not bounds:
        return (kind.validator,)
    return (kind.validator, validators.Number(**bounds))


def finite(type_: type, value: float | None) -> None:
    """A cyclopts validator refusing NaN and infinities (which pass range checks unnoticed).

    A float flag should rather be given its kind with :func:`of_kind`, which also bounds it.
    """
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


def positive() -> tuple[Callable[..., None], ...]:
    """The validators of a count of at least one (a :data:`~shim_common._numbers.COUNT`)."""
    return of_kind(COUNT, gte=1)


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


#: A level above every Python level: ``off`` logs nothing.
LOG_OFF = logging.CRITICAL + 10

#: The level names of ``--log-level`` / ``DYN_LOG``, matched in any case: those of Rust's
#: tracing (what Dynamo reads ``DYN_LOG`` with) plus Python's ``warning`` and ``critical``.
#: Python has no level below DEBUG, so ``trace`` logs as ``debug``.
LOG_LEVELS = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "off": LOG_OFF,
}


class LogFilter(NamedTuple):
    """The log level to use, and the parts of a Rust-style filter that could not be honoured.

    Attributes:
        level: A :mod:`logging` level (``LOG_OFF`` for ``off``).
        ignored: Per-target directives (``module=debug``) and extra bare levels, as given. The
            process has one log level, so these are reported once at start-up, then ignored.
    """

    level: int
    ignored: tuple[str, ...] = ()


#: ``info``, the default level, as Dynamo has it.
DEFAULT_LOG_FILTER = LogFilter(logging.INFO)

#: Commas that separate directives: not those inside a span filter ``target[span{a=1,b=2}]``.
_DIRECTIVE_SEPARATOR = re.compile(r",(?![^\[]*\])")


def parse_log_filter(raw: str) -> LogFilter:
    """Read a log level the way Dynamo users write ``DYN_LOG``.

    Accepted: one level name (see ``LOG_LEVELS``), or a Rust ``env-filter`` list such as
    ``info,my_module=debug``. The first bare level of the list is the level (``info`` when there
    is none, as in ``my_module=debug`` alone, or when the value is empty); every other directive
    is returned in ``ignored``.

    Raises:
        ValueError: a directive that is neither a level name nor ``target=level`` with a level
            name, e.g. ``loud`` or ``my_module=loud``; the message quotes the value.
    """
    level: int | None = None
    ignored: list[str] = []
    for directive in (part.strip() for part in _DIRECTIVE_SEPARATOR.split(raw)):
        if not directive:
            continue
        bare = LOG_LEVELS.get(directive.lower())
        if bare is not None and level is None:
            level = bare
            continue
        target, _, name = directive.rpartition("=")
        if bare is None and (not target.strip() or name.strip().lower() not in LOG_LEVELS):
            raise ValueError(
                f'"{raw}" is not a log level or a filter such as "info,my_module=debug" '
                f'(at "{directive}"; levels, any case: {", ".join(LOG_LEVELS)})'
            )
        ignored.append(directive)
    return LogFilter(DEFAULT_LOG_FILTER.level if level is None else level, tuple(ignored))


def log_filter_converter(type_: object, tokens: Sequence[Token]) -> LogFilter:
    """A cyclopts converter for ``--log-level`` / ``DYN_LOG`` (see :func:`parse_log_filter`)."""
    return parse_log_filter(tokens[0].value)


def apply_log_filter(log_filter: LogFilter, log: logging.Logger) -> None:
    """Set the root logger's level, and warn once on ``log`` about the directives ignored."""
    logging.getLogger().setLevel(log_filter.level)
    if log_filter.ignored:
        log.warning(
            "--log-level/DYN_LOG: one level applies to the whole process; using %s, ignoring %s",
            logging.getLevelName(log_filter.level).lower(),
            ", ".join(log_filter.ignored),
        )


#: The annotation of ``--log-level`` in both commands.
LOG_LEVEL_PARAMETER = Parameter(
    env_var="DYN_LOG",
    converter=log_filter_converter,
    n_tokens=1,
    accepts_keys=False,
    show_default=lambda _: "info",
    metavar="LEVEL",
)
