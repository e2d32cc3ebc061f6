"""The training recipe a corpus gets (issue 53): vocabulary size, dropout, attention dropout,
label smoothing and model shape, from statistics read before sentencepiece is trained.

:func:`recipe_for` is the one rule (``CorpusShape -> Recipe``), :data:`RULE` its table;
:func:`choose` keeps what the user gave; :func:`describe` is the run log's line. The run
plan (:mod:`jaxformer.train.plan`) applies it to a fresh run under ``--recipe auto`` and
``jaxformer-prepare`` to the vocabulary size; resumes and fine-tunes keep their values.
No JAX here: ``jaxformer-prepare`` and the flag parser read it too.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable
from typing import Any

CHARACTER_COVERAGE = 0.9995   # sentencepiece's, as jaxformer.data.tokenizer trains it


@dataclasses.dataclass(frozen=True)
class CorpusShape:
    """What the rule reads of a training corpus: ``pairs``; ``characters`` on both sides;
    ``alphabet``, the distinct characters that cover :data:`CHARACTER_COVERAGE` of them
    (sentencepiece's required characters, each a piece of the vocabulary)."""

    pairs: int
    characters: int
    alphabet: int

    @property
    def mean_characters(self) -> float:
        """Characters per sentence, source and target alike."""
        return self.characters / max(2 * self.pairs, 1)

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, str]]) -> CorpusShape:
        """The shape of ``(source, target)`` pairs, read once."""
        counts: collections.Counter[str] = collections.Counter()
        n = 0
        for src, tgt in pairs:
            counts.update(src)
            counts.update(tgt)
            n += 1
        total = sum(counts.values())
        covered = alphabet = 0
        for _, count in counts.most_common():
            if covered >= CHARACTER_COVERAGE * total:
                break
            covered += count
            alphabet += 1
        return cls(pairs=n, characters=total, alphabet=alphabet)

    def __str__(self) -> str:
        return (f"{self.pairs:,} pairs, {self.characters:,} characters ({self.mean_characters:.0f} per "
                f"sentence), alphabet {self.alphabet:,}")


# The settings a recipe decides (flat TrainConfig names). The model shape is one unit: a
# --preset or any shape flag given leaves all of SHAPE_KEYS to the user.
SHAPE_KEYS = ("d_model", "d_ff", "num_layers", "num_heads")
RECIPE_KEYS = ("vocab_size", "dropout_rate", "attention_dropout_rate", "label_smoothing", *SHAPE_KEYS)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One row of :data:`RULE`: the values it sets; ``None`` leaves the setting at its default
    (the defaults: ``--vocab-size 8000``, the preset's dropout and shape, no attention dropout,
    ``--label-smoothing 0.1``). ``reason``: the row's condition, in words."""

    vocab_size: int | None = None
    dropout_rate: float | None = None
    attention_dropout_rate: float | None = None
    label_smoothing: float | None = None
    d_model: int | None = None
    d_ff: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    reason: str = ""

    def settings(self) -> dict[str, Any]:
        """The values set, by flat setting name."""
        return {k: getattr(self, k) for k in RECIPE_KEYS if getattr(self, k) is not None}

    def flags(self) -> list[str]:
        """The values set as ``train.py`` flags (``["--vocab-size", "4000", ...]``)."""
        return [part for k, v in self.settings().items() for part in ("--" + k.replace("_", "-"), str(v))]


# (most training pairs, recipe): the first row whose bound holds the corpus is its recipe.
# One row, the defaults, while the rows measured better at the default budget (dropout on
# corpora of up to ~15,000 pairs: benchmarks/README.md, "Recipes for small corpora") rest on
# one seed of one pair: every corpus gets the defaults, so --recipe auto trains as fixed.
RULE: tuple[tuple[float, Recipe], ...] = (
    (math.inf, Recipe(reason="the defaults at any size until the small-corpus rows are confirmed")),
)


def recipe_for(shape: CorpusShape, rule: tuple[tuple[float, Recipe], ...] | None = None) -> Recipe:
    """The recipe of a corpus of ``shape``: the first row of ``rule`` (default :data:`RULE`)
    whose bound on training pairs holds it. A pure function of the shape; the table
    (docs/training.md, "The recipe follows the corpus"):

    ============== ========== ============ ================= =============== ==============
    training pairs vocabulary dropout      attention dropout label smoothing model
    ============== ========== ============ ================= =============== ==============
    any            8000       preset's (0) 0                 0.1             preset (small)
    ============== ========== ============ ================= =============== ==============

    (the default run's values; the measured candidates for small corpora are in
    benchmarks/README.md, "Recipes for small corpora"; issue 53)."""
    for bound, recipe in RULE if rule is None else rule:
        if shape.pairs <= bound:
            return recipe
    raise ValueError(f"the recipe rule has no row for {shape.pairs:,} pairs: its last row must hold any size")


def choose(recipe: Recipe, chosen: Iterable[str], settings: dict[str, Any]) -> dict[str, Any]:
    """The settings ``recipe`` changes in a run whose flat ``settings`` were given as ``chosen``
    (flags, ``--config`` keys): none the user chose; no model shape beside a chosen ``preset``
    or shape key; no attention dropout under a fused ``attention_backend``, which has none."""
    chosen = set(chosen)
    changes = {k: v for k, v in recipe.settings().items() if k not in chosen}
    if chosen & {"preset", *SHAPE_KEYS}:
        changes = {k: v for k, v in changes.items() if k not in SHAPE_KEYS}
    if settings.get("attention_backend") not in (None, "reference"):
        changes.pop("attention_dropout_rate", None)
    return changes


def resumed(record: dict[str, Any], chosen: Iterable[str]) -> dict[str, Any]:
    """The settings a resume takes from its run's flat ``record`` (``config.json``'s ``"train"``):
    ``recipe`` and each setting it decides, unless ``chosen`` now; the rule is not asked again.
    An older record has no ``recipe``: its run trained with the defaults, ``fixed``."""
    chosen = set(chosen)
    kept = {k: record[k] for k in RECIPE_KEYS if k in record and k not in chosen}
    if record and "recipe" not in chosen:
        kept["recipe"] = record.get("recipe", "fixed")
    return kept


_WORDS = (("vocab_size", "vocabulary {}"), ("dropout_rate", "dropout {:g}"),
          ("attention_dropout_rate", "attention dropout {:g}"), ("label_smoothing", "label smoothing {:g}"),
          ("d_model", "model d_model {}"), ("num_layers", "{} layers"), ("num_heads", "{} heads"),
          ("d_ff", "d_ff {}"))


def describe(shape: CorpusShape, recipe: Recipe, values: dict[str, Any], chosen: Iterable[str]) -> str:
    """The log's line: the corpus, the ``values`` of the recipe's settings the run uses (as the
    architecture has them; ``num_layers``: each stack's) and why: the rule's row, the flags given."""
    given = sorted(set(chosen) & {*RECIPE_KEYS, "preset"})
    why = f"rule: {recipe.reason}"
    if given:
        why += f"; given: {', '.join('--' + k.replace('_', '-') for k in given)}"
    chose = ", ".join(words.format(values[k]) for k, words in _WORDS if k in values)
    return f"recipe (--recipe auto): {shape}: {chose} ({why}; --recipe fixed: the defaults)"
