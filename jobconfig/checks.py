"""The checks every config field uses: a bad value raises ValueError naming the field and what is allowed."""

from __future__ import annotations

import math
from typing import Any

A_DAY_S = 86_400.0
"""Upper bound of every timeout: a longer one is a typo (or a unit mix-up), and a run would hang for it."""


def require(condition: bool, field_name: str, allowed: str, value: Any) -> None:
    """ValueError ``"<field_name> must be <allowed>, got <value>"`` unless ``condition`` holds."""
    if not condition:
        raise ValueError(f"{field_name} must be {allowed}, got {value!r}")


def is_positive_int(value: Any) -> bool:
    return is_non_negative_int(value) and value > 0


def is_non_negative_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool, which YAML gives for true/false)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def require_seconds(value: Any, field_name: str, low: float) -> None:
    require(is_number(value) and low <= value <= A_DAY_S, field_name,
            f"a number of seconds in [{low:g}, {A_DAY_S:g}] (a day)", value)


def one_of(choices: tuple[str, ...]) -> str:
    return f"one of {', '.join(choices)}"
