"""A run's Argos Translate package in the real argostranslate and LibreTranslate, each in its own
virtual environment, against ``jaxformer-translate --engine ct2`` under the settings
argostranslate decodes with (docs/argos.md):

    python benchmarks/argos_libretranslate.py --workdir runs/en-de \\
        --argos-venv VENVS/argos --lt-venv VENVS/lt [--sentences 200] [--json OUT.json]

Steps: ``jaxformer-convert --to-argos`` writes the package (float32); the first ``--sentences``
lines of the run's test sources (``RUN/test.src``, or ``--input``) are translated by

- ours: ``python -m jaxformer.cli.translate --engine ct2 --beam-size 4 --alpha 0.2
  --length-normalization hf --early-stopping --repetition-penalty 1 --no-repeat-ngram-size 0
  --max-len-a 0 --max-len-b 256`` (the run's own defaults may differ), float32 and int8;
- argostranslate (``--argos-venv``): ``package.install_from_path`` then ``translate.translate``
  per line, with ``ARGOS_COMPUTE_TYPE=float32`` and at its default ``auto`` (which CTranslate2
  resolves to int8_float32 on a CPU with int8 support, so it is compared with our int8);
- LibreTranslate (``--lt-venv``): its server on 127.0.0.1 with the package installed in its own
  data folder, ``POST /translate`` per line, compared with our float32 output passed through
  LibreTranslate's own formatting (``improve_translation_formatting``, called in its venv);
  ``GET /languages``, a list ``q`` with alternatives, a form request and the libretranslatepy
  client are recorded.

Each line that differs is explained only where the explanation reproduces argostranslate's
text from ours: the package's spaCy splitter made several sentences of it (argostranslate
translates them apart and joins them with a space: we translate the same sentences and join
them), our output holds ``_`` (argostranslate's decode writes a space) or ``⁇`` (argostranslate
puts the source piece it attends to most in place of ``<unk>``: matched as any one word). A
source over the model's ``max_len`` or an output at it (our limit; argostranslate reads 1024 and
writes 256 tokens) is named, not reproduced; anything else is "unexplained".

Offline throughout: ``HOME`` is a scratch folder, ``ARGOS_CHUNK_TYPE=SPACY``,
``ARGOS_PACKAGE_INDEX`` a local empty index. The venvs are set up as docs/argos.md says.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "argos_worker.py"
ARGOS_RULES = ["--beam-size", "4", "--alpha", "0.2", "--length-normalization", "hf", "--early-stopping",
               "--repetition-penalty", "1", "--no-repeat-ngram-size", "0", "--max-len-a", "0",
               "--max-len-b", "256"]


def venv_env(home: Path, index: Path, **settings: str) -> dict[str, str]:
    """The environment of a venv's process: our variables (PYTHONPATH, ARGOS_*, XDG_*) left out,
    its own HOME, spaCy splitting, a local package index, ``settings`` on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ARGOS_", "XDG_", "PYTHON", "LT_"))}
    home.mkdir(parents=True, exist_ok=True)
    return {**env, "HOME": str(home), "ARGOS_CHUNK_TYPE": "SPACY",
            "ARGOS_PACKAGE_INDEX": index.as_uri() + "/", **settings}


def worker(venv: Path, request: dict, env: dict[str, str], scratch: Path) -> dict:
    """``request`` answered by benchmarks/argos_worker.py under ``venv``'s Python."""
    answer = scratch / f"answer-{time.monotonic_ns()}.json"
    done = subprocess.run([str(venv / "bin" / "python"), str(WORKER), str(answer)], input=json.dumps(request),
                          text=True, env=env, capture_output=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"{venv} worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(answer.read_text(encoding="utf-8"))


def ours(workdir: Path, lines: list[str], quantization: str, checkpoint: str, scratch: Path) -> list[str]:
    """``jaxformer-translate --engine ct2`` of ``lines`` under argostranslate's rules."""
    source = scratch / f"ours-{time.monotonic_ns()}.txt"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "jaxformer.cli.translate", "--workdir", str(workdir),
                           "--engine", "ct2", "--quantization", quantization, "--checkpoint", checkpoint,
                           *ARGOS_RULES,
                           "--input", str(source)], capture_output=True, text=True, env=env, check=True)
    return done.stdout.splitlines()


def predicted(mine: list[str], sentences: list[list[str]], mine_sentences: list[str]) -> list[str]:
    """argostranslate's text as ours predicts it: a line spaCy split is our translations of its
    sentences joined by a space (their pieces decoded together), ``_`` a space, no leading space
    (argostranslate's tokenizer.py and translate.py)."""
    parts, out = iter(mine_sentences), []
    for text, split in zip(mine, sentences):
        text = " ".join(next(parts) for _ in split) if len(split) > 1 else text
        text = text.replace("_", " ")
        out.append(text[1:] if text.startswith(" ") else text)
    return out


def unknown_replaced(expected: str, theirs: str) -> bool:
    """Whether ``theirs`` is ``expected`` with each ``⁇`` (our ``<unk>``) one word."""
    parts = re.split(r"\s*⁇\s*", expected)
    return len(parts) > 1 and re.fullmatch(r"\s*\S+\s*".join(map(re.escape, parts)), theirs) is not None


def compare(name: str, lines: list[str], theirs: list[str], mine: list[str], expected: list[str],
            sentences: list[list[str]], limits) -> dict:
    """Counts the lines equal to ``mine``, and explains each that differs (the module's docstring)."""
    differ = []
    for i, (source, a, b, e) in enumerate(zip(lines, theirs, mine, expected)):
        if a == b:
            continue
        if a == e or unknown_replaced(e, a):
            reasons = (("split into sentences", len(sentences[i]) > 1), ("_ as space", "_" in b),
                       ("unknown piece", "⁇" in e))
            why = [reason for reason, holds in reasons if holds]
        else:
            why = ["at max_len (not reproduced)"] if limits(source, b) else ["unexplained"]
        differ.append({"line": i, "source": source, "theirs": a, "ours": b, "why": why})
    return {"name": name, "lines": len(lines), "equal": len(lines) - len(differ), "differ": differ,
            "unexplained": sum(d["why"] == ["unexplained"] for d in differ)}


def http(url: str, data: dict | None = None, form: bool = False) -> tuple[int, object]:
    """(status, JSON body) of a GET (``data`` None) or POST (JSON, or ``form``-encoded)."""
    body, headers = None, {}
    if data is not None:
        body = (urllib.parse.urlencode(data) if form else json.dumps(data)).encode()
        headers["Content-Type"] = "application/x-www-form-urlencoded" if form else "application/json"
    request = urllib.request.Request(url, body, headers, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def start_libretranslate(venv: Path, env: dict[str, str], codes: tuple[str, str], port: int,
                         log: Path, timeout: float = 600) -> tuple[subprocess.Popen, float]:
    """LibreTranslate on 127.0.0.1:``port`` loading only ``codes``; waits until ``/languages``
    answers from it (another server on the port is an error). Returns the process and the
    seconds it took to start."""
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"port {port} already answers on 127.0.0.1: choose another --port")
    start = time.perf_counter()
    process = subprocess.Popen([str(venv / "bin" / "libretranslate"), "--host", "127.0.0.1", "--port",
                                str(port), "--load-only", ",".join(codes)], env=env,
                               stdout=log.open("w"), stderr=subprocess.STDOUT)
    while time.perf_counter() - start < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"LibreTranslate exited ({process.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if http(f"http://127.0.0.1:{port}/languages")[0] == 200 and process.poll() is None:
                return process, time.perf_counter() - start
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"LibreTranslate did not answer in {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def check_libretranslate(args, package: Path, codes: tuple[str, str], lines: list[str], mine: list[str],
                         expected: list[str], sentences, limits, scratch: Path, index: Path) -> dict:
    """LibreTranslate's answers for ``lines``, compared with ``mine`` (float32) and ``expected`` as
    LibreTranslate formats them."""
    env = venv_env(scratch / "lt-home", index)
    install = "import sys, argostranslate.package as p; p.install_from_path(sys.argv[1])"
    subprocess.run([str(args.lt_venv / "bin" / "python"), "-c", install, str(package)], env=env, check=True,
                   capture_output=True)
    url, (source, target) = f"http://127.0.0.1:{args.port}", codes
    process, started = start_libretranslate(args.lt_venv, env, codes, args.port,
                                            scratch / "libretranslate.log")
    try:
        begin = time.perf_counter()
        answers = [http(f"{url}/translate", {"q": line, "source": source, "target": target})
                   for line in lines]
        seconds = time.perf_counter() - begin
        first = {"q": lines[0], "source": source, "target": target}
        shown = {"GET /languages": http(f"{url}/languages"),
                 "POST /translate (JSON, list q, alternatives 2)": http(
                     f"{url}/translate", {**first, "q": lines[:2], "alternatives": 2}),
                 "POST /translate (form)": http(f"{url}/translate", first, form=True),
                 "POST /translate (unknown target)": http(f"{url}/translate", {**first, "target": "qq"})}
        client = worker(args.lt_venv, {"do": "libretranslatepy", "url": url, "from": source, "to": target,
                                       "text": lines[0]}, env, scratch)
    finally:
        process.terminate()
        process.wait(timeout=60)
    formatted = worker(args.lt_venv, {"do": "lt_format", "pairs": list(zip(lines + lines, mine + expected))},
                       env, scratch)["formatted"]
    theirs = [body["translatedText"] if status == 200 else f"HTTP {status}: {body}"
              for status, body in answers]
    result = compare("LibreTranslate vs ours float32 as LibreTranslate formats it", lines, theirs,
                     formatted[: len(lines)], formatted[len(lines):], sentences, limits)
    return {**result, "start_seconds": round(started, 1),
            "sentences_per_second": round(len(lines) / seconds, 1), "responses": shown,
            "libretranslatepy": client}


def build(args, scratch: Path) -> tuple[Path, dict, object, int]:
    """The package (``--to-argos``, float32), its metadata, its sentencepiece model and the run's max_len."""
    import sentencepiece as spm

    from jaxformer.interop.argos import export_argos
    from jaxformer.run.directory import RunDir

    package = export_argos(args.workdir, scratch / "package.argosmodel", checkpoint=args.checkpoint,
                           from_code=args.from_code, to_code=args.to_code)
    with zipfile.ZipFile(package) as z:
        def member(name: str) -> bytes:
            return z.read(next(n for n in z.namelist() if n.endswith(f"/{name}")))

        metadata, sp = json.loads(member("metadata.json")), spm.SentencePieceProcessor(
            model_proto=member("sentencepiece.model"))
    return package, metadata, sp, RunDir(args.workdir).read_run_record()["model"]["max_len"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True, help="the run to package")
    parser.add_argument("--argos-venv", type=Path, help="virtual environment with argostranslate")
    parser.add_argument("--lt-venv", type=Path, help="virtual environment with libretranslate (and spaCy)")
    parser.add_argument("--input", type=Path, help="sources, one per line (default: RUN/test.src)")
    parser.add_argument("--sentences", type=int, default=200, help="the first N lines")
    parser.add_argument("--checkpoint", default="auto", help="the checkpoint packaged and translated with "
                        "(default auto; name a step while the run still trains)")
    parser.add_argument("--from-code", help="the package's source language (default: the run's)")
    parser.add_argument("--to-code", help="the package's target language (default: the run's)")
    parser.add_argument("--port", type=int, default=0, help="LibreTranslate's port on 127.0.0.1 (default: a "
                        "free one)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    if not args.port:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            args.port = probe.getsockname()[1]
    if not (args.argos_venv or args.lt_venv):
        parser.error("give --argos-venv, --lt-venv or both")
    args.input = args.input or args.workdir / "test.src"
    if not args.input.is_file():
        parser.error(f"{args.input} is missing (a run writes test.src when it finishes): give --input FILE")
    sys.path.insert(0, str(REPO))
    scratch = Path(tempfile.mkdtemp(prefix="argos-lt-"))
    index = scratch / "index"
    index.mkdir()
    (index / "index.json").write_text("[]\n")   # nothing to download: LibreTranslate starts in seconds
    package, metadata, sp, max_len = build(args, scratch)
    codes = (metadata["from_code"], metadata["to_code"])

    def limits(source: str, output: str) -> bool:
        return len(sp.encode(source)) > max_len or len(sp.encode(output)) >= max_len - 1

    text = args.input.read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.strip()][: args.sentences]
    request = {"do": "translate", "package": str(package), "from": codes[0], "to": codes[1], "lines": lines}
    venv = args.argos_venv or args.lt_venv   # the same spaCy rules split in either
    sentences = worker(venv, {**request, "translate": False}, venv_env(scratch / "split-home", index),
                       scratch)["sentences"]
    split = [s for parts in sentences if len(parts) > 1 for s in parts]
    mine, expected = {}, {}
    for quantization in ("float32", "int8"):
        mine[quantization] = ours(args.workdir, lines, quantization, args.checkpoint, scratch)
        mine_sentences = ours(args.workdir, split, quantization, args.checkpoint, scratch) if split else []
        expected[quantization] = predicted(mine[quantization], sentences, mine_sentences)
    report = {"run": str(args.workdir), "checkpoint": args.checkpoint, "package": metadata,
              "lines": len(lines), "split_lines": sum(len(parts) > 1 for parts in sentences), "checks": []}
    for compute, quantization in (("float32", "float32"), ("auto", "int8")) if args.argos_venv else ():
        env = venv_env(scratch / f"argos-home-{compute}", index, ARGOS_COMPUTE_TYPE=compute)
        theirs = worker(args.argos_venv, request, env, scratch)["translations"]
        name = f"argostranslate (ARGOS_COMPUTE_TYPE={compute}) vs ours {quantization}"
        report["checks"].append(compare(name, lines, theirs, mine[quantization], expected[quantization],
                                        sentences, limits))
    if args.lt_venv:
        report["checks"].append(check_libretranslate(args, package, codes, lines, mine["float32"],
                                                     expected["float32"], sentences, limits, scratch, index))
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def _print(report: dict) -> None:
    print(f"run {report['run']} ({report['checkpoint']} checkpoint): package "
          f"{report['package']['from_code']}→{report['package']['to_code']}, "
          f"{report['lines']} lines, {report.get('split_lines', '?')} split into several sentences by spaCy")
    for check in report["checks"]:
        reasons: dict[str, int] = {}
        for d in check["differ"]:
            for why in d["why"]:
                reasons[why] = reasons.get(why, 0) + 1
        print(f"{check['name']}: {check['equal']}/{check['lines']} equal; differing lines by reason: "
              f"{reasons or 'none'}")
        for d in [d for d in check["differ"] if d["why"] == ["unexplained"]][:5]:
            print(f"  unexplained line {d['line']}: {d['source']!r}\n    theirs {d['theirs']!r}\n"
                  f"    ours   {d['ours']!r}")
        if "start_seconds" in check:
            print(f"  started in {check['start_seconds']} s; {check['sentences_per_second']} sentences/s, "
                  f"one request at a time")
            for what, (status, body) in check["responses"].items():
                print(f"  {what}: {status} {json.dumps(body, ensure_ascii=False)[:300]}")
            print(f"  libretranslatepy: {json.dumps(check['libretranslatepy'], ensure_ascii=False)[:300]}")


if __name__ == "__main__":
    main()
