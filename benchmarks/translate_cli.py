"""The translate tool's speed on a trained run (issue 14's three numbers, plus import time).

    python train.py --workdir runs/en-de                      # the default run, ~7 minutes
    python benchmarks/translate_cli.py --workdir runs/en-de   # ~2 minutes on 2 cores

Measures, on an otherwise idle machine:

1. ``import``: wall time of ``python -c "import jaxformer.translate"`` (median of
   --repeats fresh processes).
2. ``second call``: wall time of ``python -m jaxformer.translate --workdir RUN "Click OK."``
   (beam 4) after one call has filled the run's compilation cache (``RUN/jax_cache``):
   the median of --repeats fresh processes. Each process's compile-cache misses are
   counted; a second call must have none. Target ≤ 3.5 s.
3. ``file``: wall time of one process translating ``--input`` (default ``RUN/test.src``,
   the 994 test sentences of the default run) with beam 4, cache warm. Target ≤ 35 s.
4. ``warm latency``: one sentence at beam 4 from the library (``Translator``), in one
   process after a warm-up call: the median of 30 calls, in milliseconds. Target ≤ 30 ms
   for the small preset.

``--cold`` first deletes ``RUN/jax_cache`` so the first call's compile time is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COUNTING = """
import collections, json, sys
import jax.monitoring
events = collections.Counter()
jax.monitoring.register_event_listener(lambda name, **kw: events.update([name]))
from jaxformer.cli.translate import cli
cli()   # what jaxformer-translate runs
print("EVENTS " + json.dumps({k.rsplit("/", 1)[-1]: v for k, v in events.items()}), file=sys.stderr)
"""


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def timed_process(args: list[str]) -> tuple[float, dict[str, int]]:
    """Wall seconds of one fresh process (``python -c COUNTING args``) and its cache events."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", COUNTING, *args], env=_env(), capture_output=True,
                          text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"translate failed ({done.returncode}):\n{done.stderr}")
    line = [x for x in done.stderr.splitlines() if x.startswith("EVENTS ")][-1]
    return seconds, json.loads(line[len("EVENTS "):])


def import_seconds(repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import jaxformer.translate"], env=_env(), check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def warm_latency_ms(workdir: str, sentence: str, calls: int = 30) -> float:
    sys.path.insert(0, str(REPO))
    from jaxformer.decode.translator import Translator

    translator = Translator(workdir)
    translator([sentence], beam_size=4)   # compiles
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        translator([sentence], beam_size=4)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="a trained run directory")
    parser.add_argument("--input", help="file to translate (default: WORKDIR/test.src)")
    parser.add_argument("--sentence", default="Click OK.", help="the single sentence")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per timing")
    parser.add_argument("--cold", action="store_true", help="delete WORKDIR/jax_cache first")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    source = Path(args.input) if args.input else workdir / "test.src"
    if not (workdir / "config.json").exists() or not source.exists():
        sys.exit(f"need a trained run in {workdir} and an input file {source}")
    if args.cold:
        shutil.rmtree(workdir / "jax_cache", ignore_errors=True)
    common = ["--workdir", str(workdir)]
    first, first_events = timed_process([*common, args.sentence])
    print(f"first call (fills the cache): {first:.2f} s wall, cache misses "
          f"{first_events.get('cache_misses', 0)}, hits {first_events.get('cache_hits', 0)}")
    seconds, misses = [], []
    for _ in range(args.repeats):
        wall, events = timed_process([*common, args.sentence])
        seconds.append(wall)
        misses.append(events.get("cache_misses", 0))
    print(f"import jaxformer.translate: {import_seconds(args.repeats):.2f} s (median of {args.repeats})")
    print(f"second call: {statistics.median(seconds):.2f} s wall (median of {args.repeats}; "
          f"runs {', '.join(f'{s:.2f}' for s in seconds)}), cache misses {misses}  [target <= 3.5 s]")
    lines = sum(1 for _ in source.open(encoding="utf-8"))
    output = workdir / "bench.hyp"
    cold, _ = timed_process([*common, "--input", str(source), "--output", str(output)])   # caches its shapes
    wall, events = timed_process([*common, "--input", str(source), "--output", str(output)])
    print(f"file of {lines} lines: {wall:.2f} s wall, cache misses {events.get('cache_misses', 0)} "
          f"(first time, compiling its batch shapes: {cold:.2f} s)  [target <= 35 s]")
    output.unlink(missing_ok=True)
    print(f"warm latency, one sentence, beam 4: {warm_latency_ms(str(workdir), args.sentence):.1f} ms "
          f"(median of 30)  [target <= 30 ms, small preset]")


if __name__ == "__main__":
    main()
