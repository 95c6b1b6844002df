"""The validation layer where input enters: number rules and text files.

Every number a user gives (a flag, a workload key, a trace field, a profile coefficient)
goes through one `Rule`: finite, integral when it counts something, inside its range. A
refusal names where the value came from, the value and what is allowed. Text files are
read whole and decoded strictly, so a file that is not UTF-8 is refused with its byte
offset instead of failing half-way through with a traceback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from twin.errors import ConfigError, TraceError

# Upper bounds that keep arithmetic exact and runs finite: token counts fit in int32
# (SGLang's own limit for lengths), times stay where a 1 ms step still moves the clock.
MAX_TOKENS = 2**31 - 1
MAX_TIME_S = 1e9
MAX_REQUESTS = 10_000_000


@dataclass(frozen=True)
class Rule:
    """What a number may be: `integer`, `lo`/`hi` bounds (open when `lo_open`/`hi_open`)."""

    integer: bool = False
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        lo = None if self.lo is None else f"{'>' if self.lo_open else '>='} {_fmt(self.lo)}"
        hi = None if self.hi is None else f"{'<' if self.hi_open else '<='} {_fmt(self.hi)}"
        if lo and hi:
            left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            return f"{kind} in {left}{_fmt(self.lo)}, {_fmt(self.hi)}{right}"
        return " ".join(filter(None, (kind, lo or hi)))

    def parse(self, value: object) -> int | float:
        """The number `value` stands for; `ValueError(describe())` when it breaks the rule."""
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(self.describe())
        try:
            num = float(value) if not isinstance(value, int) else value
        except (ValueError, OverflowError):
            raise ValueError(self.describe()) from None
        if isinstance(num, float) and not math.isfinite(num):
            raise ValueError(self.describe())
        if self.integer:
            if num != int(num):
                raise ValueError(self.describe())
            num = int(num)
        if self.lo is not None and (num < self.lo or self.lo_open and num == self.lo):
            raise ValueError(self.describe())
        if self.hi is not None and (num > self.hi or self.hi_open and num == self.hi):
            raise ValueError(self.describe())
        return num


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


POSITIVE = Rule(lo=0, lo_open=True)
NON_NEGATIVE = Rule(lo=0)
FINITE = Rule()
COUNT = Rule(integer=True, lo=1)  # a count of one or more
NON_NEGATIVE_INT = Rule(integer=True, lo=0)
PROBABILITY = Rule(lo=0, hi=1)
TOKENS = Rule(integer=True, lo=1, hi=MAX_TOKENS)
PRIORITY = Rule(integer=True, lo=-(2**31), hi=2**31 - 1)
SEED = Rule(integer=True, lo=0, hi=2**32 - 1)


def check(label: str, value: object, rule: Rule) -> int | float:
    """`value` under `rule`, or `ConfigError` naming `label` (a flag, a key) and the value."""
    try:
        return rule.parse(value)
    except ValueError:
        raise ConfigError(f"{label} {value!r}: must be {rule.describe()}") from None


def check_optional(label: str, value: object, rule: Rule) -> int | float | None:
    return None if value is None else check(label, value, rule)


def check_field(path: Path | str, line: int, row: dict, key: str, rule: Rule) -> int | float:
    """`row[key]` under `rule`, or `TraceError` naming file, line and field."""
    if key not in row:
        raise TraceError(str(path), line, key, "missing")
    try:
        return rule.parse(row[key])
    except ValueError:
        raise TraceError(str(path), line, key,
                         f"{row[key]!r} is not {rule.describe()}") from None


def read_text(path: Path | str, flag: str) -> str:
    """The whole file as text (UTF-8, a BOM allowed). An unreadable file is a `ConfigError`
    naming `flag`; bytes that are not UTF-8 a `TraceError` with the line and byte offset."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise TraceError(str(path), line, "<bytes>",
                         f"not UTF-8 text: byte 0x{data[exc.start]:02x} at byte offset "
                         f"{exc.start}") from None


def text_lines(text: str) -> list[str]:
    """Lines split on newlines only (not on the other separators `str.splitlines` knows,
    which JSON strings may contain)."""
    return [line.removesuffix("\r") for line in text.split("\n")]
