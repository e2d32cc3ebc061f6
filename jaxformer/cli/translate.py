"""Translate with a trained run: ``jaxformer-translate --workdir RUN "sentence"``.

Translates the arguments, ``--input FILE`` or stdin, one line out per line in, to stdout
or ``--output``. With both --input and --output (bulk mode, jaxformer.cli.bulk) a file
of any size is translated in chunks of --chunk-lines lines written to OUTPUT.parts/: the
same command resumes a killed run; --mesh and several processes (--coordinator-address,
--num-processes, --process-id) share the chunks. Stdin from a terminal or a pipe is
answered as lines arrive. Checkpoint: --checkpoint (default the best by dev BLEU, else
the latest). Decoding: beam search, --n-best lists with scores, or --sample; a line's
sampling key comes from --seed and its line number. The run's jax_cache/ keeps the
compiled and exported decoders for the next call.
"""

from __future__ import annotations

import gc
import io
import os
import select
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

from jaxformer.cli import bulk as bulk_cli
from jaxformer.cli import constraint_files, fail, warn_replaced
from jaxformer.cli.engine import choose_engine, rules
from jaxformer.cli.translate_flags import PROG, TranslateArgs, parse_translate_args
from jaxformer.data import lines as lines_lib
from jaxformer.run.platform import skip_absent_tpu
from jaxformer.serve.ct2_engine import CT2Engine, CT2Search


def _is_stream(stream) -> bool:   # a terminal or a pipe, not a regular file
    try:
        return not stat.S_ISREG(os.fstat(stream.fileno()).st_mode)
    except (OSError, ValueError, AttributeError):   # no file descriptor (a test's StringIO)
        return False


def arriving_lines(stream, max_lines: int, errors: str = "strict",
                   bad: list[int] | None = None) -> Iterator[list[str]]:
    """Batches of the lines of ``stream`` (by :mod:`jaxformer.data.lines`' rules) as they
    arrive: each read takes every byte already readable, without waiting for more, from the
    file descriptor (Python's buffer would hide them from ``select``).

    Raises:
      lines.NotUtf8: a line that is not UTF-8 with ``errors="strict"``, once the lines before it
        are given; with ``"replace"`` its bad bytes become U+FFFD and its number goes to ``bad``.
      jaxformer.data.lines.TextError: stdin is UTF-16.
    """
    fd, splitter, eof = stream.fileno(), lines_lib.LineSplitter("stdin", errors, bad), False
    while not eof:
        data = os.read(fd, 1 << 16)
        eof = not data
        while not eof and select.select([fd], [], [], 0)[0]:   # whatever else is already there
            chunk = os.read(fd, 1 << 16)
            data, eof = data + chunk, not chunk
        lines, failed = [], None
        try:
            lines.extend(splitter.feed(data, final=eof))
        except lines_lib.NotUtf8 as e:   # the lines before it are answered first
            failed = e
        for start in range(0, len(lines), max_lines):
            yield lines[start:start + max_lines]
        if failed is not None:
            raise failed


def _read_lines(args: TranslateArgs) -> list[str]:
    """The lines of ``--input`` (or of stdin redirected from a file), read whole by
    :func:`jaxformer.data.lines.read_lines`; lines that are not UTF-8 stop the run with their
    numbers, or with ``--input-errors replace`` become U+FFFD, counted."""
    where, bad = args.input or "stdin", []
    source = args.input or getattr(sys.stdin, "buffer", None) or io.BytesIO(sys.stdin.read().encode())
    try:   # every line read with U+FFFD, so a refusal names all the bad ones
        lines = list(lines_lib.read_lines(source, "replace", bad, where=where))
    except lines_lib.TextError as e:
        fail(PROG, str(e))
    if bad and args.input_errors == "strict":
        fail(PROG, str(lines_lib.NotUtf8(where, bad)))
    warn_replaced(where, bad)
    return lines


def _strategy(args: TranslateArgs, translator):
    """The flags' decoding strategy (the run's :attr:`Translator.defaults` where a flag is
    not given; for :class:`CT2Engine` a :class:`CT2Search`) and whether each sentence keeps its
    own length limit (not with ``hf``)."""
    defaults = translator.defaults
    rules = {**defaults, **{k: getattr(args, k) for k in defaults if getattr(args, k) is not None}}
    if isinstance(translator, CT2Engine):   # the run's repetition penalty was tuned on log-probabilities:
        # on CT2's logits 1.4 is far stronger (docs/translation.md), so CT2 takes it from the flag alone
        return CT2Search(rules["beam_size"], rules["alpha"], args.repetition_penalty or 1.0,
                         rules["no_repeat_ngram_size"], args.n_best, args.sample, args.temperature or 1.0,
                         args.top_k, args.top_p), True
    from jaxformer.decode.constrained import Constrained
    from jaxformer.decode.penalties import penalties
    from jaxformer.decode.strategies import Beam, Sample, strategy_for

    if args.sample:
        processors = penalties(rules["no_repeat_ngram_size"], rules["repetition_penalty"])
        return Sample(args.temperature, args.top_k, args.top_p, processors), True
    if args.constrained_by:   # a beam of any width, 1 included
        processors = penalties(rules["no_repeat_ngram_size"], rules["repetition_penalty"])
        beam = Beam(*(rules[k] for k in ("beam_size", "alpha", "length_normalization", "early_stopping")),
                    processors=processors)
        return Constrained.of(beam), rules["length_normalization"] != "hf"
    return strategy_for(**rules), rules["length_normalization"] != "hf"


def _translate_lines(translator, args, lines: list[str], first_index: int,
                     out) -> tuple[list[str], dict[str, int]]:
    """Translates and writes ``lines``, lines ``first_index`` on of the input (sampling keys
    come from the line index); empty lines stay empty, and lines over ``max_len`` tokens too
    with ``--long-lines empty``. Returns the best translations and counts: ``empty`` and
    ``long`` lines, source ``tokens`` decoded."""
    max_len = translator.config.max_len
    lengths = [len(ids) if line.strip() else 0
               for line, ids in zip(lines, translator.tokenizer.encode_source(lines))]
    keep = [n <= max_len or args.long_lines == "truncate" for n in lengths]
    counts = {"empty": sum(not line.strip() for line in lines), "long": sum(n > max_len for n in lengths),
              "tokens": sum(min(n, max_len) for n, kept in zip(lengths, keep) if kept)}
    strategy, length_limits = _strategy(args, translator)
    sentences, indices = [line if kept else "" for line, kept in zip(lines, keep)], list(
        range(first_index, first_index + len(lines)))
    if args.constrained_by:   # --constraints, --terminology, --prefix (the JAX engine): notes per line
        try:
            constraints, prefixes = constraint_files.for_lines(args, translator.tokenizer, lines, first_index)
        except constraint_files.SideFileError as e:
            fail(PROG, str(e))
        results, notes = translator.constrained(sentences, strategy, constraints, prefixes, indices=indices,
                                                length_limits=length_limits)
        print("".join(f"warning: {note}\n" for note in notes), end="", file=sys.stderr)
    else:
        results = translator.decode(sentences, strategy, seed=args.seed if args.sample else None,
                                    length_limits=length_limits, indices=indices)
    if args.n_best > 1:   # n lines per input line; an empty line's are empty (score 0)
        for i, hypotheses in enumerate(results, first_index):
            hypotheses = hypotheses[: args.n_best] + hypotheses[-1:] * (args.n_best - len(hypotheses))
            out.write("".join(f"{i}\t{score:.4f}\t{text}\n" for text, score in hypotheses))
    else:
        out.write("".join(f"{n_best[0][0]}\n" for n_best in results))
    out.flush()
    return [n_best[0][0] for n_best in results], counts


def _load_ct2(args: TranslateArgs) -> CT2Engine:
    """The run's CTranslate2 engine (its model converted on first use), or exit status 2."""
    try:
        return CT2Engine(args.workdir, checkpoint=args.checkpoint,
                         quantization=args.quantization or "float32", batch_size=args.batch_size,
                         max_len_a=args.max_len_a, max_len_b=args.max_len_b,
                         throughput=bool(args.input) or not (args.sentences or _is_stream(sys.stdin)),
                         inter_threads=args.inter_threads, intra_threads=args.intra_threads,
                         src_lang=args.src_lang, tgt_lang=args.tgt_lang)
    except (ImportError, ValueError, OSError) as e:   # ConversionError is a ValueError
        fail(PROG, str(e))


def enable_compilation_cache(run_dir) -> bool:
    """JAX's compilation cache in ``run_dir`` (:func:`jaxformer.run.directory.enable_compilation_cache`,
    imported on the JAX engine's path only)."""
    from jaxformer.run.directory import enable_compilation_cache as enable

    return enable(run_dir)


def _load(args: TranslateArgs):
    """The run's JAX translator (on ``--mesh``'s devices), the flags checked against its model."""
    import jax

    from jaxformer.decode.translator import Translator
    from jaxformer.model.sharding import initialize_distributed, make_mesh
    from jaxformer.run.directory import RunDir

    skip_absent_tpu()   # libtpu installed on a CPU host: never start the TPU backend
    if args.multi_process:   # before any other JAX use
        initialize_distributed(args.coordinator_address, args.num_processes, args.process_id, auto=True)
    run_dir = RunDir(Path(args.workdir))
    cached = run_dir.config.exists() and enable_compilation_cache(run_dir)
    if run_dir.config.exists() and not cached:
        print(f"note: {run_dir.root} is not writable; decoders are compiled without a cache",
              file=sys.stderr)
    try:
        mesh = make_mesh(args.mesh, jax.local_devices()) if args.mesh else None
        translator = Translator(args.workdir, batch_size=args.batch_size, checkpoint=args.checkpoint,
                                max_len_a=args.max_len_a, max_len_b=args.max_len_b, exported=cached,
                                mesh=mesh, staged=bulk_cli.bulk_mode(args), matmul_dtype=args.matmul_dtype,
                                src_lang=args.src_lang, tgt_lang=args.tgt_lang)
    except (ValueError, OSError) as e:
        fail(PROG, str(e))
    for flag, value, count in (("--layer", args.layer, translator.config.num_decoder_layers),
                               ("--head", args.head, translator.config.num_heads)):
        if value is not None and not 0 <= value < count:
            fail(PROG, f"{flag} {value} is out of range; this model has {count} (0..{count - 1})")
    return translator


def _translate_text(args: TranslateArgs, translator):
    """The arguments, stdin or a file read whole (or stdin's lines as they arrive), to
    stdout or ``--output``. Returns the first non-empty line and its translation."""
    try:
        out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    except OSError as e:   # what the flag checks cannot see (a link to a folder that is gone)
        fail(PROG, f"--output {args.output!r} cannot be written ({e.strerror})")
    first, long_lines, bad, done = None, 0, [], 0
    try:
        if args.sentences or args.input or not _is_stream(sys.stdin):
            batches: Iterator[list[str]] = iter([list(args.sentences) or _read_lines(args)])
        else:   # a terminal or a pipe: answer each batch of arrived lines at once
            batches = arriving_lines(sys.stdin, args.batch_size, args.input_errors, bad)
        for lines in batches:
            best, counts = _translate_lines(translator, args, lines, done, out)
            long_lines += counts["long"]
            first = first or next(((line, hyp) for line, hyp in zip(lines, best) if line.strip()), None)
            done += len(lines)
    except lines_lib.NotUtf8 as e:   # streamed: the lines before it are translated already
        fail(PROG, f"{e} (the {done} line(s) before it were translated)")
    except lines_lib.TextError as e:
        fail(PROG, str(e))
    finally:
        if out is not sys.stdout:
            out.close()
    warn_replaced("stdin", bad)
    if long_lines:
        done = "were truncated to it" if args.long_lines == "truncate" else "gave empty lines"
        print(f"warning: {long_lines} sentence(s) longer than max_len={translator.config.max_len} tokens "
              f"{done}", file=sys.stderr)
    return first


def main(argv=None) -> None:
    args = parse_translate_args(argv)
    engine, why = choose_engine(args)
    translator = _load_ct2(args) if engine == "ct2" else _load(args)
    beam_size = args.beam_size or translator.defaults["beam_size"]
    if not args.sample and args.n_best > beam_size:
        fail(PROG, f"--n-best {args.n_best} needs a beam at least as wide; this run decodes with beam "
                   f"{beam_size}: pass --beam-size {args.n_best}")
    if args.needs_jax_only and 1 < args.n_best > beam_size // 2:
        fail(PROG, f"--n-best {args.n_best} with constraints needs a beam of {2 * args.n_best} or more (the "
                   f"finished hypotheses come from the top bank, at most half the beam); this run decodes "
                   f"with beam {beam_size}: pass --beam-size {2 * args.n_best}")
    described = f"; {translator.describe()}" if engine == "ct2" else ""
    decoding = rules(engine, _strategy(args, translator)[0], beam_size, args.sample)
    print(f"[{translator.kind} checkpoint, step {translator.step}]\n[engine {engine} ({why}){described}; "
          f"{decoding}]", file=sys.stderr)
    if not bulk_cli.bulk_mode(args):
        first = _translate_text(args, translator)
    elif bulk_cli.translate(args, translator, _translate_lines) == 0 and args.attention_png:
        index, line = next(((i, line) for i, line in enumerate(lines_lib.read_lines(args.input, "replace"))
                            if line.strip()), (0, None))
        first = line and (line, _translate_lines(translator, args, [line], index, io.StringIO())[0][0])
    else:
        first = None
    if args.attention_png and first:
        from jaxformer.decode.translator import save_attention_png

        weights, src_pieces, tgt_pieces = translator.cross_attention(*first, args.layer, args.head)
        which = (f"layer {args.layer}" if args.layer is not None else "mean of layers") + ", " + \
                (f"head {args.head}" if args.head is not None else "mean of heads")
        save_attention_png(args.attention_png, weights, src_pieces, tgt_pieces,
                           title=f"cross-attention ({which})")
        print(f"wrote {args.attention_png}", file=sys.stderr)


def cli() -> None:
    """``jaxformer-translate``: :func:`main`, with the import's objects frozen out of the
    garbage collector (``gc.freeze``: 0.3-0.4 s less per call, benchmarks/README.md)."""
    gc.freeze()
    main()


if __name__ == "__main__":
    cli()
