"""`--only`: one variant selector for every command (pure: no I/O).

    SELECTOR := ID | AXIS=VALUE[,VALUE...]
    AXIS     := id | os | device | cuda | cudnn | python | paddle | platform

A bare word is a variant id. `cuda=cpu` and `cudnn=none` select the CPU variants. Commas give
alternatives on one axis (`python=3.10,3.11`). `platform=linux/arm64` selects the variants built
for that platform (a multi-platform variant is selected whole: its index needs every platform). `--only` is repeatable; a variant is selected
when any selector matches it. An unknown axis or an empty value is bad input (exit 2), and so
is a selection that matches no variant: a CI job that quietly does nothing is worse than one
that stops.

It works on plan Variants and on build-report VariantRecords alike: anything with the
`Selectable` attributes. A report written before variants recorded their OS has `os` None,
which no `os=` selector matches.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from imagebuild.core.source import InputError, known_list, suggest

AXES = ("id", "os", "device", "cuda", "cudnn", "python", "paddle", "platform")
OPTION = "--only"
HELP = ("Variant id, or AXIS=VALUE[,VALUE...] with AXIS one of " + ", ".join(AXES)
        + " (cuda=cpu for CPU variants); repeatable, any match selects.")


class Selectable(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def os(self) -> str | None: ...
    @property
    def device(self) -> str: ...
    @property
    def cuda(self) -> str | None: ...
    @property
    def cudnn(self) -> str | None: ...
    @property
    def python(self) -> str: ...
    @property
    def paddle(self) -> str: ...
    @property
    def platforms(self) -> Sequence[str]: ...


T = TypeVar("T", bound=Selectable)


def axis_values(variant: Selectable) -> dict[str, str | None]:
    return {"id": variant.id, "os": variant.os, "device": variant.device, "cuda": variant.cuda or "cpu",
            "cudnn": variant.cudnn or "none", "python": variant.python, "paddle": variant.paddle}


@dataclass(frozen=True)
class Selector:
    axis: str
    values: frozenset[str]
    text: str  # as given, for messages

    def matches(self, variant: Selectable) -> bool:
        if self.axis == "platform":
            return any(p in self.values for p in variant.platforms)
        return axis_values(variant)[self.axis] in self.values


@dataclass(frozen=True)
class Selection:
    """The parsed `--only` options. Empty: every variant."""

    selectors: tuple[Selector, ...] = ()

    @classmethod
    def parse(cls, texts: Iterable[str], option: str = OPTION) -> Selection:
        return cls(tuple(parse_selector(text, option) for text in texts))

    def __bool__(self) -> bool:
        return bool(self.selectors)

    def describe(self) -> str:
        return ", ".join(s.text for s in self.selectors)

    def matches(self, variant: Selectable) -> bool:
        return not self.selectors or any(s.matches(variant) for s in self.selectors)

    def apply(self, variants: Iterable[T]) -> list[T]:
        """The selected variants, in their order; may be empty."""
        return [v for v in variants if self.matches(v)]

    def choose(self, variants: Sequence[T], where: str, option: str = OPTION) -> list[T]:
        """The selected variants; none is bad input, blamed on `where` (the matrix or report)."""
        chosen = self.apply(variants)
        if not chosen:
            raise InputError(where, None, option, f"selects no variant ({self.describe()})")
        return chosen


def parse_selector(text: str, option: str = OPTION) -> Selector:
    axis, sep, value = text.partition("=")
    axis = axis.strip() if sep else "id"
    value = (value if sep else text).strip()
    values = frozenset(v.strip() for v in value.split(",")) if sep else frozenset({value})
    if axis not in AXES:
        raise InputError(option, None, text, f"unknown axis '{axis}'{suggest(axis, AXES)} "
                                             f"(known: {known_list(AXES)})")
    if not value or "" in values:
        raise InputError(option, None, text, f"no value for {axis} (expected {axis}=VALUE)")
    return Selector(axis, values, text.strip())
