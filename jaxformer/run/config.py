"""The run (training) configuration and its command line, both from one typed dataclass."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import types
import typing
from pathlib import Path
from typing import Any

PAIRS = ("en-de", "en-fr", "en-zh")   # the shipped corpora (jaxformer/corpora/), --pair
SCHEDULES = ("inverse_sqrt", "wsd")   # --lr-schedule (jaxformer.train.optimizer.make_schedule)

@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything about a run that is not the architecture.

    Model fields left ``None`` come from the preset (:data:`jaxformer.model.config.PRESETS`).
    """

    # Where and what.
    workdir: str | None = None         # default: derived from the data (runs/en-de, runs/<file>, ...)
    pair: str = "en-de"
    train_file: str | None = None      # source<TAB>target lines (.tsv or .tsv.gz)
    src_file: str | None = None        # or two aligned text files
    tgt_file: str | None = None
    dev_file: str | None = None        # optional explicit dev/test TSV files
    test_file: str | None = None
    init_from: str | None = None       # fine-tune: architecture, tokenizer and weights of this run
    # Model.
    preset: str = "small"
    d_model: int | None = None
    num_heads: int | None = None
    d_ff: int | None = None
    num_layers: int | None = None      # encoder and decoder layers alike
    dropout_rate: float | None = None
    max_len: int | None = None
    norm_position: str | None = None
    dtype: str | None = None          # compute dtype; bfloat16 on GPU/TPU (params stay float32)
    attention_backend: str | None = None   # reference | xla | cudnn (jax.nn.dot_product_attention)
    remat: bool | None = None          # recompute layer activations in the backward pass
    scan_layers: bool | None = None    # each stack's layers as one nn.scan (compile time flat in depth)
    vocab_size: int = 8000
    max_train_len: int | None = None  # drop (and count) longer training pairs; default max_len
    # Optimisation (§5.3, §5.4).
    batch_tokens: int = 2048           # padded tokens per batch (rows × bucket length)
    pack: bool = True                  # pack pairs into rows of max_train_len (one compile,
                                       # ~8% padding); --no-pack = length buckets (~35%)
    max_steps: int = 100_000
    max_minutes: float | None = None   # wall-clock budget of the training loop
    warmup_steps: int = 4000
    lr_schedule: str = "inverse_sqrt"  # the paper's (§5.3), or wsd: warm-up, stable, decay to 0
    decay_fraction: float = 0.2        # wsd: the last fraction of --max-steps decays linearly
    lr_scale: float = 1.0
    label_smoothing: float = 0.1
    grad_clip: float | None = None
    grad_accum_steps: int = 1          # micro-batches per update (batch_tokens is per update)
    # Scaling out (README, "Scaling out").
    mesh: str | None = None            # e.g. "data=4,model=2" or "fsdp=8"; default: every device on data
    devices: int | None = None         # single-process runs: train on the first N devices only
    distributed: bool = False          # jax.distributed.initialize() with cluster auto-detection
    coordinator_address: str | None = None   # host:port of process 0 (multi-process runs)
    num_processes: int | None = None
    process_id: int | None = None
    seed: int = 0
    # Evaluation, logging, checkpoints.
    eval_every: int = 1000
    dev_bleu_sentences: int = 300      # dev sentences decoded at each periodic eval
    eval_batch_size: int = 64
    beam_size: int = 4                 # dev/test BLEU decoding; 1 = greedy
    alpha: float = 0.6                 # GNMT length penalty (§6.1)
    no_repeat_ngram_size: int = 0      # decoding: ban repeating an n-gram (0 = off; fairseq's flag)
    repetition_penalty: float = 1.0    # decoding: CTRL's penalty on generated tokens (1 = off)
    log_every: int = 50
    checkpoint_every: int = 1000
    keep_checkpoints: int = 3
    num_samples: int = 5               # dev sentences written to samples.txt per eval
    progress: bool = True
    # Data preparation (jaxformer.data.prepare) and streaming (jaxformer.data.streaming).
    max_length_ratio: float = 9.0      # drop pairs whose id counts differ more (Moses clean-corpus-n)
    bt_file: str | None = None         # back-translated pairs (TSV), tagged (jaxformer.data.back_translation)
    bt_ratio: float | None = None      # synthetic pairs per real training pair; default: each once
    data_workers: int | None = None    # grain worker processes collating batches; default: 0 on
                                       # CPU (they would share its cores), 2 on GPU/TPU
    # Scoring, early stopping, checkpoint averaging (issue 14).
    tgt_lang: str | None = None        # target language code for scoring; default: the corpus's
    sacrebleu_tokenize: str | None = None   # default: chosen by sacrebleu from the target language
    patience: int | None = None        # stop after this many evaluations without a better dev BLEU
    average_last: int | None = None    # average the last N checkpoints' params at the end (§6.1)

    def __post_init__(self):
        """Rejects values that would crash later or silently do something else.

        Raises:
          ValueError: naming the flag and what it needs (a value of the wrong type too,
            e.g. ``max_steps="20"``, which would fail later as a comparison of str and int).
        """
        wrong = _wrong_types(self)
        if wrong:
            raise ValueError("; ".join(wrong) + ".")
        at_least_one = ("vocab_size", "batch_tokens", "max_steps", "warmup_steps", "grad_accum_steps",
                        "eval_every", "dev_bleu_sentences", "eval_batch_size", "beam_size", "log_every",
                        "checkpoint_every", "keep_checkpoints")
        problems = [f"--{n.replace('_', '-')} must be at least 1, got {getattr(self, n)}"
                    for n in at_least_one if getattr(self, n) < 1]
        for name in ("max_minutes", "lr_scale", "grad_clip"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                problems.append(f"--{name.replace('_', '-')} must be a positive finite number, got {value}")
        if not 0.0 < self.decay_fraction <= 1.0:
            problems.append(f"--decay-fraction must be in (0, 1], got {self.decay_fraction}")
        if not 0.0 <= self.label_smoothing < 1.0:
            problems.append(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.devices is not None and self.devices < 1:
            problems.append(f"--devices must be at least 1, got {self.devices}")
        if self.no_repeat_ngram_size < 0:
            problems.append(f"--no-repeat-ngram-size must be at least 0 (0 = off), "
                            f"got {self.no_repeat_ngram_size}")
        if not self.repetition_penalty > 0:
            problems.append(f"--repetition-penalty must be positive (1 = off), got {self.repetition_penalty}")
        if self.num_samples < 0:
            problems.append(f"--num-samples must be at least 0, got {self.num_samples}")
        if self.patience is not None and self.patience < 1:
            problems.append(f"--patience must be at least 1, got {self.patience}")
        if self.average_last is not None and not 2 <= self.average_last <= self.keep_checkpoints:
            problems.append(f"--average-last must be in [2, --keep-checkpoints={self.keep_checkpoints}] "
                            f"(only kept checkpoints can be averaged), got {self.average_last}")
        for name in ("d_model", "num_heads", "d_ff", "num_layers", "max_len"):   # named as the flag
            if getattr(self, name) is not None and getattr(self, name) < 1:
                problems.append(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_train_len is not None and self.max_train_len < 2:
            problems.append(f"--max-train-len must be at least 2, got {self.max_train_len}")
        if self.data_workers is not None and self.data_workers < 0:
            problems.append(f"--data-workers must be at least 0, got {self.data_workers}")
        if self.bt_ratio is not None and not (0 < self.bt_ratio < float("inf") and self.bt_file):
            problems.append(f"--bt-ratio needs --bt-file and a positive finite value, got {self.bt_ratio}")
        if not 0 <= self.seed < 2**32:   # numpy's and JAX's seeds; larger ones overflow deep inside
            problems.append(f"--seed must be in [0, 2**32), got {self.seed}")
        if not math.isfinite(self.alpha):
            problems.append(f"--alpha must be a finite number, got {self.alpha}")
        if self.workdir is not None and not str(self.workdir).strip():   # "" would be the current folder
            problems.append("--workdir must name a folder, got an empty value (an unset variable?)")
        if not self.max_length_ratio >= 1:
            problems.append(f"--max-length-ratio must be at least 1, got {self.max_length_ratio}")
        for name, allowed in _choices().items():   # None: the preset's (or sacrebleu's) choice
            if getattr(self, name) is not None and getattr(self, name) not in allowed:
                problems.append(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, "
                                f"got {getattr(self, name)!r}")
        if self.mesh is not None:
            from jaxformer.model.sharding import parse_mesh_axes

            try:
                parse_mesh_axes(self.mesh)
            except ValueError as e:
                problems.append(str(e).rstrip("."))
        if problems:
            raise ValueError("; ".join(problems) + ".")
        if self.workdir is None:   # one run directory per data set: --pair en-fr never resumes en-de
            object.__setattr__(self, "workdir", default_workdir(self))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def row_length(self, max_len: int) -> int:
        """Positions of a training row: ``--max-train-len``, never past the model's ``max_len``."""
        return min(self.max_train_len or max_len, max_len)

    def model_overrides(self) -> dict[str, Any]:
        """The model fields set on the command line."""
        names = ("d_model", "num_heads", "d_ff", "dropout_rate", "max_len", "norm_position", "dtype",
                 "attention_backend", "remat", "scan_layers")
        out = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        if self.num_layers is not None:
            out.update(num_encoder_layers=self.num_layers, num_decoder_layers=self.num_layers)
        return out


def default_workdir(cfg: TrainConfig) -> str:
    """``runs/<pair>`` for a shipped corpus, ``runs/<file name>`` for a user's corpus
    (``runs/train.en-de`` for ``train.en`` + ``train.de``)."""
    def stem(path: str) -> str:
        name = Path(path).name.removesuffix(".gz")
        return name.removesuffix(".tsv") if name.endswith(".tsv") else name

    if cfg.train_file:
        return f"runs/{stem(cfg.train_file)}"
    if cfg.src_file and cfg.tgt_file:
        src, tgt = stem(cfg.src_file), stem(cfg.tgt_file)
        src_base, _, src_ext = src.rpartition(".")
        tgt_base, _, tgt_ext = tgt.rpartition(".")
        return f"runs/{src_base}.{src_ext}-{tgt_ext}" if src_base and src_base == tgt_base else \
            f"runs/{src}-{tgt}"
    return f"runs/{cfg.pair}"


# The defaults of `python train.py`: a CPU run of under 10 minutes at 150 GFLOP/s (README,
# "What the default run reaches"), chosen by the sweep of benchmarks/default_run.py: a fixed
# step budget whose learning rate decays to zero at its end, so the result does not depend
# on the machine's speed, and a mild repetition penalty in evaluation against looping.
DEFAULT_CPU_RUN = dict(max_steps=1000, lr_schedule="wsd", warmup_steps=150, lr_scale=0.5,
                       max_train_len=64, eval_every=500, dev_bleu_sentences=200,
                       checkpoint_every=200,   # a SIGKILL loses at most ~1.5 minutes
                       repetition_penalty=1.4)


def _choices() -> dict[str, tuple[str, ...]]:
    """The fixed sets of values, read from their owners (no copy to drift)."""
    from sacrebleu.metrics.bleu import BLEU

    from jaxformer.model.config import _FLOAT_DTYPES, ATTENTION_BACKENDS, PRESETS

    return {"pair": PAIRS, "preset": tuple(PRESETS), "norm_position": ("post", "pre"),
            "dtype": _FLOAT_DTYPES, "attention_backend": ATTENTION_BACKENDS, "lr_schedule": SCHEDULES,
            "sacrebleu_tokenize": tuple(BLEU.TOKENIZERS)}


@functools.cache
def _field_types() -> dict[str, tuple[type, bool]]:
    """Each :class:`TrainConfig` field's type and whether ``None`` is allowed."""
    hints = typing.get_type_hints(TrainConfig)
    return {name: (_base_type(tp), type(None) in typing.get_args(tp)) for name, tp in hints.items()}


def _wrong_types(cfg: TrainConfig) -> list[str]:
    """The fields of ``cfg`` whose value is not of the field's type (an int is a float;
    a bool is not an int)."""
    numbers_of = {int: numbers.Integral, float: numbers.Real}
    wrong = []
    for name, (kind, optional) in _field_types().items():
        value = getattr(cfg, name)
        if value is None and optional:
            continue
        ok = isinstance(value, numbers_of.get(kind, kind)) and (kind is bool or not isinstance(value, bool))
        if not ok:
            wrong.append(f"{name} must be {kind.__name__}{' or None' if optional else ''}, got {value!r}")
    return wrong


def _base_type(tp) -> type:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def save_json(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
