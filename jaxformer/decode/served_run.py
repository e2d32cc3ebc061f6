"""A trained or imported run loaded to translate (:class:`ServedRun`): its record, tokenizer,
languages, decoding rules and the checkpoint chosen, read once and handed to either engine
(:mod:`jaxformer.decode.engine`) and to every exporter. Reading it imports no JAX (the
CTranslate2 engine never does); :meth:`ServedRun.restore_params` does.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from jaxformer.data.tokenizer import load_tokenizer, with_languages
from jaxformer.decode.defaults import decoding_defaults, forced_eos, length_limits
from jaxformer.model.config import TransformerConfig
from jaxformer.run.checkpoint_files import Checkpoint, candidates
from jaxformer.run.directory import RunDir

LANGUAGE_FLAGS = {"src_lang": "--src-lang", "tgt_lang": "--tgt-lang"}   # the tokenizer's names, the flags


@dataclasses.dataclass(frozen=True)
class ServedRun:
    """One run directory ready to translate.

    Attributes:
      root: the run directory.
      record: its ``config.json``.
      config: the model's :class:`~jaxformer.model.config.TransformerConfig`.
      tokenizer: its tokenizer (:func:`~jaxformer.data.tokenizer.load_tokenizer`), a multilingual
        one set to the languages asked or recorded.
      checkpoints: the checkpoints that can serve, preferred first
        (:func:`~jaxformer.run.checkpoint_files.candidates`; a restore falls back along them).
      defaults: the decoding options of :data:`jaxformer.decode.defaults.FALLBACK`'s names: an
        imported model's generation config, else the run's dev/test decoding, else §6.1's.
      max_len_a, max_len_b: the output limit a · source length + b (eos included; never more
        than the model's ``max_len``).
      forced_eos: an imported model's rule at that limit (:func:`~jaxformer.decode.defaults.forced_eos`:
        eos there, or a cut without it as ``generate`` without ``forced_eos_token_id``); ``None``
        for our runs, whose strategies keep their own.
    """

    root: Path
    record: dict[str, Any]
    config: TransformerConfig
    tokenizer: Any
    checkpoints: tuple[Checkpoint, ...]
    defaults: dict[str, Any]
    max_len_a: float
    max_len_b: int
    forced_eos: bool | None = None

    @classmethod
    def load(cls, workdir: str | Path, *, checkpoint: str | int = "auto", max_len_a: float | None = None,
             max_len_b: int | None = None, src_lang: str | None = None,
             tgt_lang: str | None = None) -> ServedRun:
        """Reads run ``workdir``: ``checkpoint`` as :func:`~jaxformer.run.checkpoint_files.candidates`
        takes it; ``max_len_a``, ``max_len_b`` as :func:`~jaxformer.decode.defaults.length_limits`;
        ``src_lang``, ``tgt_lang`` a multilingual model's languages (its codes: M2M100 ``en``,
        NLLB ``eng_Latn``; ``None``: the run's).

        Raises ``FileNotFoundError`` without ``config.json``, the tokenizer or such a checkpoint;
        ``ValueError`` for a damaged (or Hugging Face's) ``config.json``, a language not the
        model's or given to a model of one pair, limits out of range.
        """
        record = RunDir(workdir).read_run_record()
        tokenizer = load_tokenizer(workdir, record)
        if src_lang or tgt_lang:
            tokenizer = with_languages(tokenizer, src_lang, tgt_lang)
        max_len_a, max_len_b = length_limits(record, max_len_a, max_len_b)
        return cls(Path(workdir), record, TransformerConfig.from_dict(record["model"]), tokenizer,
                   tuple(candidates(workdir, checkpoint)), decoding_defaults(record), max_len_a, max_len_b,
                   forced_eos(record))

    @property
    def checkpoint(self) -> Checkpoint:
        """The preferred checkpoint (an engine may fall back to a later one: its ``checkpoint``)."""
        return self.checkpoints[0]

    @property
    def multilingual(self) -> bool:
        """Whether the model translates between many languages (M2M100, NLLB)."""
        return hasattr(self.tokenizer, "with_languages")

    @property
    def languages(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``(source codes, target codes)`` the run translates: a multilingual model's every code,
        else the run's recorded pair (``()`` where it records none)."""
        if self.multilingual:
            codes = tuple(self.tokenizer.codes)
            return codes, codes
        source, target = self.record.get("source_language"), self.record.get("target_language")
        return (source,) if source else (), (target,) if target and target != "xx" else ()

    def with_languages(self, src_lang: str | None, tgt_lang: str | None) -> ServedRun:
        """This run translating ``src_lang`` → ``tgt_lang`` (``None``: as now); raises
        ``ValueError`` as :meth:`load`."""
        return dataclasses.replace(self, tokenizer=with_languages(self.tokenizer, src_lang, tgt_lang))

    def tokenizer_for(self, src_lang: str | None = None, tgt_lang: str | None = None):
        """The tokenizer translating ``src_lang`` → ``tgt_lang`` (``None``: the run's), checked as
        :meth:`check_languages`; a model of one pair takes its own codes only. ``ValueError``
        otherwise, naming the codes it has."""
        if not self.multilingual:
            sources, targets = self.languages
            wrong = [(side, code, have) for side, code, have in (("source", src_lang, sources),
                                                                 ("target", tgt_lang, targets))
                     if code is not None and code not in have]
            if wrong:
                raise ValueError("; ".join(f"this run translates one pair and its {side} language is "
                                           f"{have[0] if have else 'not recorded'}, not {code!r}"
                                           for side, code, have in wrong) + ".")
            return self.tokenizer
        run = self.with_languages(src_lang, tgt_lang) if src_lang or tgt_lang else self
        run.check_languages()
        return run.tokenizer

    def check_languages(self) -> None:
        """Raises ``ValueError`` for a multilingual model whose source or target language neither
        the run records nor the command gave, naming the flags (before any work is done)."""
        if not self.multilingual:
            return
        tokenizer = self.tokenizer
        missing = [name for name in LANGUAGE_FLAGS if getattr(tokenizer, name) is None]
        if missing:
            sides = " or ".join("source" if name == "src_lang" else "target" for name in missing)
            flags = " and ".join(LANGUAGE_FLAGS[name] for name in missing)
            example = "en, de" if tokenizer.kind == "m2m100" else "eng_Latn, deu_Latn"
            raise ValueError(f"this {tokenizer.kind} model translates between many languages, and its run "
                             f"records no {sides} language: pass {flags} (its codes, such as {example}).")

    def restore_params(self, abstract_params: Any = None, report=None) -> tuple[Any, Checkpoint]:
        """``(params, checkpoint)``: the first readable of :attr:`checkpoints`
        (:func:`jaxformer.run.checkpoints.restore_params`, which reports a fallback through ``report``,
        default stderr) laid out as ``abstract_params`` (default: plain arrays on one device).
        Imports JAX. Raises ``CheckpointError`` (none readable), ``CheckpointMismatchError``."""
        import jax
        import jax.numpy as jnp
        from flax import linen as nn

        from jaxformer.model.transformer import Transformer
        from jaxformer.run.checkpoints import restore_params

        if abstract_params is None:
            ids = jnp.ones((1, 8), jnp.int32)
            model = Transformer(self.config)
            abstract_params = nn.unbox(jax.eval_shape(
                lambda: model.init(jax.random.key(0), ids, ids)["params"]))
            device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            abstract_params = jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract_params)
        return restore_params(self.checkpoints, abstract_params,
                              report or (lambda message: print(message, file=sys.stderr)))
