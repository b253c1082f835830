"""argparse types the benchmarks share, so a flag a benchmark cannot run with is a usage error
(exit 2, naming the flag and why) before anything starts, not a traceback or a hang after."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable


def at_least(minimum: int) -> Callable[[str], int]:
    """An int flag of `minimum` or more (--repeats 0 has no median; --workers 0 never ends)."""
    def parse(text: str) -> int:
        value = _number(text, int, "a whole number")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value
    return parse


def above_zero(text: str) -> float:
    """A float flag above 0 (a duration, a rate)."""
    value = _number(text, float, "a number")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not above 0")
    return value


def int_list(minimum: int) -> Callable[[str], str]:
    """Comma-separated ints of `minimum` or more; hands back the text (the script splits it)."""
    def check(item: str) -> None:
        if _number(item, int, "comma-separated whole numbers") < minimum:
            raise argparse.ArgumentTypeError(f"{item} is below {minimum}")
    return _each_item(check)


def names_of(known: Iterable[str]) -> Callable[[str], str]:
    """Comma-separated names, each one of `known`; hands back the text."""
    known = tuple(known)

    def check(item: str) -> None:
        if item not in known:
            raise argparse.ArgumentTypeError(f"unknown {item} (of {','.join(known)})")
    return _each_item(check)


def names_or_ints(known: Iterable[str]) -> Callable[[str], str]:
    """Comma-separated items, each one of `known` or a whole number of 1 or more; hands back the text."""
    known = tuple(known)

    def check(item: str) -> None:
        if item not in known and _number(item, int, f"a whole number or one of {','.join(known)}") < 1:
            raise argparse.ArgumentTypeError(f"{item} is below 1")
    return _each_item(check)


def _each_item(check: Callable[[str], None]) -> Callable[[str], str]:
    """A comma-separated flag whose every item must pass `check`; hands back the text."""
    def parse(text: str) -> str:
        for item in text.split(","):
            check(item)
        return text
    return parse


def prefill_decode(text: str) -> str:
    """P:D, prefill and decode instances, 1 or more of each; hands back the text."""
    counts = text.split(":")
    if len(counts) != 2 or min(_number(n, int, "P:D, e.g. 1:2") for n in counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not P:D with 1 or more of each, e.g. 1:2")
    return text


def _number(text: str, kind: type, what: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help shows the description as written and each flag's default after its help."""
