"""A trained run as a :class:`Translator`: beam search, n-best lists, sampling and
cross-attention maps (the command line around it: :mod:`jaxformer.cli.translate`)."""

from __future__ import annotations

import contextlib
import hashlib
import math
import numbers
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxformer.data.tokenizer import load_tokenizer, with_languages
from jaxformer.decode import constraint_inputs
from jaxformer.decode.defaults import decoding_defaults, length_limits
from jaxformer.decode.evaluation import Evaluator
from jaxformer.decode.exported import ExportCache
from jaxformer.decode.penalties import penalties
from jaxformer.decode.strategies import Beam, Sample, strategy_for
from jaxformer.model.config import TransformerConfig
from jaxformer.model.matmul import cast_matmul_weights
from jaxformer.model.scan import unrolled
from jaxformer.model.sharding import Layout
from jaxformer.model.transformer import Transformer
from jaxformer.model.validation import check_count
from jaxformer.run.checkpoints import RunCheckpoints
from jaxformer.run.directory import RunDir


class Translator:
    """A trained run (``workdir``) ready to translate: its config, tokenizer and parameters on one
    device or a ``mesh`` (data-parallel, parameters laid out as in training). Decoding options left
    ``None`` take :attr:`defaults`: an imported model's generation config, else the run's dev/test
    decoding, else §6.1's beam 4, α 0.6.

    Args:
      batch_size: the most sentences per decoding batch.
      checkpoint: ``"auto"`` (best by dev BLEU, else latest), ``"best"``, ``"latest"``,
        ``"averaged"`` or a training step (int).
      max_len_a, max_len_b: at most ``a * source length + b`` tokens (eos included); ``None``
        (both): an imported model's ``max_length`` (a = 0, b = max_length - 1: Hugging Face
        counts the decoder start token), else 1 and 50.
      exported, staged: keep exported decoders in ``RUN/jax_cache/exported``; beam search in
        stages (:mod:`jaxformer.decode.exported`, :mod:`~jaxformer.decode.staged`); not with a mesh.
      matmul_dtype: the weight matmuls' dtype (:mod:`jaxformer.model.matmul`); ``None``: the run's.
      src_lang, tgt_lang: a multilingual run's languages (M2M100 ``en``, NLLB ``eng_Latn``; the
        target is forced as the first token); ``None``: the run's. Others refuse them.

    Raises ``FileNotFoundError`` without ``config.json``, the tokenizer or the checkpoint asked for;
    ``ValueError`` for a damaged (or Hugging Face's) ``config.json``, a language not the model's,
    a ``batch_size`` not an integer ≥ 1, a ``max_len_a`` not a finite number ≥ 0, a ``max_len_b``
    not an integer, a + b < 1.
    """

    def __init__(self, workdir: str | Path, batch_size: int = 32, checkpoint: str | int = "auto",
                 max_len_a: float | None = None, max_len_b: int | None = None, exported: bool = False,
                 mesh: jax.sharding.Mesh | None = None, staged: bool = False,
                 matmul_dtype: str | None = None, src_lang: str | None = None, tgt_lang: str | None = None):
        batch_size = check_count("batch_size", batch_size)
        if isinstance(checkpoint, np.integer) or isinstance(checkpoint, str) and checkpoint.isdigit():
            checkpoint = int(checkpoint)   # "20" (as the command line reads it) or a NumPy 20: a step
        run_dir = RunDir(workdir)
        exports = ExportCache(run_dir.jax_cache / "exported") if exported and mesh is None else None
        record = run_dir.read_run_record()
        config = TransformerConfig.from_dict(record["model"])
        self.config = config if matmul_dtype is None else config.replace(matmul_dtype=matmul_dtype)
        self.tokenizer = load_tokenizer(workdir, record)
        if src_lang or tgt_lang:   # a multilingual model's languages (M2M100/NLLB: its own codes)
            self.tokenizer = with_languages(self.tokenizer, src_lang, tgt_lang)
        self.model = Transformer(self.config)
        ids, layout = jnp.ones((1, 8), jnp.int32), None

        def boxed_shapes():
            return jax.eval_shape(lambda: self.model.init(jax.random.key(0), ids, ids)["params"])

        # Restore onto one device (or this mesh), whatever mesh the run was trained on.
        if mesh is not None:
            layout = Layout.for_params(mesh, boxed := boxed_shapes())
            shapes, shardings = nn.unbox(boxed), layout.params
        else:
            shapes = (nn.unbox(boxed_shapes()) if exports is None
                      else exports.abstract_params(self.config, lambda: nn.unbox(boxed_shapes())))
            one_device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            shardings = jax.tree_util.tree_map(lambda _: one_device, shapes)
        abstract_params = jax.tree_util.tree_map(
            lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), shapes, shardings)
        with contextlib.closing(RunCheckpoints(workdir, read_only=True)) as checkpoints:   # parameters only
            self.params, self.step, self.kind = checkpoints.restore_params_from(checkpoint, abstract_params)
        self.params = cast_matmul_weights(self.params, self.config)
        self.max_len_a, self.max_len_b = length_limits(record, max_len_a, max_len_b)
        self.evaluator = Evaluator(self.model, self.tokenizer, batch_size=batch_size, layout=layout,
                                   target_language=record.get("target_language", "xx"), scoring=False,
                                   max_len_a=self.max_len_a, max_len_b=self.max_len_b, exports=exports,
                                   staged=staged)
        self.defaults = decoding_defaults(record)

    def decode(self, sentences: list[str], strategy: Any, *, seed: int | None = None,
               indices: list[int] | None = None, length_limits: bool = True) -> list[list[tuple[str, float]]]:
        """(translation, score) lists of ``sentences`` decoded with ``strategy``, best first, in
        order (a blank one: ``[("", 0.0)]``). Sentence i samples with ``fold_in(key(seed or 0),
        indices[i])``, its index in the whole input (default: in ``sentences``), on any path;
        ``length_limits`` as ``Evaluator.decode``'s. ``TypeError`` unless ``sentences`` is a list
        of strings; ``ValueError`` for a ``seed`` not an integer in [0, 2**32), or ``indices`` not
        one integer in [0, 2**31) per sentence."""
        if not isinstance(sentences, (list, tuple)) or not all(isinstance(s, str) for s in sentences):
            raise TypeError(f"sentences must be a list of strings, got {type(sentences).__name__}"
                            + (": wrap one sentence in a list" if isinstance(sentences, str) else ""))
        if seed is not None and not 0 <= check_count("seed", seed, minimum=-(1 << 63)) < 1 << 32:
            problem = f"seed must be in [0, 2**32), got {seed}"   # what --seed takes
        elif indices is not None and (len(indices) != len(sentences) or not all(
                isinstance(i, numbers.Integral) and not isinstance(i, bool) and 0 <= i < 1 << 31
                for i in indices)):
            problem = f"indices must be one integer in [0, 2**31) per sentence, got {list(indices)[:8]}"
        else:
            problem = None
        if problem:
            raise ValueError(problem + ".")
        rng = None if seed is None else jax.random.key(int(seed))   # None: key(0), so an exported decoder
        indices = range(len(sentences)) if indices is None else indices
        todo = [i for i, sentence in enumerate(sentences) if sentence.strip()]
        out = [[("", 0.0)] for _ in sentences]
        for i, result in zip(todo, self.evaluator.decode(
                self.params, [sentences[i] for i in todo], strategy, rng=rng,
                indices=[indices[i] for i in todo], length_limits=length_limits) if todo else []):
            out[i] = result
        return out

    def constrained(self, sentences: list[str], strategy: Any, constraints: list[list[str]] | None = None,
                    prefixes: list[str] | None = None, *, indices: list[int] | None = None,
                    length_limits: bool = True) -> tuple[list[list[tuple[str, float]]], list[str]]:
        """:meth:`decode` with a :class:`~jaxformer.decode.constrained.Constrained` ``strategy``:
        sentence i's translations hold each target phrase of ``constraints[i]`` and start with
        ``prefixes[i]`` (``""``: none). Returns the (translation, score) lists and notes, one per
        line (``indices[i] + 1``) that needs one: constraints that cannot fit its output limit
        (dropped), phrases the best translation misses, a beam too small for the banks
        (:func:`~jaxformer.decode.constrained.bank_rule`). ``ValueError``: lists not one per
        sentence, or another strategy."""
        from jaxformer.decode.constrained import Constrained

        if not isinstance(strategy, Constrained) or any(
                x is not None and len(x) != len(sentences) for x in (constraints, prefixes)):
            raise ValueError(f"constrained() needs a Constrained strategy (got {type(strategy).__name__}) "
                             f"and at most one constraint list and prefix per sentence ({len(sentences)}).")
        indices = list(range(len(sentences)) if indices is None else indices)
        requests = constraint_inputs.encode_requests(self.tokenizer, constraints, prefixes, len(sentences))
        source_lengths = [min(len(ids), self.config.max_len)
                          for ids in self.tokenizer.encode_source(sentences)]
        limits = [min(math.floor(self.max_len_a * n) + self.max_len_b, self.evaluator.max_decode_len(n))
                  if length_limits else self.evaluator.max_decode_len(n) for n in source_lengths]
        lines = [i + 1 for i in indices]
        notes = constraint_inputs.fit_requests(requests, limits, strategy.beam_size, lines)
        todo = [i for i, sentence in enumerate(sentences) if sentence.strip()]
        out = [[("", 0.0)] for _ in sentences]
        for i, result in zip(todo, self.evaluator.decode(
                self.params, [sentences[i] for i in todo], strategy, indices=[indices[i] for i in todo],
                length_limits=length_limits, requests=[requests[i] for i in todo]) if todo else []):
            out[i] = result
        return out, notes + constraint_inputs.missing_notes(
            [requests[i] for i in todo], [out[i][0][0] for i in todo], [lines[i] for i in todo])

    def n_best(self, sentences: list[str], *, best_only: bool = False, **options) -> list[list]:
        """``beam_size`` (translation, score) pairs per sentence, best first: :meth:`decode` with
        the :class:`~jaxformer.decode.strategies.Beam` of ``options`` (:attr:`defaults`' names;
        left out or ``None``: the default); ``best_only``: beam 1 is greedy (``strategy_for``)."""
        rules = {**self.defaults, **{k: v for k, v in options.items() if v is not None}}
        strategy = strategy_for(**rules)
        if not best_only and not isinstance(strategy, Beam):   # beam 1: its one hypothesis, scored
            strategy = Beam(1, *(rules[k] for k in ("alpha", "length_normalization", "early_stopping")),
                            processors=strategy.processors)
        return self.decode(sentences, strategy, length_limits=rules["length_normalization"] != "hf")

    def __call__(self, sentences: list[str], **options) -> list[str]:
        """Best translations of ``sentences``, in order (options as :meth:`n_best`; beam 1: greedy)."""
        return [n_best[0][0] for n_best in self.n_best(sentences, **options, best_only=True)]

    def sample(self, sentences: list[str], *, seed: int = 0, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None, no_repeat_ngram_size: int | None = None,
               repetition_penalty: float | None = None, indices: list[int] | None = None) -> list[str]:
        """One sampled translation per sentence: :meth:`decode` with a ``Sample`` and, left
        ``None``, the run's repetition rules (``seed``, ``indices``: as :meth:`decode`)."""
        processors = penalties(
            self.defaults["no_repeat_ngram_size"] if no_repeat_ngram_size is None else no_repeat_ngram_size,
            self.defaults["repetition_penalty"] if repetition_penalty is None else repetition_penalty)
        return [n_best[0][0] for n_best in self.decode(
            sentences, Sample(temperature, top_k, top_p, processors), seed=seed, indices=indices)]

    def params_digest(self) -> str:
        """SHA-256 of the decoded parameters' paths, dtypes, shapes and bytes (a bulk job's record)."""
        digest = hashlib.sha256()
        for path, leaf in jax.tree_util.tree_leaves_with_path(self.params):
            array = np.ascontiguousarray(leaf)
            digest.update(f"{jax.tree_util.keystr(path)} {array.dtype} {array.shape}".encode())
            digest.update(array.tobytes())
        return digest.hexdigest()

    def cross_attention(self, source: str, translation: str, layer: int | None = None,
                        head: int | None = None):
        """Cross-attention weights of one sentence pair, teacher-forced: ``(weights [T, S]
        float32, source pieces [S], target pieces [T])`` of decoder ``layer`` and ``head``
        (``None``: their average). Raises ``ValueError`` for a layer or head not the model's."""
        for name, value, count in (("layer", layer, self.config.num_decoder_layers),
                                   ("head", head, self.config.num_heads)):
            if value is not None and not 0 <= value < count:
                raise ValueError(f"{name} {value} is out of range: this model has {count} (0..{count - 1})")
        tok = self.tokenizer
        src_ids = tok.encode_source([source])[0][: self.config.max_len]
        tgt_ids = tok.encode_target([translation])[0][: self.config.max_len - 1]
        model, variables = unrolled(self.model, {"params": self.params})   # one entry per layer
        _, state = model.apply(variables, jnp.asarray([src_ids], jnp.int32),
                               jnp.asarray([[tok.bos_id, *tgt_ids]], jnp.int32), mutable=["intermediates"])
        layers = state["intermediates"]["decoder"]
        stack = np.stack([np.asarray(layers[f"layer_{i}"]["cross_attention"]["attention_weights"][0][0])
                          for i in range(self.config.num_decoder_layers)])      # [N, H, T, S]
        stack = stack.mean(axis=0) if layer is None else stack[layer]
        weights = stack.mean(axis=0) if head is None else stack[head]
        return weights, tok.source_pieces(src_ids), tok.target_pieces([*tgt_ids, tok.eos_id])


def save_attention_png(path: str | Path, weights, src_pieces, tgt_pieces, title: str = "") -> None:
    """Heat map of cross-attention ``weights [T, S]`` on a matplotlib ``Figure`` (not ``pyplot``,
    which would touch an application's figures)."""
    from matplotlib.figure import Figure

    height, width = weights.shape
    fig = Figure(figsize=(max(4, 0.45 * width + 2), max(3, 0.4 * height + 1.5)))
    ax = fig.subplots()
    fig.colorbar(ax.imshow(weights, cmap="viridis", aspect="auto", vmin=0.0), ax=ax)
    ax.set_xticks(range(width), src_pieces, rotation=90)
    ax.set_yticks(range(height), tgt_pieces[:height])
    ax.set(xlabel="source", ylabel="target", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

