"""The README's "Scaling on paper" table: the real train step compiled for TPU slices (and
an H100 node) from this CPU host with ``jaxformer-compile``, one process per compile.

    python benchmarks/compile_topologies.py                       # every row (hours on 2 cores)
    python benchmarks/compile_topologies.py --rows base-v5e-16    # one row
    python benchmarks/compile_topologies.py --list
    python benchmarks/compile_topologies.py --write benchmarks/README.md   # the table into the README

Each row compiles the paper's base recipe batch (§5.1: ~25k target tokens a step, here
``--batch-tokens 25600`` in 128-token packed rows, rounded to the data axis) in bf16 with
a 32k vocabulary, and prints per-chip peak memory, the fit verdict, FLOPs per step and
device, the roofline step time and tokens/s (and at 50% MFU), the time of the base
recipe's 100k steps at the slower of the two (50% MFU is out of reach where the
roofline's memory or collective bound is slower), and the compile's wall time (kept with the cached
report, so a cached row shows the time its compile took). Reports are cached by
``jaxformer-compile`` (``~/.cache/jaxformer/compile``): a second run prints the same
table in seconds; ``--no-cache`` compiles again. Run it alone on the machine: the wall
times are what a 2-core host takes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from _common import write_between_markers

from jaxformer.interop.m2m100 import nllb200_flags

COMMON = ["--vocab-size", "32000", "--batch-tokens", "25600", "--max-train-len", "128",
          "--dtype", "bfloat16", "--no-decode"]
ROWS = {   # name: (preset, topology, mesh, extra flags; a later --preset or --vocab-size wins)
    "base-v4-8": ("base", "v4-8", "data=4", []),
    "base-v5e-16": ("base", "v5e-16", "data=16", []),
    "base-v5p-64": ("base", "v5p-64", "data=32", []),
    "big-v4-8": ("big", "v4-8", "data=4", []),
    "big-v5e-16": ("big", "v5e-16", "data=8,model=2", []),
    "big-v5p-64": ("big", "v5p-64", "data=32", []),
    "base-h100-8": ("base", "h100-8", "data=8", []),
    "base-h200-8": ("base", "h200-8", "data=8", []),
    # NLLB-200's shapes (256k shared vocabulary, pre-norm, 12+12 or 24+24 layers): fine-tuning
    "nllb600m-v5e-16": ("big", "v5e-16", "data=4,fsdp=4", nllb200_flags("600M")),
    "nllb600m-h100-8": ("big", "h100-8", "data=8", nllb200_flags("600M")),
    "nllb1.3b-v5p-64": ("big", "v5p-64", "data=8,fsdp=4", nllb200_flags("1.3B")),
    "nllb3.3b-v5p-64": ("big", "v5p-64", "data=4,fsdp=8", nllb200_flags("3.3B") + ["--remat"]),
}
MARKERS = ("<!-- compile_topologies: begin -->", "<!-- compile_topologies: end -->")
STEPS = 100_000   # the base recipe (§5.3)


def compile_row(name: str, no_cache: bool) -> dict:
    preset, topology, mesh, extra = ROWS[name]
    argv = [sys.executable, "-m", "jaxformer.compile", "--topology", topology, "--preset", preset,
            "--mesh", mesh, *COMMON, *extra, "--json"] + (["--no-cache"] if no_cache else [])
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        return {"name": name, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    out = json.loads(done.stdout)
    return {"name": name, "wall_s": time.perf_counter() - start, **out}


def table_row(row: dict) -> str:
    if "error" in row:
        return f"| {row['name']} | error: {row['error']} |"
    t, r = row["target"], row["train_step"]
    batch = f"{t['batch']['rows']}×{t['batch']['length']}"
    how = f"{r['compile_s']:.0f} s"   # the compile's own wall time, also when its report is cached
    if "verdict" in r:
        return (f"| {t['model']['d_model']}/{t['model']['num_encoder_layers']}L | {t['topology']} "
                f"| {t['mesh']} | {batch} | needs {r['needed'] / 2**30:.1f} GiB | no | | | | | {how} |")
    tokens = t["batch"]["rows"] * t["batch"]["length"]
    recipe_s = STEPS * r["step_s_estimate"]
    recipe = f"{recipe_s / 3600:.1f} h" if recipe_s >= 3600 else f"{recipe_s / 60:.0f} min"
    return (f"| {t['model']['d_model']}/{t['model']['num_encoder_layers']}L | {t['topology']} | {t['mesh']} "
            f"| {batch} | {r['memory']['peak'] / 2**30:.2f} of {r['hbm'] / 2**30:.1f} GiB "
            f"| {'yes' if r['fits'] else 'no'} | {r['flops_per_device'] / 1e12:.2f} "
            f"| {r['roofline_step_s'] * 1e3:.0f} ms, {r['tokens_per_s_roofline'] / 1e3:.0f}k/s "
            f"| {r['step_s_at_50_mfu'] * 1e3:.0f} ms, {r['tokens_per_s_at_50_mfu'] / 1e3:.0f}k/s "
            f"| {recipe} ({tokens:,} tokens/step) | {how} |")


HEADER = ("| model (d_model/layers) | target | mesh | batch | peak per chip | fits | TFLOP/step/chip "
          "| roofline (est.) | at 50% MFU (est.) | base recipe, 100k steps (est.) | compile |\n"
          "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated row names (see --list)")
    parser.add_argument("--list", action="store_true", help="print the row names and exit")
    parser.add_argument("--no-cache", action="store_true", help="compile again even if reports are cached")
    parser.add_argument("--write", metavar="MARKDOWN",
                        help="also put the table between the compile_topologies markers of this file "
                             "(benchmarks/README.md)")
    args = parser.parse_args()
    if args.list:
        print("\n".join(f"{k}: {v[0]} on {v[1]}, mesh {v[2]}" for k, v in ROWS.items()))
        return
    print(HEADER, flush=True)
    lines = [HEADER]
    for name in filter(None, args.rows.split(",")):
        lines.append(table_row(compile_row(name, args.no_cache)))
        print(lines[-1], flush=True)
    if args.write:
        write_between_markers(args.write, MARKERS, lines)


if __name__ == "__main__":
    main()
