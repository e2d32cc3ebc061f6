"""Translate with a trained run: ``jaxformer-translate --workdir RUN "sentence"``.

Reads sentences from the arguments, from ``--input FILE``, or from stdin, and writes
one translation per line, in input order, to stdout or ``--output FILE``. With both
--input and --output a file of any size is translated in bulk: streamed in chunks of
--chunk-lines lines, each sorted by length into batches and written whole to
OUTPUT.parts/ (a killed run started again with the same command decodes only the
missing chunks and gives the same file), with a progress bar on a terminal and a
report of lines/s at the end; --mesh decodes on several devices, and several processes
(jax.distributed: --coordinator-address, --num-processes, --process-id) share the
chunks, each on its own devices (jaxformer.cli.bulk). Another file (or
stdin redirected from one) is read whole and sorted by length into batches; stdin
that is a terminal or a pipe is answered as lines arrive: each batch holds the lines
that are already there, so an interactive session or a process that writes one line
and waits gets its answer at once. Batches are padded to the next power of two of
their size, not to --batch-size.

Checkpoints: the best by dev BLEU (else the latest) unless --checkpoint names best,
latest, averaged (--average-last in training) or a training step. Decoding: beam
search (--beam-size, GNMT length penalty --alpha), --n-best lists with scores, or
--sample with --temperature/--top-k/--top-p; --no-repeat-ngram-size and
--repetition-penalty against looping output (with any of them); a translation has at most
a * source length + b tokens (--max-len-a/--max-len-b, fairseq's names).
--attention-png draws the cross-attention of the first sentence.

JAX's persistent compilation cache lives in the run directory (jax_cache/), with the
exported decoders and the parameters' shapes (jax_cache/exported/): the first call
traces and compiles the decoder, later calls load it.
"""

from __future__ import annotations

import gc
import gzip
import io
import os
import select
import stat
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

from jaxformer.cli import bulk as bulk_cli
from jaxformer.cli import fail
from jaxformer.cli.translate_flags import PROG, TranslateArgs, parse_translate_args
from jaxformer.decode import bulk
from jaxformer.decode.translator import Translator, save_attention_png
from jaxformer.run.directory import RunDir, enable_compilation_cache
from jaxformer.run.platform import skip_absent_tpu


def _is_stream(stream) -> bool:
    """A terminal or a pipe (answered as lines arrive), not a regular file."""
    try:
        return not stat.S_ISREG(os.fstat(stream.fileno()).st_mode)
    except (OSError, ValueError, AttributeError):   # no file descriptor (a test's StringIO)
        return False


class NotUtf8(ValueError):
    """A line of streamed stdin that is not UTF-8, under ``--input-errors strict``."""


def arriving_lines(stream, max_lines: int, errors: str = "strict",
                   bad: list[int] | None = None) -> Iterator[list[str]]:
    """Batches of the lines of ``stream`` as they arrive: waits for one line, then takes
    every further complete line already readable (at most ``max_lines``) without waiting.
    Reads the file descriptor directly so Python's buffer hides nothing from ``select``.
    Lines follow :func:`jaxformer.decode.bulk.split_lines`'s rules (``\\n`` ends a line,
    one ``\\r`` before it and a leading byte-order mark are dropped).

    Raises:
      NotUtf8: a line that is not UTF-8 with ``errors="strict"``; with ``"replace"`` its
        bad bytes become U+FFFD and its (1-based) number is appended to ``bad``.
    """
    fd, pending, eof, number = stream.fileno(), b"", False, 0
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
        lines, failed = [], None
        for raw in complete:
            number += 1
            raw = raw.removeprefix(b"\xef\xbb\xbf") if number == 1 else raw
            raw = raw[:-1] if raw.endswith(b"\r") else raw
            try:
                lines.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                if errors == "strict":   # the lines before it are answered first
                    failed = NotUtf8(f"line {number} of stdin is not valid UTF-8")
                    break
                bad.append(number)
                lines.append(raw.decode("utf-8", errors="replace"))
        for start in range(0, len(lines), max_lines):
            yield lines[start:start + max_lines]
        if failed is not None:
            raise failed
        if eof and not pending:
            return


def _read_lines(args: TranslateArgs) -> list[str]:
    """The lines of ``--input`` (or of stdin redirected from a file), split at ``\\n`` only:
    a bare ``\\r`` inside a line stays there (universal newlines would split it and shift
    every later translation off its source), and one ``\\r`` before the ``\\n`` is a
    Windows line end. Bytes that are not UTF-8 stop the run with their line numbers
    (exit status 2), or with ``--input-errors replace`` become U+FFFD, counted."""
    if args.input:
        with open(args.input, "rb") as stream:
            data = stream.read()
    else:   # a file redirected to stdin (a test's StringIO has no bytes underneath)
        buffer = getattr(sys.stdin, "buffer", None)
        data = buffer.read() if buffer is not None else sys.stdin.read().encode("utf-8")
    if data[:2] == b"\x1f\x8b":   # gzip's magic number: a .gz corpus, as training reads them
        try:
            data = gzip.decompress(data)
        except (EOFError, OSError, zlib.error) as e:
            fail(PROG, f"{args.input or 'stdin'} is a truncated or corrupt gzip file ({e}); check it "
                       f"with gzip -t")
    lines, bad = [], []
    for number, raw in enumerate(bulk.split_lines(io.BytesIO(data)), 1):   # the bulk mode's rules
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            bad.append(number)
            lines.append(raw.decode("utf-8", errors="replace"))
    if bad:
        where = args.input or "stdin"
        numbers = bulk.line_numbers(bad)
        if args.input_errors == "strict":
            fail(PROG, f"{len(bad)} line(s) of {where} are not valid UTF-8 (line {numbers}); fix the file "
                       f"(e.g. iconv -f LATIN1 -t UTF-8) or pass --input-errors replace")
        print(f"warning: {len(bad)} line(s) of {where} were not valid UTF-8 (line {numbers}); "
              f"their bad bytes were replaced with U+FFFD", file=sys.stderr)
    return lines


def _translate_lines(translator: Translator, args, lines: list[str], first_index: int, out,
                     stream: int | None = None) -> tuple[list[str], dict[str, int]]:
    """Translates one batch of ``lines`` and writes them; empty lines stay empty, and so
    do lines longer than ``max_len`` tokens with ``--long-lines empty``. ``stream``: the
    sampling stream (bulk mode's chunk index).

    Returns:
      the best translation of each line, and counts: ``empty`` lines, ``long`` lines
      (over ``max_len`` tokens), source ``tokens`` decoded.
    """
    max_len = translator.config.max_len
    todo = [i for i, line in enumerate(lines) if line.strip()]
    lengths = [len(ids) for ids in translator.tokenizer.encode_source([lines[i] for i in todo])]
    counts = {"empty": len(lines) - len(todo), "long": sum(n > max_len for n in lengths)}
    if args.long_lines == "empty":
        todo = [i for i, n in zip(todo, lengths) if n <= max_len]
    counts["tokens"] = sum(min(n, max_len) for n in lengths if args.long_lines == "truncate" or n <= max_len)
    sources = [lines[i] for i in todo]
    best = [""] * len(lines)
    rules = dict(no_repeat_ngram_size=args.no_repeat_ngram_size, repetition_penalty=args.repetition_penalty)
    if args.sample:
        results = [[(text, 0.0)] for text in translator.sample(
            sources, seed=args.seed, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            stream=stream, **rules)]
    elif args.n_best > 1:
        results = translator.n_best(sources, beam_size=args.beam_size, alpha=args.alpha,
                                    length_normalization=args.length_normalization,
                                    early_stopping=args.early_stopping, **rules)
    else:
        results = [[(text, 0.0)] for text in translator(sources, beam_size=args.beam_size, alpha=args.alpha,
                                                       length_normalization=args.length_normalization,
                                                       early_stopping=args.early_stopping, **rules)]
    for i, n_best in zip(todo, results):
        best[i] = n_best[0][0]
    if args.n_best > 1:   # n lines per input line; an empty line's are empty (score 0)
        by_line = dict(zip(todo, results))
        for i in range(len(lines)):
            hypotheses = by_line.get(i, [("", 0.0)])[: args.n_best]
            hypotheses += [hypotheses[-1]] * (args.n_best - len(hypotheses))
            for text, score in hypotheses:
                out.write(f"{first_index + i}\t{score:.4f}\t{text}\n")
    else:
        out.write("".join(f"{text}\n" for text in best))
    out.flush()
    return best, counts


def _load(args: TranslateArgs) -> Translator:
    """The run's translator (on ``--mesh``'s devices if given), its flags checked against
    the model; bad input exits with status 2."""
    skip_absent_tpu()   # libtpu installed on a CPU host: never start the TPU backend
    bulk_cli.initialize(args)   # jax.distributed, before any other JAX use
    run_dir = RunDir(Path(args.workdir))
    cached = run_dir.config.exists() and enable_compilation_cache(run_dir)
    if run_dir.config.exists() and not cached:
        print(f"note: {run_dir.root} is not writable; decoders are compiled without a cache",
              file=sys.stderr)
    try:
        mesh = None
        if args.mesh:
            import jax

            from jaxformer.model.sharding import make_mesh

            mesh = make_mesh(args.mesh, jax.local_devices())
        checkpoint = int(args.checkpoint) if args.checkpoint.isdigit() else args.checkpoint
        translator = Translator(args.workdir, batch_size=args.batch_size, checkpoint=checkpoint,
                                max_len_a=args.max_len_a, max_len_b=args.max_len_b, exported=cached,
                                mesh=mesh, staged=bulk_cli.bulk_mode(args), matmul_dtype=args.matmul_dtype)
    except (ValueError, OSError) as e:
        fail(PROG, str(e))
    for flag, value, count in (("--layer", args.layer, translator.config.num_decoder_layers),
                               ("--head", args.head, translator.config.num_heads)):
        if value is not None and not 0 <= value < count:
            fail(PROG, f"{flag} {value} is out of range; this model has {count} (0..{count - 1})")
    beam_size = args.beam_size or translator.defaults["beam_size"]
    if not args.sample and args.n_best > beam_size:
        fail(PROG, f"--n-best {args.n_best} needs a beam at least as wide; this run decodes with beam "
                   f"{beam_size}: pass --beam-size {args.n_best}")
    return translator


def _translate_text(args: TranslateArgs, translator: Translator):
    """The arguments, stdin or a file read whole (or stdin's lines as they arrive), to
    stdout or ``--output``. Returns the first non-empty line and its translation."""
    try:
        out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    except OSError as e:   # what the flag checks cannot see (a link to a folder that is gone)
        fail(PROG, f"--output {args.output!r} cannot be written ({e.strerror})")
    first, long_lines, bad = None, 0, []
    try:
        if args.sentences or args.input or not _is_stream(sys.stdin):
            lines = list(args.sentences) or _read_lines(args)
            batches: Iterator[list[str]] = iter([lines])
        else:   # a terminal or a pipe: answer each batch of arrived lines at once
            batches = arriving_lines(sys.stdin, args.batch_size, args.input_errors, bad)
        done = 0
        for lines in batches:
            best, counts = _translate_lines(translator, args, lines, done, out)
            long_lines += counts["long"]
            if first is None and any(line.strip() for line in lines):
                first = next((line, hyp) for line, hyp in zip(lines, best) if line.strip())
            done += len(lines)
    except NotUtf8 as e:   # streamed: the lines before it are translated already
        fail(PROG, f"{e} (the {done} line(s) before it were translated); fix the input (e.g. iconv -f "
                   f"LATIN1 -t UTF-8) or pass --input-errors replace")
    finally:
        if out is not sys.stdout:
            out.close()
    if bad:
        print(f"warning: {len(bad)} line(s) of stdin were not valid UTF-8 (line {bulk.line_numbers(bad)}); "
              f"their bad bytes were replaced with U+FFFD", file=sys.stderr)
    if long_lines:
        done = "were truncated to it" if args.long_lines == "truncate" else "gave empty lines"
        print(f"warning: {long_lines} sentence(s) longer than max_len={translator.config.max_len} tokens "
              f"{done}", file=sys.stderr)
    return first


def main(argv=None) -> None:
    args = parse_translate_args(argv)
    translator = _load(args)
    print(f"[{translator.kind} checkpoint, step {translator.step}]", file=sys.stderr)
    if bulk_cli.bulk_mode(args):
        process = bulk_cli.translate(args, translator, _translate_lines)
        first = next(((line, translator([line], beam_size=args.beam_size)[0])
                      for chunk in bulk.read_chunks(args.input, 1000, args.input_errors) for line in chunk
                      if line.strip()), None) if args.attention_png and process == 0 else None
    else:
        first = _translate_text(args, translator)
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
