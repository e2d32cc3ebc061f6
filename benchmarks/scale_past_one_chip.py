"""Issue #19's proofs on paper: FSDP, scanned layers and the Pallas attention kernel,
each compiled for a TPU slice from this CPU host with ``jaxformer-compile`` (libtpu's
compile-only devices), one process per compile.

    python benchmarks/scale_past_one_chip.py                      # every row (~15 min + the unrolled
                                                                  # 48-layer compile on 2 cores)
    python benchmarks/scale_past_one_chip.py --rows fsdp,data     # some rows
    python benchmarks/scale_past_one_chip.py --write benchmarks/README.md

Rows:
- ``fsdp`` / ``data``: issue #19's example encoder–decoder (d_model 2048, d_ff 8192, 16
  heads, 24+24 layers, 32k shared vocabulary: 2.89B parameters) under ``--scan-layers
  --remat`` in bf16 on a v5e-16 slice (16 GiB HBM a chip), 256 rows × 256 tokens a step,
  with its parameters and Adam moments split 16 ways (``--mesh fsdp=16``) and with every
  chip holding all of them (``--mesh data=16``).
- ``fsdp`` again and ``unrolled``: the same 48-layer model compiled with and without
  ``--scan-layers``: compile wall time, the serialized executable's size (``--save``)
  and the compiler's code bytes.
- ``pallas`` / ``reference``: the ``base`` preset at T = S = 1024 on v5e-4 (16 rows of
  1024 tokens, 4 a chip): per-chip temp memory of the train step with the splash kernel
  and with the reference einsum-softmax-einsum core.

Nothing is cached (every compile runs); run it alone on the machine, the times are what
a 2-core host takes. ``--write`` puts the tables between this script's markers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import write_between_markers

BIG = ["--preset", "big", "--d-model", "2048", "--d-ff", "8192", "--num-heads", "16", "--num-layers", "24",
       "--vocab-size", "32000", "--batch-tokens", "65536", "--max-train-len", "256", "--dtype", "bfloat16",
       "--remat", "--topology", "v5e-16"]
BASE_1024 = ["--preset", "base", "--vocab-size", "32000", "--max-len", "1024", "--max-train-len", "1024",
             "--batch-tokens", "16384", "--dtype", "bfloat16", "--topology", "v5e-4", "--mesh", "data=4"]
ROWS = {   # name: (flags, save the executable)
    "fsdp": (BIG + ["--scan-layers", "--mesh", "fsdp=16"], True),
    "data": (BIG + ["--scan-layers", "--mesh", "data=16"], False),
    "unrolled": (BIG + ["--no-scan-layers", "--mesh", "fsdp=16"], True),
    "pallas": (BASE_1024 + ["--attention-backend", "pallas"], False),
    "reference": (BASE_1024 + ["--attention-backend", "reference"], False),
}
MARKERS = ("<!-- scale_past_one_chip: begin -->", "<!-- scale_past_one_chip: end -->")
GiB = 2 ** 30


def compile_row(name: str) -> dict:
    flags, save = ROWS[name]
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", "jaxformer.compile", *flags, "--no-decode", "--no-cache", "--json",
                "--cache-dir", str(Path(tmp) / "cache")] + (["--save", tmp] if save else [])
        start = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode not in (0, 1):
            return {"name": name, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
        executable = Path(tmp) / "train_step.xla"
        size = executable.stat().st_size if executable.exists() else None
    out = json.loads(done.stdout)
    return {"name": name, "wall_s": wall, "executable_bytes": size, **out}


def _memory(row: dict) -> str:
    r = row["train_step"]
    if not r["fits"] and "needed" in r:
        return f"needs {r['needed'] / GiB:.2f} of {r['hbm'] / GiB:.2f} GiB: **does not fit**"
    m = r["memory"]
    return (f"{m['peak'] / GiB:.2f} of {r['hbm'] / GiB:.2f} GiB (arguments {m['argument'] / GiB:.2f}, "
            f"temp {m['temp'] / GiB:.2f}): {'fits' if r['fits'] else '**does not fit**'}")


def tables(rows: dict[str, dict]) -> list[str]:
    lines = []
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"- {name}: error: {row['error']}")
    fit = [n for n in ("fsdp", "data") if n in rows and "error" not in rows[n]]
    if fit:
        lines += ["", "| 2.89B enc–dec, scanned, remat, bf16, v5e-16 | mesh | peak per chip |",
                  "|---|---|---|"]
        lines += [f"| {n} | {rows[n]['target']['mesh']} | {_memory(rows[n])} |" for n in fit]
    depth = [n for n in ("fsdp", "unrolled") if n in rows and "error" not in rows[n]]
    if depth:
        lines += ["", "| the same 48-layer model, fsdp=16 | compile (tool's) | process wall | executable "
                      "| code per chip | peak per chip | TFLOP / GB accessed per chip |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for n in depth:
            r = rows[n]["train_step"]
            size = rows[n]["executable_bytes"]
            scaled = " (scaled)" if r.get("loop_scale") else ""
            lines.append(f"| {'--scan-layers' if n == 'fsdp' else 'unrolled'} | {r['compile_s']:.0f} s "
                         f"| {rows[n]['wall_s']:.0f} s | {size / 2**20:.0f} MiB | "
                         f"{r['memory']['code'] / 2**20:.0f} MiB | {r['memory']['peak'] / GiB:.2f} GiB "
                         f"| {r['flops_per_device'] / 1e12:.1f} / {r['bytes_accessed_per_device'] / 1e9:.0f}"
                         f"{scaled} |")
    attention = [n for n in ("pallas", "reference") if n in rows and "error" not in rows[n]]
    if attention:
        lines += ["", "| base, T = S = 1024, bf16, v5e-4 (4 rows a chip) | temp per chip | peak per chip "
                      "| compile |", "|---|---:|---:|---:|"]
        for n in attention:
            r = rows[n]["train_step"]
            lines.append(f"| --attention-backend {n} | {r['memory']['temp'] / GiB:.2f} GiB "
                         f"| {r['memory']['peak'] / GiB:.2f} GiB | {r['compile_s']:.0f} s |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--write", metavar="MARKDOWN", help="put the tables between this script's markers")
    args = parser.parse_args()
    rows = {}
    for name in filter(None, args.rows.split(",")):
        rows[name] = compile_row(name)
        print(f"{name}: {json.dumps({k: v for k, v in rows[name].items() if k != 'target'})[:600]}",
              flush=True)
    lines = tables(rows)
    print("\n".join(lines))
    if args.write:
        write_between_markers(args.write, MARKERS, lines)


if __name__ == "__main__":
    main()
