"""The run (training) configuration and its command line, both from one typed dataclass."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything about a run that is not the architecture.

    Model fields left ``None`` come from the preset (:data:`jaxformer.config.PRESETS`).
    """

    # Where and what.
    workdir: str = "runs/en-de"
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
    vocab_size: int = 4000
    max_train_len: int | None = None  # drop (and count) longer training pairs; default max_len
    # Optimisation (§5.3, §5.4).
    batch_tokens: int = 2048           # padded tokens per batch (rows × bucket length)
    pack: bool = True                  # pack pairs into rows of max_train_len (one compile,
                                       # ~8% padding); --no-pack = length buckets (~35%)
    max_steps: int = 100_000
    max_minutes: float | None = None   # wall-clock budget of the training loop
    warmup_steps: int = 4000
    lr_scale: float = 1.0
    label_smoothing: float = 0.1
    grad_clip: float | None = None
    grad_accum_steps: int = 1          # micro-batches per update (batch_tokens is per update)
    # Scaling out (README, "Scaling out").
    mesh: str | None = None            # e.g. "data=4,model=2"; default: every device on data
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
    log_every: int = 50
    checkpoint_every: int = 1000
    keep_checkpoints: int = 3
    num_samples: int = 5               # dev sentences written to samples.txt per eval
    progress: bool = True

    def __post_init__(self):
        """Rejects values that would crash later or silently do something else.

        Raises:
          ValueError: naming the flag and what it needs.
        """
        at_least_one = ("vocab_size", "batch_tokens", "max_steps", "warmup_steps", "grad_accum_steps",
                        "eval_every", "dev_bleu_sentences", "eval_batch_size", "beam_size", "log_every",
                        "checkpoint_every", "keep_checkpoints")
        problems = [f"--{n.replace('_', '-')} must be at least 1, got {getattr(self, n)}"
                    for n in at_least_one if getattr(self, n) < 1]
        for name in ("max_minutes", "lr_scale", "grad_clip"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                problems.append(f"--{name.replace('_', '-')} must be positive, got {value}")
        if not 0.0 <= self.label_smoothing < 1.0:
            problems.append(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.max_train_len is not None and self.max_train_len < 2:
            problems.append(f"--max-train-len must be at least 2, got {self.max_train_len}")
        if problems:
            raise ValueError("; ".join(problems) + ".")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def model_overrides(self) -> dict[str, Any]:
        """The model fields set on the command line."""
        names = ("d_model", "num_heads", "d_ff", "dropout_rate", "max_len", "norm_position", "dtype",
                 "attention_backend", "remat")
        out = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        if self.num_layers is not None:
            out.update(num_encoder_layers=self.num_layers, num_decoder_layers=self.num_layers)
        return out


# The defaults of `python train.py`: a CPU run of under 10 minutes (see README), the
# result of a sweep over model width, batch size and learning rate on 2 cores.
DEFAULT_CPU_RUN = dict(max_minutes=7.0, max_steps=100_000, warmup_steps=150, lr_scale=0.5,
                       max_train_len=64, eval_every=400, dev_bleu_sentences=200,
                       checkpoint_every=200)   # a SIGKILL loses at most ~2 minutes


def _base_type(tp) -> type:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def build_parser(defaults: dict[str, Any] | None = None, description: str = "") -> argparse.ArgumentParser:
    """An argparse parser with one ``--flag`` per :class:`TrainConfig` field."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(TrainConfig)
    defaults = defaults or {}
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        default = defaults.get(field.name, field.default)
        kind = _base_type(hints[field.name])
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help="default: %(default)s")
        else:
            parser.add_argument(flag, type=kind, default=default, metavar=kind.__name__.upper(),
                                help="default: %(default)s")
    parser.add_argument("--fresh", action="store_true",
                        help="start a new run even if the workdir holds checkpoints "
                             "(moves the old checkpoints aside)")
    return parser


def from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def save_json(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
