"""Reading a config: YAML, `--set` overrides, type conversion, did-you-mean suggestions.

Offers `load_config(path, overrides)`, `read_raw_config`, `config_from_dict`, `config_to_dict`,
`dump_config`, `apply_override`, `override_keys`, `did_you_mean` and `in_current_folder` (for
the missing-path message). Precedence is dataclass defaults < YAML < `--set key=value`; every YAML
value is converted to the field's declared type (PyYAML reads `3e-4` as a string).

Paths in a config are relative to the current folder, not to the config file (as every command
line path is). A path given in the file that is missing there but exists from the config file's
folder (or one or two above it: a project's root) is an error that names both, on any command,
before anything is read or written.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from minillm.config.hub_id import is_hub_id
from minillm.config.schema import SECTIONS, Config, DataConfig
from minillm.errors import ConfigError

# ----------------------------------------------------------------------------- conversion


_UNIONS = (typing.Union, types.UnionType)


def _type_name(tp: Any) -> str:
    if dataclasses.is_dataclass(tp):  # a nested section such as train.lora
        return "a mapping of " + ", ".join(f.name for f in dataclasses.fields(tp))
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in _UNIONS:
        args = typing.get_args(tp)
        names = " or ".join(_type_name(a) for a in args if a is not type(None))
        return names + (" or null" if type(None) in args else "")
    if origin is tuple:  # a fixed length: "a list of 2 numbers"
        args = typing.get_args(tp)
        if len(set(args)) == 1:
            return f"a list of {len(args)} {_plural(_type_name(args[0]))}"
        return f"a list of {len(args)} values: " + ", ".join(_type_name(a) for a in args)
    if origin is list:
        return "a list of " + _plural(_type_name(typing.get_args(tp)[0]))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, str(tp)
    )


def _plural(name: str) -> str:
    """`a number` -> `numbers`, `an integer` -> `integers` (a list's items)."""
    if " or " not in name:
        for article in ("a ", "an "):
            if name.startswith(article):
                return name.removeprefix(article) + "s"
    return f"values, each {name}"  # true or false, one of ..., X or null


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML value to the declared type `tp`, or raise ConfigError naming `key`."""
    if dataclasses.is_dataclass(tp):  # a nested section (train.lora): its keys, checked alike
        return _build_section(tp, value, key)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = ConfigError(key, f"expected {_type_name(tp)}, got {value!r}{_closest_choice(value, tp)}")
    if origin in _UNIONS:  # X | None, or X | Literal[...]: the first member that takes it
        nullable = type(None) in args
        if nullable and (
            value is None or (isinstance(value, str) and value.lower() in ("null", "none"))
        ):
            return None
        for inner in (a for a in args if a is not type(None)):
            try:
                return _convert(value, inner, key)
            except ConfigError:
                pass
        raise bad
    if origin is Literal:
        if value not in args:
            raise bad
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise bad
        return tuple(_convert(v, a, key) for v, a in zip(value, args))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise bad
        return [_convert(v, args[0], key) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise bad
    if isinstance(value, bool):  # YAML's `yes`/`true` must not become 1 or 1.0
        raise bad
    if tp is int:
        if isinstance(value, int):
            return value
        try:
            number = float(value) if isinstance(value, str) else value
        except ValueError:
            raise bad from None
        if isinstance(number, float) and number.is_integer():
            return int(number)
        raise bad
    if tp is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise bad from None
        if not isinstance(value, (int, float)):
            raise bad
        if not math.isfinite(value):  # nan passes every range check (nan < 0 is False)
            raise ConfigError(key, f"expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    raise bad


def _choices(tp: Any) -> list[str]:
    """The string values a Literal (or a union with one) allows."""
    if typing.get_origin(tp) is Literal:
        return [a for a in typing.get_args(tp) if isinstance(a, str)]
    if typing.get_origin(tp) in _UNIONS:
        return [c for a in typing.get_args(tp) for c in _choices(a)]
    return []


def _closest_choice(value: Any, tp: Any) -> str:
    """`; did you mean 'cosine'?` for a mistyped value of a Literal (`cosin`), as for keys."""
    if not isinstance(value, str):
        return ""
    match = difflib.get_close_matches(value.lower(), _choices(tp), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def _build_section(cls: type, raw: Any, name: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(name, f"must be a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(
                f"{name}.{key}",
                f"unknown key{did_you_mean(str(key), fields, name + '.')} "
                f"(valid keys: {', '.join(sorted(fields))})",
            )
        kwargs[key] = _convert(value, hints[key], f"{name}.{key}")
    missing = [
        k
        for k, f in fields.items()
        if k not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{name}.{missing[0]}", "is required")
    return cls(**kwargs)


# Names other trainers give our keys (HF, nanoGPT), so that a typo of one of them finds ours.
_ALIASES = {
    "learning_rate": "lr",
    "max_lr": "lr",
    "min_learning_rate": "min_lr",
    "max_iters": "max_steps",
    "num_steps": "max_steps",
    "warmup_iters": "warmup_steps",
    "micro_batch_size": "batch_size",
    "gradient_accumulation_steps": "grad_accum",
    "n_embd": "d_model",
    "hidden_size": "d_model",
    "n_layers": "n_layer",
    "num_layers": "n_layer",
    "n_heads": "n_head",
    "num_heads": "n_head",
    "block_size": "max_seq_len",
}


def did_you_mean(key: str, valid: typing.Iterable[str], prefix: str = "") -> str:
    """`; did you mean <prefix><closest>?` for a mistyped key, or "" when nothing is close."""
    valid = list(valid)
    names = valid + [alias for alias, ours in _ALIASES.items() if ours in valid]
    match = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    return f"; did you mean {prefix}{_ALIASES.get(match[0], match[0])}?" if match else ""


def override_keys(overrides: typing.Iterable[str]) -> set[str]:
    """The `section.key`s (and bare sections) that `--set` overrides give, for error messages."""
    keys = set()
    for override in overrides:
        dotted = override.split("=", 1)[0].strip()
        keys.update({dotted, dotted.split(".", 1)[0]})
    return keys


# What `require_model=False` puts in place of an absent model section: the smallest valid model,
# with a context that no train.seq_len exceeds. Only `minillm tokenize` asks for it, and it reads
# the data section alone; nothing is built or trained from this model.
_NO_MODEL = {"d_model": 2, "n_layer": 1, "n_head": 1, "max_seq_len": 2**31 - 1}


def config_from_dict(
    raw: Any,
    file: str | None = None,
    overridden: typing.Collection[str] = (),
    require_model: bool = True,
) -> Config:
    """Build and validate a Config from plain data (the parsed YAML); errors name `file`.

    An error about a key in `overridden` (see `override_keys`) names `--set` instead of `file`:
    the user typed that value on the command line, not in the file. `require_model=False`
    accepts a config without a model section (for a command that reads only the data section).
    """
    try:
        if not isinstance(raw, dict):
            raise ConfigError("", "the top level must be a mapping with model, data, train, sample")
        for key in raw:
            if key not in SECTIONS:
                hint = did_you_mean(str(key), SECTIONS)
                raise ConfigError(key, f"unknown section{hint} (valid: {', '.join(SECTIONS)})")
        raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
        if "model" not in raw and not require_model:
            raw["model"] = dict(_NO_MODEL)
        if "model" not in raw:
            raise ConfigError("model", "section is required (or train.init_from to take a model's)")
        # The embedding table defaults to the tokenizer's size.
        model_raw, data_raw = raw.get("model"), raw.get("data") or {}
        if isinstance(model_raw, dict) and "vocab_size" not in model_raw:
            model_raw["vocab_size"] = (
                data_raw.get("vocab_size", DataConfig.vocab_size)
                if isinstance(data_raw, dict)
                else DataConfig.vocab_size
            )
        sections = {
            name: _build_section(cls, raw.get(name), name) for name, cls in SECTIONS.items()
        }
        return Config(**sections)
    except ConfigError as e:
        e.file = e.file or ("--set" if e.key in overridden else file)
        raise
    except TypeError as e:  # a dataclass compared values of incompatible types
        raise ConfigError("", str(e), file) from None


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Plain data for YAML/JSON: tuples become lists."""
    out = {}
    for name in SECTIONS:
        section = dataclasses.asdict(getattr(cfg, name))
        out[name] = {k: list(v) if isinstance(v, tuple) else v for k, v in section.items()}
    return out


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def apply_override(raw: dict, override: str) -> None:
    """Apply one `section.key=value` (or `section.key.subkey=value` for a nested section such
    as train.lora) to the raw dict; the value is parsed as YAML."""
    if "=" not in override:
        raise ConfigError(override, "an override must look like section.key=value", "--set")
    dotted, text = override.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise ConfigError(dotted, "an override key must be section.key, e.g. train.lr", "--set")
    section, *path, key = parts
    if section not in SECTIONS:
        hint = did_you_mean(section, SECTIONS)
        raise ConfigError(dotted, f"unknown section{hint} (valid: {', '.join(SECTIONS)})", "--set")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    target = raw.setdefault(section, {})
    if target is None:
        target = raw[section] = {}
    if not isinstance(target, dict):
        raise ConfigError(section, "is not a mapping", "--set")
    for i, part in enumerate(path, start=2):
        if target.get(part) is None:
            target[part] = {}
        target = target[part]
        if not isinstance(target, dict):
            raise ConfigError(".".join(parts[:i]), "is not a mapping", "--set")
    target[key] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice in one mapping is an error, not "last wins"."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue  # an odd key (a list, ...): the schema check names it later
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply `section.key=value` overrides, convert types and validate.

    An empty `train.out_dir` becomes `runs/<config file stem>`. A config whose model comes from
    `train.init_from` is read with `minillm.checkpoint.init_from.load_run_config` instead.
    """
    raw = read_raw_config(path, overrides)
    return config_from_dict(raw, str(path), override_keys(overrides or []))


PATH_RULE = "paths in a config are relative to the current folder, not to the config file"

# The keys naming a file or folder that is read. A missing data.source may be a hub dataset name
# and a missing data.tokenizer is what `tokenize` writes, so those two are only checked against
# the config file's folder; the others must exist for any run.
_PATH_KEYS = {
    "data.source": False,
    "data.tokenizer": False,
    "train.init_from": True,
    "train.eval_tasks": True,
}


def in_current_folder(path: str | Path) -> str:
    """` in <the current folder> (<the rule>)` for the error about a relative config path that
    is missing (`no such file or folder` + this); "" for an absolute one."""
    if Path(path).expanduser().is_absolute():
        return ""
    return f" in {Path.cwd()} (the current folder: {PATH_RULE})"


def _exists(path: str) -> bool:
    if any(c in path for c in "*?["):  # a data.source glob
        return bool(glob.glob(path, recursive=True))
    return os.path.exists(path)


def _bases(file: Path) -> list[Path]:
    """Where a user may have meant a config's relative paths to start: the config file's folder
    and the two above it (a project's root above its configs/), less the current folder, which
    reads the path as the command does. From inside configs/ (`cd configs && minillm tokenize
    tiny.yaml`) that leaves the project's root above it."""
    cwd = Path.cwd().resolve()
    folder = file.resolve().parent
    return [base for base in [folder, *folder.parents][:3] if base != cwd]


def _check_paths(raw: dict[str, Any], file: Path, overridden: typing.Collection[str]) -> None:
    """Stop at a relative path of the file that is missing from the current folder but exists
    from the config file's folder or one above it (every key), or nowhere (the keys that must
    exist)."""
    bases = _bases(file)
    for dotted, must_exist in _PATH_KEYS.items():
        if dotted in overridden:  # typed on the command line: relative to the current folder
            continue
        section, key = dotted.split(".")
        values = raw.get(section, {}).get(key) if isinstance(raw.get(section), dict) else None
        for value in values if isinstance(values, list) else [values]:
            if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute():
                continue  # the schema checks the type; absolute paths read the same anywhere
            if _exists(value):
                continue
            message = f"{value}: no such file or folder{in_current_folder(value)}"
            base = next((b for b in bases if _exists(str(b / value))), None)
            if base is not None:
                there = os.path.relpath(base / value)
                raise ConfigError(
                    dotted,
                    f"{message}; {there} exists: run from {os.path.relpath(base)}, or use that "
                    "path",
                    str(file),
                )
            if dotted == "train.init_from" and is_hub_id(value):
                continue  # a published model's hub name (minillm.checkpoint.hub)
            if must_exist:
                raise ConfigError(dotted, message, str(file))


def _other_suffix(path: Path) -> str:
    """`; did you mean configs/tiny.yaml?` where the other YAML suffix names a file, or ""."""
    other = {".yml": ".yaml", ".yaml": ".yml"}.get(path.suffix.lower())
    if other is not None and path.with_suffix(other).is_file():
        return f"; did you mean {path.with_suffix(other)}?"
    return ""


def read_raw_config(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """The YAML file as plain data with the overrides applied, before types and checks (but
    after the check of its paths: see the module's docstring)."""
    path = Path(path)
    file = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("", "no such config file" + _other_suffix(path), file) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("", f"cannot read: {e}", file) from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f"line {where.line + 1}: " if where is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError("", f"invalid YAML: {line}{problem}", file) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            "", "the top level must be a mapping with model, data, train, sample", file
        )
    for override in overrides or []:
        apply_override(raw, override)
    _check_paths(raw, path, override_keys(overrides or []))
    train = raw.get("train")
    if train is None or (isinstance(train, dict) and not train.get("out_dir")):
        raw["train"] = dict(train or {}, out_dir=str(Path("runs") / path.stem))
    return raw
