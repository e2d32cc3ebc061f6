"""Bulk translation of a file, ``jaxformer-translate --input F --output F``, against
CTranslate2 4.x (float32 and int8) on the same run exported to Hugging Face Marian.

    python train.py --workdir runs/en-de-post --norm-position post     # a post-norm run, ~10 min
    python benchmarks/bulk_translate.py --workdir runs/en-de-post      # 100k lines, 2 rounds: hours
    python benchmarks/bulk_translate.py --workdir RUN --quick          # 2,000 lines, 1 round: a check
    python benchmarks/bulk_translate.py --workdir RUN --write benchmarks/README.md   # the table there

Only a post-norm run exports (``jaxformer-convert --to-hf`` refuses the default ``small``
preset, which is pre-norm). Each step is a fresh process, one at a time:

1. Input: the shipped en-de English sources repeated up to N = ``--lines`` lines, round
   r ≥ 1 with `` (r)`` appended so that every line differs.
2. Models: ``jaxformer-convert --to-hf``, then ``TransformersConverter`` to float32 and
   int8 with Marian's loader minus two OPUS-MT rules: it drops the last vocabulary row as
   ``<pad>`` (here ``<pad>`` is id 0: the conversion fails) and starts decoding from a
   zero vector (here from ``<s>``); and with the run's LayerNorm ε (the export has 1e-5).
3. Warm-up, not timed, fills ``RUN/jax_cache``; its time, compiles included, is printed.
   Greedy: one call on a small file whose batches take every shape the input's can (row
   counts min(B, a power of two) × the length buckets in the input). Beam 4: the input
   itself, once per stopping rule (the staged beam search's stages depend on when the
   sentences close). The timed runs count their compile-cache misses: 0 = compile time
   excluded.
4. Timed, ``--repeats`` rounds, each in turns: jaxformer, CT2 float32, CT2 int8 at beam 1,
   then at beam 4 (and jaxformer with the exact stopping rule). jaxformer:
   ``jaxformer-translate --input --output --beam-size k --batch-size B --chunk-lines C
   --repetition-penalty P --early-stopping`` (GNMT α 0.6, ≤ L + 50 tokens; a sentence is
   done once k hypotheses ended, CT2's rule with a length penalty; beam search in stages,
   :mod:`jaxformer.decode.staged`); "jaxformer, exact stop": ``--no-early-stopping``;
   "jaxformer, bfloat16 matmuls": ``--matmul-dtype bfloat16`` (``--matmul-dtype none``
   leaves it out), its "= jaxformer" the share of lines equal to float32's.
   CT2: ``Translator(device="cpu", inter_threads=1, intra_threads=cores)``, and at beam 4
   also CT2's throughput setting, ``inter_threads=cores, intra_threads=1`` (one translator
   per core, each on its own batches; "N translators × 1 thread" in the table),
   ``translate_iterable`` over the file streamed in pieces of the export's ``source.spm``
   (the run's sentencepiece), ``max_batch_size=B``, ``length_penalty`` α (|Y|^α, not
   GNMT), ``min_decoding_length=0``, ``max_input_length`` = max_len, ``max_decoding_length``
   M = jaxformer's limit for the first length bucket (32 + 50, at most max_len), M - 1 at
   beam > 1 (jaxformer's beam counts the eos that ends every hypothesis, CT2 stops at M
   tokens without one); ``<pad>`` and ``<s>`` suppressed (jaxformer never emits them).
5. RSS flat in file size: jaxformer greedy on the warm-up file followed by the first N/10
   lines, and by all N lines, chunked like the warm-up file. Both meet every batch shape
   (each shape's decoder held in the process counts too), so the difference is the file
   size's alone.
6. Resume: jaxformer greedy SIGKILLed once half its chunks are in OUTPUT.parts/, then the
   same command again: its time as a share of the uninterrupted greedy run's, and its
   output compared with that run's byte for byte.

Columns: "wall s", the whole process (start-up, imports, model load, decoding); "sent/s",
lines / wall s; "loop sent/s", the decoding loop alone (jaxformer's report line, the CT2
child's loop around ``translate_iterable``); peak RSS of the process (``wait4``; this
script imports neither JAX nor torch, as a child's count starts at its parent's RSS);
"= jaxformer", the share of lines identical to jaxformer's at the same beam. Ratios:
jaxformer / CT2 in sent/s, the median of each round's ratio. The float32 2048³ matmul
rate (``jnp.dot``) is printed at start and end. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _ct2
from _common import matmul_flops_per_s, publish, usable_cores

REPO = Path(__file__).resolve().parents[1]
MARKERS = ("<!-- bulk_translate: begin -->", "<!-- bulk_translate: end -->")
COUNTING = """
import collections, json, sys
import jax.monitoring
events = collections.Counter()
jax.monitoring.register_event_listener(lambda name, **kw: events.update([name]))
from jaxformer.cli.translate import cli
try:
    cli()   # what jaxformer-translate runs
finally:
    print("EVENTS " + json.dumps({k.rsplit("/", 1)[-1]: v for k, v in events.items()}), file=sys.stderr)
"""
EXACT = "jaxformer, exact stop"
TARGETS = {("CT2 int8", 4): " [target ≥ 1.0×]", ("CT2 float32", 4): " [target ≥ 1.3×]"}
LOOP = re.compile(r" in ([\d.]+) s: ([\d,.]+) sentences/s")


@dataclasses.dataclass
class Result:
    engine: str
    beam: int
    lines: int
    seconds: float
    rss_mib: float
    loop_rate: float | None
    misses: int | None
    output: Path

    @property
    def rate(self) -> float:
        return self.lines / self.seconds


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def measured(cmd: list[str], log: Path) -> tuple[float, float, str]:
    """Runs ``cmd`` in a fresh process (output to ``log``): wall seconds, peak RSS in MiB
    (``wait4``: this child alone) and the log's text. A failure stops the benchmark."""
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds, text = time.perf_counter() - start, log.read_text(errors="replace")
    if proc.returncode:
        shown = " ".join(c for c in cmd if "\n" not in c)
        sys.exit(f"failed ({proc.returncode}): {shown}\n{text[-3000:]}")
    return seconds, usage.ru_maxrss / 1024, text


def in_child(spec: dict, log: Path) -> tuple[float, float, str]:
    """:func:`measured` on ``python bulk_translate.py --child SPEC`` (:func:`child`)."""
    return measured([sys.executable, __file__, "--child", json.dumps(spec)], log)


def _loop_rate(text: str) -> float | None:
    loop = LOOP.search(text)
    return float(loop.group(2).replace(",", "")) if loop else None


def matmul_gflops(out: Path) -> float:
    return float(re.search(r"GFLOPS ([\d.]+)", in_child({"do": "matmul"}, out / "matmul.log")[2]).group(1))


def _clear(output: Path) -> None:
    output.unlink(missing_ok=True)
    shutil.rmtree(output.with_name(output.name + ".parts"), ignore_errors=True)


def jaxformer_cmd(args, source: Path, output: Path, beam: int, chunk_lines: int,
                  early_stopping: bool = True, matmul_dtype: str | None = None) -> list[str]:
    return [sys.executable, "-c", COUNTING, "--workdir", args.workdir, "--input", str(source),
            "--output", str(output), "--beam-size", str(beam), "--batch-size", str(args.batch_size),
            "--chunk-lines", str(chunk_lines), "--repetition-penalty", str(args.repetition_penalty),
            "--early-stopping" if early_stopping else "--no-early-stopping",
            *(["--matmul-dtype", matmul_dtype] if matmul_dtype else [])]


def jaxformer_run(args, source: Path, output: Path, beam: int, chunk_lines: int, lines: int,
                  early_stopping: bool = True, matmul_dtype: str | None = None) -> Result:
    _clear(output)
    cmd = jaxformer_cmd(args, source, output, beam, chunk_lines, early_stopping, matmul_dtype)
    seconds, rss, text = measured(cmd, output.with_suffix(".log"))
    events = json.loads([x for x in text.splitlines() if x.startswith("EVENTS ")][-1][len("EVENTS "):])
    misses = events.get("cache_misses", 0)
    engine = (f"jaxformer, {matmul_dtype} matmuls" if matmul_dtype else "jaxformer") if early_stopping \
        else EXACT
    return Result(engine, beam, lines, seconds, rss, _loop_rate(text), misses, output)


def ct2_run(args, spec: dict, quantization: str, beam: int, lines: int, translators: int = 1) -> Result:
    """CT2 on the input: one translator with ``--threads`` intra threads, or (``translators``
    > 1) that many translators of one thread each, working on batches in parallel."""
    output = args.out / f"ct2-{quantization}-beam{beam}-x{translators}.de"
    threads = {"inter_threads": 1, "threads": args.threads} if translators == 1 else \
        {"inter_threads": translators, "threads": 1}
    seconds, rss, text = in_child({**spec, **threads, "do": "translate", "beam": beam,
                                   "output": str(output), "model": str(args.out / f"ct2-{quantization}")},
                                  output.with_suffix(".log"))
    engine = f"CT2 {quantization}" + (f", {translators} translators × 1 thread" if translators > 1 else "")
    return Result(engine, beam, lines, seconds, rss, _loop_rate(text), None, output)


def child(spec: dict) -> None:
    """The work done in child processes: the matmul rate, the input files, the CT2 models, a CT2 run."""
    if spec["do"] == "matmul":
        from jaxformer.run.platform import skip_absent_tpu

        skip_absent_tpu()   # libtpu on a CPU host: use the CPU, as the translate tool does
        print(f"GFLOPS {matmul_flops_per_s(2048, 5) / 1e9:.1f}")
    elif spec["do"] == "inputs":
        source = Path(spec["source"])
        build_input(source, spec["lines"])
        print(f"WARM_CHUNK {warmup_input(spec, source)}")
        warm = Path(spec["warm"]).read_bytes()
        for name, lines in (("small", spec["small_lines"]), ("big", spec["lines"])):
            with source.open("rb") as f:   # every batch shape first, then the first lines
                Path(spec[name]).write_bytes(warm + b"".join(line for _, line in zip(range(lines), f)))
    elif spec["do"] == "convert":
        _ct2.convert(spec)
    else:
        _ct2.translate(spec)


def export(args) -> dict:
    """The run as a Marian folder (``jaxformer-convert --to-hf``) and as CT2 float32/int8
    models; returns the settings the CT2 runs share."""
    record = json.loads((Path(args.workdir) / "config.json").read_text())
    model = record["model"]
    if record.get("tokenizer", {}).get("kind", "sentencepiece") != "sentencepiece":
        sys.exit("this benchmark takes a run trained here (a joint sentencepiece tokenizer), not an import")
    hf = args.out / "hf"
    done = subprocess.run([sys.executable, "-m", "jaxformer.cli.convert", "--to-hf", args.workdir, "--out",
                           str(hf)], capture_output=True, text=True, env=_env(), cwd=REPO)
    if done.returncode:
        sys.exit(f"jaxformer-convert --to-hf failed:\n{done.stderr.strip()}\nCTranslate2 needs a post-norm "
                 f"run, e.g. python train.py --workdir runs/en-de-post --norm-position post")
    convert = {"do": "convert", "hf": str(hf), "out": str(args.out), "epsilon": model["layer_norm_epsilon"]}
    in_child(convert, args.out / "convert.log")
    return {"spm": str(hf / "source.spm"), "input": str(args.out / "input.en"), "threads": args.threads,
            "batch_size": args.batch_size, "alpha": 0.6, "repetition_penalty": args.repetition_penalty,
            "max_len": model["max_len"], "max_decoding_length": min(32 + 50, model["max_len"])}


def build_input(path: Path, lines: int) -> None:
    """The shipped en-de sources, round r ≥ 1 with `` (r)`` appended, up to ``lines`` lines."""
    from jaxformer.data import corpus

    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for i in range(lines):
            r, k = divmod(i, len(pairs))
            f.write(f"{pairs[k][0]} ({r})\n" if r else f"{pairs[k][0]}\n")


def warmup_input(spec: dict, source: Path) -> int:
    """A file whose batches take every shape ``source``'s can: per row count r (min(B, a
    power of two)) one chunk with r lines of each length bucket found in ``source``,
    filled up with empty lines (not decoded). Returns its chunk size."""
    import sentencepiece as spm

    from jaxformer.data.batching import bucket_boundaries

    sp = spm.SentencePieceProcessor(model_file=spec["spm"])
    max_len, batch = spec["max_len"], spec["batch_size"]
    bounds, examples = bucket_boundaries(max_len, 32), {}   # the translate tool's buckets
    with source.open(encoding="utf-8", newline="\n") as f:
        for line in f:
            line = line.removesuffix("\n")
            examples.setdefault(bisect.bisect_left(bounds, max(1, min(len(sp.encode(line)), max_len))), line)
    chunk = batch * len(examples)
    with Path(spec["warm"]).open("w", encoding="utf-8", newline="\n") as f:
        for rows in sorted({min(batch, 1 << (c - 1).bit_length()) for c in range(1, batch + 1)}):
            block = [line for line in examples.values() for _ in range(rows)]
            f.write("".join(f"{x}\n" for x in block + [""] * (chunk - len(block))))
    return chunk


def resume(args, source: Path, reference: Path, chunk_lines: int, lines: int) -> dict:
    """Greedy jaxformer SIGKILLed once half its chunks are written, then run again."""
    output = args.out / "resume.de"
    _clear(output)
    parts, chunks = output.with_name(output.name + ".parts"), -(-lines // chunk_lines)
    cmd = jaxformer_cmd(args, source, output, 1, chunk_lines)
    with (args.out / "killed.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
        while proc.poll() is None and len(list(parts.glob("*.txt"))) < -(-chunks // 2):
            time.sleep(0.01)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_at = len(list(parts.glob("*.txt")))
    seconds, rss, text = measured(cmd, args.out / "resumed.log")
    found = re.search(r"(\d+) found finished", text)
    return {"killed": proc.returncode == -signal.SIGKILL, "chunks": chunks, "killed_at": killed_at,
            "found": int(found.group(1)) if found else None, "seconds": seconds, "rss": rss,
            "same": output.read_bytes() == reference.read_bytes()}


def same_share(a: Path, b: Path) -> float:
    """The share of lines of ``a`` and ``b`` that are identical (NaN if the counts differ)."""
    x, y = (p.read_bytes().removesuffix(b"\n").split(b"\n") for p in (a, b))
    return sum(p == q for p, q in zip(x, y)) / max(len(x), 1) if len(x) == len(y) else float("nan")


def report(runs: list[list[Result]], notes: list[str]) -> list[str]:
    """The markdown table (medians over the rounds), the ratios and the notes."""
    rows = ["| engine | beam | lines | wall s | sent/s | loop sent/s | peak RSS MiB | = jaxformer "
            "| compile misses |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ratios = []
    for i, first in enumerate(runs[0]):
        same = [rnd[i] for rnd in runs]
        ours = [next(r for r in rnd if r.engine == "jaxformer" and r.beam == first.beam) for rnd in runs]
        agree = "—" if first.engine == "jaxformer" else f"{same_share(ours[-1].output, same[-1].output):.1%}"
        loops = [r.loop_rate for r in same if r.loop_rate]
        misses = "—" if first.misses is None else ", ".join(str(r.misses) for r in same)
        rows.append(f"| {first.engine} | {first.beam} | {first.lines:,} | "
                    f"{statistics.median(r.seconds for r in same):.1f} | "
                    f"{statistics.median(r.rate for r in same):,.1f} | "
                    f"{statistics.median(loops) if loops else float('nan'):,.1f} | "
                    f"{max(r.rss_mib for r in same):,.0f} | {agree} | {misses} |")
        if first.engine.startswith("CT2"):   # each early-stopping jaxformer against each CT2 setting
            for k, mine in enumerate(runs[0]):
                if mine.beam != first.beam or not mine.engine.startswith("jaxformer") or mine.engine == EXACT:
                    continue
                values = [rnd[k].rate / r.rate for rnd, r in zip(runs, same)]
                each = ", ".join(f"{v:.2f}" for v in values)
                target = TARGETS.get((first.engine, first.beam), "")
                ratios.append(f"- {mine.engine} / {first.engine}, beam {first.beam}: "
                              f"**{statistics.median(values):.2f}×** (rounds: {each}){target}")
    return rows + [""] + sorted(ratios, key=lambda line: "beam 4" not in line) + [f"- {n}" for n in notes]


def measure(args, spec: dict, chunk_lines: int) -> tuple[list[list[Result]], list[str]]:
    """Warm-up, the timed rounds, RSS at N/10 and N lines, resume; returns results and notes."""
    lines, small_lines = args.lines, max(1, args.lines // 10)
    source, small, big, warm = (args.out / name for name in ("input.en", "rss-tenth.en", "rss-all.en",
                                                             "warmup.en"))
    inputs = {"do": "inputs", "source": str(source), "lines": lines, "small": str(small), "big": str(big),
              "small_lines": small_lines, "warm": str(warm), **spec}
    warm_chunk = int(re.search(r"WARM_CHUNK (\d+)", in_child(inputs, args.out / "inputs.log")[2]).group(1))
    notes = []
    narrow = [args.matmul_dtype] if args.matmul_dtype != "none" else []
    for beam, early, dtype in ((1, True, None), (4, True, None), (4, False, None),
                               *((b, True, d) for d in narrow for b in (1, 4))):
        # Greedy: the warm-up file's batches take every shape. The staged beam search's
        # shapes depend on when sentences close, so its warm-up is the input itself.
        path, chunk = (warm, warm_chunk) if beam == 1 else (source, chunk_lines)
        run = jaxformer_run(args, path, args.out / f"warmup-beam{beam}.de", beam, chunk, 0, early, dtype)
        notes.append(f"warm-up, beam {beam}{'' if early else ', exact stop'}"
                     f"{f', {dtype} matmuls' if dtype else ''} (fills RUN/jax_cache; not in "
                     f"the table): {run.seconds:.1f} s wall, {run.misses} compile-cache misses")
        print(notes[-1], flush=True)
    # Both files start with the warm-up block, so both meet every batch shape: the RSS
    # difference is the file size's alone, not that of more compiled shapes.
    rss = [jaxformer_run(args, path, args.out / f"{path.stem}.de", 1, warm_chunk, n)
           for path, n in ((small, small_lines), (big, lines))]
    rounds = []
    for i in range(args.repeats):
        rnd = []
        for beam in (1, 4):
            first = len(rnd)
            rnd.append(jaxformer_run(args, source, args.out / f"jaxformer-beam{beam}.de", beam, chunk_lines,
                                     lines))
            if beam > 1:
                rnd.append(jaxformer_run(args, source, args.out / f"jaxformer-beam{beam}-exact.de", beam,
                                         chunk_lines, lines, early_stopping=False))
            rnd += [jaxformer_run(args, source, args.out / f"jaxformer-beam{beam}-{dtype}.de", beam,
                                  chunk_lines, lines, matmul_dtype=dtype) for dtype in narrow]
            rnd += [ct2_run(args, spec, quantization, beam, lines) for quantization in ("float32", "int8")]
            if beam > 1 and args.threads > 1:   # CT2's throughput setting: parallel batches
                rnd += [ct2_run(args, spec, quantization, beam, lines, translators=args.threads)
                        for quantization in ("float32", "int8")]
            for r in rnd[first:]:
                print(f"round {i + 1}: {r.engine} beam {beam}: {r.rate:,.1f} sent/s", flush=True)
        rounds.append(rnd)
    greedy = [rnd[0] for rnd in rounds]
    notes.append(f"RSS flat in file size, jaxformer greedy, --chunk-lines {warm_chunk:,}, each file led by "
                 f"the warm-up block (every batch shape): + {small_lines:,} lines {rss[0].rss_mib:,.0f} MiB, "
                 f"+ {lines:,} lines {rss[1].rss_mib:,.0f} MiB ({rss[1].rss_mib / rss[0].rss_mib:.2f}×)")
    res = resume(args, source, greedy[-1].output, chunk_lines, lines)
    whole = statistics.median(r.seconds for r in greedy)
    notes.append(f"resume: greedy run SIGKILLed{'' if res['killed'] else ' (NOT: it finished first)'} with "
                 f"{res['killed_at']} of {res['chunks']} chunks written; the same command again found "
                 f"{res['found']} and took {res['seconds']:.1f} s = **{res['seconds'] / whole:.0%}** of the "
                 f"uninterrupted run's {whole:.1f} s (peak RSS {res['rss']:,.0f} MiB); output "
                 f"{'identical byte for byte' if res['same'] else '**DIFFERENT**'} to the uninterrupted one")
    return rounds, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--workdir", help="a trained post-norm run directory")
    add("--lines", type=int, default=100_000, help="input lines N (default 100000)")
    add("--batch-size", type=int, default=32, help="B, both engines (default 32)")
    add("--chunk-lines", type=int, help="jaxformer's --chunk-lines (default N/10: 10 chunks)")
    add("--repeats", type=int, default=2, help="timed rounds (default 2)")
    add("--repetition-penalty", type=float, default=1.0, help="both engines (default 1 = off)")
    add("--threads", type=int, default=usable_cores(), help="CT2 intra_threads (default: usable cores)")
    add("--out", type=Path, help="scratch folder (default: a new one in /tmp, removed at the end)")
    add("--write", metavar="MARKDOWN", help="put the table between the markers in this file")
    add("--matmul-dtype", choices=("bfloat16", "float16", "none"), default="bfloat16",
        help="also time jaxformer with --matmul-dtype this (default bfloat16; none: only float32)")
    add("--quick", action="store_true", help="2,000 lines, one round: to check that it runs")
    add("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if not args.workdir or not (Path(args.workdir) / "config.json").exists():
        parser.error("--workdir must be a trained run directory (with config.json)")
    if args.quick:
        args.lines, args.repeats = 2_000, 1
    chunk_lines = args.chunk_lines or max(1, args.lines // 10)
    scratch = args.out is None
    args.out = Path(tempfile.mkdtemp(prefix="bulk_translate_")) if scratch else args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.workdir = str(Path(args.workdir).resolve())
    try:
        gflops = [matmul_gflops(args.out)]
        print(f"matmul f32 2048³: {gflops[0]:.0f} GFLOP/s at start; {usable_cores()} cores; "
              f"scratch {args.out}", flush=True)
        spec = export(args)
        rounds, notes = measure(args, spec, chunk_lines)
        gflops.append(matmul_gflops(args.out))
        notes.append(f"float32 2048³ matmul: {gflops[0]:.0f} GFLOP/s at start, {gflops[1]:.0f} at end; "
                     f"{usable_cores()} cores; batch {args.batch_size}, --chunk-lines {chunk_lines:,}, "
                     f"repetition penalty {args.repetition_penalty}, CT2 max_decoding_length "
                     f"{spec['max_decoding_length']}, intra_threads {args.threads}")
        table = report(rounds, notes)   # reads the outputs: before the scratch folder goes
    finally:
        if scratch:
            shutil.rmtree(args.out, ignore_errors=True)
    command = " ".join(["python", "benchmarks/bulk_translate.py", *sys.argv[1:]])
    lines = [f"`{command}` ({datetime.date.today()}, run `{Path(args.workdir).name}`):", ""] + table
    publish(lines, args.write, MARKERS)


if __name__ == "__main__":
    main()
