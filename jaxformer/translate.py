"""Translate with a trained run: ``jaxformer-translate --workdir RUN "sentence"``.

Reads sentences from the arguments, from ``--input FILE``, or from stdin, and writes
one translation per line, in input order, to stdout or ``--output FILE``. A file (or
stdin redirected from one) is read whole and sorted by length into batches; stdin
that is a terminal or a pipe is answered as lines arrive: each batch holds the lines
that are already there, so an interactive session or a process that writes one line
and waits gets its answer at once. Batches are padded to the next power of two of
their size, not to --batch-size.

Checkpoints: the best by dev BLEU (else the latest) unless --checkpoint names best,
latest, averaged (--average-last in training) or a training step. Decoding: beam
search (--beam-size, GNMT length penalty --alpha), --n-best lists with scores, or
--sample with --temperature/--top-k/--top-p; a translation has at most
a * source length + b tokens (--max-len-a/--max-len-b, fairseq's names).
--attention-png draws the cross-attention of the first sentence.

JAX's persistent compilation cache lives in the run directory (jax_cache/), with the
exported decoders and the parameters' shapes (jax_cache/exported/): the first call
traces and compiles the decoder, later calls load it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import select
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.checkpoints import RunCheckpoints
from jaxformer.config import TransformerConfig
from jaxformer.evaluation import Evaluator
from jaxformer.exported import ExportCache
from jaxformer.model import Transformer
from jaxformer.rundir import RunDir
from jaxformer.tokenizer import load_tokenizer


class Translator:
    """A trained model ready to translate: config, tokenizer and parameters of a run.

    Args:
      workdir: the run directory.
      batch_size: the most sentences per decoding batch.
      checkpoint: ``"auto"`` (best by dev BLEU, else latest), ``"best"``, ``"latest"``,
        ``"averaged"`` or a training step (int).
      max_len_a, max_len_b: output limit ``a * source length + b`` tokens.
      exported: keep the parameters' shapes and the exported greedy/beam decoders in
        ``RUN/jax_cache/exported`` (:mod:`jaxformer.exported`), so a later process neither
        traces the model nor the decoders (the translate tool does, when the run
        directory is writable).

    Raises:
      FileNotFoundError: the run directory lacks ``config.json``, the tokenizer or the
        checkpoint asked for.
    """

    def __init__(self, workdir: str | Path, batch_size: int = 32, checkpoint: str | int = "auto",
                 max_len_a: float = 1.0, max_len_b: int = 50, exported: bool = False):
        from flax import linen as nn

        workdir = Path(workdir)
        exports = ExportCache(RunDir(workdir).jax_cache / "exported") if exported else None
        config_path = RunDir(workdir).config
        if not config_path.exists():
            raise FileNotFoundError(f"{config_path} not found: is {str(workdir)!r} a jaxformer run "
                                    f"directory? Train one with `python train.py --workdir ...`.")
        record = json.loads(config_path.read_text())
        self.config = TransformerConfig.from_dict(record["model"])
        self.tokenizer = load_tokenizer(workdir, record)
        self.model = Transformer(self.config)
        ids = jnp.ones((1, 8), jnp.int32)
        # Restore onto one device, whatever mesh the run was trained on.
        one_device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        def params_shapes():
            return jax.eval_shape(lambda: nn.unbox(self.model.init(jax.random.key(0), ids, ids)["params"]))

        abstract_params = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device),
            params_shapes() if exports is None else exports.abstract_params(self.config, params_shapes))
        checkpoints = RunCheckpoints(workdir, read_only=True)
        try:   # parameters only: the optimizer state is never read
            self.params, self.step, self.kind = checkpoints.restore_params_from(checkpoint, abstract_params)
        finally:
            checkpoints.close()
        self.evaluator = Evaluator(self.model, self.tokenizer, batch_size=batch_size, scoring=False,
                                   target_language=record.get("target_language", "xx"), smoothing=0.0,
                                   max_len_a=max_len_a, max_len_b=max_len_b, exports=exports)
        # Decoding defaults: an imported model's generation_config (jaxformer.convert), else §6.1.
        generation = record.get("generation", {})
        self.defaults = {"beam_size": generation.get("beam_size", 4),
                         "alpha": generation.get("length_penalty", 0.6),
                         "length_normalization": generation.get("length_normalization", "gnmt")}

    def _options(self, beam_size, alpha, length_normalization):
        chosen = dict(beam_size=beam_size, alpha=alpha, length_normalization=length_normalization)
        return {k: self.defaults[k] if v is None else v for k, v in chosen.items()}

    def __call__(self, sentences: list[str], *, beam_size: int | None = None, alpha: float | None = None,
                 length_normalization: str | None = None) -> list[str]:
        """Best translations of ``sentences``, in order (``beam_size=1`` = greedy); options
        left ``None`` take the run's defaults (:attr:`defaults`)."""
        return self.evaluator.translate(self.params, sentences,
                                        **self._options(beam_size, alpha, length_normalization))

    def n_best(self, sentences: list[str], *, beam_size: int | None = None, alpha: float | None = None,
               length_normalization: str | None = None):
        """``beam_size`` (translation, score) pairs per sentence, best first."""
        return self.evaluator.translate_n_best(self.params, sentences,
                                               **self._options(beam_size, alpha, length_normalization))

    def sample(self, sentences: list[str], *, seed: int = 0, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None) -> list[str]:
        return self.evaluator.sample(self.params, sentences, jax.random.key(seed),
                                     temperature=temperature, top_k=top_k, top_p=top_p)

    def cross_attention(self, source: str, translation: str, layer: int | None = None,
                        head: int | None = None):
        """Cross-attention weights of one sentence pair, teacher-forced.

        Args:
          layer: decoder layer index, or ``None`` = average over layers.
          head: head index, or ``None`` = average over heads.

        Returns:
          ``(weights [T, S] float32, source pieces [S], target pieces [T])``.
        """
        tok = self.tokenizer
        src_ids = tok.encode_source([source])[0][: self.config.max_len]
        tgt_ids = tok.encode_target([translation])[0][: self.config.max_len - 1]
        src = jnp.asarray([src_ids], jnp.int32)
        tgt_in = jnp.asarray([[tok.bos_id, *tgt_ids]], jnp.int32)
        _, state = self.model.apply({"params": self.params}, src, tgt_in, mutable=["intermediates"])
        layers = state["intermediates"]["decoder"]
        stack = np.stack([np.asarray(layers[f"layer_{i}"]["cross_attention"]["attention_weights"][0][0])
                          for i in range(self.config.num_decoder_layers)])      # [N, H, T, S]
        stack = stack.mean(axis=0) if layer is None else stack[layer]
        weights = stack.mean(axis=0) if head is None else stack[head]
        src_pieces = tok.source_pieces(src_ids)
        tgt_pieces = tok.target_pieces([*tgt_ids, tok.eos_id])
        return weights, src_pieces, tgt_pieces


def save_attention_png(path: str | Path, weights, src_pieces, tgt_pieces, title: str = "") -> None:
    """Heat map of cross-attention ``weights [T, S]``: source pieces × target pieces."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    height, width = weights.shape
    fig, ax = plt.subplots(figsize=(max(4, 0.45 * width + 2), max(3, 0.4 * height + 1.5)))
    image = ax.imshow(weights, cmap="viridis", aspect="auto", vmin=0.0)
    ax.set_xticks(range(width), src_pieces, rotation=90)
    ax.set_yticks(range(height), tgt_pieces[:height])
    ax.set_xlabel("source")
    ax.set_ylabel("target")
    ax.set_title(title)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def enable_compilation_cache(run_dir: RunDir) -> bool:
    """JAX's persistent compilation cache in ``run_dir/jax_cache`` (every program, however
    quick to compile). Must run before the first compile; returns ``False`` (and the
    caller goes on without it) when the run directory is not writable."""
    try:
        run_dir.jax_cache.mkdir(exist_ok=True)
    except OSError:
        return False
    if not os.access(run_dir.jax_cache, os.W_OK):
        return False
    jax.config.update("jax_compilation_cache_dir", str(run_dir.jax_cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return True


def _is_stream(stream) -> bool:
    """A terminal or a pipe (answered as lines arrive), not a regular file."""
    try:
        return not stat.S_ISREG(os.fstat(stream.fileno()).st_mode)
    except (OSError, ValueError, AttributeError):   # no file descriptor (a test's StringIO)
        return False


def arriving_lines(stream, max_lines: int) -> Iterator[list[str]]:
    """Batches of the lines of ``stream`` as they arrive: waits for one line, then takes
    every further complete line already readable (at most ``max_lines``) without waiting.
    Reads the file descriptor directly so Python's buffer hides nothing from ``select``."""
    fd, pending, eof = stream.fileno(), b"", False
    while True:
        while b"\n" not in pending and not eof:   # block for the first line
            chunk = os.read(fd, 1 << 16)
            pending, eof = pending + chunk, not chunk
        while not eof and select.select([fd], [], [], 0)[0]:   # whatever else is already there
            chunk = os.read(fd, 1 << 16)
            pending, eof = pending + chunk, not chunk
        *complete, pending = pending.split(b"\n")
        if eof and pending:
            complete, pending = complete + [pending], b""
        for start in range(0, len(complete), max_lines):
            yield [line.decode("utf-8").rstrip("\r") for line in complete[start:start + max_lines]]
        if eof and not pending:
            return


def _parse_checkpoint(value: str) -> str | int:
    if value in ("auto", "best", "latest", "averaged"):
        return value
    if value.isdigit():
        return int(value)
    raise argparse.ArgumentTypeError(f"{value!r} is not best, latest, averaged, auto or a step number")


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``jaxformer-translate`` (every flag with one line of help)."""
    parser = argparse.ArgumentParser(prog="jaxformer-translate", description=__doc__.replace("``", ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--workdir", required=True, help="run directory written by jaxformer-train")
    add("--input", help="file with one sentence per line (default: the arguments, else stdin)")
    add("--output", help="write the translations to this file (default: stdout)")
    add("--checkpoint", type=_parse_checkpoint, default="auto", metavar="{auto,best,latest,averaged,STEP}",
        help="parameters to use: auto = best by dev BLEU, else latest (default: auto)")
    add("--batch-size", type=int, default=32, help="most sentences per batch (default: 32)")
    add("--beam-size", type=int, default=None, help="beam width; 1 = greedy (default: the run's, else 4)")
    add("--alpha", type=float, default=None,
        help="length penalty exponent (default: the run's, else 0.6)")
    add("--length-normalization", choices=("gnmt", "hf"), default=None,
        help="gnmt: ((5+|Y|)/6)^alpha (paper); hf: |Y|^alpha with Hugging Face generate's stopping "
             "rule (default: the run's, else gnmt)")
    add("--max-len-a", type=float, default=1.0, help="output limit a * source length + b: a (default: 1)")
    add("--max-len-b", type=int, default=50, help="output limit a * source length + b: b (default: 50)")
    add("--n-best", type=int, default=1,
        help="print this many hypotheses per sentence as index<TAB>score<TAB>text (<= --beam-size)")
    add("--sample", action="store_true", help="sample instead of beam search")
    add("--temperature", type=float, default=1.0, help="sampling temperature (default: 1)")
    add("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    add("--top-p", type=float, default=None, help="sample from the smallest set of probability >= p")
    add("--seed", type=int, default=0, help="rng seed for --sample (default: 0)")
    add("--attention-png", help="write the first sentence's cross-attention heat map")
    add("--layer", type=int, default=None, help="decoder layer for the heat map (default: mean)")
    add("--head", type=int, default=None, help="head for the heat map (default: mean)")
    add("sentences", nargs="*", help="sentences to translate")
    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flag errors, all before anything is loaded (exit status 2)."""
    if (args.beam_size is not None and args.beam_size < 1) or args.n_best < 1 \
            or (args.beam_size is not None and args.n_best > args.beam_size):
        parser.error("need --beam-size >= 1 and 1 <= --n-best <= --beam-size")
    if args.batch_size < 1:
        parser.error("--batch-size must be at least 1")
    if args.max_len_a < 0 or args.max_len_a + args.max_len_b < 1:
        parser.error("need --max-len-a >= 0 and --max-len-a + --max-len-b >= 1 (room for one token)")
    if args.sample and (args.temperature <= 0 or (args.top_k is not None and args.top_k < 1)
                        or (args.top_p is not None and not 0 < args.top_p <= 1)):
        parser.error("sampling needs --temperature > 0, --top-k >= 1 and 0 < --top-p <= 1")
    if args.input and not Path(args.input).is_file():
        parser.exit(2, f"{parser.prog}: error: --input file {args.input!r} does not exist\n")
    for flag in ("output", "attention_png"):
        path = getattr(args, flag)
        if path and not Path(path).absolute().parent.is_dir():
            parser.exit(2, f"{parser.prog}: error: the folder of --{flag.replace('_', '-')} {path!r} "
                           f"does not exist\n")


def _translate_lines(translator: Translator, args, lines: list[str], first_index: int, out) -> list[str]:
    """Translates one batch of ``lines`` and writes them; empty lines stay empty.
    Returns the best translation of each line."""
    todo = [i for i, line in enumerate(lines) if line.strip()]
    sources = [lines[i] for i in todo]
    too_long = sum(len(ids) > translator.config.max_len
                   for ids in translator.tokenizer.encode_source(sources))
    if too_long:
        print(f"warning: {too_long} sentence(s) longer than max_len={translator.config.max_len} tokens "
              f"were truncated to it", file=sys.stderr)
    best = [""] * len(lines)
    if args.sample:
        results = [[(text, 0.0)] for text in translator.sample(
            sources, seed=args.seed, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)]
    elif args.n_best > 1:
        results = translator.n_best(sources, beam_size=args.beam_size, alpha=args.alpha,
                                    length_normalization=args.length_normalization)
    else:
        results = [[(text, 0.0)] for text in translator(sources, beam_size=args.beam_size, alpha=args.alpha,
                                                       length_normalization=args.length_normalization)]
    for i, n_best in zip(todo, results):
        best[i] = n_best[0][0]
    if args.n_best > 1:
        by_line = dict(zip(todo, results))
        for i in range(len(lines)):
            for text, score in by_line.get(i, [])[: args.n_best]:
                out.write(f"{first_index + i}\t{score:.4f}\t{text}\n")
    else:
        out.write("".join(f"{text}\n" for text in best))
    out.flush()
    return best


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    run_dir = RunDir(Path(args.workdir))
    cached = run_dir.config.exists() and enable_compilation_cache(run_dir)
    if run_dir.config.exists() and not cached:
        print(f"note: {run_dir.root} is not writable; decoders are compiled without a cache",
              file=sys.stderr)
    try:
        translator = Translator(args.workdir, batch_size=args.batch_size, checkpoint=args.checkpoint,
                                max_len_a=args.max_len_a, max_len_b=args.max_len_b, exported=cached)
    except (ValueError, OSError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    for flag, value, count in (("--layer", args.layer, translator.config.num_decoder_layers),
                               ("--head", args.head, translator.config.num_heads)):
        if value is not None and not 0 <= value < count:
            parser.exit(2, f"{parser.prog}: error: {flag} {value} is out of range; this model has "
                           f"{count} (0..{count - 1})\n")
    print(f"[{translator.kind} checkpoint, step {translator.step}]", file=sys.stderr)
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    first = None
    try:
        if args.sentences or args.input or not _is_stream(sys.stdin):
            if args.sentences:
                lines = args.sentences
            else:
                with open(args.input, encoding="utf-8") if args.input else sys.stdin as stream:
                    lines = [line.rstrip("\n") for line in stream]
            batches: Iterator[list[str]] = iter([lines])
        else:   # a terminal or a pipe: answer each batch of arrived lines at once
            batches = arriving_lines(sys.stdin, args.batch_size)
        done = 0
        for lines in batches:
            best = _translate_lines(translator, args, lines, done, out)
            if first is None and any(line.strip() for line in lines):
                first = next((line, hyp) for line, hyp in zip(lines, best) if line.strip())
            done += len(lines)
    finally:
        if out is not sys.stdout:
            out.close()
    if args.attention_png and first is not None:
        weights, src_pieces, tgt_pieces = translator.cross_attention(*first, args.layer, args.head)
        which = (f"layer {args.layer}" if args.layer is not None else "mean of layers") + ", " + \
                (f"head {args.head}" if args.head is not None else "mean of heads")
        save_attention_png(args.attention_png, weights, src_pieces, tgt_pieces,
                           title=f"cross-attention ({which})")
        print(f"wrote {args.attention_png}", file=sys.stderr)


def cli() -> None:
    """The ``jaxformer-translate`` program (and ``python -m jaxformer.translate``): :func:`main`
    on ``sys.argv`` with the objects made by importing frozen out of the garbage collector.

    They live until exit anyway; frozen (``gc.freeze``, CPython ≥ 3.7), the collector no
    longer re-scans them while the decoder is traced, nor in its sweep at interpreter
    exit, which alone took 0.3-0.4 s of a 3.5 s call (benchmarks/README.md). A library
    caller's process is left alone: only this entry point freezes.
    """
    gc.freeze()
    main()


if __name__ == "__main__":
    cli()
