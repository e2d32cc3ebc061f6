"""A run's decoding defaults from its record (``config.json``), without JAX: both engines
(:class:`~jaxformer.decode.translator.Translator` and :mod:`jaxformer.serve.ct2_engine`) read
them here, so a flag left out means the same on either."""

from __future__ import annotations

import math
from typing import Any

from jaxformer.model.validation import check_count, check_real

# §6.1's beam 4 and α 0.6; the rest off
FALLBACK = dict(beam_size=4, alpha=0.6, length_normalization="gnmt", early_stopping=False,
                no_repeat_ngram_size=0, repetition_penalty=1.0)


def decoding_defaults(record: dict[str, Any]) -> dict[str, Any]:
    """The options :data:`FALLBACK` names: an imported model's generation config (``length_penalty``
    is α), else the run's dev/test decoding (``train``), else :data:`FALLBACK`."""
    generation, train = record.get("generation", {}), record.get("train", {})
    return {name: generation.get("length_penalty" if name == "alpha" else name, train.get(name, value))
            for name, value in FALLBACK.items()}


def forced_eos(record: dict[str, Any]) -> bool | None:
    """Whether a hypothesis that reaches the output limit ends with eos there: an imported
    model's rule (its ``forced_eos_token_id``, transformers' ``ForcedEOSTokenLogitsProcessor``;
    without one ``generate`` cuts it at ``max_length``); ``None`` for a run without that rule (our
    own), whose strategies keep their own (:func:`~jaxformer.decode.strategies.strategy_for`)."""
    value = record.get("generation", {}).get("forced_eos")
    return None if value is None else bool(value)


def length_limits(record: dict[str, Any], max_len_a: float | None,
                  max_len_b: int | None) -> tuple[float, int]:
    """The checked ``(a, b)`` of the output limit a · source length + b: given, else an imported
    model's ``max_length`` (a = 0, b = max_length - 1: Hugging Face counts the decoder start
    token), else 1 and 50. ``ValueError``: ``a`` not a finite number ≥ 0, ``b`` not an integer,
    a + b < 1."""
    generation = record.get("generation", {})
    if max_len_a is None and max_len_b is None and generation.get("max_length"):
        max_len_a, max_len_b = 0.0, int(generation["max_length"]) - 1
    a = check_real("max_len_a", 1.0 if max_len_a is None else max_len_a, minimum=0.0)
    return a, check_count("max_len_b", 50 if max_len_b is None else max_len_b,
                          minimum=math.ceil(1 - a))   # a + b ≥ 1: room for a token
