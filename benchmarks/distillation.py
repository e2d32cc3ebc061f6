"""Sequence-level distillation on the shipped corpus: a teacher run, a student of half its
width trained on the teacher's beam-4 translations of its own training sources, their
test BLEU and decode speed (README, "Distillation"; Kim & Rush 2016).

    python train.py --workdir runs/en-de                                  # the teacher (~10 min)
    python benchmarks/distillation.py --teacher runs/en-de --out runs/distill
    python benchmarks/distillation.py --teacher runs/en-de --out runs/distill --write benchmarks/README.md

Every step is the recipe's own command, run as a subprocess, and skipped when its output
is there (run it again after a kill and it goes on):

1. ``jaxformer-prepare --workdir TEACHER --write-train-sources OUT/train.en``;
2. ``jaxformer-translate --workdir TEACHER --input OUT/train.en --output
   OUT/train.distilled.de --beam-size 4`` (bulk mode: resumable);
3. ``OUT/distilled.tsv`` = the two side by side (``paste``);
4. ``train.py`` for the student: the teacher's own flags (its ``config.json``) with
   ``--d-model``/``--d-ff`` halved (``--student-flags`` to change), on
   ``distilled.tsv``, scored on the teacher's ``prepared/dev.tsv`` and ``test.tsv``;
   with ``--baseline`` also the same shape trained on the teacher's own corpus (the
   same split, real references): what distilling adds;
5. decode speed: each model translates the test sources in bulk with beam 4, once to
   fill its compile cache, then timed (the tool's own report: sentences/s of the
   decoding loop, and the whole process's wall time).

Printed: parameters, test BLEU and chrF (from each run's ``results.json``), the teacher's
bulk-translation rate on its training sources, and the decode rates; the float32 2048³
matmul rate at start and end. BLEU does not depend on the machine; the rates do, so run
it alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from _common import matmul_flops_per_s, publish

REPO = Path(__file__).resolve().parents[1]
MARKERS = ("<!-- distillation: begin -->", "<!-- distillation: end -->")


def run(cmd: list[str], log: Path) -> float:
    """Runs ``cmd`` (output appended to ``log``); returns its wall seconds. Exits on failure."""
    start = time.perf_counter()
    with open(log, "a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    if code:
        sys.exit(f"failed (exit {code}): {' '.join(cmd)}; see {log}")
    return time.perf_counter() - start


def translate_cmd(workdir: Path, source: Path, output: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jaxformer.translate",
        "--workdir",
        str(workdir),
        "--input",
        str(source),
        "--output",
        str(output),
        "--beam-size",
        "4",
        "--batch-size",
        "64",
    ]


def loop_rate(log: Path) -> float:
    """The last bulk report's sentences/s in ``log``."""
    return float(re.findall(r"([\d,.]+) sentences/s", log.read_text())[-1].replace(",", ""))


def student_flags(teacher: Path, extra: str | None) -> list[str]:
    """The teacher's training flags at half the width (or ``extra`` for the width)."""
    record = json.loads((teacher / "config.json").read_text())
    model = record["model"]
    width = (
        extra.split()
        if extra
        else ["--d-model", str(model["d_model"] // 2), "--d-ff", str(model["d_ff"] // 2)]
    )
    return ["--config", str(teacher / "config.json"), *width]


def decode_speed(workdir: Path, test_sources: Path, out: Path, log: Path) -> tuple[float, float]:
    """(loop sentences/s, whole-process seconds) of a timed bulk beam-4 run, after a warm one."""
    for name in ("warm", "timed"):
        target = out / f"test.{workdir.name}.{name}.de"
        target.unlink(missing_ok=True)
        seconds = run(translate_cmd(workdir, test_sources, target), log)
    return loop_rate(log), seconds


def parameters(workdir: Path) -> int:
    """Parameter count of a run's model, from its shapes (no checkpoint read)."""
    code = (
        "import json, sys, jax, jax.numpy as jnp, math\n"
        "from jaxformer.model.config import TransformerConfig\n"
        "from jaxformer.model.transformer import Transformer\n"
        "c = TransformerConfig.from_dict(json.load(open(sys.argv[1]))['model'])\n"
        "ids = jnp.ones((1, 8), jnp.int32)\n"
        "p = jax.eval_shape(lambda: Transformer(c).init(jax.random.key(0), ids, ids))['params']\n"
        "print(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(p)))\n"
    )
    out = subprocess.check_output(
        [sys.executable, "-c", code, str(workdir / "config.json")],
        cwd=REPO,
        env={"JAX_PLATFORMS": "cpu", **os.environ},
        text=True,
    )
    return int(out.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--teacher", type=Path, required=True, help="a finished run (results.json)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the data and the student run")
    parser.add_argument(
        "--student-flags",
        help="width flags of the student (default: half the "
        'teacher\'s d_model and d_ff, e.g. "--d-model 64 --d-ff 256")',
    )
    parser.add_argument("--baseline", action="store_true",
                        help="also train the student's shape on the teacher's own data (real references)")
    parser.add_argument("--write", metavar="MARKDOWN", help="put the table between the markers in this file")
    args = parser.parse_args()
    teacher, out = args.teacher.resolve(), args.out.resolve()
    if not (teacher / "results.json").exists():
        parser.error(
            f"{teacher} has no results.json: train the teacher first (python train.py --workdir ...)"
        )
    out.mkdir(parents=True, exist_ok=True)
    log, student = out / "distillation.log", out / "student"
    gflops = [matmul_flops_per_s(2048, 3) / 1e9]
    sources, hyps, distilled = out / "train.en", out / "train.distilled.de", out / "distilled.tsv"
    if not sources.exists():
        run(
            [
                sys.executable,
                "-m",
                "jaxformer.prepare",
                "--workdir",
                str(teacher),
                "--write-train-sources",
                str(sources),
            ],
            log,
        )
    lines = sum(1 for _ in open(sources, encoding="utf-8"))
    distill_s = None
    if not hyps.exists():
        distill_s = run(translate_cmd(teacher, sources, hyps), log)
    distill_rate = loop_rate(log) if distill_s else None
    if not distilled.exists():
        with (
            open(sources, encoding="utf-8") as src,
            open(hyps, encoding="utf-8") as tgt,
            open(distilled, "w", encoding="utf-8") as both,
        ):
            both.writelines(f"{s.rstrip(chr(10))}\t{t.rstrip(chr(10))}\n" for s, t in zip(src, tgt))
    if not (student / "results.json").exists():
        run(
            [
                sys.executable,
                "train.py",
                *student_flags(teacher, args.student_flags),
                "--workdir",
                str(student),
                "--train-file",
                str(distilled),
                "--dev-file",
                str(teacher / "prepared" / "dev.tsv"),
                "--test-file",
                str(teacher / "prepared" / "test.tsv"),
                "--no-progress",
            ],
            log,
        )
    test_sources = out / "test.en"
    test_sources.write_text(
        "".join(
            line.split("\t")[0] + "\n"
            for line in (teacher / "prepared" / "test.tsv").read_text(encoding="utf-8").splitlines()
        )
    )
    baseline = out / "baseline"   # the student's shape on the teacher's real data: what distilling adds
    if args.baseline and not (baseline / "results.json").exists():
        run([sys.executable, "train.py", *student_flags(teacher, args.student_flags), "--workdir",
             str(baseline), "--no-progress"], log)
    rows = []
    models = [("teacher", teacher), ("student (distilled)", student)]
    models += [("same shape, real data", baseline)] if args.baseline else []
    for name, workdir in models:
        results = json.loads((workdir / "results.json").read_text())
        model = json.loads((workdir / "config.json").read_text())["model"]
        rate, seconds = decode_speed(workdir, test_sources, out, log)
        rows.append(
            f"| {name} | {model['d_model']} / {model['d_ff']} | {parameters(workdir) / 1e6:.2f}M "
            f"| {results['test_bleu']:.2f} | {results['test_chrf']:.2f} | {rate:,.1f} | {seconds:.1f} s |"
        )
        print(rows[-1], flush=True)
    gflops.append(matmul_flops_per_s(2048, 3) / 1e9)
    command = " ".join(["python", "benchmarks/distillation.py", *sys.argv[1:]])
    table = [
        f"`{command}` ({datetime.date.today()}):",
        "",
        "| model | d_model / d_ff | parameters | test BLEU | test chrF | beam-4 sentences/s (loop) "
        "| test set, whole process |",
        "|---|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"- distillation data: {lines:,} teacher training sources translated with beam 4"
        + (
            f" at {distill_rate:,.1f} sentences/s ({distill_s / 60:.1f} min, whole process)"
            if distill_s
            else " (translated by an earlier call)"
        ),
        f"- decode speed: the {sum(1 for _ in open(test_sources))} test sources, bulk mode, beam 4, batch "
        f"64, after a call that filled the compile cache; float32 2048³ matmul {gflops[0]:.0f} "
        f"GFLOP/s at start, {gflops[1]:.0f} at end",
    ]
    publish(table, args.write, MARKERS)


if __name__ == "__main__":
    main()
