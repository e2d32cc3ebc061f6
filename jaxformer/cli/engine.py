"""Which engine decodes a ``jaxformer-translate`` command, and the rules it decodes by.

``--engine auto`` picks CTranslate2 (:mod:`jaxformer.serve`) on a CPU where it is installed
and the flags ask nothing only JAX honours (:attr:`TranslateArgs.jax_flags`); JAX otherwise:
on a GPU or TPU, or for such a request. The choice and its rules go to stderr once.
"""

from __future__ import annotations

import importlib.util

from jaxformer.cli.translate_flags import TranslateArgs
from jaxformer.run.platform import accelerator_present
from jaxformer.serve.ct2_engine import INSTALL


def ct2_installed() -> bool:
    """Whether ``ctranslate2`` can be imported (found, not imported)."""
    return importlib.util.find_spec("ctranslate2") is not None


def choose_engine(args: TranslateArgs) -> tuple[str, str]:
    """``("ct2" | "jax", why)`` for these (checked) flags; ``why`` is a few words."""
    if args.engine != "auto":
        return args.engine, "--engine"
    if args.jax_flags:
        return "jax", f"{' and '.join(args.jax_flags)} need{'s' * (len(args.jax_flags) == 1)} it"
    if args.ct2_flags:
        return "ct2", f"{' and '.join(args.ct2_flags)} ask{'s' * (len(args.ct2_flags) == 1)} for it"
    if not ct2_installed():
        return "jax", f"ctranslate2 is not installed; for CPU serving: {INSTALL}"
    if accelerator_present():
        return "jax", "a GPU or TPU is here"
    return "ct2", "a CPU, ctranslate2 installed"


def rules(engine: str, search, beam_size: int, sampling: bool) -> str:
    """The decoding rules ``engine`` applies with ``search`` (a strategy or ``CT2Search``)."""
    if sampling:
        return "sampling"
    if beam_size == 1:
        return "greedy"
    if engine == "ct2":
        return (f"beam {beam_size}, CTranslate2's rules: length penalty |Y|^{search.alpha}, a sentence ends "
                f"once {beam_size} hypotheses ended, one length limit per batch of similar sources, "
                f"repetition penalty {search.repetition_penalty:g} on the logits")
    penalty = "|Y|" if search.length_normalization == "hf" else "((5+|Y|)/6)"
    stop = "ends once k hypotheses ended" if search.early_stopping else "exact stop"
    return f"beam {beam_size}, length penalty {penalty}^{search.alpha}, {stop}, a length limit per sentence"
