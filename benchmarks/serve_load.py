"""Load on ``jaxformer-serve`` (issue 52): closed-loop clients sending one-sentence requests, our
service against a bare CTranslate2 ``translate_batch`` and against LibreTranslate serving the
same model as our Argos package.

    python benchmarks/serve_load.py --workdir runs/en-de --write benchmarks/README.md
    python benchmarks/serve_load.py --workdir runs/en-de --lt-venv VENVS/lt --write benchmarks/README.md
    python benchmarks/serve_load.py --workdir RUN:en-de --duration 3 --clients 1 8   # a quick check
    python benchmarks/serve_load.py --workdir runs/en-de --clients 64 --duration 600 --quantization int8

Run it alone on the machine: the clients share its cores with the server.

1. Sentences: the run's test sources (``RUN/test.src``, written by train.py), else the shipped
   en-de English sources; the first ``--sentences`` distinct ones. The clients take them in
   turn from one shared cursor, so no sentence comes twice in a row (LibreTranslate answers a
   repeat of the last request from its cache).
2. Ours: ``python -m jaxformer.serve --workdir RUN --engine ct2 --quantization Q`` (the model
   converted beforehand by one untimed ``jaxformer-translate --engine ct2``; its defaults:
   one translator per core, one thread each; the run's beam; one fixed output limit), ready
   by ``/health``. LibreTranslate (``--lt-venv``, its venv set up as docs/argos.md says): our
   package (``jaxformer-convert --to-argos``) installed in a scratch HOME, served offline at its
   defaults (waitress 4 threads, one translator of CTranslate2's default threads) and at its
   best layout (one one-thread translator per core, ``LT_THREADS`` 8), beam
   ``ARGOS_BEAM_SIZE`` = the run's; helpers from benchmarks/argos_libretranslate.py.
3. For each client count: ``--warmup`` seconds unmeasured, then ``--duration`` seconds of
   closed-loop clients (asyncio in this one process, a keep-alive HTTP/1.1 connection each):
   sentences/s (answered requests / seconds), p50/p95/p99 latency, errors (a status other than
   200 or a transport error), the server's RSS and peak RSS (``/proc``) at the start and the end
   of the level, and the CPU seconds this load generator used.
4. Bare: a fresh process loads the same CTranslate2 model with the same thread layout and times
   one ``translate_batch`` over all the sentences (tokenized beforehand), ``max_batch_size`` 32
   (CTranslate2 sorts them by length and runs the sub-batches on its translators), with the
   engine's options and the service's output limit: the throughput limit of this model here.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import publish, usable_cores

REPO = Path(__file__).resolve().parents[1]
MARKERS = ("<!-- serve_load: begin -->", "<!-- serve_load: end -->")


def _env() -> dict[str, str]:
    paths = (str(REPO), os.environ.get("PYTHONPATH"))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}


def sentences_of(run: Path, count: int) -> list[str]:
    """The first ``count`` distinct lines of the run's test sources, else of the shipped corpus."""
    if (run / "test.src").is_file():
        lines = (run / "test.src").read_text(encoding="utf-8").splitlines()
    else:
        from jaxformer.data import corpus

        lines = [source for source, _ in corpus.read_tsv(corpus.builtin_corpus_path("en-de"))[0]]
    return list(dict.fromkeys(line.strip() for line in lines if line.strip()))[:count]


def memory(pid: int) -> tuple[float, float]:
    """``(RSS, peak RSS)`` of process ``pid`` in MiB (Linux ``/proc``)."""
    status = Path(f"/proc/{pid}/status").read_text()
    kib = {key: int(value.split()[0]) for key, value in re.findall(r"^(VmRSS|VmHWM):\s+(.*)$", status, re.M)}
    return kib["VmRSS"] / 1024, kib["VmHWM"] / 1024


class Connection:
    """One keep-alive HTTP/1.1 connection posting JSON: the lightest client there is, so the load
    generator takes little of the cores it shares with the server (httpx's pool took ~6 ms of CPU
    a request at 64 connections here, more than the server)."""

    def __init__(self, url: str):
        self.host, port = url.removeprefix("http://").split(":")
        self.port, self.reader, self.writer = int(port), None, None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        self.writer.write(head % (path.encode(), self.host.encode(), len(body)) + body)
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        status = int(head.split(" ", 2)[1])
        if "transfer-encoding: chunked" in head:
            data = b""
            while size := int((await self.reader.readline()).strip(), 16):
                data += (await self.reader.readexactly(size + 2))[:-2]   # a chunk and its line end
            await self.reader.readline()
        else:
            data = await self.reader.readexactly(int(re.search(r"content-length: *(\d+)", head).group(1)))
        if "connection: close" in head:
            await self.close()
        return status, data

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None


async def closed_loop(url: str, sentences: list[str], clients: int, seconds: float, pair: tuple[str, str],
                      cursor: list[int]) -> dict:
    """``clients`` clients, each sending its next sentence as soon as its last one is answered,
    for ``seconds``: ``{"done", "errors", "latencies"}`` (errors by kind, latencies in seconds)."""
    done, errors, latencies = 0, {}, []
    stop = time.perf_counter() + seconds

    async def one_client():
        nonlocal done, errors
        connection = Connection(url)
        while time.perf_counter() < stop:
            sentence = sentences[cursor[0] % len(sentences)]
            cursor[0] += 1
            body = json.dumps({"q": sentence, "source": pair[0], "target": pair[1]}).encode()
            started = time.perf_counter()
            try:
                status, data = await connection.post("/translate", body)
                ok = status == 200 and isinstance(json.loads(data).get("translatedText"), str)
                kind = f"HTTP {status}"
            except (OSError, ValueError, asyncio.IncompleteReadError) as e:
                ok, kind = False, type(e).__name__
                await connection.close()
            if ok:
                done += 1
                latencies.append(time.perf_counter() - started)
            else:
                errors[kind] = errors.get(kind, 0) + 1
        await connection.close()

    await asyncio.gather(*(one_client() for _ in range(clients)))
    return {"done": done, "errors": errors, "latencies": latencies}


def _quantile(latencies: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``latencies``, in milliseconds (NaN for none)."""
    return 1000 * latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")


def load_levels(name: str, url: str, pid: int, args, sentences: list[str],
                pair: tuple[str, str]) -> list[dict]:
    """Every client count of ``args.clients`` against ``url``: one row each."""
    rows, cursor = [], [0]
    for clients in args.clients:
        if args.warmup:
            asyncio.run(closed_loop(url, sentences, clients, args.warmup, pair, cursor))
        rss_start = memory(pid)
        cpu = resource.getrusage(resource.RUSAGE_SELF)
        started = time.perf_counter()
        result = asyncio.run(closed_loop(url, sentences, clients, args.duration, pair, cursor))
        seconds = time.perf_counter() - started
        used = resource.getrusage(resource.RUSAGE_SELF)
        latencies = sorted(result["latencies"])
        rss_end = memory(pid)
        row = {"server": name, "clients": clients, "seconds": round(seconds, 1), "done": result["done"],
               "errors": sum(result["errors"].values()), "error_kinds": result["errors"],
               "sentences_per_s": result["done"] / seconds,
               "p50_ms": _quantile(latencies, 0.50), "p95_ms": _quantile(latencies, 0.95),
               "p99_ms": _quantile(latencies, 0.99), "rss_start_mib": rss_start[0], "rss_end_mib": rss_end[0],
               "peak_rss_start_mib": rss_start[1], "peak_rss_end_mib": rss_end[1],
               "client_cpu_s": used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


class Process:
    """A server process until stopped (SIGTERM), its output in ``log``; ready once ``url + ready``
    answers 200."""

    def __init__(self, command: list[str], log: Path, url: str, ready: str, env: dict[str, str],
                 timeout: float = 900):
        self.log = log
        self.proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                                     cwd=REPO)
        import httpx

        deadline = time.perf_counter() + timeout
        while True:
            if self.proc.poll() is not None or time.perf_counter() > deadline:
                self.stop()
                raise RuntimeError(f"{command[:3]} did not start:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}{ready}", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def ours(args, q: str, sentences: list[str], pair: tuple[str, str], out: Path) -> list[dict]:
    # the model converted beforehand (JAX, once per checkpoint): the server's RSS is serving's alone
    subprocess.run([sys.executable, "-m", "jaxformer.cli.translate", "--workdir", run_path(args), "--engine",
                    "ct2", "--quantization", q, "convert"], check=True, env=_env(), cwd=REPO,
                   capture_output=True)
    url = f"http://127.0.0.1:{args.port}"
    server = Process([sys.executable, "-m", "jaxformer.serve", "--workdir", args.workdir, "--engine", "ct2",
                      "--quantization", q, "--port", str(args.port), "--max-queue", "100000",
                      *args.serve_flags.split()],
                     out / f"serve-{q}.log", url, "/health", _env())
    try:
        return load_levels(f"jaxformer-serve, {q}", url, server.proc.pid, args, sentences, pair)
    finally:
        server.stop()


def libretranslate(args, q: str, sentences: list[str], pair: tuple[str, str], out: Path,
                   beam: int) -> list[dict]:
    """LibreTranslate serving our package at its defaults and at its best layout."""
    # the argos benchmark's helpers (benchmarks/argos_libretranslate.py)
    from argos_libretranslate import start_libretranslate, venv_env

    package, index = out / "package.argosmodel", out / "index"
    if not package.exists():
        codes = [] if ":" not in args.workdir else ["--from-code", pair[0], "--to-code", pair[1]]
        subprocess.run([sys.executable, "-m", "jaxformer.cli.convert", "--to-argos", run_path(args), "--out",
                        str(package), *codes], check=True, env=_env(), cwd=REPO)
    index.mkdir(exist_ok=True)
    (index / "index.json").write_text("[]")
    rows = []
    cores = usable_cores()
    layouts = {"defaults": {}, f"{cores} translators × 1 thread, LT_THREADS 8": {
        "ARGOS_INTER_THREADS": str(cores), "ARGOS_INTRA_THREADS": "1", "LT_THREADS": "8"}}
    for layout, settings in layouts.items():
        env = venv_env(out / f"lt-home-{q}", index, ARGOS_BEAM_SIZE=str(beam), ARGOS_COMPUTE_TYPE=q,
                       **settings)
        install = "import sys, argostranslate.package as p; p.install_from_path(sys.argv[1])"
        subprocess.run([str(args.lt_venv / "bin" / "python"), "-c", install, str(package)], env=env,
                       check=True, capture_output=True)
        process, _ = start_libretranslate(args.lt_venv, env, pair, args.port, out / f"lt-{q}.log")
        try:
            rows += load_levels(f"LibreTranslate ({layout}), {q}", f"http://127.0.0.1:{args.port}",
                                process.pid, args, sentences, pair)
        finally:
            process.terminate()
            process.wait(timeout=120)
    return rows


def run_path(args) -> str:
    path, colon, pair = args.workdir.rpartition(":")
    return path if colon and not Path(args.workdir).exists() else args.workdir


def bare(args, q: str, sentences: list[str], out: Path) -> dict:
    """The bare ``translate_batch`` rate (a fresh process, point 4)."""
    spec = {"workdir": run_path(args), "quantization": q, "sentences": sentences}
    (out / "bare.json").write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, __file__, "--child", str(out / "bare.json")], capture_output=True,
                          text=True, env=_env(), cwd=REPO, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def bare_child(spec: dict) -> None:
    import ctranslate2

    from jaxformer.decode.engine import Request
    from jaxformer.decode.served_run import ServedRun
    from jaxformer.serve.ct2_engine import CT2Engine, CT2Search

    run = ServedRun.load(spec["workdir"])
    limit = run.max_len_b if run.max_len_a == 0 else run.config.max_len   # the service's default
    engine = CT2Engine(ServedRun.load(spec["workdir"], max_len_a=0, max_len_b=limit),
                       quantization=spec["quantization"], throughput=True)
    tokenizer = engine.tokenizer
    ids = [s[: engine.config.max_len] for s in tokenizer.encode_source(spec["sentences"])]
    pieces = [tokenizer.source_pieces(s) for s in ids]
    search = CT2Search.of(Request(), engine.defaults)
    prefix, suppress = engine.generation_rules(tokenizer)
    hf, forced = engine.defaults["length_normalization"] == "hf", engine.run.forced_eos
    eos_at_limit = int((search.beam_size > 1 or hf) if forced is None else forced)   # as the engine's call
    inter, intra = engine.threads
    translator = ctranslate2.Translator(str(engine.model_dir), device="cpu", inter_threads=inter,
                                        intra_threads=intra)
    options = dict(max_batch_size=32, batch_type="examples", suppress_sequences=suppress,
                   max_decoding_length=engine.max_decode_len(1) - eos_at_limit, **search.options())
    translator.translate_batch(pieces[:64], None if prefix is None else [prefix] * 64, **options)   # warm
    started = time.perf_counter()
    translator.translate_batch(pieces, None if prefix is None else [prefix] * len(pieces), **options)
    seconds = time.perf_counter() - started
    print(json.dumps({"sentences": len(pieces), "seconds": seconds, "sentences_per_s": len(pieces) / seconds,
                      "layout": f"{inter} × {intra}", "beam": search.beam_size}))


def table(args, rows: list[dict], bares: dict[str, dict], sentences: int) -> list[str]:
    cores = usable_cores()
    command = f"python benchmarks/serve_load.py --workdir {args.workdir} --duration {args.duration:g}"
    command += f" --serve-flags '{args.serve_flags}'" if args.serve_flags else ""
    lines = [f"`{command}` "
             f"({datetime.date.today()}, {cores} cores, {sentences} distinct one-sentence requests, "
             f"load generator: one asyncio process, a keep-alive connection per client):", "",
             "| server | clients | sentences/s | p50 ms | p95 ms | p99 ms | errors | RSS MiB start→end "
             "| peak RSS MiB start→end | client CPU s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['server']} | {r['clients']} | {r['sentences_per_s']:.1f} | {r['p50_ms']:.0f} | "
                     f"{r['p95_ms']:.0f} | {r['p99_ms']:.0f} | {r['errors']} | {r['rss_start_mib']:.0f}→"
                     f"{r['rss_end_mib']:.0f} | {r['peak_rss_start_mib']:.0f}→{r['peak_rss_end_mib']:.0f} | "
                     f"{r['client_cpu_s']:.1f} |")
    for q, b in bares.items():
        lines.append(f"| bare `translate_batch`, {q}, one call ({b['layout']}, beam {b['beam']}) | – | "
                     f"{b['sentences_per_s']:.1f} | | | | | | | |")
    lines.append("")
    for q, b in bares.items():
        mine = {r["clients"]: r for r in rows if r["server"] == f"jaxformer-serve, {q}"}
        most = max(mine)
        rate = mine[most]["sentences_per_s"]
        lines.append(f"- {q}: ours at {most} clients / bare: **{rate / b['sentences_per_s']:.2f}×** "
                     f"[target ≥ 0.8×]")
        theirs = [r for r in rows if r["server"].startswith("LibreTranslate") and r["server"].endswith(q)]
        for r in theirs:
            if r["clients"] == most:
                lines.append(f"- {q}: ours / {r['server']} at {most} clients: "
                             f"**{rate / r['sentences_per_s']:.2f}×**")
            if r["clients"] == 8 and 8 in mine:
                lines.append(f"- {q}: p99 at 8 clients, ours {mine[8]['p99_ms']:.0f} ms, {r['server']} "
                             f"{r['p99_ms']:.0f} ms")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", help="the run to serve, or RUN:SRC-TGT for one that records no pair")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds per client count")
    parser.add_argument("--warmup", type=float, default=5.0, help="unmeasured seconds before each")
    parser.add_argument("--quantization", nargs="+", default=["float32", "int8"])
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--port", type=int, default=5077)
    parser.add_argument("--lt-venv", type=Path, help="LibreTranslate's venv: measure it too")
    parser.add_argument("--serve-flags", default="", help="more jaxformer-serve flags ('--batch-wait-ms 2')")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "jaxformer-serve-load")
    parser.add_argument("--write", help="put the table into this README between its markers")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return bare_child(json.loads(Path(args.child).read_text()))
    if not args.workdir:
        parser.error("give --workdir RUN")
    args.out.mkdir(parents=True, exist_ok=True)
    from jaxformer.decode.served_run import ServedRun
    from jaxformer.serve.languages import lt_codes, parse_pair

    run = ServedRun.load(run_path(args))
    sources, targets = run.languages
    pair = parse_pair(args.workdir.rpartition(":")[2]) if run_path(args) != args.workdir else \
        tuple(lt_codes([sources[0], targets[0]]).values())
    sentences = sentences_of(run.root, args.sentences)
    rows, bares = [], {}
    for q in args.quantization:
        rows += ours(args, q, sentences, pair, args.out)
        bares[q] = bare(args, q, sentences, args.out)
        print(json.dumps(bares[q]), flush=True)
        if args.lt_venv:
            rows += libretranslate(args, q, sentences, pair, args.out, int(run.defaults["beam_size"]))
    (args.out / "results.json").write_text(json.dumps({"rows": rows, "bare": bares}, indent=1))
    publish(table(args, rows, bares, len(sentences)), args.write, MARKERS)


if __name__ == "__main__":
    main()
