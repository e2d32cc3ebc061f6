"""The training command line and ``--config`` files: one ``--flag`` per
:class:`~jaxformer.run.config.TrainConfig` field, its help from
:data:`~jaxformer.run.flag_help.HELP` and its choices from the value's owner."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import typing
from pathlib import Path
from typing import Any

from jaxformer.run.config import TrainConfig, _base_type, _choices
from jaxformer.run.flag_help import HELP


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after each help, unless the help already says its
    default in words ("(default: the preset's)"): it printed both, e.g. "(default: None)"."""

    def _get_help_string(self, action):
        help_text = action.help or ""
        return help_text if "(default:" in help_text else super()._get_help_string(action)


def build_parser(defaults: dict[str, Any] | None = None, description: str = "",
                 prog: str | None = None, *, typed_only: bool = False) -> argparse.ArgumentParser:
    """An argparse parser with one ``--flag`` per :class:`TrainConfig` field (help from
    :data:`HELP`, choices where the set is fixed), plus ``--config FILE`` and ``--fresh``.
    ``typed_only``: no defaults at all (``argparse.SUPPRESS``), so a namespace it parses
    holds exactly the flags given."""
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False,
                                     formatter_class=_DefaultsHelp,
                                     argument_default=argparse.SUPPRESS if typed_only else None)
    parser.add_argument("--config", metavar="FILE",
                        help="JSON or YAML file of run settings (flag names with _ or -); flags on the "
                             "command line override it. A run's own config.json replays that run "
                             "(give another --workdir to start a new one).")
    add_config_flags(parser, [f.name for f in dataclasses.fields(TrainConfig)], defaults,
                     typed_only=typed_only)
    parser.add_argument("--fresh", action="store_true",
                        help="start a new run even if the workdir holds checkpoints "
                             "(moves the old run's files aside, deletes nothing)")
    return parser


def add_config_flags(parser: argparse.ArgumentParser, names: list[str],
                     defaults: dict[str, Any] | None = None, *, typed_only: bool = False) -> None:
    """Adds the ``--flag`` of each named :class:`TrainConfig` field, as :func:`build_parser`
    does (another tool that takes some of the training flags, e.g. ``jaxformer-compile``)."""
    hints = typing.get_type_hints(TrainConfig)
    choices = _choices()
    defaults = defaults or {}
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name in names:
        field = fields[name]
        flag = "--" + name.replace("_", "-")
        default = argparse.SUPPRESS if typed_only else defaults.get(name, field.default)
        kind = _base_type(hints[name])
        help_text = HELP.get(name, "")
        if name in defaults and defaults[name] != field.default:   # this tool's own default replaces
            help_text = re.sub(r"\s*\(default: [^)]*\)", "", help_text)   # the field's, in words
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif name in choices:
            parser.add_argument(flag, type=kind, default=default, choices=choices[name], help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=default, metavar=kind.__name__.upper(),
                                help=help_text)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Run settings from a JSON or YAML file: a flat mapping of :class:`TrainConfig` field
    names (``batch_tokens`` or ``batch-tokens``), or a run's ``config.json`` (its ``"train"``
    record is used).

    Raises:
      ValueError: unreadable file, not a mapping, an unknown name or a value of the wrong
        type; the message names the file, the key and the fix.
    """
    return _read_config_file(path)[0]


def _read_config_file(path: str | Path) -> tuple[dict[str, Any], bool]:
    """:func:`load_config_file`, and whether the file was a run's ``config.json`` (a
    replay, which records every setting, not only those the user chose)."""
    import yaml

    loader = _unique_key_loader()
    path = Path(path)
    if path.suffix.lower() in (".toml", ".ini", ".cfg"):
        raise ValueError(f"--config {str(path)!r}: only JSON (.json) and YAML (.yaml, .yml) files are "
                         f"read; write the settings as YAML, e.g. 'batch_tokens: 4096'.")
    try:   # utf-8-sig: a byte-order mark (as some editors write) is dropped, for JSON as for YAML
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {str(path)!r} cannot be read: {e}") from e
    try:   # YAML is a superset of JSON, but JSON's own errors are clearer for .json files
        data = (json.loads(text, object_pairs_hook=_unique_keys) if path.suffix == ".json"
                else yaml.load(text, Loader=loader))
    except (json.JSONDecodeError, yaml.YAMLError, _DuplicateKey) as e:
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise ValueError(f"--config {str(path)!r} is not valid {kind}: {e}") from e
    run_record = isinstance(data, dict) and isinstance(data.get("train"), dict) and "model" in data
    if run_record:
        data = data["train"]   # a run's config.json: replay its settings
    if not isinstance(data, dict):
        raise ValueError(f"--config {str(path)!r} must hold a mapping of setting: value (JSON or "
                         f"YAML), got {type(data).__name__}.")
    hints = typing.get_type_hints(TrainConfig)
    choices = _choices()
    out, problems, spelled = {}, [], {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in hints:
            problems.append(f"unknown setting {key!r}")
            continue
        if name in spelled:   # max_steps and max-steps: which one would win is not the user's choice
            problems.append(f"{spelled[name]!r} and {key!r} are the same setting; keep one")
            continue
        spelled[name] = key
        kind = _base_type(hints[name])
        if isinstance(value, str) and kind in (int, float):
            # YAML 1.1 reads 5e-1 and -5e-1 (no dot) as strings; a flag's type() takes them
            try:
                value = kind(value)
            except ValueError:
                pass
        if value is None and type(None) not in typing.get_args(hints[name]):
            problems.append(f"{key!r} must be {kind.__name__}, got null (leave it out for the default)")
            continue
        ok = (value is None or (isinstance(value, kind) and not (kind is int and isinstance(value, bool)))
              or (kind is float and isinstance(value, int) and not isinstance(value, bool)))
        if not ok:
            hint = (" (YAML reads no, yes, on, off, true and false as booleans: put the value in quotes, "
                    f"e.g. {key}: 'no')" if kind is str and isinstance(value, bool) else "")
            problems.append(f"{key!r} must be {kind.__name__}, got {value!r}{hint}")
            continue
        if value is not None and name in choices and value not in choices[name]:
            problems.append(f"{key!r} must be one of {', '.join(map(str, choices[name]))}; got {value!r}")
            continue
        out[name] = float(value) if kind is float and value is not None else value
    if problems:
        raise ValueError(f"--config {str(path)!r}: " + "; ".join(problems) +
                         ". Settings are the flag names without dashes, e.g. batch_tokens; "
                         "see --help.")
    return out, run_record


class _DuplicateKey(ValueError):
    """A key written twice in one mapping of a --config file."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: a key given twice is an error, not the last one."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"{key!r} is given twice; keep one")
        out[key] = value
    return out


def _unique_key_loader():
    """A ``yaml.SafeLoader`` whose mappings refuse a key given twice (PyYAML keeps the last)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
            twice = sorted({str(k) for k in keys if keys.count(k) > 1})
            if twice:
                raise _DuplicateKey(f"{', '.join(map(repr, twice))} given twice "
                                    f"(line {node.start_mark.line + 1}); keep one")
            return super().construct_mapping(node, deep=deep)

    return Loader


def parse_train_args(argv: list[str] | None = None, defaults: dict[str, Any] | None = None,
                     description: str = "", prog: str | None = None
                     ) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """Parses a training command line: ``--config FILE`` values replace the defaults,
    then the flags given override both. Exits with status 2 and a message on bad input.

    The namespace's ``chosen`` is the set of settings the user chose rather than left at
    their defaults: the flags given (however spelt: ``--vocab-size=500``, an abbreviation
    argparse accepts) and the keys of a ``--config`` settings file. A run's replayed
    ``config.json`` records every setting of that run, chosen then, not now: none of its
    keys count.
    """
    parser = build_parser(defaults, description, prog)
    known, _ = parser.parse_known_args(argv)
    chosen: set[str] = set()
    if known.config:
        try:
            settings, run_record = _read_config_file(known.config)
        except ValueError as e:
            parser.error(str(e))
        chosen = set() if run_record else set(settings)
        parser.set_defaults(**settings)
    args = parser.parse_args(argv)
    typed = build_parser(typed_only=True).parse_args(argv)   # holds only the flags given
    args.chosen = frozenset(chosen | set(vars(typed)))
    return parser, args


def from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
