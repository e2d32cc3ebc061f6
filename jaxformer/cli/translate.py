"""The ``jaxformer-translate`` command (:data:`jaxformer.cli.translate_flags.DESCRIPTION`, its
``--help``): the flags checked, the run loaded once (:class:`~jaxformer.decode.served_run.ServedRun`),
an engine chosen and opened over it (:mod:`jaxformer.cli.engine`), then the arguments, stdin or a
file translated through the engine's interface alone (:class:`~jaxformer.decode.engine.Engine`);
bulk mode: :mod:`jaxformer.cli.bulk`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import os
import select
import stat
import sys
from collections.abc import Iterator

from jaxformer.cli import bulk as bulk_cli
from jaxformer.cli import constraint_files, fail, warn_replaced
from jaxformer.cli.engine import choose_engine, open_engine, request_of
from jaxformer.cli.translate_flags import PROG, TranslateArgs, parse_translate_args
from jaxformer.data import lines as lines_lib
from jaxformer.decode.engine import Engine
from jaxformer.decode.served_run import ServedRun
from jaxformer.decode.text import by_sentence
from jaxformer.run.platform import skip_absent_tpu


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


def _translate_lines(engine: Engine, args, lines: list[str], first_index: int,
                     out) -> tuple[list[str], dict[str, int]]:
    """Translates and writes ``lines``, lines ``first_index`` on of the input (sampling keys and
    notes come from the line index); empty lines stay empty. A line is translated sentence by
    sentence (``TranslateArgs.by_sentence``), else whole, and then a line over ``max_len``
    tokens stays empty with ``--long-lines empty``. Returns the best translations and counts:
    ``empty`` and ``long`` lines, source ``tokens`` decoded."""
    run = engine.run
    max_len = run.config.max_len
    if args.by_sentence:
        return _translate_by_sentence(engine, args, lines, first_index, out)
    lengths = [len(ids) if line.strip() else 0
               for line, ids in zip(lines, run.tokenizer.encode_source(lines))]
    keep = [n <= max_len or args.long_lines == "truncate" for n in lengths]
    counts = {"empty": sum(not line.strip() for line in lines), "long": sum(n > max_len for n in lengths),
              "tokens": sum(min(n, max_len) for n, kept in zip(lengths, keep) if kept)}
    sentences = [line if kept else "" for line, kept in zip(lines, keep)]
    request = request_of(args)
    if args.constrained_by:   # --constraints, --terminology, --prefix (the JAX engine): notes per line
        try:
            constraints, prefixes = constraint_files.for_lines(args, run.tokenizer, lines, first_index)
        except constraint_files.SideFileError as e:
            fail(PROG, str(e))
        request = dataclasses.replace(
            request, constraints=None if constraints is None else tuple(map(tuple, constraints)),
            prefixes=None if prefixes is None else tuple(prefixes))
    translations = engine.translate(sentences, request, first_index=first_index)
    lines_of: dict[str, list[int]] = {}   # each note once, with the lines it is about
    for line, translation in enumerate(translations, first_index + 1):
        for note in translation.notes:
            lines_of.setdefault(note, []).append(line)
    print("".join(f"warning: line{'s' * (len(at) > 1)} {lines_lib.line_numbers(at)}: {note}\n"
                  for note, at in lines_of.items()), end="", file=sys.stderr)
    if args.n_best > 1:   # n lines per input line; an empty line's are empty (score 0)
        for i, translation in enumerate(translations, first_index):
            hypotheses = list(translation.hypotheses)
            hypotheses = hypotheses[: args.n_best] + hypotheses[-1:] * (args.n_best - len(hypotheses))
            out.write("".join(f"{i}\t{score:.4f}\t{text}\n" for text, score in hypotheses))
    else:
        out.write("".join(f"{translation.text}\n" for translation in translations))
    out.flush()
    return [translation.text for translation in translations], counts


def _translate_by_sentence(engine: Engine, args, lines: list[str], first_index: int,
                           out) -> tuple[list[str], dict[str, int]]:
    """:func:`_translate_lines` sentence by sentence (:func:`jaxformer.decode.text.by_sentence`,
    the run's source language's rules); a sentence over ``max_len`` tokens is translated in
    pieces, so no line is long."""
    run, decoded = engine.run, []
    tokenizer = run.tokenizer
    count = lambda sentences: [len(ids) for ids in tokenizer.encode_source(sentences)]   # noqa: E731
    language = getattr(tokenizer, "src_lang", None) or next(iter(run.languages[0]), "xx")

    def translate(sentences: list[str]) -> list[str]:
        decoded.extend(count(sentences))
        return [t.text for t in engine.translate(sentences, request_of(args), first_index=first_index)]

    texts = by_sentence(lines, language, count, run.config.max_len, translate)
    out.write("".join(f"{text}\n" for text in texts))
    out.flush()
    return texts, {"empty": sum(not line.strip() for line in lines), "long": 0, "tokens": sum(decoded)}


def _load_run(args: TranslateArgs) -> ServedRun:
    """The run the flags name, its languages and the heat map's layer and head checked before any
    work (a conversion, a compile), or exit status 2."""
    try:
        run = ServedRun.load(args.workdir, checkpoint=args.checkpoint, max_len_a=args.max_len_a,
                             max_len_b=args.max_len_b, src_lang=args.src_lang, tgt_lang=args.tgt_lang)
        run.check_languages()
    except (ValueError, OSError) as e:
        fail(PROG, str(e))
    for flag, value, count in (("--layer", args.layer, run.config.num_decoder_layers),
                               ("--head", args.head, run.config.num_heads)):
        if value is not None and not 0 <= value < count:
            fail(PROG, f"{flag} {value} is out of range; this model has {count} (0..{count - 1})")
    return run


def enable_compilation_cache(run_dir) -> bool:
    """JAX's compilation cache in ``run_dir`` (:func:`jaxformer.run.directory.enable_compilation_cache`,
    imported on the JAX engine's path only)."""
    from jaxformer.run.directory import enable_compilation_cache as enable

    return enable(run_dir)


def _open(args: TranslateArgs, run: ServedRun, engine: str) -> Engine:
    """The run's ``engine``, or exit status 2. JAX first keeps off an absent TPU, joins
    ``jax.distributed`` and uses the run's compilation cache (exported decoders with it)."""
    cached = False
    if engine == "jax":
        from jaxformer.model.sharding import initialize_distributed
        from jaxformer.run.directory import RunDir

        skip_absent_tpu()   # libtpu installed on a CPU host: never start the TPU backend
        if args.multi_process:   # before any other JAX use
            initialize_distributed(args.coordinator_address, args.num_processes, args.process_id, auto=True)
        cached = enable_compilation_cache(RunDir(run.root))
        if not cached:
            print(f"note: {run.root} is not writable; decoders are compiled without a cache", file=sys.stderr)
    throughput = bool(args.input) or not (args.sentences or _is_stream(sys.stdin))
    try:
        return open_engine(args, run, engine, throughput=throughput, exported=cached)
    except (ImportError, ValueError, OSError) as e:   # ConversionError is a ValueError
        fail(PROG, str(e))


def _translate_text(args: TranslateArgs, engine: Engine):
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
            best, counts = _translate_lines(engine, args, lines, done, out)
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
        print(f"warning: {long_lines} sentence(s) longer than max_len={engine.run.config.max_len} tokens "
              f"{done}", file=sys.stderr)
    return first


def main(argv=None) -> None:
    args = parse_translate_args(argv)
    run = _load_run(args)
    engine_name, why = choose_engine(args)
    with contextlib.closing(_open(args, run, engine_name)) as engine:
        translate_with(args, engine, f"engine {engine_name} ({why})")


def translate_with(args: TranslateArgs, engine: Engine, chosen: str) -> None:
    """The command's work with any :class:`~jaxformer.decode.engine.Engine` (``chosen``: why it
    decodes, for the engine line): checks the request against its run, says what decodes, and
    translates the arguments, stdin or a file (bulk mode), as the flags say."""
    beam_size = args.beam_size or engine.run.defaults["beam_size"]
    if not args.sample and args.n_best > beam_size:
        fail(PROG, f"--n-best {args.n_best} needs a beam at least as wide; this run decodes with beam "
                   f"{beam_size}: pass --beam-size {args.n_best}")
    if args.needs_jax_only and 1 < args.n_best > beam_size // 2:
        fail(PROG, f"--n-best {args.n_best} with constraints needs a beam of {2 * args.n_best} or more (the "
                   f"finished hypotheses come from the top bank, at most half the beam); this run decodes "
                   f"with beam {beam_size}: pass --beam-size {2 * args.n_best}")
    print(f"[{engine.checkpoint.kind} checkpoint, step {engine.checkpoint.step}]\n[{chosen}; "
          f"{engine.describe()}; {engine.rules(request_of(args))}]", file=sys.stderr)
    if not bulk_cli.bulk_mode(args):
        first = _translate_text(args, engine)
    elif bulk_cli.translate(args, engine, _translate_lines) == 0 and args.attention_png:
        index, line = next(((i, line) for i, line in enumerate(lines_lib.read_lines(args.input, "replace"))
                            if line.strip()), (0, None))
        first = line and (line, _translate_lines(engine, args, [line], index, io.StringIO())[0][0])
    else:
        first = None
    if args.attention_png and first:
        from jaxformer.decode.translator import save_attention_png

        weights, src_pieces, tgt_pieces = engine.cross_attention(*first, args.layer, args.head)
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
