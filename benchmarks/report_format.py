"""Markdown pieces for docs/benchmarks.md (stdlib only): tables, numbers, parameter lines, and the section of a
result file that has no renderer of its own (``generic``)."""

from __future__ import annotations


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: object, digits: int = 3) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "no", None: "-"}[value]
    if isinstance(value, float):
        return f"{value:,.{digits}f}".rstrip("0").rstrip(".") if abs(value) < 1000 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def params_line(params: dict) -> str:
    """``key: value`` pairs of a recorded parameter dict, nested dicts flattened with dots."""
    flat: list[str] = []

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        elif not (isinstance(value, str) and value.startswith("/tmp/")):  # a temporary path says nothing
            flat.append(f"`{prefix}`: {value if not isinstance(value, float) else fmt(value)}")

    walk("", params)
    return ", ".join(flat)


def generic(result: dict) -> list[str]:
    scalars = {k: v for k, v in result.items() if isinstance(v, (int, float, str)) and k not in ("command", "date")}
    return [f"Recorded: {params_line(scalars)}." if scalars else "(no scalar fields recorded)"]
