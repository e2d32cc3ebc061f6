"""The training command line: tyro turns :class:`~jaxformer.run.config.TrainConfig` into
flags (one ``--flag`` per field, help from its comment, choices from its ``Literal``), and
``--config FILE`` supplies the defaults the flags then override."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import tyro
import yaml

from jaxformer.run.config import CHECKING, SECTION_OF, SECTIONS, TrainConfig
from jaxformer.run.recipe import RECIPE_KEYS


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainArgs:
    """A parsed training command line. ``chosen``: the settings given as flags or ``--config``
    file keys (not a replayed ``config.json``'s, which records every setting, but for the
    recipe's: a replay trains with the values its run's rule chose, unless ``--recipe`` is given)."""

    cfg: TrainConfig
    # JSON or YAML file of settings (flag names with _ or -); flags given override it.
    # A run's config.json replays that run (give another --workdir to start a new one).
    config: str | None = None
    # start a new run even if the workdir holds checkpoints (moves the old run aside)
    fresh: Annotated[bool, tyro.conf.FlagCreatePairsOff] = False
    chosen: tyro.conf.Suppress[frozenset[str]] = frozenset()


def parse_train_args(argv: list[str] | None = None, defaults: dict[str, Any] | None = None,
                     description: str = "", prog: str | None = None) -> TrainArgs:
    """Parses a training command line: ``--config FILE`` values replace ``defaults`` (flat names),
    the flags given override both. Exits with status 2 and a message naming the flag on bad input."""
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = prog or Path(sys.argv[0]).name
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    path = pre.parse_known_args(argv)[0].config
    if sum(t == "--config" or t.startswith("--config=") for t in argv) > 1:
        print(f"{prog}: error: --config is given twice; put the settings in one file (flags on the "
              f"command line override it)", file=sys.stderr)
        sys.exit(2)
    settings, replay = {}, False
    try:
        if path is not None:
            settings, replay = read_settings(path)
        base = TrainConfig.flat(**{**(defaults or {}), **settings})
    except ValueError as e:
        print(f"{prog}: error: --config {path!r}: {e}", file=sys.stderr)
        sys.exit(2)
    unchecked = CHECKING.set(False)   # checked below, so a bad value reads as one plain line
    try:
        args = tyro.cli(TrainArgs, args=argv, default=TrainArgs(cfg=base, config=path), prog=prog,
                        description=description, config=(tyro.conf.OmitArgPrefixes,))
    finally:
        CHECKING.reset(unchecked)
    try:
        args = dataclasses.replace(args, cfg=TrainConfig.flat(**args.cfg.settings()))
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    given = given_names(argv)
    chosen = (given & (set(SECTION_OF) | {"config"})) | (set() if replay else set(settings))
    if replay and "recipe" not in given and not args.cfg.run.init_from:
        chosen |= set(RECIPE_KEYS) & set(settings)   # the values the replayed run's rule chose
    return dataclasses.replace(args, chosen=frozenset(chosen))


def given_names(argv: list[str]) -> set[str]:
    """The flat names of the flags in ``argv`` (``--no-pack``: ``pack`` and ``no_pack``)."""
    given = {token[2:].split("=")[0].replace("-", "_") for token in argv if token.startswith("--")}
    return given | {name[3:] for name in given if name.startswith("no_")}


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The flat settings of a JSON or YAML file, or of a run's ``config.json`` (its ``"train"``).
    Raises ``ValueError`` naming the key and the fix (unreadable, not a mapping, a key twice)."""
    return read_settings(path)[0]


def read_settings(path: str | Path) -> tuple[dict[str, Any], bool]:
    """:func:`load_config_file`, and whether the file was a run's ``config.json`` (a replay)."""
    path, data, problem, twice = Path(path), None, None, []
    if path.suffix.lower() not in (".json", ".yaml", ".yml"):
        problem = "only JSON (.json) and YAML (.yaml, .yml) files are read; write the settings as YAML, " \
                  "e.g. 'batch_tokens: 4096'"
    else:
        try:   # utf-8-sig: a byte-order mark (as some editors write) is dropped
            text = path.read_text(encoding="utf-8-sig")
            data = json.loads(text, object_pairs_hook=lambda pairs: _unique(pairs, twice)) \
                if path.suffix == ".json" else yaml.load(text, Loader=_loader(twice))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, yaml.YAMLError) as e:
            problem = f"cannot be read: {e}"
    replay = (isinstance(data, dict) and isinstance(data.get("train"), dict)
              and "src_vocab_size" in (data.get("model") or {}))   # a run's config.json
    if replay:
        data = data["train"]
    elif isinstance(data, dict) and any(isinstance(data.get(part), dict) for part in SECTIONS):
        data = dict(_sections(data, twice))   # TrainConfig's own sections: model:, train:, ...
    names = [str(key).replace("-", "_") for key in data] if isinstance(data, dict) else []
    if problem is None and twice:
        problem = f"{', '.join(map(repr, sorted(set(twice))))} given twice; keep one"
    elif problem is None and not isinstance(data, dict):
        problem = f"must hold a mapping of setting: value, got {type(data).__name__}"
    elif problem is None and len(set(names)) < len(names):   # max_steps and max-steps: which one wins?
        problem = f"{sorted({n for n in names if names.count(n) > 1})} given twice (as _ and -); keep one"
    if problem:
        raise ValueError(problem)
    flat = dict(zip(names, data.values()))
    for name, value in flat.items():   # YAML 1.1 reads 5e-1 as text
        kind = SECTIONS[SECTION_OF[name]].__annotations__[name] if name in SECTION_OF else ""
        if isinstance(value, str) and ("int" in kind or "float" in kind):
            flat[name] = _number(value)
    return flat, replay


def _sections(data: dict[str, Any], twice: list) -> list[tuple[str, Any]]:
    """The settings of a file written in :class:`TrainConfig`'s sections (``train: {max_steps: 5}``),
    flat; a setting under another section than its own, or outside any, is left to be named."""
    pairs = []
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            pairs += [(name if SECTION_OF.get(str(name).replace("-", "_")) == key else f"{key}.{name}", v)
                      for name, v in value.items()]
        else:
            pairs.append((key, value))
    keys = [str(k).replace("-", "_") for k, _ in pairs]
    twice += [k for k in keys if keys.count(k) > 1]
    return pairs


def _number(text: str) -> Any:
    """``text`` as an int or a float where it is one, else unchanged."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _unique(pairs: list[tuple[str, Any]], twice: list) -> dict[str, Any]:
    """A mapping of ``pairs``; keys given twice are added to ``twice`` (JSON and PyYAML keep the last)."""
    keys = [key for key, _ in pairs]
    twice += [key for key in keys if keys.count(key) > 1]
    return dict(pairs)


def _loader(twice: list) -> type:
    """A safe YAML loader whose mappings report keys given twice into ``twice``."""
    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            return _unique([(self.construct_object(k, deep=deep), self.construct_object(v, deep=deep))
                            for k, v in node.value], twice)

    return Loader
