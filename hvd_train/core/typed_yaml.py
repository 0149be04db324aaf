"""YAML and `--set key=value` values into typed dataclasses, with one-line errors naming the dotted
key and the offending value (`ConfigError`); and dataclasses back to YAML. Generic: the experiment
config's own rules are in `core.config`."""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from typing import Any

import yaml

from hvd_train.errors import ConfigError


def dump(data: dict[str, Any]) -> str:
    """YAML text of nested dicts and lists, keys in their order."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


class _Dumper(yaml.SafeDumper):
    """Block style, except lists of scalars on one line (`shape: [8, 8, 1]`)."""

    def represent_list(self, data: list[Any]) -> yaml.Node:
        flow = all(not isinstance(item, (list, dict)) for item in data)
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _Dumper.represent_list)


def read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping a YAML config file holds.

    Raises:
      ConfigError: the file cannot be read, is not UTF-8, is not valid YAML, is empty (nothing but
        comments and whitespace: a file given by name that sets nothing is a mistake, not a
        request for the defaults), or its top level is not a mapping.
    """
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise ConfigError(f"{name}: cannot read the config file ({err.strerror})") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"{name}: not UTF-8 text ({err.reason} at byte {err.start})") from err
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(
            f"{name}{_yaml_location(err)}: invalid YAML: {_yaml_problem(err)}"
        ) from err
    if raw is None:
        raise ConfigError(
            f"config {name} is empty: give at least one section (e.g. train: {{epochs: 3}}), or "
            "no config file for the defaults"
        )
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: the top level must be a mapping of sections, got {show(raw)}")
    return raw


def _yaml_location(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    return f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""


def _yaml_problem(err: yaml.YAMLError) -> str:
    problem = getattr(err, "problem", None) or str(err)
    return " ".join(problem.split())


def parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, value_text = text.partition("=")
    key = key.strip()
    if not sep:
        raise ConfigError(f"--set {text!r}: expected dotted.key=value")
    if not key:
        raise ConfigError(f"--set {text!r}: empty key")
    keys = key.split(".")
    if not all(keys):
        raise ConfigError(f"--set {text!r}: empty part in the key {key!r}")
    try:
        value = yaml.safe_load(value_text)
    except yaml.YAMLError as err:
        raise ConfigError(
            f"{key}: invalid YAML value {value_text!r} in --set: {_yaml_problem(err)}"
        ) from err
    return keys, value


def set_path(raw: dict[str, Any], keys: list[str], value: Any) -> None:
    node = raw
    for depth, key in enumerate(keys[:-1], start=1):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            raise ConfigError(
                f"{'.'.join(keys)}: cannot set a key inside {'.'.join(keys[:depth])}, which is "
                f"{show(child)}, not a mapping"
            )
        node = child
    node[keys[-1]] = value


def build(cls: type, raw: Any, prefix: str) -> Any:
    """An instance of the dataclass `cls` from a mapping, with types checked and converted."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix}: expected a mapping, got {show(raw)}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in raw.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in known:
            raise ConfigError(f"{dotted}: unknown key (known: {', '.join(sorted(known))})")
        values[key] = _convert(value, hints[key], dotted)
    return cls(**values)


def _convert(value: Any, hint: Any, key: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return build(hint, value, key)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        (inner,) = (a for a in args if a is not type(None))
        if not _is_scalar(value, inner):
            raise ConfigError(f"{key}: expected {_describe(hint)}, got {show(value)}")
        return _convert(value, inner, key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected {_describe(hint)}, got {show(value)}")
        return [_convert(item, args[0], f"{key}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}: expected {_describe(hint)}, got {show(value)}")
        return value
    if not _is_scalar(value, hint):
        raise ConfigError(f"{key}: expected {_describe(hint)}, got {show(value)}")
    if hint is float:
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {show(value)}")
        return float(value)
    return value


def _is_scalar(value: Any, hint: Any) -> bool:
    """Whether `value` fits the scalar type `hint`: a bool is not an int, an int is a float."""
    if hint is bool or hint is str:
        return isinstance(value, hint)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    raise TypeError(f"unsupported config type {hint!r}")


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        (inner,) = (a for a in args if a is not type(None))
        return f"{_describe(inner)} or null"
    if origin is list:
        return f"a list of {_SCALAR_NAMES[args[0]][1]}"
    if origin is dict:
        return "a mapping with string keys"
    return _SCALAR_NAMES[hint][0]


_SCALAR_NAMES = {
    bool: ("a boolean", "booleans"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    str: ("a string", "strings"),
}


def show(value: Any) -> str:
    """The value as one short line: YAML's null for None, else repr, cut at 80 characters."""
    text = "null" if value is None else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
