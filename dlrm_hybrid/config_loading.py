"""Run configuration from YAML (safe_load) and `--set` overrides into the typed dataclasses of
config.py, then checked (config_checks.py) for the world size.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from collections.abc import Hashable
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

from dlrm_hybrid.config import CHOICES, NON_NEGATIVE, Config, ConfigError
from dlrm_hybrid.config_checks import validate

LEGACY_KEYS = {"dcn_layers": "layers", "dcn_low_rank": "rank"}  # model.<old> -> model.dcn.<new>


class UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping: YAML keeps the last, so a
    second `model:` section would silently drop every setting of the first."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                break  # the mapping's own construction names it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    problem=f"{key!r} given twice (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep)


def world_size_from_env() -> int:
    """The job's size as torchrun tells each rank (1 without torchrun): configs are validated
    for it before torch is imported."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def load_config(path: Optional[str], overrides: List[str] = (), world_size: int = 1) -> Config:
    """Read `path` (or the defaults), apply `key=value` overrides, validate for `world_size` ranks."""
    raw: dict = {}
    if path is not None:
        try:
            raw = yaml.load(Path(path).read_text(), Loader=UniqueKeyLoader) or {}
        except OSError as e:
            raise ConfigError(f"config file {path}: cannot read ({e.strerror}); check the path")
        except UnicodeDecodeError:
            raise ConfigError(f"config file {path}: not text (UTF-8); give a YAML config") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path}: not valid YAML ({str(e).splitlines()[0]})")
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path}: expected a mapping of sections (model, data, ...)")
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item}: expected KEY=VALUE, e.g. --set train.max_steps=40")
        try:
            value = yaml.load(text, Loader=UniqueKeyLoader) if text.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {key}: {text!r} is not a valid YAML value "
                              f"({str(e).splitlines()[0]}); quote it or fix its brackets")
        _assign(raw, key.strip(), value)
    _move_legacy_keys(raw)
    cfg = _build(Config, raw, "")
    validate(cfg, world_size)
    return cfg


def _assign(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for name in parents:
        node = node.setdefault(name, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: '{name}' is not a section")
    node[leaf] = value


def _move_legacy_keys(raw: dict) -> None:
    """Configs (and checkpoints) written before `model.dcn` existed name its keys
    model.dcn_layers and model.dcn_low_rank: read them as model.dcn.layers and .rank."""
    model = raw.get("model")
    if not isinstance(model, dict):
        return
    for old, new in LEGACY_KEYS.items():
        if old in model:
            dcn = model.setdefault("dcn", {})
            if not isinstance(dcn, dict):
                return  # _build names the bad section
            if new in dcn and dcn[new] != model[old]:
                raise ConfigError(f"model.{old}: {model[old]!r} contradicts model.dcn.{new} "
                                  f"({dcn[new]!r}); give only model.dcn.{new}")
            dcn[new] = model.pop(old)


def _build(cls: type, raw: Any, prefix: str) -> Any:
    """Build dataclass `cls` from a mapping, rejecting unknown keys and wrong types."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise ConfigError(f"{prefix}{key}: unknown key; valid keys here: {', '.join(sorted(names))}")
    values = {}
    for name, value in raw.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            values[name] = _check_type(f"{prefix}{name}", hint, value)
    return cls(**values)


def _check_type(key: str, hint: Any, value: Any) -> Any:
    if typing.get_origin(hint) in (dict, Dict):
        _, item = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return {k: _check_type(f"{key}.{k}", item, v) for k, v in value.items()}
    if typing.get_origin(hint) in (list, List):
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list of {item.__name__}, got {value!r}")
        if dataclasses.is_dataclass(item):
            return [_build(item, v, f"{key}[{i}].") for i, v in enumerate(value)]
        return [_check_type(f"{key}[{i}]", item, v) for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if hint is float and isinstance(value, float):
        least = key in NON_NEGATIVE
        if not math.isfinite(value) or least and value < 0:
            raise ConfigError(f"{key}: expected a finite number{' of at least 0' * least}, "
                              f"got {value}")
        return value
    if hint is str and isinstance(value, bool) and "true" in CHOICES.get(key, ()):
        return str(value).lower()  # YAML reads true/false as booleans
    if hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {hint.__name__}, got {value!r}")
    return value
