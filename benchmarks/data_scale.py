"""Data at scale: prepare once and stream (issue #12) against the in-memory path.

    python benchmarks/data_scale.py                          # 100k, 1M, 4.5M pairs (~1 h, ~3 GB disk)
    python benchmarks/data_scale.py --sizes 2k --old-up-to 2k --steps 5   # a check in ~5 minutes
    python benchmarks/data_scale.py --sizes ""                # only the shipped-corpus comparison

For each size, a corpus is synthesized from the shipped en-de text (round r of the
corpus appends `` r`` to both sides, so every pair is new, hashes anew and splits
anew) into ``--out``; then, each in a fresh process whose peak RSS is read from
``wait4``:

* ``prepare``: ``python -m jaxformer.prepare`` (stream, split, sentencepiece on a
  sample, encode, write): seconds, pairs/s, peak RSS;
* ``first run`` and ``resume``: ``setup()`` of the trainer (data, tokenizer, model,
  restore) up to the first train step done, on the prepared data; the first run saves
  a checkpoint that the resume restores: seconds to the first step and peak RSS. Both
  compile through the run directory's persistent cache, as ``train.py`` does (the first
  run fills it); ``resume_uncached`` resumes once more without it;
* ``in-memory`` (sizes up to ``--old-up-to``): the whole corpus in memory instead, read
  + split + sentencepiece + tokenize + plan it all as one block, to the first batch
  (``in_memory`` of benchmarks/corpus.py, batched by ``streaming.stream_dataset``).

Then, on the shipped corpus with the default run's settings (``small`` preset,
2048-token batches of 64-token packed rows): padding over one epoch (streamed block
plans and the whole-corpus plan) and steps/s of ``--steps`` steps fed by each pipeline
with the same compiled step: streamed and collated in this process (the CPU default),
streamed from 2 grain worker processes (``--data-workers 2``, the GPU/TPU default) and
in memory. Run it alone on the machine: anything running beside it makes the timings
worthless.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZES = {"2k": 2_000, "100k": 100_000, "1M": 1_000_000, "4.5M": 4_500_000}


def synthesize(n: int, path: Path) -> Path:
    """``n`` pairs from the shipped en-de text as ``source<TAB>target`` lines (cached)."""
    from jaxformer.data import corpus

    if path.exists():
        return path
    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    tmp = path.with_suffix(".partial")
    with tmp.open("w", encoding="utf-8") as f:
        written, r = 0, 0
        while written < n:
            suffix = f" {r}" if r else ""
            for s, t in pairs[: n - written]:
                f.write(f"{s}{suffix}\t{t}{suffix}\n")
            written += min(len(pairs), n - written)
            r += 1
    tmp.rename(path)
    return path


def measured(args: list[str]) -> dict:
    """Runs ``python args`` in a fresh process: wall seconds, peak RSS (GB), its last JSON line."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}):\n{out[-3000:]}")
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return {"seconds": time.perf_counter() - start, "peak_rss_gb": usage.ru_maxrss / 2**20,
            **(json.loads(lines[-1]) if lines else {})}


def _cfg(args: argparse.Namespace, **overrides):
    from jaxformer.run.config import DEFAULT_CPU_RUN, TrainConfig

    data = {"train_file": args.train_file} if args.train_file else {}
    return TrainConfig.flat(**{**DEFAULT_CPU_RUN, **data, "workdir": args.workdir, "progress": False,
                                "max_train_len": args.max_train_len, "checkpoint_every": 10**9, **overrides})


def startup(args: argparse.Namespace) -> None:
    """(child) ``setup()`` to the first train step done; saves a checkpoint for the resume.
    Compiles through the run directory's persistent cache, as ``train.py`` does, unless
    ``--no-cache``."""
    import jax

    from jaxformer.model import sharding as sharding_lib
    from jaxformer.run.directory import RunDir, keep_compilation_cache
    from jaxformer.train.run_setup import setup
    from jaxformer.train.step import jit_train_step

    start = time.perf_counter()
    if not args.no_cache:   # as train.py does: JAX's persistent cache in the run directory
        keep_compilation_cache(RunDir(args.workdir))
    run = setup(_cfg(args))
    step = jit_train_step(run.model, run.cfg.train.label_smoothing, layout=run.layout)
    batch = sharding_lib.shard_batch(next(run.data.iterator), run.layout.batch)
    run.state, metrics = step(run.state, batch, run.dropout_key)
    jax.block_until_ready(metrics)
    seconds = time.perf_counter() - start
    run.checkpoints.save(int(run.state.step), run.state, run.data.iterator)
    run.close()
    print(json.dumps({"to_first_step_s": seconds, "step": int(run.state.step)}))


def old_path(args: argparse.Namespace) -> None:
    """(child) The whole corpus in memory: read, split, train the tokenizer, tokenize, plan it
    all as one block, to the first batch."""
    from corpus import in_memory, in_memory_stream

    start, settings = time.perf_counter(), _cfg(args).to_dict()
    _, examples, tokenizer = in_memory(settings, Path(args.workdir) / "tokenizer")
    next(in_memory_stream(examples, tokenizer, settings, pack=True))
    print(json.dumps({"to_first_batch_s": time.perf_counter() - start}))


def shipped(args: argparse.Namespace) -> None:
    """(child) Padding over one epoch and steps/s of both pipelines on the shipped corpus."""
    import jax
    import numpy as np
    from corpus import epoch_batches, in_memory, in_memory_stream

    from jaxformer.data import batching
    from jaxformer.data.prepared import PreparedCorpus
    from jaxformer.data.streaming import process_plans
    from jaxformer.model import sharding as sharding_lib
    from jaxformer.train.run_setup import build_train_data, setup
    from jaxformer.train.step import jit_train_step

    cfg = _cfg(args)
    run = setup(cfg)   # on CPU the default: collated in this process (--data-workers 0)
    tok = run.tokenizer
    corpus_ = PreparedCorpus.open(run.run_dir.prepared)
    bounds = batching.bucket_boundaries(cfg.train.max_train_len)
    plans = iter(process_plans(corpus_, max_len=cfg.train.max_train_len, batch_tokens=cfg.train.batch_tokens,
                               boundaries=bounds, seed=0))
    real = processed = 0
    while plans.get_state()["epoch"] == 0:
        length, ids, _ = next(plans)
        used = ids[ids >= 0]
        real += int(corpus_.src_lengths[used].sum() + corpus_.tgt_lengths[used].sum() + used.size)
        processed += 2 * length * len(ids)
    settings = cfg.to_dict()
    _, examples, _ = in_memory(settings, run.run_dir.tokenizer_dir, max_ratio=cfg.data.max_length_ratio)
    old = in_memory_stream(examples, tok, settings, pack=True)
    step = jit_train_step(run.model, cfg.train.label_smoothing, layout=run.layout)
    whole_plan = epoch_batches(examples, settings, True)
    result = {"padding_streamed": 1 - real / processed,
              "padding_old": batching.padding_fraction(examples, whole_plan)["both"]}
    workers = build_train_data(_cfg(args, data_workers=2), corpus_, tok, run.model.config,
                               row_multiple=1).iterator   # the same batches
    state = run.state   # donated by each step: one state carried through all turns
    turns = (("streamed", run.data.iterator), ("streamed_2_workers", workers), ("old", old)) * 2
    for name, iterator in turns:   # in turns, so drift hits every pipeline alike
        state, m = step(state, sharding_lib.shard_batch(next(iterator), run.layout.batch), run.dropout_key)
        jax.block_until_ready(m)   # compiled (once) and warm
        start = time.perf_counter()
        for _ in range(args.steps):
            batch = sharding_lib.shard_batch(next(iterator), run.layout.batch)
            state, m = step(state, batch, run.dropout_key)
        jax.block_until_ready(m)
        result[f"steps_per_s_{name}"] = max(result.get(f"steps_per_s_{name}", 0.0),
                                           args.steps / (time.perf_counter() - start))
    workers.close()
    run.close()
    print(json.dumps({k: round(float(np.asarray(v)), 4) for k, v in result.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100k,1M,4.5M", help=f"comma-separated, of {list(SIZES)}")
    parser.add_argument("--old-up-to", default="1M", help="largest size the old in-memory path runs at")
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "jaxformer-data-scale"),
                        help="corpora and run directories")
    parser.add_argument("--steps", type=int, default=60,
                        help="timed steps per pipeline on the shipped corpus")
    parser.add_argument("--max-train-len", type=int, default=64)
    parser.add_argument("--child", choices=("startup", "old", "shipped"), help=argparse.SUPPRESS)
    parser.add_argument("--train-file", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--no-cache", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        {"startup": startup, "old": old_path, "shipped": shipped}[args.child](args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    me, rows = [str(Path(__file__).resolve())], []
    common = ["--max-train-len", str(args.max_train_len), "--steps", str(args.steps)]
    for size in filter(None, args.sizes.split(",")):
        n = SIZES[size]
        data = synthesize(n, out / f"synthetic-{size}.tsv")
        workdir = out / f"run-{size}"
        prep = measured(["-m", "jaxformer.prepare", "--train-file", str(data), "--workdir", str(workdir)])
        row = {"pairs": size, "prepare_s": prep["seconds"], "prepare_pairs_per_s": n / prep["seconds"],
               "prepare_rss_gb": prep["peak_rss_gb"]}
        for name, extra in (("first_run", []), ("resume", []), ("resume_uncached", ["--no-cache"])):
            child = measured(me + ["--child", "startup", "--train-file", str(data), "--workdir", str(workdir)]
                             + common + extra)
            row.update({f"{name}_to_first_step_s": child["to_first_step_s"],
                        f"{name}_rss_gb": child["peak_rss_gb"]})
        if n <= SIZES[args.old_up_to]:
            old = measured(me + ["--child", "old", "--train-file", str(data), "--workdir",
                                 str(out / f"old-{size}")] + common)
            row.update({"old_to_first_batch_s": old["to_first_batch_s"], "old_rss_gb": old["peak_rss_gb"]})
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    shipped_row = measured(me + ["--child", "shipped", "--workdir", str(out / "run-shipped")] + common)
    print(json.dumps({"shipped en-de": shipped_row}), flush=True)
    print(f"(peak RSS of this parent: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB)")


if __name__ == "__main__":
    main()
