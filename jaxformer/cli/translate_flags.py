"""The flags of ``jaxformer-translate`` (:mod:`jaxformer.cli.translate`) as one frozen
dataclass: tyro parses them, their declared types and bounds and :meth:`TranslateArgs.problems`
check them, and every error ends the command with status 2 and a one-line message before
a model is loaded."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Literal

import tyro
from annotated_types import Ge, Gt, Interval

from jaxformer.cli import fail
from jaxformer.run.config import Finite, Flag, check_fields, shown
from jaxformer.run.directory import probe_writable

PROG = "jaxformer-translate"
Switch = tyro.conf.FlagCreatePairsOff   # a bool flag that is off unless given


@dataclasses.dataclass(frozen=True, kw_only=True)
class TranslateArgs:
    """The translate tool's command line (``--help`` prints each field's comment)."""

    workdir: str   # run directory written by jaxformer-train
    sentences: Annotated[tuple[str, ...], tyro.conf.Positional,   # sentences to translate
                         tyro.conf.arg(help_behavior_hint="(default: --input, else stdin)")] = ()
    input: Annotated[str | None, shown("the arguments, else stdin")] = None   # one sentence per line
    output: Annotated[str | None, shown("stdout")] = None   # write the translations to this file
    # input lines that are not UTF-8: strict = stop with their numbers, replace = U+FFFD, counted
    input_errors: Literal["strict", "replace"] = "strict"
    # parameters: auto = best by dev BLEU, else latest; best, latest, averaged or a step number
    checkpoint: str = "auto"
    batch_size: Annotated[int, Ge(1)] = 32   # most sentences per batch
    beam_size: Annotated[int | None, Ge(1), shown("the run's, else 4")] = None   # beam width; 1 = greedy
    alpha: Annotated[float | None, Finite, shown("the run's, else 0.6")] = None   # length penalty exponent
    # gnmt: ((5+|Y|)/6)^alpha (paper); hf: |Y|^alpha with Hugging Face generate's stopping rule
    length_normalization: Annotated[Literal["gnmt", "hf"] | None, shown("the run's, else gnmt")] = None
    # beam search: a sentence is done once --beam-size hypotheses ended (fairseq's, CTranslate2's rule)
    early_stopping: Annotated[bool | None, Flag, shown("the run's, else off")] = None
    # output limit a * source length + b: a
    max_len_a: Annotated[float | None, Interval(ge=0, lt=math.inf), shown("imported model's, else 1")] = None
    # output limit a * source length + b: b
    max_len_b: Annotated[int | None, shown("imported model's max_length - 1, else 50")] = None
    # never repeat an n-gram of N tokens (fairseq's flag; 0 = off)
    no_repeat_ngram_size: Annotated[int | None, Ge(0), shown("the run's, else 0")] = None
    # divide the scores of generated tokens by P (> 1 discourages repeats; 1 = off)
    repetition_penalty: Annotated[float | None, Gt(0), shown("the run's, else 1")] = None
    n_best: Annotated[int, Ge(1)] = 1   # print N hypotheses per sentence as index<TAB>score<TAB>text
    sample: Annotated[bool, Switch] = False   # sample instead of beam search
    temperature: Annotated[float | None, Interval(gt=0, lt=math.inf), shown("1")] = None   # sampling
    top_k: Annotated[int | None, Ge(1)] = None   # sample from the k most likely tokens
    top_p: Annotated[float | None, Interval(gt=0, le=1)] = None   # sample from the top-p nucleus
    seed: Annotated[int, Interval(ge=0, lt=2**32)] = 0   # rng seed for --sample
    # sentences longer than max_len tokens: translate their first max_len tokens, or write ""
    long_lines: Literal["truncate", "empty"] = "truncate"
    chunk_lines: Annotated[int, Ge(1)] = 10_000   # bulk mode: lines per chunk, sorted, written, resumed
    # weight matmuls in this dtype, summed in float32
    matmul_dtype: Annotated[Literal["float32", "bfloat16", "float16"] | None, shown("the run's")] = None
    mesh: Annotated[str | None, shown("one device")] = None   # decode data-parallel, e.g. data=8
    coordinator_address: str | None = None   # bulk mode on several processes: host:port of process 0
    num_processes: Annotated[int | None, Ge(1)] = None   # bulk mode on several processes: how many
    process_id: int | None = None   # bulk mode on several processes: this one's index
    distributed: Annotated[bool, Switch] = False   # several processes found by jax.distributed
    attention_png: str | None = None   # write the first sentence's cross-attention heat map
    layer: Annotated[int | None, shown("mean")] = None   # decoder layer for the heat map
    head: Annotated[int | None, shown("mean")] = None   # head for the heat map

    def problems(self) -> str | None:
        """What is wrong with these flags together, in words, or ``None``."""
        try:
            check_fields(self)
        except ValueError as e:
            return str(e).rstrip(".")
        beam_rules = [flag for flag, value in (("--beam-size", self.beam_size), ("--alpha", self.alpha),
                                               ("--early-stopping", self.early_stopping)) if value]
        sampling = [flag for flag, value in (("--temperature", self.temperature), ("--top-k", self.top_k),
                                             ("--top-p", self.top_p)) if value is not None]
        drawing = [flag for flag, value in (("--layer", self.layer), ("--head", self.head))
                   if value is not None]
        a = 1.0 if self.max_len_a is None else self.max_len_a
        b = 50 if self.max_len_b is None else self.max_len_b
        rules = (
            (self.sample and self.n_best > 1, "--n-best lists come from beam search; --sample gives one "
                                              "translation per sentence (run it again with another --seed)"),
            (self.sample and beam_rules, f"{' and '.join(beam_rules)} {_are(beam_rules)} for beam "
                                         f"search; --sample draws one translation per sentence: drop "
                                         f"{_them(beam_rules)}"),
            (self.beam_size is not None and self.n_best > self.beam_size, "need --n-best <= --beam-size"),
            (a + b < 1, "need --max-len-a + --max-len-b >= 1 (room for one token)"),
            (sampling and not self.sample, f"{' and '.join(sampling)} {_are(sampling)} for sampling: "
                                           f"add --sample (beam search and greedy would ignore "
                                           f"{_them(sampling)})"),
            (drawing and not self.attention_png, f"{' and '.join(drawing)} "
                                                 f"{'choose' if len(drawing) > 1 else 'chooses'} what "
                                                 f"--attention-png draws: add --attention-png FILE.png, or "
                                                 f"drop {_them(drawing)}"),
            (self.checkpoint not in ("auto", "best", "latest", "averaged") and not self.checkpoint.isdigit(),
             f"--checkpoint {self.checkpoint!r} is not best, latest, averaged, auto or a step number"),
            (self.multi_process and (not (self.input and self.output) or self.sentences),
             "the multi-process flags (--coordinator-address, --num-processes, --process-id, "
             "--distributed) are for bulk mode only: give --input and --output (and no sentences)"),
            (self.multi_process and not self.distributed
             and None in (self.coordinator_address, self.num_processes, self.process_id),
             "several processes need all of --coordinator-address, --num-processes and --process-id (or "
             "--distributed for auto-detection)"),
            (self.num_processes is not None and not 0 <= (self.process_id or 0) < self.num_processes,
             f"--process-id {self.process_id} is not in 0..{(self.num_processes or 1) - 1}"),
        )
        return next((message for broken, message in rules if broken), None)

    @property
    def multi_process(self) -> bool:
        """Whether the flags ask for ``jax.distributed``."""
        return bool(self.distributed or self.coordinator_address or self.num_processes is not None
                    or self.process_id is not None)


def _are(flags: list[str]) -> str:
    return "are" if len(flags) > 1 else "is"


def _them(flags: list[str]) -> str:
    return "them" if len(flags) > 1 else "it"


def parse_translate_args(argv: list[str] | None = None) -> TranslateArgs:
    """The checked flags of ``jaxformer-translate``; bad ones exit with status 2 and a message."""
    args = tyro.cli(TranslateArgs, args=sys.argv[1:] if argv is None else argv, prog=PROG,
                    description=sys.modules["jaxformer.cli.translate"].__doc__.replace("``", ""))
    problem = args.problems()
    if problem:
        fail(PROG, problem)
    try:
        problem = _path_problem(args)
    except OSError as e:   # a name longer than the filesystem allows, a folder that cannot be searched
        problem = f"cannot use the path {e.filename!r}: {e.strerror}"
    if problem:
        fail(PROG, problem)
    return dataclasses.replace(args, temperature=1.0 if args.temperature is None else args.temperature)


# File types of --attention-png that matplotlib writes with its own backends and Pillow
# alone (.pgf needs LaTeX, .avif a Pillow built with it: left out).
IMAGE_TYPES = ("png", "svg", "svgz", "pdf", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")


def _path_problem(args: TranslateArgs) -> str | None:
    """``--input`` a readable file; ``--output`` and ``--attention-png`` in a folder that
    exists; ``--attention-png`` a file type matplotlib writes (without one it would add
    ``.png`` to the name); ``--output`` a writable file that is not the input."""
    if args.input and not Path(args.input).exists():
        return f"--input file {args.input!r} does not exist"
    if args.input and not Path(args.input).is_file():
        return (f"--input {args.input!r} is not a regular file (a folder, a pipe?); give a file, or pipe "
                f"the text to stdin without --input")
    for flag, path in (("--output", args.output), ("--attention-png", args.attention_png)):
        if path and not Path(path).absolute().parent.is_dir():
            return f"the folder of {flag} {path!r} does not exist"
    if args.attention_png:
        from matplotlib.figure import Figure

        kinds = sorted(set(IMAGE_TYPES) & set(Figure().canvas.get_supported_filetypes()))
        if Path(args.attention_png).suffix.lower().lstrip(".") not in kinds:
            return (f"--attention-png {args.attention_png!r} needs a file type matplotlib writes, e.g. "
                    f"heatmap.png; one of: {', '.join('.' + k for k in kinds)}")
    problem = _output_problem(args)
    return f"--output {args.output!r} {problem}" if problem else None


def _output_problem(args: TranslateArgs) -> str | None:
    """Why ``--output`` cannot be written: a folder, the input (overwritten before it is read
    whole), gzip-named (translations are plain text), a name too long for the ``.parts``/``.tmp``
    names beside it, or a folder no file can be made in (probed with a uniquely named file,
    removed again; the output itself is never opened, so a pipe given as ``--output`` is left
    alone). ``None`` if it can."""
    if not args.output:
        return None
    out = Path(args.output)
    if out.is_dir():
        return "is a folder; name a file in it"
    if args.input and out.exists() and out.resolve() == Path(args.input).resolve():
        return "is the --input file, which it would overwrite; write to another file"
    if out.suffix == ".gz":
        return "ends in .gz, but translations are written as plain text; drop .gz (or gzip the file after)"
    if out.exists() and not out.is_file():   # a pipe or a device is written as it is
        return None
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
