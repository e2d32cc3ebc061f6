"""Real-corpus training throughput and padding waste, with the default run's data path.

    python benchmarks/corpus.py                  # both batchings, 60 timed steps each
    python benchmarks/corpus.py --quick          # 8 timed steps each
    python benchmarks/corpus.py --count-only     # padding fractions over one epoch, no training

What ``python train.py`` does, minus evaluation: the shipped en-de corpus, its hashed
train split, a joint sentencepiece vocabulary (--vocab-size) trained on that split (cached in
the system temp dir), pairs longer than 64 tokens dropped, 2048-token batches, the
``small`` preset, Adam with label smoothing 0.1, the jitted and donated train step, a
host-side id check before each step (as in ``jaxformer.train.trainer.train``).

Two batchings, back to back in one process:

* ``bucket``: length buckets 16/32/48/64 (``bucket_boundaries(64)``), one compile per
  bucket; every row holds one pair padded to its bucket;
* ``pack``: whole pairs packed into rows of 64 source and 64 target positions with
  segment ids (``pack_plan``), one compile.

The data are held in memory (read, split by ``corpus.Splitter``, ``tokenize_pairs``) and
batched by the package's own pipeline (``streaming.stream_dataset`` over the whole
corpus as one block), so "epoch" is exactly the plan the timed steps walk through.

Padding fraction = pad positions / processed positions (rows × length), for the source
side, the target side and both together; "epoch" counts every batch of one epoch,
"timed" only the steps that were run. Every distinct batch shape is compiled before
the clock starts (compile count and time are reported); then ``--steps`` steps are
timed without a per-step sync. Non-pad tokens/s = real source + target tokens per
second (target alone in brackets: the tokens the loss is computed on).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxformer.data import batching, corpus, streaming
from jaxformer.data.tokenizer import Tokenizer
from jaxformer.model.config import preset
from jaxformer.model.transformer import Transformer
from jaxformer.model.validation import check_token_ids
from jaxformer.run.config import DEFAULT_CPU_RUN, TrainConfig
from jaxformer.train.optimizer import make_optimizer, transformer_schedule
from jaxformer.train.step import create_train_state, jit_train_step


def default_settings(**overrides) -> dict:
    """The default CPU run's flat settings (as ``config.json``'s ``"train"`` keeps them)."""
    return TrainConfig.flat(**{**DEFAULT_CPU_RUN, **overrides}).to_dict()


def in_memory(settings: dict, tokenizer_dir: Path, max_ratio: float | None = None):
    """The run's data held in memory: the corpus split by the hash of its source
    (``corpus.Splitter``, explicit dev/test files not supported), a sentencepiece model
    trained on the train split (loaded from ``tokenizer_dir`` if there), and the train split
    tokenized, pairs longer than ``max_train_len`` dropped. Returns ``(splits, examples,
    tokenizer)``."""
    path = settings["train_file"] or corpus.builtin_corpus_path(settings["pair"])
    pairs, _ = corpus.read_tsv(path)
    splitter, splits = corpus.Splitter.for_size(len(pairs)), {"train": [], "dev": [], "test": []}
    for pair in pairs:
        splits[splitter(pair[0])].append(pair)
    model = Path(tokenizer_dir) / "spm.model"
    tokenizer = Tokenizer(model) if model.exists() else Tokenizer.train(
        [s for pair in splits["train"] for s in pair], tokenizer_dir, vocab_size=settings["vocab_size"])
    examples = batching.tokenize_pairs(splits["train"], tokenizer, settings["max_train_len"],
                                       max_ratio=max_ratio)
    return splits, examples, tokenizer


def in_memory_stream(examples, tokenizer, settings: dict, pack: bool, row_multiple: int = 1):
    """The package's pipeline over examples in memory, the whole corpus planned as one block."""
    return streaming.BatchStream(lambda start: streaming.stream_dataset(
        examples, max_len=settings["max_train_len"], batch_tokens=settings["batch_tokens"],
        boundaries=batching.bucket_boundaries(settings["max_train_len"]), seed=settings["seed"],
        pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
        row_multiple=row_multiple, pack=pack, block_pairs=len(examples), start=start))


def prepare(cfg: dict):
    """Train examples and tokenizer as the default run builds them."""
    cache = Path(tempfile.gettempdir()) / f"jaxformer-bench-{cfg['pair']}-{cfg['vocab_size']}"
    _, examples, tokenizer = in_memory(cfg, cache)
    return examples, tokenizer


def epoch_batches(examples, cfg: dict, pack: bool):
    """The first epoch's plan of :func:`in_memory_stream` (one block: the whole corpus)."""
    plans = streaming.process_plans(examples, max_len=cfg["max_train_len"], batch_tokens=cfg["batch_tokens"],
                                    boundaries=batching.bucket_boundaries(cfg["max_train_len"]),
                                    seed=cfg["seed"], row_multiple=jax.local_device_count(), pack=pack,
                                    block_pairs=len(examples))
    iterator, batches = iter(plans), []
    while iterator.get_state()["epoch"] == 0:
        length, indices, _ = next(iterator)
        batches.append((length, indices))
    return batches


def fractions_line(fractions):
    return f"source {fractions['src']:.1%}, target {fractions['tgt']:.1%}, both {fractions['both']:.1%}"


def run(examples, tokenizer, cfg: dict, pack: bool, steps: int) -> dict:
    batches = epoch_batches(examples, cfg, pack)
    shapes = sorted({(length, len(idx)) for length, idx in batches})
    config = preset(cfg["preset"], src_vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id)
    model = Transformer(config)
    state = create_train_state(model, jax.random.key(cfg["seed"]),
                               make_optimizer(transformer_schedule(config.d_model, cfg["warmup_steps"],
                                                                   cfg["lr_scale"])))
    step_fn = jit_train_step(model, cfg["label_smoothing"])
    iterator = in_memory_stream(examples, tokenizer, cfg, pack, row_multiple=jax.local_device_count())
    rng = jax.random.key(1)
    # Compile every shape first: one real batch of each (the dataset's own collate).
    build = batching.collate_packed if pack else batching.collate
    start = time.perf_counter()
    for length, rows in shapes:
        indices = next(idx for L, idx in batches if (L, len(idx)) == (length, rows))
        batch = build(examples, length, indices, pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id,
                      eos_id=tokenizer.eos_id)
        state, metrics = step_fn(state, batch, rng)
        jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - start
    counts = {"src_real": 0, "tgt_real": 0, "processed": 0}
    start = time.perf_counter()
    for _ in range(steps):
        batch = next(iterator)
        for name in ("src", "tgt_in", "tgt_out"):
            check_token_ids(batch[name], name=name, vocab_size=config.src_vocab_size, max_len=config.max_len)
        counts["src_real"] += int(np.sum(batch["src"] != tokenizer.pad_id))
        counts["tgt_real"] += int(np.sum(batch["tgt_out"] != tokenizer.pad_id))
        counts["processed"] += batch["src"].size
        state, metrics = step_fn(state, batch, rng)
    jax.block_until_ready((state, metrics))
    seconds = time.perf_counter() - start
    processed = counts["processed"]
    timed = {"src": 1 - counts["src_real"] / processed, "tgt": 1 - counts["tgt_real"] / processed,
             "both": 1 - (counts["src_real"] + counts["tgt_real"]) / (2 * processed)}
    return {"batches_per_epoch": len(batches), "shapes": shapes, "compiles": step_fn._cache_size(),
            "compile_s": compile_s, "seconds": seconds, "steps": steps,
            "epoch_padding": batching.padding_fraction(examples, batches), "timed_padding": timed,
            "real_tokens_per_s": (counts["src_real"] + counts["tgt_real"]) / seconds,
            "tgt_tokens_per_s": counts["tgt_real"] / seconds,
            "loss": float(metrics["loss_sum"]) / max(float(metrics["tokens"]), 1.0)}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per batching")
    parser.add_argument("--batching", choices=("bucket", "pack", "both"), default="both")
    parser.add_argument("--count-only", action="store_true", help="padding over one epoch, no training")
    parser.add_argument("--quick", action="store_true", help="8 timed steps")
    args = parser.parse_args()
    if args.quick:
        args.steps = 8
    cfg = default_settings()
    start = time.perf_counter()
    examples, tokenizer = prepare(cfg)
    print(f"config: shipped {cfg['pair']} train split, {len(examples)} pairs <= {cfg['max_train_len']} "
          f"tokens, sentencepiece {tokenizer.vocab_size}, batch_tokens {cfg['batch_tokens']}, preset "
          f"{cfg['preset']}, buckets {batching.bucket_boundaries(cfg['max_train_len'])}, "
          f"{jax.local_device_count()} device(s), {args.steps} timed steps "
          f"({time.perf_counter() - start:.1f}s to prepare)", flush=True)
    modes = {"bucket": [False], "pack": [True], "both": [False, True]}[args.batching]
    results = {}
    for pack in modes:
        name = "pack" if pack else "bucket"
        if args.count_only:
            batches = epoch_batches(examples, cfg, pack)
            shapes = sorted({(length, len(idx)) for length, idx in batches})
            print(f"{name:6s}: {len(batches)} batches/epoch, {len(shapes)} shapes (= compiles), "
                  f"padding {fractions_line(batching.padding_fraction(examples, batches))}")
            continue
        r = results[name] = run(examples, tokenizer, cfg, pack, args.steps)
        print(f"{name:6s}: {r['batches_per_epoch']} batches/epoch, {r['compiles']} compiles "
              f"({r['compile_s']:.1f}s incl. one step each), shapes {r['shapes']}\n"
              f"        padding per epoch: {fractions_line(r['epoch_padding'])}; "
              f"in the timed steps: {fractions_line(r['timed_padding'])}\n"
              f"        {r['steps']} steps in {r['seconds']:.1f}s = {r['steps'] / r['seconds']:.2f} steps/s, "
              f"{r['real_tokens_per_s']:.0f} non-pad tokens/s ({r['tgt_tokens_per_s']:.0f} target), "
              f"loss {r['loss']:.2f}", flush=True)
    if len(results) == 2:
        print(f"ratio pack/bucket non-pad tokens/s: "
              f"{results['pack']['real_tokens_per_s'] / results['bucket']['real_tokens_per_s']:.2f}x; "
              f"padding (both sides) {results['bucket']['epoch_padding']['both']:.1%} -> "
              f"{results['pack']['epoch_padding']['both']:.1%} [target <= 15%]")


if __name__ == "__main__":
    main()
