"""The main job: train a translator, evaluate BLEU, checkpoint, resume.

``train.py`` is a thin entry point; everything here is importable and tested.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import sacrebleu
from tqdm import tqdm

from jaxformer import data as data_lib
from jaxformer import sharding as sharding_lib
from jaxformer.checkpoints import RunCheckpoints
from jaxformer.config import TransformerConfig, preset
from jaxformer.decoding import beam_translate, greedy_translate, jit_decoder, sample_translate
from jaxformer.model import Transformer
from jaxformer.run_config import TrainConfig, save_json
from jaxformer.training import (
    add_metrics,
    create_sharded_train_state,
    jit_eval_step,
    jit_train_step,
    make_optimizer,
    transformer_schedule,
)
from jaxformer.validation import check_token_ids


def log(message: str) -> None:
    """Prints above the progress bar; in a multi-process run only process 0 speaks."""
    if _is_main_process():
        tqdm.write(message)


def _is_main_process() -> bool:
    """Process 0 writes the run's logs and records; every process writes checkpoints."""
    return jax.process_index() == 0


# ---------------------------------------------------------------------- data
def load_splits(cfg: TrainConfig) -> tuple[dict[str, list[data_lib.Pair]], str]:
    """Reads the corpus named by ``cfg`` and splits it; prints the data report.

    Returns:
      ``(splits, target_language)``.
    """
    if cfg.train_file and (cfg.src_file or cfg.tgt_file):
        raise ValueError("Give either --train-file or --src-file/--tgt-file, not both.")
    if bool(cfg.src_file) != bool(cfg.tgt_file):
        raise ValueError("--src-file and --tgt-file go together.")
    if cfg.train_file:
        pairs, report = data_lib.read_tsv(cfg.train_file)
        name = cfg.train_file
    elif cfg.src_file:
        pairs, report = data_lib.read_aligned(cfg.src_file, cfg.tgt_file)
        name = f"{cfg.src_file} + {cfg.tgt_file}"
    else:
        path = data_lib.builtin_corpus_path(cfg.pair)
        pairs, report = data_lib.read_tsv(path)
        name = f"shipped {cfg.pair} corpus (LibreOffice help, MPL-2.0)"
    log(report.summary(name))
    explicit = {}
    for split, path in (("dev", cfg.dev_file), ("test", cfg.test_file)):
        if path:
            explicit[split], rep = data_lib.read_tsv(path)
            log(rep.summary(f"{split} file {path}"))
    splits = _split_with_explicit(pairs, explicit) if explicit else data_lib.split_pairs(pairs)
    log("split: " + ", ".join(f"{k} {len(v)}" for k, v in splits.items()))
    target_language = cfg.pair.split("-")[1] if not (cfg.train_file or cfg.src_file) else "xx"
    return splits, target_language


def _split_with_explicit(pairs, explicit):
    """Explicit dev/test files replace the hashed split's; the rest goes to train."""
    if "dev" in explicit and "test" in explicit:
        return {"train": list(pairs), **explicit}
    held = data_lib.split_pairs(pairs, dev_size=1000, test_size=1000)
    return {"train": held["train"] + held["dev" if "dev" in explicit else "test"],
            "dev": explicit.get("dev", held["dev"]), "test": explicit.get("test", held["test"])}


def load_or_train_tokenizer(workdir: Path, train_pairs: Sequence[data_lib.Pair],
                            vocab_size: int) -> data_lib.Tokenizer:
    """The run's tokenizer: loaded from ``workdir/tokenizer`` or trained on the train split."""
    model_file = workdir / "tokenizer" / "spm.model"
    if jax.process_count() > 1:   # process 0 trains it; the others wait and load the same file
        from jax.experimental import multihost_utils

        if _is_main_process() and not model_file.exists():
            _train_tokenizer(model_file, train_pairs, vocab_size)
        multihost_utils.sync_global_devices("tokenizer")
    if model_file.exists():
        return data_lib.Tokenizer(model_file)
    return _train_tokenizer(model_file, train_pairs, vocab_size)


def _train_tokenizer(model_file: Path, train_pairs: Sequence[data_lib.Pair],
                     vocab_size: int) -> data_lib.Tokenizer:
    start = time.perf_counter()
    sentences = [s for pair in train_pairs for s in pair]
    tokenizer = data_lib.Tokenizer.train(sentences, model_file.parent, vocab_size=vocab_size)
    log(f"trained sentencepiece ({tokenizer.vocab_size} pieces) in {time.perf_counter() - start:.1f}s")
    return tokenizer


# ---------------------------------------------------------------------- evaluation
class Evaluator:
    """Dev/test evaluation and batched translation: teacher-forced loss, decoding, BLEU."""

    def __init__(self, model: Transformer, tokenizer: data_lib.Tokenizer, *, batch_size: int,
                 target_language: str, smoothing: float, layout: sharding_lib.Layout | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.layout = layout
        self.batch_size = batch_size
        # Coarse buckets: each is one compile of the decode loop and of the eval step.
        self.boundaries = data_lib.bucket_boundaries(model.config.max_len, step=32)
        self.eval_step = jit_eval_step(model, smoothing, layout=layout)
        self._decoders: dict[Any, Any] = {}
        tokenize = "zh" if target_language == "zh" else "13a"
        self.bleu = sacrebleu.metrics.BLEU(tokenize=tokenize)

    def _decoder(self, decoder, **static):
        """``decoder(params, src[, rng])`` with the statics bound; under a layout, jitted with
        explicit in/out shardings (:func:`jaxformer.decoding.jit_decoder`). Cached."""
        key = (decoder, tuple(sorted(static.items())))
        if key not in self._decoders:
            self._decoders[key] = jit_decoder(decoder, self.model, self.layout, **static)
        return self._decoders[key]

    def _place(self, batch):
        """This process's block of rows of a (whole, host) batch, as global sharded arrays."""
        rows = next(iter(batch.values())).shape[0] // jax.process_count()
        start = jax.process_index() * rows
        return sharding_lib.shard_batch({k: v[start:start + rows] for k, v in batch.items()},
                                        self.layout.batch)

    def _length_batches(self, lengths):
        order = np.argsort(lengths, kind="stable")
        buckets = np.searchsorted(np.asarray(self.boundaries), np.asarray(lengths)[order])
        for b in np.unique(buckets):
            members = order[buckets == b]
            for start in range(0, members.size, self.batch_size):
                yield self.boundaries[b], members[start:start + self.batch_size]

    def _decode(self, sources: Sequence[str], decode_batch) -> list[list[tuple[str, float]]]:
        """Sorts sources by length into fixed-shape batches, decodes each with
        ``decode_batch(src [b, L], max_decode_len) -> (ids [b, n, M], scores [b, n])`` and
        restores the input order. Sources longer than ``max_len`` tokens are truncated."""
        c = self.model.config
        ids = [s[: c.max_len] for s in self.tokenizer.encode(sources)]
        out: list[list[tuple[str, float]]] = [[] for _ in ids]
        for length, members in self._length_batches([max(1, len(s)) for s in ids]):
            src = np.full((self.batch_size, length), c.pad_id, np.int32)
            for r, i in enumerate(members):
                src[r, : len(ids[i])] = ids[i]
            check_token_ids(src, name="src", vocab_size=c.src_vocab_size, max_len=c.max_len)
            src = self._place({"src": src})["src"] if self.layout else jnp.asarray(src)
            hyps, scores = sharding_lib.to_host(decode_batch(src, min(length + 50, c.max_len)))
            for r, i in enumerate(members):
                texts = self.tokenizer.decode(hyps[r])
                out[i] = list(zip(texts, (float(x) for x in scores[r])))
        return out

    def translate_n_best(self, params: Any, sources: Sequence[str], *, beam_size: int = 4,
                         alpha: float = 0.6) -> list[list[tuple[str, float]]]:
        """Beam search: for each source, ``beam_size`` (translation, score) pairs, best first."""
        bos, eos = self.tokenizer.bos_id, self.tokenizer.eos_id

        def decode_batch(src, max_decode_len):
            return self._decoder(beam_translate, beam_size=beam_size, alpha=alpha,
                                 max_decode_len=max_decode_len, bos_id=bos, eos_id=eos)(params, src)

        return self._decode(sources, decode_batch)

    def translate(self, params: Any, sources: Sequence[str], *, beam_size: int = 1,
                  alpha: float = 0.6) -> list[str]:
        """Best translation of each source, in input order: greedy for ``beam_size=1``,
        else beam search with the GNMT length penalty α."""
        if beam_size > 1:
            return [n_best[0][0] for n_best in self.translate_n_best(params, sources,
                                                                     beam_size=beam_size, alpha=alpha)]
        bos, eos = self.tokenizer.bos_id, self.tokenizer.eos_id

        def decode_batch(src, max_decode_len):
            hyp = self._decoder(greedy_translate, max_decode_len=max_decode_len, bos_id=bos,
                                eos_id=eos)(params, src)
            return hyp[:, None], jnp.zeros(hyp.shape[:1] + (1,))

        return [n_best[0][0] for n_best in self._decode(sources, decode_batch)]

    def sample(self, params: Any, sources: Sequence[str], rng: jax.Array, *, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None) -> list[str]:
        """One sampled translation per source (see :func:`jaxformer.decoding.sample`)."""
        bos, eos = self.tokenizer.bos_id, self.tokenizer.eos_id
        counter = iter(range(1 << 30))

        def decode_batch(src, max_decode_len):
            hyp = self._decoder(sample_translate, max_decode_len=max_decode_len, bos_id=bos, eos_id=eos,
                                temperature=temperature, top_k=top_k, top_p=top_p,
                                )(params, src, jax.random.fold_in(rng, next(counter)))
            return hyp[:, None], jnp.zeros(hyp.shape[:1] + (1,))

        return [n_best[0][0] for n_best in self._decode(sources, decode_batch)]

    def loss(self, params: Any, examples: data_lib.Examples) -> dict[str, float]:
        """Teacher-forced per-token loss and perplexity on tokenized pairs."""
        totals = None
        lengths = [max(len(s), len(t) + 1) for s, t in zip(examples.src, examples.tgt)]
        for length, members in self._length_batches(lengths):
            indices = np.concatenate([members, np.full(self.batch_size - members.size, -1)])
            batch = data_lib.collate(examples, length, indices, pad_id=self.model.config.pad_id,
                                     bos_id=self.tokenizer.bos_id, eos_id=self.tokenizer.eos_id)
            totals = add_metrics(totals, self.eval_step(params, self._place(batch) if self.layout else batch))
        totals = jax.device_get(totals)
        tokens = max(float(totals["tokens"]), 1.0)
        return {"loss": float(totals["loss_sum"]) / tokens,
                "ppl": math.exp(min(float(totals["nll_sum"]) / tokens, 50.0)),
                "accuracy": float(totals["correct"]) / tokens}

    def score(self, hypotheses: Sequence[str], references: Sequence[str]) -> float:
        return float(self.bleu.corpus_score(list(hypotheses), [list(references)]).score)


# ---------------------------------------------------------------------- run directory
def _model_config(cfg: TrainConfig, tokenizer: data_lib.Tokenizer) -> TransformerConfig:
    return preset(cfg.preset, src_vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id,
                  **cfg.model_overrides())


def check_resume_compatible(saved: dict[str, Any], model_config: TransformerConfig) -> None:
    """Raises ``ValueError`` naming every architecture field that differs from the saved run."""
    saved_model = saved.get("model", {})
    # How the weights are computed (attention kernel, remat) may change between runs;
    # a field missing from an older run's record has its default.
    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    differing = {k: (saved_model.get(k, defaults[k]), v) for k, v in model_config.to_dict().items()
                 if k not in ("attention_backend", "remat") and saved_model.get(k, defaults[k]) != v}
    if differing:
        fields = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in sorted(differing.items()))
        raise ValueError(f"The run directory holds checkpoints of another architecture ({fields}). "
                         f"Use the same flags to resume, another --workdir, or --fresh to start over.")


def prepare_workdir(workdir: Path, fresh: bool) -> None:
    """Creates the run directory (clear error if impossible); ``fresh`` moves the previous
    run's files (checkpoints, tokenizer, logs) into ``old-<time>/``."""
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / f".write-test-{jax.process_index()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise OSError(f"Cannot write the run directory {str(workdir)!r}: {e}. "
                      f"Choose a writable --workdir.") from e
    if fresh and _is_main_process():   # nothing is deleted: the previous run moves to old-<time>/
        names = ("checkpoints", "best", "config.json", "metrics.jsonl", "metrics.redone.jsonl",
                 "tokenizer", "tensorboard", "plots", "samples.txt", "results.json",
                 "test_hypotheses.txt", "corrupt")
        present = [n for n in names if (workdir / n).exists()]
        if present:
            old = Path(tempfile.mkdtemp(prefix=f"old-{time.strftime('%Y%m%d-%H%M%S')}-", dir=workdir))
            for name in present:
                shutil.move(str(workdir / name), str(old / name))
            log(f"--fresh: moved the previous run's files to {old}")


def write_plots(workdir: Path) -> None:
    """``plots/loss.png``, ``plots/lr.png`` and ``plots/bleu.png`` from ``metrics.jsonl``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line]
    plots = workdir / "plots"
    plots.mkdir(exist_ok=True)
    series = {
        "loss": [("train", "train/loss"), ("dev", "dev/loss")],
        "lr": [("learning rate", "train/lr")],
        "bleu": [("dev BLEU", "dev/bleu")],
    }
    for name, curves in series.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, key in curves:
            points = [(r["step"], r[key]) for r in rows if key in r]
            if points:
                ax.plot(*zip(*points), label=label, marker="o" if name == "bleu" else None)
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        if ax.lines:   # a run too short to log has nothing to label
            ax.legend()
        fig.tight_layout()
        fig.savefig(plots / f"{name}.png", dpi=100)
        plt.close(fig)


class MetricsLog:
    """``metrics.jsonl`` plus TensorBoard events, one record per call (process 0 only)."""

    def __init__(self, workdir: Path):
        from tensorboardX import SummaryWriter

        self.path = workdir / "metrics.jsonl"
        self.writer = SummaryWriter(str(workdir / "tensorboard")) if _is_main_process() else None

    def write(self, step: int, values: dict[str, float]) -> None:
        if self.writer is None:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# ---------------------------------------------------------------------- nothing lost
class Preempted(Exception):
    """Training stopped on SIGTERM/SIGINT after checkpointing the current step."""

    def __init__(self, signum: int, step: int, message: str):
        super().__init__(message)
        self.signum, self.step = signum, step


class TrainingDiverged(RuntimeError):
    """Every update of a logging window had a non-finite loss or gradient norm."""


class PreemptionGuard:
    """Turns SIGTERM and SIGINT into a stop that the training loop checks between steps.

    A preemptible machine sends SIGTERM some seconds before it is taken away; Ctrl-C
    sends SIGINT. Either lets the current step finish, then the trainer writes a
    checkpoint and stops. A second SIGINT ends the process at once with status 130 and
    one line (no traceback, no save); the last complete checkpoint is still there,
    since orbax writes steps atomically. Outside the main thread (where Python cannot
    install handlers) the guard does nothing.

    With several processes (``multi_process=True``) all of them must stop at the same
    step, or the ones still training wait forever in a collective. SIGTERM is then left
    to JAX's preemption service (installed by ``jax.distributed.initialize``), which
    spreads the notice and picks the step (``multihost_utils.reached_preemption_sync_point``,
    asked once per step); a SIGINT is passed on to it as a SIGTERM, so the run stops
    as preempted (exit 143). The stop comes at the agreed step, about a second and a
    few steps after the signal; a signal that arrives after the loop (final
    evaluation) is only recorded by JAX and the run finishes. If JAX's preemption
    service is turned off (``jax_enable_preemption_service``), signals are not caught.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, multi_process: bool = False):
        self.received: int | None = None
        self.multi_process = multi_process
        self._interrupted = False
        self._checks = 0   # sync-point ids count from 0 in every launch (see stop_requested)
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and (self._interrupted or self.received is not None):
            sys.stderr.write("second interrupt: stopped at once without saving; run the same "
                             "command again to resume from the newest complete checkpoint\n")
            sys.stderr.flush()
            os._exit(128 + signal.SIGINT)
        if self.multi_process:   # only SIGINT comes here: hand it to the preemption service
            self._interrupted = True
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.received = signum

    def stop_requested(self) -> bool:
        """Whether to stop before the next step; call it once per step.

        With several processes every one must call it once per step, from the same
        first step on; they all get ``True`` at the same step. The ids given to JAX's
        sync point are this launch's check count, not the training step: a notice that
        arrives before the first check (during a resumed run's start-up) is set to id
        1, which a step count that starts at the restored step would never meet.
        """
        if self.multi_process and self.received is None:
            from jax.experimental import multihost_utils

            try:
                if multihost_utils.reached_preemption_sync_point(self._checks):
                    self.received = signal.SIGTERM
            except RuntimeError as error:   # jax_enable_preemption_service is off
                log(f"multi-process run without JAX's preemption service "
                    f"({str(error).splitlines()[0]}); SIGTERM and Ctrl-C will not checkpoint")
                self.multi_process = False
                self.__exit__()   # give SIGINT back: one process alone must not stop
            self._checks += 1
        return self.received is not None

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            signals = (signal.SIGINT,) if self.multi_process else self.SIGNALS
            self._previous = {s: signal.signal(s, self._handle) for s in signals}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def _past_deadline(deadline: float, step: int, every: int) -> bool:
    """Whether the ``--max-minutes`` budget is spent. With several processes the clocks
    differ, so they agree (any one past it) every ``every`` steps, on the same step."""
    if jax.process_count() == 1:
        return time.perf_counter() > deadline
    if step % every:
        return False
    from jax.experimental import multihost_utils

    past = multihost_utils.process_allgather(np.asarray(time.perf_counter() > deadline))
    return bool(np.any(past))


def _set_aside_metrics_after(path: Path, step: int) -> None:
    """On resume, moves ``metrics.jsonl`` rows after the restored ``step`` (written by a
    run that stopped before its next checkpoint; those steps are about to be redone) to
    ``metrics.redone.jsonl``, so the curves never show a step twice."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    stale = [line for line in lines if json.loads(line)["step"] > step]
    if stale:
        with path.with_name("metrics.redone.jsonl").open("a") as f:
            f.write("\n".join(stale) + "\n")
        path.write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= step))


# ---------------------------------------------------------------------- the main job
def _check_batch_rows(batch_tokens: int, row_length: int, row_multiple: int) -> None:
    """Rows of a full-length batch: ``batch_tokens // row_length``, rounded down to a multiple
    of ``row_multiple`` (data axis × grad-accumulation steps × processes). Too small a budget is
    an error; a rounded one is reported, so the batch is never silently another size."""
    rows = batch_tokens // row_length
    if rows < row_multiple:
        raise ValueError(f"--batch-tokens {batch_tokens} gives {rows} row(s) of {row_length} tokens, but "
                         f"a batch needs a multiple of {row_multiple} rows (data axis × "
                         f"--grad-accum-steps × processes); use --batch-tokens "
                         f"{row_length * row_multiple} or more.")
    if rows % row_multiple:
        log(f"note: a batch of {row_length}-token rows has {rows // row_multiple * row_multiple} rows, "
            f"not {rows}: rounded down to a multiple of {row_multiple} (data axis × "
            f"--grad-accum-steps × processes)")


def _resume_record(config_path: Path, run_record: dict[str, Any], resumed: bool) -> dict[str, Any]:
    """The run record to write: on resume, earlier run settings are kept in a history
    and changes are reported (the architecture was checked before)."""
    if not (resumed and config_path.exists()):
        return run_record
    saved = json.loads(config_path.read_text())
    changed = {k: (saved.get("train", {}).get(k), v) for k, v in run_record["train"].items()
               if k != "progress" and saved.get("train", {}).get(k) != v}
    if changed:
        log("resuming with changed run settings: " +
            ", ".join(f"{k} {a!r} → {b!r}" for k, (a, b) in sorted(changed.items())))
    history = saved.get("train_history", []) + ([saved["train"]] if changed and "train" in saved else [])
    return {**run_record, "train_history": history} if history else run_record


def train(cfg: TrainConfig, *, fresh: bool = False) -> dict[str, Any]:
    """Trains, evaluates and checkpoints one run; resumes if the workdir has a checkpoint.

    Resume is exact: the checkpoint holds the step, parameters, optimizer state and
    the data iterator's position, and dropout keys are ``fold_in(seed key, step)``,
    so N steps in one go equal N/2 + N/2 across a restart, bit for bit on CPU.

    Returns:
      the final results (also written to ``workdir/results.json``).

    Raises:
      ValueError / FileNotFoundError / OSError: bad corpus, bad paths, or an
        incompatible checkpoint; all before any compile.
      CheckpointError: checkpoints exist but none is readable (nothing is changed).
      Preempted: SIGTERM/SIGINT; the current step was checkpointed first.
      TrainingDiverged: a whole logging window of non-finite updates (all skipped);
        the last checkpoint is intact.
    """
    t_start = time.perf_counter()
    sharding_lib.initialize_distributed(cfg.coordinator_address, cfg.num_processes, cfg.process_id,
                                        auto=cfg.distributed)
    mesh = sharding_lib.make_mesh(cfg.mesh)   # a bad --mesh fails here, before any data work
    workdir = Path(cfg.workdir)
    prepare_workdir(workdir, fresh)
    if jax.process_count() > 1:   # every process sees the directory after --fresh moved things
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("workdir")
    splits, target_language = load_splits(cfg)
    tokenizer = load_or_train_tokenizer(workdir, splits["train"], cfg.vocab_size)
    model_config = _model_config(cfg, tokenizer)
    checkpoints = RunCheckpoints(workdir, keep=cfg.keep_checkpoints)
    config_path = workdir / "config.json"
    if checkpoints.latest_step() is not None and config_path.exists():
        check_resume_compatible(json.loads(config_path.read_text()), model_config)

    report = data_lib.DataReport(read=len(splits["train"]))
    max_train_len = min(cfg.max_train_len or model_config.max_len, model_config.max_len)
    train_examples = data_lib.tokenize_pairs(splits["train"], tokenizer, max_train_len, report)
    log(report.summary("train tokens"))
    dev_examples = data_lib.tokenize_pairs(splits["dev"], tokenizer, model_config.max_len)
    boundaries = data_lib.bucket_boundaries(max_train_len)
    row_multiple = math.lcm(mesh.shape["data"] * cfg.grad_accum_steps, jax.process_count())
    _check_batch_rows(cfg.batch_tokens, max_train_len, row_multiple)
    dataset = data_lib.train_dataset(train_examples, batch_tokens=cfg.batch_tokens,
                                     boundaries=boundaries, seed=cfg.seed, pad_id=tokenizer.pad_id,
                                     bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
                                     row_multiple=row_multiple,
                                     process_index=jax.process_index(),
                                     process_count=jax.process_count(), pack=cfg.pack)
    iterator = iter(dataset)

    model = Transformer(model_config)
    schedule = transformer_schedule(model_config.d_model, cfg.warmup_steps, cfg.lr_scale)
    tx = make_optimizer(schedule, cfg.grad_clip)
    root_key = jax.random.key(cfg.seed)
    init_key, dropout_key = jax.random.split(root_key)
    state, layout = create_sharded_train_state(model, init_key, tx, mesh)
    num_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    log(f"model: {num_params / 1e6:.2f}M parameters, preset {cfg.preset!r}")
    # Restore before writing anything: if no checkpoint is readable, the run dir is untouched.
    restored = checkpoints.restore_latest(sharding_lib.abstract_state(state), iterator, report=log)
    start_step = None
    if restored is not None:
        state, start_step = restored
        log(f"resumed from {workdir / 'checkpoints'} at step {int(state.step)}")

    run_record = {"model": model_config.to_dict(), "train": cfg.to_dict(),
                  "tokenizer": {"file": "tokenizer/spm.model", "pad_id": tokenizer.pad_id,
                                "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id,
                                "unk_id": tokenizer.unk_id, "vocab_size": tokenizer.vocab_size},
                  "target_language": target_language}
    if _is_main_process():
        save_json(config_path, _resume_record(config_path, run_record, start_step is not None))
    log("model config: " + json.dumps(run_record["model"]))
    log("run config: " + json.dumps({k: v for k, v in cfg.to_dict().items() if v is not None}))

    train_step = jit_train_step(model, cfg.label_smoothing, layout=layout,
                                grad_accum_steps=cfg.grad_accum_steps)
    evaluator = Evaluator(model, tokenizer, batch_size=cfg.eval_batch_size,
                          target_language=target_language, smoothing=cfg.label_smoothing, layout=layout)
    metrics_path = workdir / "metrics.jsonl"
    if start_step is not None and metrics_path.exists() and _is_main_process():
        _set_aside_metrics_after(metrics_path, start_step)
    metrics_log = MetricsLog(workdir)
    dev_subset = splits["dev"][: cfg.dev_bleu_sentences]
    # On resume the best score so far is the one recorded with the best checkpoint.
    best_bleu = checkpoints.best_bleu()
    best_bleu = -1.0 if best_bleu is None else best_bleu

    def evaluate(step: int) -> float:
        nonlocal best_bleu
        t0 = time.perf_counter()
        dev_loss = evaluator.loss(state.params, dev_examples)
        hyps = evaluator.translate(state.params, [p[0] for p in dev_subset], beam_size=cfg.beam_size,
                                   alpha=cfg.alpha)
        bleu = evaluator.score(hyps, [p[1] for p in dev_subset])
        metrics_log.write(step, {"dev/loss": dev_loss["loss"], "dev/ppl": dev_loss["ppl"],
                                 "dev/accuracy": dev_loss["accuracy"], "dev/bleu": bleu})
        if _is_main_process():
            with (workdir / "samples.txt").open("a") as f:
                f.write(f"== step {step} dev BLEU {bleu:.2f}\n")
                for (src, ref), hyp in list(zip(dev_subset, hyps))[: cfg.num_samples]:
                    f.write(f"SRC: {src}\nREF: {ref}\nHYP: {hyp}\n\n")
        if bleu > best_bleu:
            best_bleu = bleu
            checkpoints.save_best(step, state.params, bleu)
        log(f"step {step}: dev loss {dev_loss['loss']:.3f} ppl {dev_loss['ppl']:.1f} "
            f"BLEU {bleu:.2f} ({len(dev_subset)} sentences, {time.perf_counter() - t0:.0f}s)")
        return bleu

    step = int(state.step)
    deadline = None if cfg.max_minutes is None else t_start + 60 * cfg.max_minutes
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not cfg.progress, dynamic_ncols=True,
               desc="train", unit="step")
    totals, last_log_time = None, time.perf_counter()
    stopped_by = "max_steps"
    recent_skips = 0.0   # updates skipped as non-finite in the last logged window

    def save_if_healthy(step: int) -> bool:
        """Checkpoints unless an update was skipped since the last clean logging window: a
        run about to diverge can have applied a finite but ruinous update just before, and
        the rotation (keep N) would then push the last good checkpoint out."""
        pending = 0.0 if totals is None else float(jax.device_get(totals["skipped"]))  # saves only
        if recent_skips == 0 and pending == 0:
            checkpoints.save(step, state, iterator)
            return True
        log(f"step {step}: not checkpointing, updates were skipped as non-finite since the last "
            f"clean logging window; step {checkpoints.latest_step()} stays the newest checkpoint")
        return False

    with PreemptionGuard(multi_process=jax.process_count() > 1) as guard:
        while step < cfg.max_steps:
            if guard.stop_requested():
                stopped_by = signal.Signals(guard.received).name
                break
            if deadline is not None and _past_deadline(deadline, step, cfg.log_every):
                stopped_by = "max_minutes"
                break
            batch = next(iterator)
            # Host-side id check before dispatch (jit would clamp bad ids silently); numpy, no sync.
            for name, vocab in (("src", model_config.src_vocab_size),
                                ("tgt_in", model_config.tgt_vocab_size),
                                ("tgt_out", model_config.tgt_vocab_size)):
                check_token_ids(batch[name], name=name, vocab_size=vocab, max_len=model_config.max_len)
            state, metrics = train_step(state, sharding_lib.shard_batch(batch, layout.batch),
                                        dropout_key)
            totals = add_metrics(totals, metrics)
            step += 1
            bar.update(1)
            if step % cfg.log_every == 0:
                values = jax.device_get(totals)   # the one host sync every log_every steps
                diverged = _finite_report(values, step, checkpoints.latest_step())
                if diverged:
                    bar.close()
                    checkpoints.wait()
                    checkpoints.close()
                    metrics_log.close()
                    raise TrainingDiverged(diverged)
                recent_skips = float(values["skipped"])
                tokens = max(float(values["tokens"]), 1.0)
                applied = max(float(values["steps"] - values["skipped"]), 1.0)
                now = time.perf_counter()
                record = {"train/loss": float(values["loss_sum"]) / tokens,
                          "train/nll": float(values["nll_sum"]) / tokens,
                          "train/accuracy": float(values["correct"]) / tokens,
                          "train/grad_norm": float(values["grad_norm"]) / applied,
                          "train/skipped": float(values["skipped"]),
                          "train/lr": float(schedule(step - 1)),
                          "train/tokens_per_s": tokens / max(now - last_log_time, 1e-9)}
                metrics_log.write(step, record)
                postfix = dict(loss=f"{record['train/loss']:.3f}",
                               tok_s=f"{record['train/tokens_per_s']:.0f}")
                if deadline is not None:   # the time budget, not max_steps, bounds this run
                    postfix["left"] = f"{max(0.0, deadline - now) / 60:.1f}min"
                bar.set_postfix(postfix)
                totals, last_log_time = None, now
            if step % cfg.eval_every == 0:
                evaluate(step)
            if step % cfg.checkpoint_every == 0:
                save_if_healthy(step)
        bar.close()
        if checkpoints.latest_step() != step:
            save_if_healthy(step)
        checkpoints.wait()
        if guard.received is not None:
            checkpoints.close()
            metrics_log.close()
            saved = checkpoints.latest_step()
            where = ("with a checkpoint" if saved == step
                     else f"(newest checkpoint: {'none' if saved is None else f'step {saved}'})")
            message = (f"{stopped_by} received: stopped at step {step} {where} in "
                       f"{workdir / 'checkpoints'}. Run the same command again to resume from there.")
            log(message)
            raise Preempted(guard.received, step, message)

    if step % cfg.eval_every != 0 or best_bleu < 0:
        evaluate(step)
    checkpoints.wait()
    log(f"training stopped at step {step} ({stopped_by}); best dev BLEU {best_bleu:.2f}")

    params, best_step, _ = checkpoints.restore_params(sharding_lib.abstract_state(state).params,
                                                      report=log)
    t0 = time.perf_counter()
    hyps = evaluator.translate(params, [p[0] for p in splits["test"]], beam_size=cfg.beam_size,
                               alpha=cfg.alpha)
    refs = [p[1] for p in splits["test"]]
    test_bleu = evaluator.score(hyps, refs)
    signature = str(evaluator.bleu.get_signature())
    decoding = "greedy" if cfg.beam_size == 1 else f"beam {cfg.beam_size}, alpha {cfg.alpha}"
    results = {"test_bleu": test_bleu, "sacrebleu_signature": signature, "best_step": best_step,
               "decoding": decoding,
               "best_dev_bleu": best_bleu, "final_step": step, "stopped_by": stopped_by,
               "test_sentences": len(refs), "num_params": int(num_params),
               "wall_minutes": (time.perf_counter() - t_start) / 60}
    if _is_main_process():
        save_json(workdir / "results.json", results)
        (workdir / "test_hypotheses.txt").write_text("\n".join(hyps) + "\n")
    log(f"test BLEU {test_bleu:.2f} on {len(refs)} sentences ({decoding}, step {best_step}, "
        f"{time.perf_counter() - t0:.0f}s) {signature}")
    metrics_log.close()
    if _is_main_process():
        write_plots(workdir)
    checkpoints.close()
    for (source, reference), hypothesis in list(zip(splits["test"], hyps))[:3]:
        log(f"  {source}\n  → {hypothesis}\n  (reference: {reference})")
    log(f"total wall time {results['wall_minutes']:.1f} min; run directory {workdir}")
    return results


def _finite_report(values: dict[str, Any], step: int, last_checkpoint: int | None) -> str | None:
    """Logs skipped non-finite updates; returns the error message when a whole logging
    window was skipped (the run cannot make progress), else ``None``."""
    skipped, window = int(values["skipped"]), int(values["steps"])
    if skipped == 0:
        return None
    if skipped < window:
        log(f"step {step}: skipped {skipped} of the last {window} updates (non-finite loss or "
            f"gradient norm); parameters were left unchanged for those steps")
        return None
    where = (f"the last checkpoint (step {last_checkpoint}) is intact" if last_checkpoint is not None
             else "no checkpoint was written")
    return (f"Training diverged: all {window} updates up to step {step} had a non-finite loss or "
            f"gradient norm and were skipped; {where}. Lower --lr-scale, set --grad-clip or use "
            f"--dtype float32, then run again to resume from the last checkpoint (or --fresh).")
