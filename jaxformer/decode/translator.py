"""A trained run as a :class:`Translator`: the JAX engine (:class:`jaxformer.decode.engine.Engine`)
and the library's face of it: beam search, n-best lists, sampling, constraints and
cross-attention maps (the command line around it: :mod:`jaxformer.cli.translate`)."""

from __future__ import annotations

import copy
import hashlib
import math
import numbers
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxformer.decode import constraint_inputs
from jaxformer.decode.constrained import Constrained
from jaxformer.decode.engine import FEATURES, Request, Translation, translate_nonblank
from jaxformer.decode.evaluation import Evaluator
from jaxformer.decode.exported import ExportCache
from jaxformer.decode.penalties import penalties
from jaxformer.decode.served_run import ServedRun
from jaxformer.decode.strategies import Sample, strategy_for
from jaxformer.model.matmul import cast_matmul_weights
from jaxformer.model.scan import unrolled
from jaxformer.model.sharding import Layout
from jaxformer.model.transformer import Transformer
from jaxformer.model.validation import check_count
from jaxformer.run.directory import RunDir


class Translator:
    """The JAX engine: a run (a :class:`~jaxformer.decode.served_run.ServedRun`, or the folder
    to load one from) ready to translate on one device or a ``mesh`` (data-parallel, parameters
    laid out as in training). It honours every request (:data:`~jaxformer.decode.engine.FEATURES`).
    Decoding options left ``None`` take :attr:`defaults`: an imported model's generation
    config, else the run's dev/test decoding, else §6.1's beam 4, α 0.6.

    Args:
      run: the run, or its folder (then ``checkpoint``, ``max_len_a``, ``max_len_b``,
        ``src_lang``, ``tgt_lang`` are :meth:`ServedRun.load`'s).
      batch_size: the most sentences per decoding batch.
      exported, staged: keep exported decoders in ``RUN/jax_cache/exported``; beam search in
        stages (:mod:`jaxformer.decode.exported`, :mod:`~jaxformer.decode.staged`); not with a mesh.
      matmul_dtype: the weight matmuls' dtype (:mod:`jaxformer.model.matmul`); ``None``: the run's.
      fixed_rows: every batch padded to ``batch_size`` rows (one program per length bucket and
        strategy, all compiled by a warm-up; a sentence's result never depends on its batch's size).

    Raises ``FileNotFoundError`` without ``config.json``, the tokenizer or the checkpoint asked for;
    ``ValueError`` for a damaged (or Hugging Face's) ``config.json``, a language not the model's,
    a ``batch_size`` not an integer ≥ 1, limits out of range, load options beside a loaded run.
    """

    name = "jax"
    honours = FEATURES

    def __init__(self, run: ServedRun | str | Path, batch_size: int = 32, checkpoint: str | int = "auto",
                 max_len_a: float | None = None, max_len_b: int | None = None, exported: bool = False,
                 mesh: jax.sharding.Mesh | None = None, staged: bool = False,
                 matmul_dtype: str | None = None, src_lang: str | None = None, tgt_lang: str | None = None,
                 fixed_rows: bool = False):
        batch_size = check_count("batch_size", batch_size)
        load = dict(checkpoint=checkpoint, max_len_a=max_len_a, max_len_b=max_len_b, src_lang=src_lang,
                    tgt_lang=tgt_lang)
        if isinstance(run, ServedRun):
            if load != dict(checkpoint="auto", max_len_a=None, max_len_b=None, src_lang=None, tgt_lang=None):
                raise ValueError("a loaded run's checkpoint, limits and languages are ServedRun.load's: give "
                                 "them there, or give the run's folder here.")
        else:
            run = ServedRun.load(run, **load)
        self.run, self.tokenizer, self.defaults = run, run.tokenizer, run.defaults
        self.config = run.config if matmul_dtype is None else run.config.replace(matmul_dtype=matmul_dtype)
        self.model = Transformer(self.config)
        exports = ExportCache(RunDir(run.root).jax_cache / "exported") if exported and mesh is None else None
        self.params, self.checkpoint = run.restore_params(self._abstract_params(mesh, exports))
        self.params = cast_matmul_weights(self.params, self.config)
        self.step, self.kind = self.checkpoint.step, self.checkpoint.kind
        self.max_len_a, self.max_len_b = run.max_len_a, run.max_len_b
        self.evaluator = Evaluator(self.model, self.tokenizer, batch_size=batch_size,
                                   layout=Layout.for_params(mesh, self._boxed_shapes()) if mesh else None,
                                   target_language=run.record.get("target_language", "xx"), scoring=False,
                                   max_len_a=self.max_len_a, max_len_b=self.max_len_b, exports=exports,
                                   staged=staged, fixed_rows=fixed_rows)
        self.mesh = mesh

    def _boxed_shapes(self):
        ids = jnp.ones((1, 8), jnp.int32)
        return jax.eval_shape(lambda: self.model.init(jax.random.key(0), ids, ids)["params"])

    def _abstract_params(self, mesh: jax.sharding.Mesh | None, exports: ExportCache | None) -> Any:
        """The parameters' shapes laid out on one device, or on ``mesh`` as in training, whatever
        mesh the run was trained on."""
        if mesh is not None:
            boxed = self._boxed_shapes()
            shapes, shardings = nn.unbox(boxed), Layout.for_params(mesh, boxed).params
        else:
            shapes = (nn.unbox(self._boxed_shapes()) if exports is None
                      else exports.abstract_params(self.config, lambda: nn.unbox(self._boxed_shapes())))
            one_device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            shardings = jax.tree_util.tree_map(lambda _: one_device, shapes)
        return jax.tree_util.tree_map(
            lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), shapes, shardings)

    # -- the engine (jaxformer.decode.engine.Engine) -------------------------------------------

    def translate(self, sentences: list[str], request: Request, *, first_index: int = 0) -> list[Translation]:
        """:meth:`Engine.translate <jaxformer.decode.engine.Engine.translate>`: the request's
        strategy (greedy, beam search, sampling, or constrained beam search when it carries
        constraints or prefixes, the run's defaults where it says nothing), sentence i sampling
        with ``fold_in(key(seed), first_index + i)``."""
        return translate_nonblank(sentences, request, first_index, self._translate)

    def _translate(self, sentences: list[str], request: Request, indices: list[int]) -> list[Translation]:
        rules = request.rules(self.defaults)
        evaluator = self._evaluator_for(request.src_lang, request.tgt_lang)
        notes: list[list[str]] = [[] for _ in sentences]
        if request.sample:
            processors = penalties(rules["no_repeat_ngram_size"], rules["repetition_penalty"])
            strategy = Sample(request.temperature, request.top_k, request.top_p, processors)
            results = evaluator.decode(self.params, sentences, strategy, indices=indices,
                                       rng=jax.random.key(request.seed))
        elif request.constraints is not None or request.prefixes is not None:   # a beam of any width
            beam = strategy_for(**rules, forced_eos=self.run.forced_eos, scored=True)
            results, notes = self._constrained(sentences, Constrained.of(beam), request.constraints,
                                               request.prefixes, indices, evaluator=evaluator,
                                               length_limits=rules["length_normalization"] != "hf")
        else:
            strategy = strategy_for(**rules, forced_eos=self.run.forced_eos)
            results = evaluator.decode(self.params, sentences, strategy, indices=indices,
                                       length_limits=rules["length_normalization"] != "hf")
        return [Translation(tuple(hyps[: request.n_best]), tuple(mine)) for hyps, mine in zip(results, notes)]

    def _evaluator_for(self, src_lang: str | None, tgt_lang: str | None) -> Evaluator:
        """The evaluator of a request's languages (a multilingual run's): the run's own, or a copy
        with that tokenizer sharing its compiled decoders."""
        if src_lang is None and tgt_lang is None:
            return self.evaluator
        evaluator = copy.copy(self.evaluator)   # shares the dict of compiled decoders
        evaluator.tokenizer = self.run.tokenizer_for(src_lang, tgt_lang)
        return evaluator

    def rules(self, request: Request) -> str:
        """The rules line of the translate command: the strategy, its length penalty and stop."""
        rules = request.rules(self.defaults)
        if request.sample:
            return "sampling"
        if rules["beam_size"] == 1 and request.constraints is None and request.prefixes is None:
            return "greedy"
        penalty = "|Y|" if rules["length_normalization"] == "hf" else "((5+|Y|)/6)"
        stop = "ends once k hypotheses ended" if rules["early_stopping"] else "exact stop"
        penalty_p, ngram = rules["repetition_penalty"], rules["no_repeat_ngram_size"]
        repeats = (f", repetition penalty {penalty_p:g}" if penalty_p != 1 else "") + (
            f", no repeated {ngram}-gram" if ngram else "")
        return (f"beam {rules['beam_size']}, length penalty {penalty}^{rules['alpha']}, {stop}{repeats}, "
                f"a length limit per sentence")

    def describe(self) -> str:
        """The engine and its devices, in one line."""
        where = (f"a mesh of {self.mesh.size} devices" if self.mesh is not None
                 else f"{jax.local_devices()[0].platform} device {jax.local_devices()[0].id}")
        return f"JAX {jax.__version__} on {where}, {self.config.matmul_dtype or self.config.dtype}"

    def digest(self) -> dict[str, Any]:
        """``{"engine": "jax", "params_sha256": ...}`` (:meth:`params_digest`)."""
        return {"engine": "jax", "params_sha256": self.params_digest()}

    def close(self) -> None:
        """Drops the parameters and compiled decoders."""
        self.params, self.evaluator = None, None

    # -- the library's face ----------------------------------------------------------------------

    def decode(self, sentences: list[str], strategy: Any, *, seed: int | None = None,
               indices: list[int] | None = None, length_limits: bool = True) -> list[list[tuple[str, float]]]:
        """(translation, score) lists of ``sentences`` decoded with ``strategy``, best first, in
        order (a blank one: ``[("", 0.0)]``). Sentence i samples with ``fold_in(key(seed or 0),
        indices[i])``, its index in the whole input (default: in ``sentences``), on any path;
        ``length_limits`` as ``Evaluator.decode``'s. ``TypeError`` unless ``sentences`` is a list
        of strings; ``ValueError`` for a ``seed`` not an integer in [0, 2**32), or ``indices`` not
        one integer in [0, 2**31) per sentence."""
        if seed is not None and not 0 <= check_count("seed", seed, minimum=-(1 << 63)) < 1 << 32:
            raise ValueError(f"seed must be in [0, 2**32), got {seed}.")   # what --seed takes
        if indices is not None and (len(indices) != len(sentences) or not all(
                isinstance(i, numbers.Integral) and not isinstance(i, bool) and 0 <= i < 1 << 31
                for i in indices)):
            raise ValueError(f"indices must be one integer in [0, 2**31) per sentence, got "
                             f"{list(indices)[:8]}.")
        rng = None if seed is None else jax.random.key(int(seed))   # None: key(0), so an exported decoder
        indices = list(range(len(sentences))) if indices is None else list(indices)

        def run(todo: list[str], _: Request, at: list[int]) -> list[Translation]:
            results = self.evaluator.decode(self.params, todo, strategy, rng=rng, length_limits=length_limits,
                                            indices=[indices[i] for i in at])
            return [Translation(tuple(hypotheses)) for hypotheses in results]

        return [list(t.hypotheses) for t in translate_nonblank(sentences, Request(), 0, run)]

    def _constrained(self, sentences: list[str], strategy: Constrained, constraints, prefixes,
                     indices: list[int], length_limits: bool,
                     evaluator: Evaluator | None = None) -> tuple[list[list], list[list[str]]]:
        """Non-blank ``sentences`` decoded with constraints (by ``evaluator``, default the run's):
        their results and notes."""
        evaluator = evaluator or self.evaluator
        tokenizer = evaluator.tokenizer
        requests = constraint_inputs.encode_requests(tokenizer, constraints, prefixes, len(sentences))
        source_lengths = [min(len(ids), self.config.max_len) for ids in tokenizer.encode_source(sentences)]
        limits = [min(math.floor(self.max_len_a * n) + self.max_len_b, evaluator.max_decode_len(n))
                  if length_limits else evaluator.max_decode_len(n) for n in source_lengths]
        notes = constraint_inputs.fit_requests(requests, limits, strategy.beam_size)
        results = evaluator.decode(self.params, sentences, strategy, indices=indices,
                                   length_limits=length_limits, requests=requests)
        missing = constraint_inputs.missing_notes(requests, [result[0][0] for result in results])
        return results, [a + b for a, b in zip(notes, missing)]

    def n_best(self, sentences: list[str], *, best_only: bool = False, **options) -> list[list]:
        """``beam_size`` (translation, score) pairs per sentence, best first: :meth:`decode` with
        the :class:`~jaxformer.decode.strategies.Beam` of ``options`` (:attr:`defaults`' names;
        left out or ``None``: the default); ``best_only``: beam 1 is greedy (``strategy_for``)."""
        rules = {**self.defaults, **{k: v for k, v in options.items() if v is not None}}
        strategy = strategy_for(**rules, forced_eos=self.run.forced_eos, scored=not best_only)
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

