"""The flags of ``jaxformer-translate`` as one frozen dataclass, parsed by tyro and checked
(types, bounds, :meth:`TranslateArgs.problems`) before a model is loaded: exit status 2."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Literal

import tyro
from annotated_types import Ge, Gt, Interval

from jaxformer.cli import fail, unwritable
from jaxformer.run.config import Finite, Flag, check_fields, shown

PROG = "jaxformer-translate"
DESCRIPTION = """\
Translate with a trained run: jaxformer-translate --workdir RUN "sentence".

Translates the arguments, --input FILE or stdin, one line out per line in, to stdout or
--output. With both --input and --output (bulk mode) a file of any size is translated in
chunks of --chunk-lines lines written to OUTPUT.parts/: the same command resumes a killed
run; --mesh and several processes (--coordinator-address, --num-processes, --process-id)
share the chunks. Stdin from a terminal or a pipe is answered as lines arrive. Checkpoint:
--checkpoint (default the best by dev BLEU, else the latest). Decoding: beam search,
--n-best lists with scores, or --sample; a line's sampling key comes from --seed and its
line number. The engine: CTranslate2 on a CPU where it is installed, else JAX (--engine).
The run's jax_cache/ keeps the compiled and exported decoders for the next call."""
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
    # a multilingual model's source and target language, its codes (M2M100: en, de; NLLB: eng_Latn)
    src_lang: Annotated[str | None, shown("the run's")] = None
    tgt_lang: Annotated[str | None, shown("the run's")] = None
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
    # translate a line of several sentences sentence by sentence (sentencex), as jaxformer-serve
    # does, a sentence over max_len tokens in pieces; a line is decoded whole with --n-best,
    # --sample and constraints
    split_sentences: bool = True
    # lines decoded whole and longer than max_len tokens: translate their first max_len tokens, or
    # write ""
    long_lines: Literal["truncate", "empty"] = "truncate"
    chunk_lines: Annotated[int, Ge(1)] = 10_000   # bulk mode: lines per chunk, sorted, written, resumed
    # weight matmuls in this dtype, summed in float32
    matmul_dtype: Annotated[Literal["float32", "bfloat16", "float16"] | None, shown("the run's")] = None
    mesh: Annotated[str | None, shown("one device")] = None   # decode data-parallel, e.g. data=8
    coordinator_address: str | None = None   # bulk mode on several processes: host:port of process 0
    num_processes: Annotated[int | None, Ge(1)] = None   # bulk mode on several processes: how many
    process_id: int | None = None   # bulk mode on several processes: this one's index
    distributed: Annotated[bool, Switch] = False   # several processes found by jax.distributed
    # ct2: CTranslate2 on the CPU; jax: ours, any device; auto: ct2 on a CPU where it is installed
    # and the flags allow it, else jax (docs/translation.md, "Serving with CTranslate2")
    engine: Literal["auto", "ct2", "jax"] = "auto"
    # CTranslate2 weights (converted once per checkpoint into RUN/ct2/); int8 on a CPU is faster
    quantization: Annotated[Literal["float32", "int8", "int8_float32", "int16"] | None,
                            shown("float32")] = None
    # CTranslate2 translators, each on its own batches
    inter_threads: Annotated[int | None, Ge(1), shown("the cores for a file, else 1")] = None
    # CTranslate2 threads per translator
    intra_threads: Annotated[int | None, Ge(1), shown("the cores left")] = None
    # target phrases each translation must hold: one line per input line, phrases tab-separated
    constraints: str | None = None
    # TSV of source term<TAB>target term: the target term is a constraint where the source has the term
    terminology: str | None = None
    prefix: str | None = None   # target prefix each translation starts with: one line per input line
    attention_png: str | None = None   # write the first sentence's cross-attention heat map
    layer: Annotated[int | None, shown("mean")] = None   # decoder layer for the heat map
    head: Annotated[int | None, shown("mean")] = None   # head for the heat map

    def problems(self) -> str | None:
        """What is wrong with these flags together, in words, or ``None``."""
        try:
            check_fields(self)
        except ValueError as e:
            return str(e).rstrip(".")
        beam_rules = _given(self, "beam_size", "alpha", "early_stopping", falsy=False)
        sampling, drawing = _given(self, "temperature", "top_k", "top_p"), _given(self, "layer", "head")
        a = 1.0 if self.max_len_a is None else self.max_len_a
        b = 50 if self.max_len_b is None else self.max_len_b
        rules = (
            (self.sample and self.n_best > 1, "--n-best lists come from beam search; --sample gives one "
                                              "translation per sentence (run it again with another --seed)"),
            (self.sample and beam_rules, f"{' and '.join(beam_rules)} {_pl(beam_rules, 'are', 'is')} for "
                                         f"beam search; --sample draws one translation per sentence: "
                                         f"drop {_pl(beam_rules, 'them', 'it')}"),
            (self.beam_size is not None and self.n_best > self.beam_size, "need --n-best <= --beam-size"),
            (self.sample and self.constrained_by,
             f"{' and '.join(self.constrained_by)} {_pl(self.constrained_by, 'need', 'needs')} (constrained) "
             f"beam search; drop --sample"),
            (self.needs_jax_only and self.beam_size is not None and 1 < self.n_best > self.beam_size // 2,
             f"--n-best {self.n_best} with constraints needs --beam-size {2 * self.n_best} or more: finished "
             f"hypotheses come from the top bank, at most half the beam (docs/translation.md, Constraints)"),
            (self.input and self.sentences, "give the sentences as arguments or in --input, not both"),
            (a + b < 1, "need --max-len-a + --max-len-b >= 1 (room for one token)"),
            (sampling and not self.sample, f"{' and '.join(sampling)} {_pl(sampling, 'are', 'is')} for "
                                           f"sampling: add --sample (beam search and greedy would ignore "
                                           f"{_pl(sampling, 'them', 'it')})"),
            (drawing and not self.attention_png, f"{' and '.join(drawing)} "
                                                 f"{_pl(drawing, 'choose', 'chooses')} what --attention-png "
                                                 f"draws: add --attention-png FILE.png, or drop "
                                                 f"{_pl(drawing, 'them', 'it')}"),
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
            (self.engine != "ct2" and self.ct2_flags and (self.engine == "jax" or self.jax_flags),
             f"{' and '.join(self.ct2_flags)} {_pl(self.ct2_flags, 'are', 'is')} for --engine ct2"
             + (f", and {' and '.join(self.jax_flags)} for jax" if self.jax_flags else "")
             + ": choose one engine's flags"),
            (self.engine == "ct2" and self.jax_flags,
             f"--engine ct2 cannot honour {' and '.join(self.jax_flags)} (docs/translation.md, "
             f"\"Serving with CTranslate2\"): use --engine jax, or drop {_pl(self.jax_flags, 'them', 'it')}"),
        )
        return next((message for broken, message in rules if broken), None)

    @property
    def jax_flags(self) -> list[str]:
        """The flags given that only the JAX engine honours."""
        return (_given(self, "mesh", "matmul_dtype", "attention_png", "constraints", "terminology", "prefix")
                + (["multi-process flags"] if self.multi_process else [])
                + ["--length-normalization gnmt"] * (self.length_normalization == "gnmt")
                + ["--no-early-stopping"] * (self.early_stopping is False))

    @property
    def ct2_flags(self) -> list[str]:
        """The flags given that only the CTranslate2 engine honours."""
        return _given(self, "quantization", "inter_threads", "intra_threads")

    @property
    def constrained_by(self) -> list[str]:
        """The constraint flags given (``--constraints``, ``--terminology``, ``--prefix``)."""
        return _given(self, "constraints", "terminology", "prefix")

    @property
    def by_sentence(self) -> bool:
        """Whether lines are translated sentence by sentence: ``--split-sentences`` (the default)
        and one translation a line (no ``--n-best``, ``--sample`` or constraints, whose options
        and notes are a line's)."""
        return self.split_sentences and self.n_best == 1 and not self.sample and not self.constrained_by

    @property
    def needs_jax_only(self) -> bool:
        """Whether only the JAX engine can serve these flags (constrained beam search)."""
        return bool(self.constraints or self.terminology)

    @property
    def multi_process(self) -> bool:
        """Whether the flags ask for ``jax.distributed``."""
        return bool(self.distributed or _given(self, "coordinator_address", "num_processes", "process_id"))


def _given(args: TranslateArgs, *names: str, falsy: bool = True) -> list[str]:
    """The flags of ``names`` given (not ``None``; with ``falsy=False`` not 0 or off either)."""
    return [f"--{name.replace('_', '-')}" for name in names
            if (getattr(args, name) is not None if falsy else getattr(args, name))]


def _pl(flags: list[str], many: str, one: str) -> str:
    return many if len(flags) > 1 else one


def parse_translate_args(argv: list[str] | None = None) -> TranslateArgs:
    """The checked flags of ``jaxformer-translate``; bad ones exit with status 2 and a message."""
    args = tyro.cli(TranslateArgs, args=sys.argv[1:] if argv is None else argv, prog=PROG,
                    description=DESCRIPTION)
    try:
        problem = args.problems() or _path_problem(args)
    except OSError as e:   # a name longer than the filesystem allows, a folder that cannot be searched
        problem = f"cannot use the path {e.filename!r}: {e.strerror}"
    if problem:
        fail(PROG, problem)
    return dataclasses.replace(args, temperature=1.0 if args.temperature is None else args.temperature)


# --attention-png types matplotlib writes alone (.pgf needs LaTeX, .avif a Pillow built with it)
IMAGE_TYPES = ("png", "svg", "svgz", "pdf", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")


def _path_problem(args: TranslateArgs) -> str | None:
    """What is wrong with ``--input``, ``--output`` or ``--attention-png`` as paths, or ``None``."""
    if args.input and not Path(args.input).exists():
        return f"--input file {args.input!r} does not exist"
    if args.input and not Path(args.input).is_file():
        return (f"--input {args.input!r} is not a regular file (a folder, a pipe?); give a file, or pipe "
                f"the text to stdin without --input")
    for flag in args.constrained_by:
        path = getattr(args, flag[2:])
        if not Path(path).exists() or Path(path).is_dir():
            return f"{flag} file {path!r} " + ("is a folder" if Path(path).is_dir() else "does not exist")
        if args.input and args.output and not args.sentences and not Path(path).is_file():
            return f"{flag} {path!r} is not a regular file; bulk mode records its digest: give a file"
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
    """Why ``--output`` cannot be written, or ``None``; it is never opened here (a pipe given
    as ``--output`` is left alone): its folder is probed with a file of another name."""
    if not args.output:
        return None
    out = Path(args.output)
    if out.is_dir():
        return "is a folder; name a file in it"
    if args.input and out.exists() and out.resolve() == Path(args.input).resolve():
        return "is the --input file, which it would overwrite; write to another file"
    from jaxformer.run.directory import RunDir

    run = Path(args.workdir).resolve()
    if any(out.resolve() == run / name or run / name in out.resolve().parents for name in RunDir.NAMES):
        return "is one of the run's own files, which it would overwrite; write to another file"
    if out.suffix == ".gz":
        return "ends in .gz, but translations are written as plain text; drop .gz (or gzip the file after)"
    if out.exists() and not out.is_file():   # a pipe or a device is written as it is
        return None
    folder = out.absolute().parent
    room = os.pathconf(folder, "PC_NAME_MAX") - len(".parts") - len(".4294967296.tmp")
    if len(out.name.encode()) > room:
        return (f"has too long a name for this folder ({len(out.name.encode())} bytes; at most {room}, "
                f"leaving room for the .parts and .tmp names written beside it)")
    problem = unwritable(folder)
    return problem and f"cannot be written: its folder {problem}"
