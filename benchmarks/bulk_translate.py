"""Serving through CTranslate2: the whole ``jaxformer-translate --engine ct2`` command against a
bare loop over ``ctranslate2.Translator.translate_batch``, and against our JAX engine.

    python train.py --workdir runs/en-de                                   # the default run
    python benchmarks/bulk_translate.py --workdir runs/en-de --write benchmarks/README.md
    python benchmarks/bulk_translate.py --workdir RUN --lines 1000 --jax-lines 200   # a check

Each measurement is a fresh process, one at a time; run it alone on the machine.

1. Input: the shipped en-de English sources repeated up to ``--lines`` lines, round r ≥ 1
   with `` (r)`` appended, so that every line differs.
2. Models: one untimed ``jaxformer-translate --engine ct2 --quantization Q`` per type
   converts the run's checkpoint into ``RUN/ct2/`` (float32 and int8).
3. Timed, in turns for each type: the whole command, ``jaxformer-translate --input
   --output --engine ct2 --quantization Q`` (start-up, read, tokenize, translate,
   detokenize, write; its default thread layout, one translator per core), and "bare":
   a process that loads the same model directory with the same layout, then times only a
   loop over ``translate_batch`` on input tokenized beforehand (not timed), in the
   command's batches (sorted by length, ``--batch-size`` 32, each with its longest source's
   limit) with the same options. Beam 4 and the command's defaults on both (the run's α;
   no repetition penalty, docs/translation.md).
4. The JAX engine (float32) on the first ``--jax-lines`` lines, with CTranslate2's rules
   (``--length-normalization hf --early-stopping``), after one untimed run on the same file
   (compiles into ``RUN/jax_cache``).
5. The run's test split (``RUN/test.src``, ``test.ref``, written by train.py) through each
   engine at its defaults, BLEU by sacrebleu.
6. One sentence from a warm cache, the whole command (``--engine ct2``), median of 5.

Columns: wall seconds of the process; sentences/s = lines / wall (for "bare", its loop
alone); peak RSS (``wait4``, the child alone). The float32 2048³ matmul rate is printed
at start and end (in a child; this script imports no JAX).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import publish

REPO = Path(__file__).resolve().parents[1]
MARKERS = ("<!-- bulk_translate: begin -->", "<!-- bulk_translate: end -->")


def measured(cmd: list[str], log: Path) -> tuple[float, float, str]:
    """Runs ``cmd`` in a fresh process: wall seconds, peak RSS (MiB, ``wait4``) and its output."""
    path = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "PYTHONPATH": path}
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds, text = time.perf_counter() - start, log.read_text(errors="replace")
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"failed: {' '.join(cmd)}\n{text[-3000:]}")
    return seconds, usage.ru_maxrss / 1024, text


def translate(args, *flags: str, log: Path) -> tuple[float, float, str]:
    return measured([sys.executable, "-m", "jaxformer.translate", "--workdir", args.workdir, *flags], log)


def child(spec: dict) -> None:
    """Work done in child processes: the matmul rate, the input file, the bare CT2 loop."""
    if spec["do"] == "matmul":
        from _common import matmul_flops_per_s

        print(f"GFLOPS {matmul_flops_per_s(2048, 5) / 1e9:.1f}")
    elif spec["do"] == "input":
        from jaxformer.data import corpus

        pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
        with open(spec["path"], "w", encoding="utf-8", newline="\n") as f:
            for i in range(spec["lines"]):
                r, k = divmod(i, len(pairs))
                f.write(f"{pairs[k][0]} ({r})\n" if r else f"{pairs[k][0]}\n")
    else:
        bare_loop(spec)


def bare_loop(spec: dict) -> None:
    """``translate_batch`` over pre-tokenized batches (the command's grouping and limits)."""
    import ctranslate2

    from jaxformer.serve.ct2_engine import CT2Engine, CT2Search

    engine = CT2Engine(spec["workdir"], quantization=spec["quantization"], throughput=True)
    lines = Path(spec["input"]).read_text(encoding="utf-8").split("\n")[:-1]
    ids = [s[: engine.config.max_len] for s in engine.tokenizer.encode_source(lines)]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    batches = [[engine.tokenizer.source_pieces(ids[i]) for i in order[s: s + 32]]
               for s in range(0, len(ids), 32)]
    limits = [engine.max_decode_len(len(batch[-1])) - 1 for batch in batches]
    _, suppress = engine.generation_rules(engine.tokenizer)
    d = engine.defaults
    # the command's CT2 settings: the run's α and n-gram rule; no repetition penalty unless given
    options = CT2Search(4, d["alpha"], 1.0, d["no_repeat_ngram_size"]).options()
    inter, intra = engine.threads
    translator = ctranslate2.Translator(str(engine.model_dir), device="cpu", inter_threads=inter,
                                        intra_threads=intra)
    start = time.perf_counter()
    pending = [translator.translate_batch(batch, asynchronous=True, max_decoding_length=limit,
                                          suppress_sequences=suppress, **options)
               for batch, limit in zip(batches, limits)]
    done = sum(len(r.result().hypotheses[0]) >= 0 for results in pending for r in results)
    print(f"LOOP {done} {time.perf_counter() - start:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", help="the run to serve (required)")
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--jax-lines", type=int, default=10_000)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "jaxformer-bulk-translate")
    parser.add_argument("--write", help="put the table into this README between its markers")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if not args.workdir:
        parser.error("give --workdir RUN")
    out, run = args.out, Path(args.workdir)
    out.mkdir(parents=True, exist_ok=True)
    me = [sys.executable, __file__, "--child"]
    gflops = [float(measured([*me, '{"do": "matmul"}'], out / "matmul.log")[2].split()[-1])]
    source = out / "input.en"
    measured([*me, json.dumps({"do": "input", "path": str(source), "lines": args.lines})], out / "input.log")
    rows, ratios = [], []
    for q in ("float32", "int8"):
        translate(args, "--engine", "ct2", "--quantization", q, "warm", log=out / f"convert-{q}.log")
        output = out / f"ct2-{q}.de"
        output.unlink(missing_ok=True)
        seconds, rss, text = translate(args, "--engine", "ct2", "--quantization", q, "--input", str(source),
                                       "--output", str(output), "--chunk-lines", str(args.lines),
                                       log=out / f"ct2-{q}.log")
        spec = {"do": "bare", "workdir": args.workdir, "quantization": q, "input": str(source)}
        _, bare_rss, bare = measured([*me, json.dumps(spec)], out / f"bare-{q}.log")
        n, loop_s = bare.split("LOOP ")[1].split()[:2]
        command_rate, bare_rate = args.lines / seconds, int(n) / float(loop_s)
        rows += [f"| `jaxformer-translate --engine ct2 --quantization {q}` | {args.lines:,} | "
                 f"{seconds:.1f} | {command_rate:,.1f} | {rss:.0f} |",
                 f"| bare `translate_batch` loop, {q} | {int(n):,} | {float(loop_s):.1f} (loop) | "
                 f"{bare_rate:,.1f} | {bare_rss:.0f} |"]
        ratios.append((q, command_rate / bare_rate, command_rate))
    jax_in = out / "input-jax.en"
    jax_in.write_text("".join(source.read_text(encoding="utf-8").splitlines(True)[: args.jax_lines]))
    jax_flags = ["--engine", "jax", "--length-normalization", "hf", "--early-stopping", "--beam-size", "4",
                 "--input", str(jax_in), "--chunk-lines", str(args.jax_lines)]
    for attempt in ("warm", "timed"):
        (out / "jax.de").unlink(missing_ok=True)
        seconds, rss, _ = translate(args, *jax_flags, "--output", str(out / "jax.de"),
                                    log=out / f"jax-{attempt}.log")
    jax_rate = args.jax_lines / seconds
    rows.append(f"| `jaxformer-translate --engine jax` (float32, CT2's rules) | {args.jax_lines:,} | "
                f"{seconds:.1f} | {jax_rate:,.1f} | {rss:.0f} |")
    bleu = {}
    import sacrebleu

    refs = (run / "test.ref").read_text(encoding="utf-8").splitlines()
    for name, flags in (("jax", ["--engine", "jax"]), ("ct2 float32", ["--engine", "ct2"]),
                        ("ct2 int8", ["--engine", "ct2", "--quantization", "int8"])):
        hyp = out / f"test-{name.replace(' ', '-')}.de"
        hyp.unlink(missing_ok=True)
        translate(args, *flags, "--input", str(run / "test.src"), "--output", str(hyp), log=out / "test.log")
        bleu[name] = sacrebleu.corpus_bleu(hyp.read_text(encoding="utf-8").splitlines(), [refs]).score
    single = []
    for _ in range(5):
        seconds, rss, _ = translate(args, "--engine", "ct2", "Choose Format - Cells.", log=out / "one.log")
        single.append(seconds)
    gflops.append(float(measured([*me, '{"do": "matmul"}'], out / "matmul.log")[2].split()[-1]))
    command = " ".join(["python benchmarks/bulk_translate.py", "--workdir", args.workdir, "--lines",
                        str(args.lines), "--jax-lines", str(args.jax_lines)])
    lines = [f"`{command}` ({datetime.date.today()}, run `{run.name}`, {os.cpu_count()} cores, float32 "
             f"2048³ matmul {gflops[0]:.0f} GFLOP/s at start, {gflops[1]:.0f} at end; beam 4):", "",
             "| what | lines | wall s | sentences/s | peak RSS MiB |", "|---|---|---|---|---|", *rows, ""]
    lines += [f"- whole command / bare loop, {q}: **{r:.2f}×** [target ≥ 0.95×]" for q, r, _ in ratios]
    lines += [f"- CT2 {q} command / JAX engine: **{rate / jax_rate:.1f}×** [target ≥ 2×]"
              for q, _, rate in ratios]
    lines += [f"- test BLEU at each engine's defaults ({len(refs)} sentences): "
              + ", ".join(f"{k} {v:.2f}" for k, v in bleu.items())
              + f"; int8 − float32 {bleu['ct2 int8'] - bleu['ct2 float32']:+.2f} [target within 0.5]",
              f"- one sentence, warm cache, the whole command: median {statistics.median(single):.2f} s of 5 "
              f"({', '.join(f'{s:.2f}' for s in single)}) [target ≤ 1.5 s]"]
    publish(lines, args.write, MARKERS)


if __name__ == "__main__":
    main()
