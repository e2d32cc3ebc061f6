"""The run configuration: five frozen sections under :class:`TrainConfig`, the one schema of
``jaxformer-train``'s flags, ``--config`` files and a run's ``config.json``.

A field is the flag of its name (``batch_tokens``: ``--batch-tokens``; names are unique across
sections, so flags and records stay flat), its comment is its ``--help`` (tyro reads it), its
type its check (``Literal`` choices, ``annotated_types`` bounds; :func:`check_fields`).
Model fields left ``None`` come from the preset or, fine-tuning, from the loaded run.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import math
import operator
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro
from annotated_types import Ge, Gt, Interval
from sacrebleu.metrics.bleu import BLEU

from jaxformer.model.config import _FLOAT_DTYPES, ATTENTION_BACKENDS, PRESETS

PAIRS = ("en-de", "en-fr", "en-zh")   # the shipped corpora (jaxformer/corpora/), --pair
SCHEDULES = ("inverse_sqrt", "wsd")   # --lr-schedule (jaxformer.train.optimizer.make_schedule)
Finite = Interval(gt=-math.inf, lt=math.inf)
Positive = Interval(gt=0, lt=math.inf)
Flag = tyro.conf.DisallowNone   # a bool | None field: --flag / --no-flag, None = left to the model


def shown(words: str):
    """The help's default in words while the default is ``None``."""
    return tyro.conf.arg(help_behavior_hint=lambda label: f"(default: {words if label == 'None' else label})")


_BOUNDS = {"gt": (operator.gt, ">"), "ge": (operator.ge, "at least"), "lt": (operator.lt, "<"),
           "le": (operator.le, "at most")}
_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


CHECKING = contextvars.ContextVar("CHECKING", default=True)   # off while tyro builds a config


def _refuse(problems: list[str]) -> None:
    """Raises ``ValueError`` with every problem in one message, if there are any."""
    if problems:
        raise ValueError("; ".join(problems) + ".")


def check_fields(section) -> None:
    """Holds each field to its type (an int is a float, a bool is no int), ``Literal`` choices
    and ``annotated_types`` bounds. Raises ``ValueError`` naming every wrong flag."""
    if not CHECKING.get():
        return
    problems = []
    for name, hint in typing.get_type_hints(type(section), include_extras=True).items():
        value = getattr(section, name)
        base, *marks = typing.get_args(hint) if typing.get_origin(hint) is Annotated else (hint,)
        union = typing.get_origin(base) in (typing.Union, types.UnionType)
        options = typing.get_args(base) if union else (base,)
        kinds = [k for k in options if k is not type(None)]
        need = None
        if value is None and len(kinds) < len(options):   # None: left to the default's owner
            continue
        if typing.get_origin(kinds[0]) is Literal:
            choices = typing.get_args(kinds[0])
            need = None if value in choices else f"one of {', '.join(map(str, choices))}"
        elif isinstance(value, bool) != (kinds[0] is bool) or not isinstance(
                value, (int, float) if kinds[0] is float else typing.get_origin(kinds[0]) or kinds[0]):
            need = _NAMES.get(kinds[0], str(kinds[0]))
        else:
            bounds = [(op, getattr(m, op)) for m in marks for op in _BOUNDS
                      if getattr(m, op, None) is not None]
            if not all(_BOUNDS[op][0](value, bound) for op, bound in bounds):
                need = "a positive finite number" if bounds == [("gt", 0), ("lt", math.inf)] else \
                    " and ".join("finite" if math.isinf(bound) else f"{_BOUNDS[op][1]} {bound}"
                                 for op, bound in bounds if not (math.isinf(bound) and op == "gt"))
        if need:
            problems.append(f"--{name.replace('_', '-')} must be {need}, got {value!r}")
    _refuse(problems)


class _Section:
    """A config section: its fields are checked (:func:`check_fields`) when it is made."""

    def __post_init__(self):
        check_fields(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelOverrides(_Section):
    """The architecture: a preset, and single fields that override it."""

    preset: Literal[tuple(PRESETS)] = "small"   # model size; the model flags below override single fields
    d_model: Annotated[int | None, Ge(1), shown("the preset's")] = None   # model width D
    num_heads: Annotated[int | None, Ge(1), shown("the preset's")] = None   # heads H; divides --d-model
    d_ff: Annotated[int | None, Ge(1), shown("the preset's")] = None   # feed-forward hidden width F
    num_layers: Annotated[int | None, Ge(1), shown("the preset's")] = None   # encoder and decoder layers each
    dropout_rate: Annotated[float | None, shown("the preset's")] = None   # residual and embedding dropout
    # dropout on the attention weights (tensor2tensor's); needs --attention-backend reference
    attention_dropout_rate: Annotated[float | None, shown("the preset's")] = None
    max_len: Annotated[int | None, Ge(1), shown("the preset's")] = None   # longest sequence in tokens
    # post = the paper's LayerNorm after the residual, pre = before
    norm_position: Annotated[Literal["post", "pre"] | None, shown("the preset's")] = None
    # compute dtype; parameters stay float32
    dtype: Annotated[Literal[_FLOAT_DTYPES] | None, shown("float32")] = None
    # reference (can return weights), xla (any device), cudnn (NVIDIA GPUs), pallas (TPU splash)
    attention_backend: Annotated[Literal[ATTENTION_BACKENDS] | None, shown("the preset's")] = None
    remat: Annotated[bool | None, Flag] = None   # recompute activations in the backward pass
    # each stack's layers as one scanned body: compile time stops growing with depth
    scan_layers: Annotated[bool | None, Flag] = None

    def overrides(self) -> dict[str, Any]:
        """The :class:`~jaxformer.model.config.TransformerConfig` fields set here."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("preset", "num_layers") and getattr(self, f.name) is not None}
        if self.num_layers is not None:
            out.update(num_encoder_layers=self.num_layers, num_decoder_layers=self.num_layers)
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig(_Section):
    """The corpus and its tokenizer (all that jaxformer-prepare needs)."""

    pair: Literal[PAIRS] = "en-de"   # shipped corpus, when no --train-file/--src-file is given
    train_file: str | None = None   # your corpus: source<TAB>target lines (.tsv or .tsv.gz)
    src_file: str | None = None   # your corpus as two aligned text files: the source side
    tgt_file: str | None = None   # your corpus as two aligned text files: the target side
    dev_file: str | None = None   # explicit dev set (TSV) instead of a split of the corpus
    test_file: str | None = None   # explicit test set (TSV) instead of a split of the corpus
    vocab_size: Annotated[int, Ge(1)] = 8000   # sentencepiece vocabulary, shared by source and target
    # auto: a fresh run's vocabulary size, dropouts, label smoothing and model shape not given
    # as flags follow the corpus (docs/training.md's table); fixed: the defaults, as before
    recipe: Literal["auto", "fixed"] = "auto"
    # prepare: drop pairs whose token counts differ by more than this factor (Moses clean-corpus-n)
    max_length_ratio: Annotated[float, Ge(1)] = 9.0
    bt_file: str | None = None   # back-translated pairs (TSV), their sources tagged <BT>
    # synthetic pairs per real training pair (needs --bt-file)
    bt_ratio: Annotated[float | None, shown("each --bt-file pair once")] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig(_Section):
    """Training batches, optimisation (§5.3, §5.4), the budget and when training stops."""

    # drop (and count) longer training pairs, in tokens
    max_train_len: Annotated[int | None, Ge(2), shown("--max-len")] = None
    pack: bool = True   # pack pairs into rows of --max-train-len; --no-pack: length buckets
    # grain worker processes collating batches
    data_workers: Annotated[int | None, Ge(0), shown("0 on CPU, 2 on GPU/TPU")] = None
    batch_tokens: Annotated[int, Ge(1)] = 2048   # padded tokens per update (rows x row length)
    grad_accum_steps: Annotated[int, Ge(1)] = 1   # micro-batches per update
    max_steps: Annotated[int, Ge(1)] = 100_000   # stop after this many updates
    max_minutes: Annotated[float | None, Positive] = None   # stop after this many minutes of wall time
    warmup_steps: Annotated[int, Ge(1)] = 4000   # linear learning-rate warm-up steps
    # inverse_sqrt = the paper's (§5.3); wsd = warm-up, peak held, linear decay to 0 at --max-steps
    lr_schedule: Literal[SCHEDULES] = "inverse_sqrt"
    decay_fraction: Annotated[float, Interval(gt=0, le=1)] = 0.2   # wsd: the last fraction that decays
    lr_scale: Annotated[float, Positive] = 1.0   # multiplies the paper's learning-rate schedule
    label_smoothing: Annotated[float, Interval(ge=0, lt=1)] = 0.1   # label smoothing epsilon (§5.4)
    grad_clip: Annotated[float | None, Positive, shown("no clipping")] = None   # global gradient norm
    eval_every: Annotated[int, Ge(1)] = 1000   # evaluate dev loss and BLEU every this many steps
    # between those, the dev NLL only (no smoothing, no decoding) every this many steps; 0: never
    nll_every: Annotated[int | None, Ge(0), shown("a fifth of --eval-every")] = None
    # stop after this many evaluations without a better dev BLEU
    patience: Annotated[int | None, Ge(1), shown("never")] = None
    # stop after this many dev-NLL evaluations in a row that each rose (overfitting)
    stop_on_overfit: Annotated[int | None, Ge(1), shown("never")] = None
    # at the end, average the last N checkpoints (§6.1); kept if its dev BLEU is better
    average_last: int | None = None

    def nll_interval(self) -> int:
        """Steps between dev-NLL evaluations (``--nll-every``, default a fifth of ``--eval-every``,
        rounded down); 0: none."""
        return self.nll_every if self.nll_every is not None else self.eval_every // 5

    def row_length(self, max_len: int) -> int:
        """Positions of a training row: ``--max-train-len``, never past the model's ``max_len``."""
        return min(self.max_train_len or max_len, max_len)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig(_Section):
    """How evaluation decodes and scores the dev and test sets."""

    beam_size: Annotated[int, Ge(1)] = 4   # beam width for dev/test BLEU; 1 = greedy
    alpha: Annotated[float, Finite] = 0.6   # GNMT length-penalty exponent (§6.1)
    no_repeat_ngram_size: Annotated[int, Ge(0)] = 0   # never repeat an n-gram of this size (0 = off)
    # divide the scores of generated tokens by this (1 = off; CTRL, HF generate)
    repetition_penalty: Annotated[float, Gt(0)] = 1.0
    # translate a dev/test line of several sentences sentence by sentence (sentencex), as
    # jaxformer-translate and jaxformer-serve do
    split_sentences: bool = True
    eval_batch_size: Annotated[int, Ge(1)] = 64   # sentences per decoding batch in evaluation
    dev_bleu_sentences: Annotated[int, Ge(1)] = 300   # dev sentences decoded for BLEU per evaluation
    num_samples: Annotated[int, Ge(0)] = 5   # dev translations written to samples.txt per evaluation
    # target language code, kept in config.json; picks the BLEU tokenizer (M2M100/NLLB: its code, deu_Latn)
    tgt_lang: Annotated[str | None, shown("the shipped pair's, else the --init-from run's")] = None
    # source language code, kept in config.json (a multilingual model's: its code, e.g. eng_Latn)
    src_lang: Annotated[str | None, shown("the shipped pair's, else the --init-from run's")] = None
    # sacrebleu tokenizer for BLEU
    sacrebleu_tokenize: Annotated[Literal[tuple(BLEU.TOKENIZERS)] | None, shown("by target language")] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig(_Section):
    """Where the run lives, the devices it uses, its seed, logs and checkpoints."""

    # run directory: checkpoints, logs, results; an existing run is resumed
    workdir: Annotated[str | None, shown("runs/<pair or corpus file name>")] = None
    # fine-tune: start from this run's weights, architecture and tokenizer (fresh optimizer)
    init_from: str | None = None
    # device mesh over data, fsdp and model, e.g. data=4,model=2
    mesh: Annotated[str | None, shown("every device on data")] = None
    devices: Annotated[int | None, Ge(1), shown("all")] = None   # single-process runs: the first N devices
    distributed: bool = False   # jax.distributed.initialize() with cluster auto-detection
    coordinator_address: str | None = None   # host:port of process 0 in a multi-process run
    num_processes: Annotated[int | None, Ge(1)] = None   # number of processes in a multi-process run
    process_id: Annotated[int | None, Ge(0)] = None   # this process's index in a multi-process run
    seed: Annotated[int, Interval(ge=0, lt=2**32)] = 0   # root random seed (init, dropout, data order)
    log_every: Annotated[int, Ge(1)] = 50   # log loss, tokens/s and learning rate every this many steps
    checkpoint_every: Annotated[int, Ge(1)] = 1000   # save a checkpoint every this many steps
    keep_checkpoints: Annotated[int, Ge(1)] = 3   # training checkpoints kept (the newest)
    progress: bool = True   # a progress bar; --no-progress prints one line per --log-every steps


SECTIONS = {"model": ModelOverrides, "data": DataConfig, "train": OptimConfig, "decode": DecodeConfig,
            "run": RunConfig}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything about a run, in sections; :meth:`flat` builds one from flat setting names,
    :meth:`to_dict` is ``config.json``'s flat record. Raises ``ValueError`` naming each flag
    that breaks its type, choices, range or a rule between fields."""

    model: ModelOverrides = ModelOverrides()
    data: DataConfig = DataConfig()
    train: OptimConfig = OptimConfig()
    decode: DecodeConfig = DecodeConfig()
    run: RunConfig = RunConfig()

    def __post_init__(self):
        if not CHECKING.get():
            return
        wrong = [f"{part} must be a {kind.__name__}, got {type(getattr(self, part)).__name__}"
                 for part, kind in SECTIONS.items() if not isinstance(getattr(self, part), kind)]
        _refuse([w + " (TrainConfig.flat builds the sections from flat names)" for w in wrong])
        problems = []
        average, keep = self.train.average_last, self.run.keep_checkpoints
        if average is not None and not 2 <= average <= keep:
            problems.append(f"--average-last must be in [2, --keep-checkpoints={keep}] (only kept "
                            f"checkpoints can be averaged), got {average}")
        ratio = self.data.bt_ratio
        if ratio is not None and not (0 < ratio < math.inf and self.data.bt_file):
            problems.append(f"--bt-ratio needs --bt-file and a positive finite value, got {ratio}")
        if self.run.workdir is not None and not self.run.workdir.strip():   # "" would be the current folder
            problems.append("--workdir must name a folder, got an empty value (an unset variable?)")
        if self.run.mesh is not None:
            from jaxformer.model.sharding import parse_mesh_axes

            try:
                parse_mesh_axes(self.run.mesh)
            except ValueError as e:
                problems.append(str(e).rstrip("."))
        _refuse(problems)

    @classmethod
    def flat(cls, **settings: Any) -> TrainConfig:
        """A config from flat setting names (``TrainConfig.flat(preset="tiny", max_steps=10)``).
        Raises ``ValueError`` on an unknown name or a value the schema refuses."""
        unknown = set(settings) - set(SECTION_OF)
        _refuse([f"unknown setting(s) {', '.join(map(repr, sorted(unknown)))}; settings are the flag "
                 f"names without dashes, e.g. batch_tokens (see --help)"] if unknown else [])
        return cls(**{part: kind(**{k: v for k, v in settings.items() if SECTION_OF[k] == part})
                      for part, kind in SECTIONS.items()})

    @property
    def workdir(self) -> str:
        """``--workdir``, or one derived from the data (:func:`default_workdir`)."""
        return self.run.workdir or default_workdir(self.data)

    def settings(self) -> dict[str, Any]:
        """Every setting by its flat name, as given (``workdir`` ``None`` when derived)."""
        return {name: value for part in SECTIONS
                for name, value in dataclasses.asdict(getattr(self, part)).items()}

    def to_dict(self) -> dict[str, Any]:
        """The flat record of ``config.json``'s ``"train"``: every setting, the workdir resolved."""
        return {**self.settings(), "workdir": self.workdir}

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some flat settings changed (``cfg.replace(max_steps=5)``)."""
        return TrainConfig.flat(**{**self.settings(), **changes})


SECTION_OF = {f.name: part for part, kind in SECTIONS.items() for f in dataclasses.fields(kind)}


def default_workdir(data: DataConfig) -> str:
    """``runs/<pair>``, or ``runs/<file name>`` for a user's corpus (``train.en`` + ``train.de``:
    ``runs/train.en-de``)."""
    def stem(path: str) -> str:
        name = Path(path).name.removesuffix(".gz")
        return name.removesuffix(".tsv") if name.endswith(".tsv") else name

    if data.train_file:
        return f"runs/{stem(data.train_file)}"
    if data.src_file and data.tgt_file:
        src, tgt = stem(data.src_file), stem(data.tgt_file)
        src_base, _, src_ext = src.rpartition(".")
        tgt_base, _, tgt_ext = tgt.rpartition(".")
        return f"runs/{src_base}.{src_ext}-{tgt_ext}" if src_base and src_base == tgt_base else \
            f"runs/{src}-{tgt}"
    return f"runs/{data.pair}"


# `python train.py`'s defaults (benchmarks/default_run.py's sweep): a CPU run of minutes on a
# fixed step budget whose learning rate decays to zero; its decoding (benchmarks/README.md,
# "The default run"): length penalty exponent 1.0, a mild repetition penalty and no repeated
# 3-gram of pieces, which keep a small model's loops under 0.5% of its test translations.
DEFAULT_CPU_RUN = dict(max_steps=1000, lr_schedule="wsd", warmup_steps=150, lr_scale=0.5,
                       max_train_len=64, eval_every=500, dev_bleu_sentences=200,
                       checkpoint_every=200, alpha=1.0, repetition_penalty=1.4, no_repeat_ngram_size=3)


def save_json(path: Path, payload: dict[str, Any]) -> None:
    """Writes ``payload`` as JSON atomically (a temporary file renamed over ``path``)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
