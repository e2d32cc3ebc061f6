"""The default run and the settings tried against it (issue 22): test BLEU per CPU-minute.

    python benchmarks/default_run.py                         # the default run alone (~10 min)
    python benchmarks/default_run.py --setting lr1="--lr-scale 1.0" --setting v8k="--vocab-size 8000"
    python benchmarks/default_run.py --quick                 # 40 steps, to check that it runs

Each setting is ``python train.py`` with the default flags plus its own, in a fresh
process and a run directory of its own under ``--out``; ``--sweep`` adds
``--eval-every 100000`` (no periodic dev evaluation: the final one picks the
checkpoint) so a setting costs its steps and the final test only. Printed per setting,
from its ``results.json`` and ``train.log``: test BLEU and chrF (beam 4), the steps
trained, steps/s of the training loop, wall minutes in all, the share of test
translations that loop on an n-gram, and the float32 2048³ matmul rate measured here
before the setting's run. BLEU does not depend on the machine's speed (the budget is
steps); the times do, so run it alone on the machine and quote the matmul rate.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from _common import matmul_flops_per_s

REPO = Path(__file__).resolve().parents[1]


def _loop_steps_per_s(log: str) -> float | None:
    """Steps/s between the first and last logging windows of ``train.log``."""
    stamps = [(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f"), int(m.group(2)))
              for m in re.finditer(r"^(\S+ \S+) INFO step (\d+) \| loss", log, re.M)]
    if len(stamps) < 2:
        return None
    (t0, s0), (t1, s1) = stamps[0], stamps[-1]
    return (s1 - s0) / max((t1 - t0).total_seconds(), 1e-9)


def run_setting(name: str, flags: list[str], out: Path) -> dict:
    """Trains one setting from scratch; returns its row of the table."""
    workdir = out / name
    cmd = [sys.executable, str(REPO / "train.py"), "--workdir", str(workdir), "--fresh", "--no-progress",
           *flags]
    print("$ " + " ".join(shlex.quote(c) for c in cmd[1:]), flush=True)
    gflops = matmul_flops_per_s(2048, 3) / 1e9   # the machine's speed, as the READMEs quote it
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = (time.perf_counter() - start) / 60
    results = json.loads((workdir / "results.json").read_text())
    return {"setting": name, "flags": " ".join(flags), "test_bleu": results["test_bleu"],
            "test_chrf": results["test_chrf"], "steps": results["final_step"],
            "steps_per_s": _loop_steps_per_s((workdir / "train.log").read_text()),
            "wall_minutes": wall, "degenerate": results["degenerate"]["fraction"],
            "matmul_gflops": gflops, "best_step": results["best_step"],
            "checkpoint": results["checkpoint"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", action="append", default=[], metavar='NAME="FLAGS"',
                        help="a setting to run after the default one: its name and train.py flags")
    parser.add_argument("--no-default", action="store_true", help="skip the default run")
    parser.add_argument("--sweep", action="store_true",
                        help="no periodic dev evaluation in any setting (--eval-every 100000)")
    parser.add_argument("--quick", action="store_true", help="40 steps each, to check that it runs")
    parser.add_argument("--out", type=Path, default=Path("/tmp/jaxformer-default-run"))
    args = parser.parse_args(argv)
    common = (["--eval-every", "100000"] if args.sweep else []) + (
        ["--max-steps", "40", "--warmup-steps", "10"] if args.quick else [])
    settings = [] if args.no_default else [("default", [])]
    for spec in args.setting:
        name, _, flags = spec.partition("=")
        settings.append((name, shlex.split(flags)))
    rows = []
    for name, flags in settings:
        rows.append(run_setting(name, common + flags, args.out))
        print(json.dumps(rows[-1]), flush=True)
    print("\n| setting | flags | test BLEU | chrF | steps | steps/s | wall min | looping | matmul GFLOP/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        rate = f"{r['steps_per_s']:.2f}" if r["steps_per_s"] else "-"
        print(f"| {r['setting']} | `{r['flags'] or '(defaults)'}` | {r['test_bleu']:.2f} | "
              f"{r['test_chrf']:.2f} | "
              f"{r['steps']} | {rate} | {r['wall_minutes']:.1f} | {r['degenerate']:.1%} | "
              f"{r['matmul_gflops']:.0f} |")


if __name__ == "__main__":
    main()
