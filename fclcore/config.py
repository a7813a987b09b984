"""Typed YAML configuration: dataclasses are the schema, validation happens once at load.

Every error is one line that names the file, the dotted key and what was expected, so a
user fixing a device config over SSH does not have to read a traceback.  Secrets never
need to live in files: any string value of the form ``${env:NAME}`` is replaced by the
environment variable ``NAME`` at load time.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from fclcore.errors import ConfigError

T = TypeVar("T")

_ENV_REF = re.compile(r"^\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}$")


def load_config(cls: type[T], path: str | os.PathLike, overrides: typing.Sequence[str] = ()) -> T:
    """Read ``path`` as YAML, apply ``key.sub=value`` overrides, and build ``cls``."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read file: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: not a YAML file (not UTF-8 text)") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}: not valid YAML{where}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(raw).__name__}")
    raw = _resolve_extends(raw, Path(path), source, depth=0)
    return from_dict(cls, apply_overrides(raw, overrides, source), source)


def _resolve_extends(raw: dict, path: Path, source: str, depth: int) -> dict:
    """``extends: other.yaml`` (relative to this file) loads that file first; keys here win."""
    if "extends" not in raw:
        return raw
    parent_name = raw.pop("extends")
    if not isinstance(parent_name, str) or depth >= 8:
        raise ConfigError(f"{source}: extends: expected a file name (at most 8 levels), got {parent_name!r}")
    parent_path = path.parent / parent_name
    try:
        parent = yaml.safe_load(parent_path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{source}: extends: cannot load {parent_path}: {exc}") from None
    if not isinstance(parent, dict):
        raise ConfigError(f"{source}: extends: {parent_path} is not a mapping")
    return _deep_merge(_resolve_extends(parent, parent_path, source, depth + 1), raw)


def _deep_merge(base: dict, top: dict) -> dict:
    out = _deep_copy(base)
    for key, value in top.items():
        out[key] = (
            _deep_merge(out[key], value)
            if isinstance(value, dict) and isinstance(out.get(key), dict)
            else _deep_copy(value)
        )
    return out


def apply_overrides(raw: dict, overrides: typing.Sequence[str], source: str = "--set") -> dict:
    """Return a copy of ``raw`` with each ``dotted.key=value`` applied (value parsed as YAML)."""
    out = _deep_copy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set {item!r}: expected dotted.key=value")
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError:
            raise ConfigError(f"--set {item!r}: value is not valid YAML") from None
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is not a mapping")
            node = child
        node[parts[-1]] = value
    return out


def from_dict(cls: type[T], raw: Any, source: str, prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``raw``, checking unknown keys, types and missing values."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {prefix or '<top>'}: expected a mapping, got {_describe(raw)}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    moved = getattr(cls, "moved_keys", {})
    for key in raw:
        if key in moved:
            raise ConfigError(f"{source}: {_join(prefix, str(key))}: this key moved to {moved[key]}")
        if key not in fields:
            known = ", ".join(sorted(fields))
            name = str(key) if str(key).isprintable() else repr(str(key))  # keep the error on one line
            raise ConfigError(f"{source}: {_join(prefix, name)}: unknown key (expected one of: {known})")
    kwargs = {}
    for name, field in fields.items():
        key = _join(prefix, name)
        if name in raw:
            kwargs[name] = _coerce(hints[name], raw[name], source, key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{source}: {key}: missing value ({_type_name(hints[name])} required)")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{source}: {prefix or '<top>'}: {exc}") from None


def option(default: Any, help: str) -> Any:
    """A dataclass field with a default and its one-line help (``options_help``): how method
    options say what they do, so that ``fcl simulate --help-method NAME`` can print it.  A list
    default is copied for each instance."""
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def options_help(cls: type) -> list[tuple[str, str, str]]:
    """(name, default, help) of every field of an options dataclass, in declaration order."""
    hints, out = get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        out.append((f.name, f"{_type_name(hints[f.name])} = {default!r}", _help(cls, f.name)))
    return out


def _help(cls: type, name: str) -> str:
    """A field's help text, from the nearest class that gave one (a preset subclass that only
    changes a default keeps its base's text)."""
    for klass in cls.__mro__:
        field = getattr(klass, "__dataclass_fields__", {}).get(name)
        if field is not None and field.metadata.get("help"):
            return field.metadata["help"]
    return ""


def to_dict(obj: Any) -> Any:
    """Plain-data form of a config dataclass (for YAML/JSON and for round messages)."""
    if dataclasses.is_dataclass(obj):
        omit = getattr(obj, "omit_when_default", ())  # keys added later, left out at their defaults
        return {
            f.name: to_dict(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if f.name not in omit or getattr(obj, f.name) != f.default
        }
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _coerce(tp: Any, value: Any, source: str, key: str) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _coerce(option, value, source, key)
            except ConfigError as exc:
                errors.append(exc)
        raise (
            errors[0]
            if len(options) == 1
            else ConfigError(f"{source}: {key}: expected {_type_name(tp)}, got {_describe(value)}")
        )
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{source}: {key}: expected one of {list(args)}, got {_describe(value)}")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, source, key)
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {key}: expected a list, got {_describe(value)}")
        inner = args[0] if args else Any
        items = [_coerce(inner, v, source, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}: expected a mapping, got {_describe(value)}")
        return {str(k): _coerce(args[1], v, source, f"{key}.{k}") for k, v in value.items()}
    return _scalar(tp, value, source, key)


def _scalar(tp: Any, value: Any, source: str, key: str) -> Any:
    if tp is Any:
        return value
    if tp is str and isinstance(value, str):
        return _resolve_env(value, source, key)
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is float and not isinstance(value, bool) and isinstance(value, (int, float, str)):
        try:  # YAML 1.1 reads "1e-3" as a string; accept it as the number it clearly is
            number = float(value)
        except ValueError:
            number = None
        if number is not None and math.isfinite(number):
            return number
        if number is not None:
            raise ConfigError(f"{source}: {key}: expected a finite number, got {_describe(value)}")
    raise ConfigError(f"{source}: {key}: expected {_type_name(tp)}, got {_describe(value)}")


def _resolve_env(value: str, source: str, key: str) -> str:
    match = _ENV_REF.match(value)
    if not match:
        return value
    name = match.group(1)
    if name not in os.environ:
        raise ConfigError(f"{source}: {key}: environment variable {name} is not set")
    return os.environ[name]


def _type_name(tp: Any) -> str:
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if get_origin(tp) is Literal:
        return "one of " + str(list(get_args(tp)))
    if get_origin(tp) in (list, tuple):
        return "a list"
    if get_origin(tp) is dict or dataclasses.is_dataclass(tp):
        return "a mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _deep_copy(raw: Any) -> Any:
    if isinstance(raw, dict):
        return {k: _deep_copy(v) for k, v in raw.items()}
    if isinstance(raw, list):
        return [_deep_copy(v) for v in raw]
    return raw
