"""The run configuration of `glm53 train`: `--config run.toml`, the resolved flags in DIR/run.toml, resume checks.

No tensors here. Keys are the train command's flags (`seq-len = 128` or `seq_len = 128`), found from the parser
itself, so a flag any module adds is a key too. Precedence: the command line, then --config FILE, then (with
--resume) the resumed run's own run.toml, then the defaults. Resuming compares the resolved values with the
saved ones: a changed key that alters the run (anything not in HARMLESS) is an error naming it unless
`--override KEY`; a changed harmless key (logging, save cadence, layout, speed) is allowed and said.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tomllib

RUN_CONFIG = "run.toml"
# Never read from a file, never written: they say how to read the configuration or where this run goes.
NOT_STORED = frozenset({"config", "override", "func", "command"})
# Taken from the command line only (a resumed run's value is not inherited): where to go and how to run here.
NOT_INHERITED = NOT_STORED | {
    "resume",
    "save",
    "overwrite",
    "dp",
    "tp",
    "ep",
    "cp",
    "device",
    "bf16",
    "threads",
    "compile",
    "no_export",
    "activation_checkpointing",
    "init",
}
# May change on resume without --override (said in the log): they do not change what the run computes.
HARMLESS = frozenset(
    {
        "steps",
        "log_every",
        "save_every",
        "keep_last",
        "tensorboard",
        "eval_data",
        "eval_every",
        "cache_dir",
        "overwrite",
        "save",
        "resume",
        "threads",
        "compile",
        "activation_checkpointing",
        "dp",
        "tp",
        "ep",
        "cp",
        "device",
        "bf16",
        "no_export",
        "init",
    }
)


class RunConfigError(ValueError):
    """A bad --config file, key or value, or a resume that would change the run; the message names the key."""


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's options by destination (argparse keeps them in `_actions`, its only record of them)."""
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", *NOT_STORED)}


def explicit(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations given on the command line `argv` (parsed again with every default suppressed)."""
    saved = {a: a.default for a in parser._actions}
    try:
        for a in parser._actions:
            a.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(argv)))
    finally:
        for a, default in saved.items():
            a.default = default


def _convert(action: argparse.Action, key: str, value: object, where: str) -> object:
    """A TOML value -> what argparse would give for it (the flag's own type and choices check it)."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise RunConfigError(f"{where}: {key} must be true or false, got {value!r}")
        return value
    if isinstance(value, dict):
        raise RunConfigError(f"{where}: {key} must be a value, not a table")
    many = action.nargs not in (None, "?")
    items = value if isinstance(value, list) else [value]
    if not many and isinstance(value, list):
        raise RunConfigError(f"{where}: {key} takes one value, got a list")
    if isinstance(action.nargs, int) and len(items) != action.nargs:
        raise RunConfigError(f"{where}: {key} takes {action.nargs} values, got {len(items)}")
    out = []
    for item in items:
        if action.nargs == "?" and item is True and action.const is not None:
            out.append(action.const)
            continue
        if isinstance(item, (bool, dict, list)) or item is None:
            raise RunConfigError(f"{where}: {key} must be a {'list of ' if many else ''}number or string, got {item!r}")
        try:
            converted = action.type(str(item)) if action.type else str(item)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            raise RunConfigError(f"{where}: {key} = {item!r}: {e}") from None
        if action.choices is not None and converted not in action.choices:
            raise RunConfigError(f"{where}: {key} = {item!r}: expected one of {', '.join(map(str, action.choices))}")
        out.append(converted)
    return out if many else out[0]


def read(parser: argparse.ArgumentParser, path: str) -> dict[str, object]:
    """A run configuration file -> {destination: value}, every key a flag of `parser`, every value checked."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise RunConfigError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise RunConfigError(f"{path}: not valid TOML ({e})") from None
    except UnicodeDecodeError as e:
        raise RunConfigError(f"{path}: not UTF-8 text ({e})") from None
    actions, out = _actions(parser), {}
    for key, value in raw.items():
        dest = key.replace("-", "_")
        if dest not in actions:
            raise RunConfigError(f"{path}: unknown key {key!r} (keys are the train flags without '--', e.g. seq-len)")
        if dest in out:
            raise RunConfigError(f"{path}: {key!r} is given twice (as {dest.replace('_', '-')} and {dest})")
        out[dest] = _convert(actions[dest], key, value, path)
    return out


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else json.dumps(str(value))
    if isinstance(value, (int, str)):
        return json.dumps(value) if isinstance(value, str) else str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} into a run configuration")


def dumps(values: dict[str, object]) -> str:
    """The resolved configuration as TOML (None values are left out: absent means the flag's default)."""
    lines = ["# glm53 train: the resolved flags of this run (--resume reads them back)"]
    for dest in sorted(values):
        if dest not in NOT_STORED and values[dest] is not None:
            lines.append(f"{dest.replace('_', '-')} = {_toml_value(values[dest])}")
    return "\n".join(lines) + "\n"


def write(path: str, values: dict[str, object]) -> None:
    """Write DIR/run.toml (a temporary file renamed into place: never half-written)."""
    os.makedirs(path, exist_ok=True)
    target = os.path.join(path, RUN_CONFIG)
    tmp = f"{target}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(dumps(values))
    os.replace(tmp, target)


def stored(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, object]:
    actions = _actions(parser)
    return {k: v for k, v in vars(args).items() if k in actions}


def _same(a: object, b: object) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def resolve(
    parser: argparse.ArgumentParser, argv: list[str], args: argparse.Namespace
) -> tuple[argparse.Namespace, list[str]]:
    """Apply --config and the resumed run's run.toml to parsed `args` (module docstring) -> (args, notes to log).

    A resume that changes a key of the run (not HARMLESS) without `--override KEY` raises RunConfigError."""
    given = explicit(parser, argv)
    actions = _actions(parser)
    from_file = read(parser, args.config) if getattr(args, "config", None) else {}
    for dest, value in from_file.items():
        if dest not in given:
            setattr(args, dest, value)
    given |= set(from_file)
    overrides = {k.replace("-", "_") for k in (getattr(args, "override", None) or [])}
    unknown = sorted(overrides - set(actions))
    if unknown:
        raise RunConfigError(f"--override {unknown[0]}: not a train flag")
    notes: list[str] = []
    resume = getattr(args, "resume", None)
    saved_file = os.path.join(resume, RUN_CONFIG) if resume else None
    if not saved_file or not os.path.isfile(saved_file):
        return args, notes
    try:
        saved = read(parser, saved_file)
    except RunConfigError as e:
        raise RunConfigError(f"--resume {resume}: its {RUN_CONFIG} cannot be read back ({e})") from None
    for dest in actions:
        if dest in NOT_INHERITED or dest in given:
            continue
        setattr(args, dest, saved.get(dest, actions[dest].default))
    for dest in sorted(actions):
        if dest in NOT_STORED or dest in ("resume", "save", "overwrite"):
            continue
        old, new = saved.get(dest, actions[dest].default), getattr(args, dest)
        if _same(old, new):
            continue
        flag = "--" + dest.replace("_", "-")
        if dest in HARMLESS or dest in overrides:
            notes.append(f"{flag}: {old!r} -> {new!r}" + (" (--override)" if dest in overrides else ""))
        else:
            raise RunConfigError(
                f"--resume {resume}: {flag} {new!r} differs from the run's {old!r} (in {saved_file}); "
                f"it changes the run: keep it, or pass --override {dest.replace('_', '-')} to change "
                f"it anyway"
            )
    return args, notes


__all__ = ["RunConfigError", "HARMLESS", "RUN_CONFIG", "dumps", "explicit", "read", "resolve", "stored", "write"]
