"""The flag checks of ``jaxformer-translate`` (:mod:`jaxformer.cli.translate`): every
flag error is found before a model is loaded, and ends the command with status 2 and a
one-line message."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from jaxformer.cli import bulk as bulk_cli
from jaxformer.run.directory import probe_writable


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flag errors, all before anything is loaded (exit status 2)."""
    if args.sample and args.n_best > 1:
        parser.error("--n-best lists come from beam search; --sample gives one translation per "
                     "sentence (run it again with another --seed for more)")
    beam_rules = [f"--{name.replace('_', '-')}" for name in ("beam_size", "alpha", "early_stopping")
                  if getattr(args, name) not in (None, False)]
    if args.sample and beam_rules:   # sampling would ignore them silently
        several = len(beam_rules) > 1
        parser.error(f"{' and '.join(beam_rules)} {'are' if several else 'is'} for beam search; --sample "
                     f"draws one translation per sentence: drop {'them' if several else 'it'}")
    if (args.beam_size is not None and args.beam_size < 1) or args.n_best < 1 \
            or (args.beam_size is not None and args.n_best > args.beam_size):
        parser.error("need --beam-size >= 1 and 1 <= --n-best <= --beam-size")
    if args.batch_size < 1 or args.chunk_lines < 1:
        parser.error("--batch-size and --chunk-lines must be at least 1")
    if args.no_repeat_ngram_size is not None and args.no_repeat_ngram_size < 0:
        parser.error("--no-repeat-ngram-size must be at least 0 (0 = off)")
    if args.repetition_penalty is not None and not args.repetition_penalty > 0:
        parser.error("--repetition-penalty must be positive (1 = off, > 1 discourages repeats)")
    a = 1.0 if args.max_len_a is None else args.max_len_a
    b = 50 if args.max_len_b is None else args.max_len_b
    if not (math.isfinite(a) and a >= 0 and a + b >= 1):   # NaN fails every comparison: say so
        parser.error("need a finite --max-len-a >= 0 and --max-len-a + --max-len-b >= 1 (room for one token)")
    if args.alpha is not None and not math.isfinite(args.alpha):
        parser.error(f"--alpha must be a finite number, got {args.alpha}")
    if args.sample and not 0 <= args.seed < 2**32:
        parser.error(f"--seed must be in [0, 2**32), got {args.seed}")
    given = [f"--{name.replace('_', '-')}" for name in ("temperature", "top_k", "top_p")
             if getattr(args, name) is not None]
    if given and not args.sample:
        parser.error(f"{' and '.join(given)} {'are' if len(given) > 1 else 'is'} for sampling: add "
                     f"--sample (beam search and greedy decoding would ignore "
                     f"{'them' if len(given) > 1 else 'it'})")
    args.temperature = 1.0 if args.temperature is None else args.temperature
    given = [f"--{name}" for name in ("layer", "head") if getattr(args, name) is not None]
    if given and not args.attention_png:
        parser.error(f"{' and '.join(given)} {'choose' if len(given) > 1 else 'chooses'} what "
                     f"--attention-png draws: add --attention-png FILE.png, or drop "
                     f"{'them' if len(given) > 1 else 'it'}")
    if args.sample and (not 0 < args.temperature < math.inf or (args.top_k is not None and args.top_k < 1)
                        or (args.top_p is not None and not 0 < args.top_p <= 1)):
        parser.error("sampling needs a finite --temperature > 0, --top-k >= 1 and 0 < --top-p <= 1")
    try:
        _check_paths(parser, args)
    except OSError as e:   # a name longer than the filesystem allows, a folder that cannot be searched
        parser.exit(2, f"{parser.prog}: error: cannot use the path {e.filename!r}: {e.strerror}\n")
    if bulk_cli.multi_process(args) and (not (args.input and args.output) or args.sentences):
        parser.error("the multi-process flags (--coordinator-address, --num-processes, --process-id, "
                     "--distributed) are for bulk mode only: give --input and --output (and no sentences)")


def _check_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--input`` a readable file; ``--output`` and ``--attention-png`` in a folder that exists."""
    if args.input and not Path(args.input).exists():
        parser.exit(2, f"{parser.prog}: error: --input file {args.input!r} does not exist\n")
    if args.input and not Path(args.input).is_file():
        parser.exit(2, f"{parser.prog}: error: --input {args.input!r} is not a regular file (a folder, a "
                       f"pipe?); give a file, or pipe the text to stdin without --input\n")
    for flag in ("output", "attention_png"):
        path = getattr(args, flag)
        if path and not Path(path).absolute().parent.is_dir():
            parser.exit(2, f"{parser.prog}: error: the folder of --{flag.replace('_', '-')} {path!r} "
                           f"does not exist\n")
    if args.attention_png:
        _check_image_name(parser, args.attention_png)
    _check_output(parser, args)


# File types of --attention-png that matplotlib writes with its own backends and Pillow
# alone (.pgf needs LaTeX, .avif a Pillow built with it: left out).
IMAGE_TYPES = ("png", "svg", "svgz", "pdf", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")


def _check_image_name(parser: argparse.ArgumentParser, path: str) -> None:
    """``--attention-png`` must end in one of :data:`IMAGE_TYPES`: without a type,
    matplotlib would add ``.png`` to the name, and an unknown one is its traceback."""
    from matplotlib.figure import Figure

    kinds = sorted(set(IMAGE_TYPES) & set(Figure().canvas.get_supported_filetypes()))
    if Path(path).suffix.lower().lstrip(".") not in kinds:
        parser.exit(2, f"{parser.prog}: error: --attention-png {path!r} needs a file type matplotlib "
                       f"writes, e.g. heatmap.png; one of: {', '.join('.' + k for k in kinds)}\n")


def _check_output(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--output`` must be a file that is not the input (it would be overwritten before it
    is read whole), not gzip-named (the translations are written as plain text), and
    writable: its name short enough for the ``.parts``/``.tmp`` names beside it, and its
    folder one a file can be made in (probed with a uniquely named file, removed again;
    the output itself is never opened here, so nothing is truncated and a pipe given as
    ``--output`` is left alone)."""
    if not args.output:
        return
    out = Path(args.output)
    problem = None
    if out.is_dir():
        problem = "is a folder; name a file in it"
    elif args.input and out.exists() and out.resolve() == Path(args.input).resolve():
        problem = "is the --input file, which it would overwrite; write to another file"
    elif out.suffix == ".gz":
        problem = "ends in .gz, but translations are written as plain text; drop .gz (or gzip the file after)"
    elif not out.exists() or out.is_file():   # a pipe or a device is written as it is
        problem = _unwritable(out)
    if problem:
        parser.exit(2, f"{parser.prog}: error: --output {args.output!r} {problem}\n")


def _unwritable(out: Path) -> str | None:
    """Why files cannot be written as ``out`` and beside it, or ``None``."""
    folder = out.absolute().parent
    room = os.pathconf(folder, "PC_NAME_MAX") - len(".parts") - len(".4294967296.tmp")
    if len(out.name.encode()) > room:
        return (f"has too long a name for this folder ({len(out.name.encode())} bytes; at most {room}, "
                f"leaving room for the .parts and .tmp names written beside it)")
    try:
        probe_writable(folder)
    except OSError as e:
        return f"cannot be written: no file can be made in its folder ({e.strerror})"
    return None
