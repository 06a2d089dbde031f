"""Load a JobConfig from a YAML file plus ``--set section.field=value`` overrides.

Example::

    job = load_job_config("job.yaml", ["training.steps=50", "optim.lr=3e-3"])

Values in overrides are parsed as YAML scalars (``true``, ``12``, ``null``, ``[1, 2]``); a
number written as ``3e-3`` is accepted for float fields (YAML 1.1 reads it as a string).
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from raylastic.jobconfig.job import JobConfig


def load_job_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Read ``path`` (optional), apply ``overrides`` and return the validated JobConfig."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise ValueError(f"--config {path}: cannot read it ({error.strerror})") from error
        try:
            loaded = yaml.safe_load(text)
            repeated = repeated_key(yaml.compose(text, Loader=yaml.SafeLoader))
        except yaml.YAMLError as error:
            raise ValueError(f"--config {path}: not valid YAML ({error})") from error
        if repeated is not None:
            raise ValueError(f"--config {path}: {repeated}; YAML would keep the last one silently, keep one")
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"--config {path}: expected a mapping of sections, got {type(loaded).__name__}")
        raw = loaded or {}
    for override in overrides:
        key, value = _parse_override(override)
        _set_nested(raw, key.split("."), value)
    return job_config_from_dict(raw)


def repeated_key(node: yaml.Node | None, prefix: str = "", seen: set[int] | None = None) -> str | None:
    """The first key given twice in one mapping of the composed YAML ``node``, as ``section.key is given twice (lines
    3 and 9)``, or None. A merge (``<<: *base``) is no repeat: the mapping's own keys override it, as YAML says."""
    seen = set() if seen is None else seen
    if node is None or id(node) in seen:  # an alias met twice: checked once
        return None
    seen.add(id(node))
    children: list[tuple[str, yaml.Node]] = []
    if isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                line = key.start_mark.line + 1
                if key.value in lines:
                    return f"{prefix}{key.value} is given twice (lines {lines[key.value]} and {line})"
                lines[key.value] = line
                children.append((f"{prefix}{key.value}.", value))
    elif isinstance(node, yaml.SequenceNode):
        children = [(f"{prefix.rstrip('.')}[{index}].", item) for index, item in enumerate(node.value)]
    for child_prefix, child in children:
        if (found := repeated_key(child, child_prefix, seen)) is not None:
            return found
    return None


def job_config_from_dict(raw: dict[str, Any]) -> JobConfig:
    """Build a JobConfig from plain nested dicts (as in YAML or ``JobConfig.to_dict()``)."""
    return _build(JobConfig, raw, prefix="")


def _parse_override(override: str) -> tuple[str, Any]:
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set {override!r}: expected section.field=value, e.g. training.steps=100")
    try:
        return key.strip(), yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as error:
        raise ValueError(f"--set {override!r}: the value is not valid YAML ({error})") from error


def _set_nested(raw: dict[str, Any], parts: list[str], value: Any) -> None:
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"--set {'.'.join(parts)}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the job config"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ValueError(f"unknown key {prefix}{unknown[0]}; allowed in {where}: {', '.join(fields)}")
    required = [name for name, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in raw]
    if missing:  # a class with required fields says what each takes (FaultConfig.ALLOWED)
        named = ", ".join(f"{prefix}{name} ({cls.ALLOWED[name]})" for name in missing)
        raise ValueError(f"missing {named}; {where} needs {', '.join(required)}")
    kwargs = {}
    for name, value in raw.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, {} if value is None else value, prefix=f"{prefix}{name}.")
        elif typing.get_origin(hint) is tuple and dataclasses.is_dataclass(typing.get_args(hint)[0]):
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"{prefix}{name} must be a list, got {value!r}")
            item = typing.get_args(hint)[0]
            kwargs[name] = tuple(_build(item, v, prefix=f"{prefix}{name}[{i}].") for i, v in enumerate(value))
        else:
            kwargs[name] = _coerce(hint, value)
    return cls(**kwargs)


def _coerce(hint: Any, value: Any) -> Any:
    """Accept what YAML gives for a number: ints for float fields, and '3e-3' strings."""
    accepts_float = hint is float or (typing.get_origin(hint) is not dict and float in typing.get_args(hint))
    if accepts_float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if accepts_float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value
