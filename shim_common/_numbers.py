"""The kinds of number that enter a process from outside, each with one range and one check.

Every number a process is set or steered with from outside (a flag, a ``DYN_*`` variable, the
admin API, a message on a plane, a request's priority) is one of these kinds, and is checked by
the kind's one rule before anything computes with it: finite, and inside a range that every piece
of code downstream can compute with and that msgpack and JSON can carry. Out of range is refused
at the edge, in the edge's own way (exit 2 naming the flag or variable, 400 on HTTP, close 1007 on
a plane), and touches nothing else. (The fields of a completion body are the OpenAI API's, with
the API's own ranges: ``frontend_shim._request_body`` checks them, every integer within the signed
64 bits the worker's protocol carries and every number finite.)

The kinds and why their ranges are what they are:

- :data:`COUNT`: a whole number from 0 to :data:`MAX_COUNT` (2**53). Tokens, blocks, requests,
  bytes. 2**53 is the largest range in which every integer is exact as a double, so a count
  survives the router's float arithmetic and any JSON reader, and it is far inside the int64
  that msgpack carries (a 40-digit integer is what crashed the encoder).
- :data:`FRACTION`: a finite number from 0 to 1 (a share of a total, e.g. of a rank's KV blocks).
- :data:`RATIO`: a finite number from 0 to :data:`MAX_RATIO` (10**6): a multiple of a count, e.g.
  of ``max_num_batched_tokens``. Its product with any :data:`COUNT` is below 10**22, finite, so
  ``int(ratio * count)`` is always defined (``int()`` of an infinite product crashed a worker).
- :data:`SECONDS`: a finite duration from 0 to :data:`MAX_SECONDS` (10**9 s, about 32 years):
  longer than any wait means, and a clock reading plus it still resolves microseconds.
- :data:`RANKS`: data-parallel ranks of one worker, from 1 to :data:`MAX_RANKS` (1,024): each rank
  costs a scheduler in the mocker and per-rank state and gauges in every frontend, so the count
  is bounded by what a process can hold, not by what an integer can.
- :data:`PRIORITY`: a request's priority, a whole number from -1000 to 1000 (lower is served
  first): the one signed kind, narrow so that a priority is a class, never an identifier.

NaN and the infinities are no kind at all. A flag may narrow its kind further (``> 0``, ``>= 1``);
it never widens it. On the wire, a field is annotated with the kind's type (:data:`Count`,
:data:`Fraction`, ...), so msgspec applies the same range when it decodes.
"""

from __future__ import annotations

import math
from typing import Annotated, Final, Generic, TypeVar

import msgspec

from shim_common._client_text import quote

__all__ = [
    "COUNT",
    "FRACTION",
    "MAX_COUNT",
    "MAX_PRIORITY",
    "MAX_RANKS",
    "MAX_RATIO",
    "MAX_SECONDS",
    "RANKS",
    "RATIO",
    "SECONDS",
    "Count",
    "Fraction",
    "Kind",
    "NumberError",
    "PRIORITY",
    "Priority",
    "Ratio",
    "Seconds",
]

MAX_COUNT: Final = 2**53
MAX_RATIO: Final = 1e6
MAX_SECONDS: Final = 1e9
MAX_RANKS: Final = 1024
MAX_PRIORITY: Final = 1000

#: The kinds as types, for msgspec structs: a decoded value out of range is a ValidationError.
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Ratio = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_RATIO)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_SECONDS)]
Priority = Annotated[int, msgspec.Meta(ge=-MAX_PRIORITY, le=MAX_PRIORITY)]

_T = TypeVar("_T", int, float)


class NumberError(ValueError):
    """A value that is not of its kind; ``str(error)`` says what the kind is and what was given."""


class Kind(Generic[_T]):
    """One kind of number: its type, its range, and the one check of both.

    Args:
        python_type: ``int`` or ``float`` (an ``int`` is accepted where a float is meant).
        high: the largest value of the kind.
        text: what the kind is, for messages ("a whole number from 0 to 2**53").
        low: the smallest value of the kind.
    """

    __slots__ = ("high", "low", "python_type", "text")

    def __init__(self, python_type: type[_T], high: _T, text: str, low: _T | None = None) -> None:
        self.python_type: type[_T] = python_type
        self.high: _T = high
        self.text = text
        self.low: _T = python_type(0) if low is None else low

    def __repr__(self) -> str:
        return f"Kind({self.text})"

    def check(self, value: object) -> _T:
        """``value`` as this kind, or :class:`NumberError`.

        Raises:
            NumberError: not a number of the type (a bool is not a number), NaN, infinite,
                below :attr:`low` or past :attr:`high`.
        """
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise NumberError(f"must be {self.text}, got {quote(value)}")
        number: int | float = value
        if (
            (self.python_type is int and isinstance(number, float))
            or (isinstance(number, float) and not math.isfinite(number))
            or not self.low <= number <= self.high
        ):
            raise NumberError(f"must be {self.text}, got {quote(value)}")
        return self.python_type(number)

    def validator(self, value: object) -> None:
        """A cyclopts validator applying :meth:`check` (``None``: the flag was not given), worded
        as cyclopts words its own (it names the flag and the value given itself).

        A bound method: cyclopts calls a method validator with the value alone.
        """
        if value is not None:
            try:
                self.check(value)
            except NumberError:
                raise ValueError(f"Must be {self.text}.") from None


COUNT: Final = Kind(int, MAX_COUNT, "a whole number from 0 to 2**53")
FRACTION: Final = Kind(float, 1.0, "a finite number from 0 to 1")
RATIO: Final = Kind(float, MAX_RATIO, "a finite number from 0 to 1e6")
SECONDS: Final = Kind(float, MAX_SECONDS, "a finite number of seconds from 0 to 1e9")
RANKS: Final = Kind(int, MAX_RANKS, "a whole number from 1 to 1024", low=1)
PRIORITY: Final = Kind(int, MAX_PRIORITY, "a whole number from -1000 to 1000", low=-MAX_PRIORITY)
