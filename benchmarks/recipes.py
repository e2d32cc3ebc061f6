"""Training recipes on corpora of several sizes (issue 53): test BLEU at an equal step budget.

    python benchmarks/recipes.py --pair en-de --size 5000 --size 10000 --size 20000 \\
        --recipe today --recipe rule --seed 0 --seed 1
    python benchmarks/recipes.py --pair en-de --size 5000 --recipe d3="--dropout-rate 0.3"
    python benchmarks/recipes.py --table                       # the table of what has run so far
    python benchmarks/recipes.py --pair en-de --size 5000 --quick   # 40 steps, to check that it runs

Each shipped corpus (``jaxformer/corpora/<pair>.tsv.gz``) is cut once, deterministically,
into ONE dev file (``--dev-pairs``) and ONE test file (``--test-pairs``), held out by
source sentence (a source never lies on two sides), and a pool of the rest in a fixed
hashed order; the training file of size N is the pool's first N pairs, so the 5k subset
lies inside the 10k one, which lies inside the 20k one, and every size is scored on the
same test set. ``--size full`` takes the whole pool.

A recipe is a name and ``train.py`` flags on top of ``python train.py``'s defaults (the
default run's: 1000 steps of 2048 tokens, so every recipe trains on the same budget):
``today`` adds none; ``rule`` adds the flags :func:`jaxformer.run.recipe.recipe_for` picks
from the training file's statistics; ``NAME="FLAGS"`` adds FLAGS. Each (corpus, size,
recipe, seed) trains once, in a fresh process, one after another, in
``OUT/runs/<pair>-<size>/<recipe>-s<seed>``; a run whose ``results.json`` exists is not run
again (the same name with other flags is refused), so the script resumes where it stopped.
Every finished run's row (test BLEU and chrF, degenerate share, best step, dev loss and
NLL at each evaluation, wall minutes, loop steps/s, the matmul rate before it) goes to
``OUT/results.json`` and ``OUT/results.tsv``. BLEU does not depend on the machine's load
(the budget is steps); the times do.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import matmul_flops_per_s
from default_run import _loop_steps_per_s

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))   # the checkout's jaxformer, not an installed one

from jaxformer.data.corpus import builtin_corpus_path, read_tsv  # noqa: E402
from jaxformer.run.recipe import CorpusShape  # noqa: E402

TSV_FIELDS = ("pair", "size", "recipe", "seed", "test_bleu", "test_chrf", "degenerate", "best_step",
              "dev_nll", "dev_bleu", "train_nll_end", "wall_minutes", "steps_per_s", "matmul_gflops",
              "flags")


def _rank(text: str, salt: str) -> bytes:
    return hashlib.sha256(f"{salt}\t{text}".encode()).digest()


def _write_tsv(path: Path, pairs: list[tuple[str, str]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{s}\t{t}\n" for s, t in pairs), encoding="utf-8")
    tmp.replace(path)


def build_corpus(pair: str, out: Path, dev_pairs: int, test_pairs: int, sizes: list[str]) -> dict[str, Path]:
    """``{"dev", "test", size...}`` → TSV file of ``pair``'s corpus under ``out/corpora/<pair>``.

    Dev and test hold whole source sentences (every pair of a source goes to one side) in the
    order of the source's salted SHA-256; the pool is the other pairs in the order of the
    pair's salted SHA-256; size N is the pool's first N. Files already written are kept."""
    folder = out / "corpora" / pair
    folder.mkdir(parents=True, exist_ok=True)
    files = {"dev": folder / "dev.tsv", "test": folder / "test.tsv"}
    files.update({size: folder / f"train-{size}.tsv" for size in sizes})
    if all(p.exists() for p in files.values()):
        return files
    pairs, _ = read_tsv(builtin_corpus_path(pair))
    by_source: dict[str, list[tuple[str, str]]] = {}
    for src, tgt in pairs:
        by_source.setdefault(src, []).append((src, tgt))
    held: dict[str, list[tuple[str, str]]] = {"dev": [], "test": []}
    pool = []
    for src in sorted(by_source, key=lambda s: _rank(s, "heldout")):
        side = "dev" if len(held["dev"]) < dev_pairs else "test" if len(held["test"]) < test_pairs else None
        (held[side] if side else pool).extend(by_source[src])
    pool.sort(key=lambda p: _rank("\t".join(p), "pool"))
    for name in ("dev", "test"):
        _write_tsv(files[name], held[name])
    for size in sizes:
        n = len(pool) if size == "full" else int(size)
        if n > len(pool):
            raise ValueError(f"{pair}: --size {n} is more than the {len(pool)} pairs left for training "
                             f"after dev and test; give a smaller --size or 'full'.")
        _write_tsv(files[size], pool[:n])
    return files


def shape_of_file(path: Path) -> CorpusShape:
    """The training file's :class:`CorpusShape` (what the rule reads)."""
    pairs, _ = read_tsv(path)
    return CorpusShape.of(pairs)


@dataclasses.dataclass(frozen=True)
class Job:
    pair: str
    size: str
    recipe: str
    seed: int
    flags: tuple[str, ...]

    def workdir(self, out: Path) -> Path:
        return out / "runs" / f"{self.pair}-{self.size}" / f"{self.recipe}-s{self.seed}"


def _metrics(workdir: Path) -> tuple[list[dict], list[dict]]:
    """``(dev evaluations, training log records)`` of ``metrics.jsonl``."""
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line]
    return [r for r in rows if "dev/loss" in r], [r for r in rows if "train/loss" in r]


def row_of(job: Job, workdir: Path, wall: float | None, gflops: float | None) -> dict:
    """A finished run's row of the results."""
    results = json.loads((workdir / "results.json").read_text())
    dev, train = _metrics(workdir)
    return {"pair": job.pair, "size": job.size, "recipe": job.recipe, "seed": job.seed,
            "flags": " ".join(job.flags), "test_bleu": results["test_bleu"],
            "test_chrf": results["test_chrf"],
            "degenerate": results["degenerate"]["fraction"], "best_step": results["best_step"],
            "dev_nll": {str(r["step"]): round(math.log(r["dev/ppl"]), 4) for r in dev},
            "dev_loss": {str(r["step"]): round(r["dev/loss"], 4) for r in dev},
            "dev_bleu": {str(r["step"]): round(r["dev/bleu"], 2) for r in dev},
            "train_nll_end": round(train[-1]["train/nll"], 4) if train else None,
            "wall_minutes": wall if wall is not None else results["wall_minutes"],
            "steps_per_s": _loop_steps_per_s((workdir / "train.log").read_text()),
            "matmul_gflops": gflops, "num_params": results["num_params"]}


def run_job(job: Job, files: dict[str, Path], out: Path, tgt_lang: str, common: list[str]) -> dict | None:
    """Trains ``job`` unless it has finished before; its row, or ``None`` if it was done."""
    workdir = job.workdir(out)
    record = workdir.parent / f"{workdir.name}.flags.json"
    if record.exists() and json.loads(record.read_text()) != list(job.flags):
        raise SystemExit(f"{workdir} ran recipe {job.recipe!r} with other flags "
                         f"({record.read_text().strip()}); name the new flags another recipe.")
    if (workdir / "results.json").exists():
        return None
    workdir.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(list(job.flags)))
    cmd = [sys.executable, str(REPO / "train.py"), "--train-file", str(files[job.size]),
           "--dev-file", str(files["dev"]), "--test-file", str(files["test"]), "--workdir", str(workdir),
           "--fresh", "--no-progress", "--seed", str(job.seed), *(["--tgt-lang", tgt_lang]),
           *common, *job.flags]
    print("$ " + " ".join(shlex.quote(c) for c in cmd[1:]), flush=True)
    gflops = matmul_flops_per_s(2048, 3) / 1e9
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    return row_of(job, workdir, (time.perf_counter() - start) / 60, gflops)


def save_rows(out: Path, rows: list[dict]) -> None:
    """``results.json`` (every row) and ``results.tsv`` (one line each, dev NLL as step:value)."""
    (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["\t".join(TSV_FIELDS)]
    for r in rows:
        cells = []
        for field in TSV_FIELDS:
            value = r.get(field)
            if isinstance(value, dict):
                value = " ".join(f"{k}:{v}" for k, v in value.items())
            elif isinstance(value, float):
                value = f"{value:.4f}" if field == "degenerate" else f"{value:.2f}"
            cells.append("" if value is None else str(value))
        lines.append("\t".join(cells))
    (out / "results.tsv").write_text("\n".join(lines) + "\n")


def table(rows: list[dict]) -> list[str]:
    """Mean over seeds per (corpus, size, recipe), and the difference to ``today``'s mean."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["pair"], r["size"], r["recipe"]), []).append(r)
    today = {key[:2]: statistics.mean(r["test_bleu"] for r in rs) for key, rs in groups.items()
             if key[2] == "today"}
    lines = ["| corpus | train pairs | recipe | seeds | test BLEU | Δ today | chrF | degenerate | best step "
             "| dev NLL by step | flags |", "|---|---:|---|---:|---:|---:|---:|---:|---|---|---|"]
    for (pair, size, recipe), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], _size_key(kv[0][1]),
                                                                            kv[0][2] != "today", kv[0][2])):
        bleu = statistics.mean(r["test_bleu"] for r in rs)
        base = today.get((pair, size))
        delta = f"{bleu - base:+.2f}" if base is not None and recipe != "today" else ""
        nll = " ".join(f"{step}:{value:.2f}" for step, value in _mean_curve(rs, "dev_nll"))
        spread = f" ±{statistics.stdev(r['test_bleu'] for r in rs):.2f}" if len(rs) > 1 else ""
        lines.append(f"| {pair} | {size} | {recipe} | {len(rs)} | {bleu:.2f}{spread} | {delta} | "
                     f"{statistics.mean(r['test_chrf'] for r in rs):.2f} | "
                     f"{statistics.mean(r['degenerate'] for r in rs):.1%} | "
                     f"{'/'.join(str(r['best_step']) for r in rs)} | {nll} | "
                     f"`{rs[0]['flags'] or '(defaults)'}` |")
    return lines


def _mean_curve(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """``(step, mean over rows)`` of a per-step record such as ``dev_nll``."""
    steps = sorted({int(step) for r in rows for step in r[key]})
    return [(step, statistics.mean(r[key][str(step)] for r in rows if str(step) in r[key])) for step in steps]


def _size_key(size: str) -> float:
    return math.inf if size == "full" else int(size)


def recipe_flags(spec: str, shape: CorpusShape) -> tuple[str, tuple[str, ...]]:
    """``(name, flags)`` of a ``--recipe`` value for a corpus of ``shape``."""
    if spec == "today":
        return "today", ()
    if spec == "rule":
        from jaxformer.run.recipe import recipe_for

        return "rule", tuple(recipe_for(shape).flags())
    name, sep, flags = spec.partition("=")
    if not sep:
        raise SystemExit(f"--recipe {spec!r}: give today, rule or NAME=\"FLAGS\"")
    return name, tuple(shlex.split(flags))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", action="append", default=[], choices=("en-de", "en-fr", "en-zh"))
    parser.add_argument("--size", action="append", default=[],
                        help="training pairs (an integer), or 'full' for all that dev and test leave")
    parser.add_argument("--recipe", action="append", default=[], metavar='today|rule|NAME="FLAGS"')
    parser.add_argument("--seed", action="append", type=int, default=[])
    parser.add_argument("--dev-pairs", type=int, default=500)
    parser.add_argument("--test-pairs", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="40 steps each, to check that it runs")
    parser.add_argument("--table", action="store_true", help="print the table of the results so far")
    parser.add_argument("--out", type=Path, default=Path("/tmp/jaxformer-recipes"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "results.json"
    rows = json.loads(saved.read_text()) if saved.exists() else []
    common = ["--max-steps", "40", "--warmup-steps", "10"] if args.quick else []
    for pair in args.pair:
        files = build_corpus(pair, args.out, args.dev_pairs, args.test_pairs, args.size or ["10000"])
        for size in args.size or ["10000"]:
            shape = shape_of_file(files[size])
            print(f"{pair} {size}: {shape}", flush=True)
            for spec in args.recipe or ["today"]:
                name, flags = recipe_flags(spec, shape)
                for seed in args.seed or [0]:
                    job = Job(pair, size, name + ("-quick" if args.quick else ""), seed, flags)
                    row = run_job(job, files, args.out, pair.split("-")[1], common)
                    if row is not None:
                        rows = [r for r in rows if (r["pair"], r["size"], r["recipe"], r["seed"]) !=
                                (pair, size, job.recipe, seed)] + [row]
                        save_rows(args.out, rows)
                        print(json.dumps({k: row[k] for k in TSV_FIELDS}), flush=True)
    if rows:
        print("\n" + "\n".join(table(rows)))


if __name__ == "__main__":
    main()
