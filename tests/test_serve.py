"""jaxformer-serve for real: uvicorn processes on free loopback ports serving a tiny en-de run
trained here (CTranslate2 and JAX engines) and a tiny NLLB model built here, called by real
clients (httpx, libretranslatepy, Debian's Chromium through playwright): LibreTranslate's API
and errors, text and HTML, keys and limits, CORS, disconnects, batching identical to one at a
time and to ``jaxformer-translate`` under the same output limit, metrics, SIGTERM draining.
The parts without a model: tests/test_serve_parts.py."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the service's dependencies: pip install -e '.[serve]'")
pytest.importorskip("ctranslate2", reason="pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx", reason="pip install -e '.[test]'")

from sentencex import segment  # noqa: E402

from jaxformer.data import corpus  # noqa: E402
from jaxformer.run.config import TrainConfig  # noqa: E402
from jaxformer.train.trainer import train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAIRS = [p for p in corpus.read_tsv(corpus.builtin_corpus_path("en-de"))[0]
         if len(p[0]) < 50 and len(p[1]) < 50]
# Single sentences to the splitter: the service translates them as they are.
SOURCES = [s for s, _ in PAIRS[:80] if len(list(segment("en", s))) == 1 and len(s.split()) >= 2][:16]
GERMAN = [t for _, t in PAIRS[:60] if len(list(segment("de", t))) == 1][:6]
LIMIT = 32            # the tiny run's max_len: the service's default output limit
NLLB_LIMIT = 15       # the NLLB model's max_length 16 - 1
KEY, OTHER_KEY = "k-0123456789abcdef", "k-fedcba9876543210"
ORIGIN = "http://allowed.example"


def _env() -> dict[str, str]:
    paths = [str(ROOT), os.environ.get("PYTHONPATH")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}


class Server:
    """``python -m jaxformer.serve --port 0 FLAGS`` until stopped: its URL once listening, its log."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxformer.serve", "--port", "0", *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**_env(), **(env or {})})
        self.lines: list[str] = []
        reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")))
        reader.daemon = True
        reader.start()
        deadline = time.monotonic() + 300
        while not (found := re.search(r"listening on (http://\S+)", self.log)):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log
            time.sleep(0.1)
        self.url = found.group(1)
        while httpx.get(f"{self.url}/health").status_code != 200:
            assert time.monotonic() < deadline, self.log
            time.sleep(0.2)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def post(self, path: str = "/translate", key: str | None = KEY, **fields) -> httpx.Response:
        return httpx.post(self.url + path, json={**fields, **({"api_key": key} if key else {})}, timeout=120)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics").text

    def stop(self, sig=signal.SIGTERM, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def _metric(text: str, name: str, **labels) -> float:
    """The value of sample ``name`` with ``labels`` in a Prometheus exposition (0 if absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _clean(response: httpx.Response) -> dict:
    """The JSON error body, checked to hold no traceback or server path."""
    body = response.json()
    assert set(body) == {"error"} and "Traceback" not in body["error"] and "/tmp" not in body["error"], body
    return body


def _translate_command(run: Path, sentences: list[str], *flags: str) -> list[str]:
    """``jaxformer-translate`` (``python -m jaxformer.translate``) on ``sentences``: its lines."""
    command = [sys.executable, "-m", "jaxformer.translate", "--workdir", str(run), *flags, *sentences]
    done = subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny en-de run (120 steps on 300 short pairs, max_len 32, greedy by default) that records no
    pair: served as RUN:en-de."""
    root = tmp_path_factory.mktemp("serve")
    (root / "corpus.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in PAIRS[:300]))
    train(TrainConfig.flat(workdir=str(root / "run"), train_file=str(root / "corpus.tsv"), preset="tiny",
                           max_steps=120, warmup_steps=20, lr_scale=0.3, batch_tokens=512, vocab_size=300,
                           max_len=LIMIT, eval_every=1000, dev_bleu_sentences=4, beam_size=1, progress=False,
                           devices=1))
    return root / "run"


@pytest.fixture(scope="module")
def nllb(tmp_path_factory):
    """A tiny random NLLB-200 model (tests/test_hf_m2m100.py's), imported as a run."""
    hf = pytest.importorskip("test_hf_m2m100", reason="the NLLB model is built with torch and transformers")
    from jaxformer.cli import convert as convert_cli

    hf_dir = tmp_path_factory.mktemp("nllb") / "hf"
    hf_dir.mkdir()
    tokenizer = hf._hf_tokenizer("nllb", hf_dir)
    # seed 3: greedy outputs of the GERMAN lines that are not empty (many random models end at once)
    model = hf._hf_model("nllb", max(tokenizer.get_vocab().values()) + 1, seed=3)
    model.save_pretrained(hf_dir)
    convert_cli.main(["--from-hf", str(hf_dir), "--workdir", str(hf_dir.parent / "nllb")])
    return hf_dir.parent / "nllb"


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(f"# the test's keys\n{KEY}\n{OTHER_KEY}\n")
    return path


@pytest.fixture(scope="module")
def ct2(run, nllb, keys):
    """The CTranslate2 server: the en-de run and the NLLB model, keys, CORS, small limits."""
    server = Server("--workdir", f"{run}:en-de", "--workdir", str(nllb), "--engine", "ct2",
                    "--api-keys", str(keys), "--cors-origin", ORIGIN, "--char-limit", "600",
                    "--batch-limit", "20", "--body-limit", "30000", "--batch-wait-ms", "40",
                    "--max-batch-sentences", "16")
    yield server
    assert server.stop() == 0, server.log


@pytest.fixture(scope="module")
def jax_server(run):
    """The JAX server of the en-de run (no keys), logging each compile."""
    server = Server("--workdir", f"{run}:en-de", "--engine", "jax", "--max-batch-sentences", "8",
                    "--batch-wait-ms", "20", env={"JAX_LOG_COMPILES": "1"})
    yield server
    assert server.stop() == 0, server.log


@pytest.fixture(scope="module")
def command(run):
    """``jaxformer-translate``'s translations of SOURCES under the service's limit rule, per engine."""
    cache = {}

    def translations(engine: str) -> list[str]:
        if engine not in cache:
            cache[engine] = _translate_command(run, SOURCES, "--engine", engine, "--max-len-a", "0",
                                               "--max-len-b", str(LIMIT))
        return cache[engine]
    return translations


def test_languages_translate_and_detect_as_libretranslate_answers(ct2):
    languages = httpx.get(f"{ct2.url}/languages").json()
    assert {"code": "en", "name": "English", "targets": sorted(languages[0]["targets"])} == languages[0]
    assert "de" in languages[0]["targets"] and all(set(e) == {"code", "name", "targets"} for e in languages)
    assert {"de", "fr", "zh-Hans"} <= {e["code"] for e in languages}   # NLLB's, in LibreTranslate's codes
    with_body = httpx.request("GET", f"{ct2.url}/languages", content=b"api_key=x",   # as libretranslatepy
                              headers={"content-type": "application/x-www-form-urlencoded"})
    assert with_body.json() == languages
    one = ct2.post(q=SOURCES[0], source="en", target="de").json()
    assert set(one) == {"translatedText"} and isinstance(one["translatedText"], str)
    many = ct2.post(q=SOURCES[:3], source="en", target="de").json()
    assert many["translatedText"][0] == one["translatedText"] and len(many["translatedText"]) == 3
    fields = {"q": SOURCES[0], "source": "en", "target": "de", "api_key": KEY}
    form = httpx.post(f"{ct2.url}/translate", data=fields)
    query = httpx.post(f"{ct2.url}/translate", params=fields)   # deep-translator sends these
    assert form.json() == query.json() == one
    auto = ct2.post(q=["Das ist ein kleines Haus am See.", "Ein Hund läuft über die Straße."], source="auto",
                    target="en").json()
    assert auto["detectedLanguage"] == [{"confidence": auto["detectedLanguage"][0]["confidence"],
                                         "language": "de"}] * 2
    assert len(auto["translatedText"]) == 2   # NLLB's de -> en
    detected = httpx.post(f"{ct2.url}/detect", data={"q": "Das ist ein kleines Haus am See.", "api_key": KEY})
    assert detected.json()[0]["language"] == "de" and 0 <= detected.json()[0]["confidence"] <= 100
    alternatives = ct2.post(q=SOURCES[1], source="en", target="de", alternatives=3).json()
    assert set(alternatives) == {"translatedText", "alternatives"} and len(alternatives["alternatives"]) <= 3
    assert alternatives["translatedText"] not in alternatives["alternatives"]
    assert len(set(alternatives["alternatives"])) == len(alternatives["alternatives"])
    scored = ct2.post(q=[SOURCES[2]], source="en", target="de", scores=True).json()
    assert len(scored["scores"][0]) == 1 and scored["scores"][0][0] <= 0


def test_errors_are_libretranslates(ct2):
    cases = [(dict(source="en", target="de"), 400, "Invalid request: missing q parameter"),
             (dict(q="x", target="de"), 400, "Invalid request: missing source parameter"),
             (dict(q="x", source="en", target="zz"), 400, "zz is not supported"),
             (dict(q="x", source="en", target="de", format="pdf"), 400, "pdf format is not supported"),
             (dict(q="x", source="en", target="de", alternatives="many"), 400,
              "Invalid request: alternatives parameter is not a number"),
             (dict(q="x", source="en", target="de", alternatives=9), 400,
              "Invalid request: alternatives parameter must be <= 3"),
             (dict(q="x", source="en", target="en"), 400,
              "English (en) is not available as a target language from English (en)"),
             (dict(q="x", source="en", target="de", terminology={"x": "y"}), 400, "--engine jax")]
    for fields, status, words in cases:
        response = ct2.post(**fields)
        assert response.status_code == status and words in _clean(response)["error"], (fields, response.text)
    bad_json = httpx.post(f"{ct2.url}/translate", content=b"[1, 2",
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and _clean(bad_json) == {"error": "Invalid JSON format"}
    assert httpx.get(f"{ct2.url}/nowhere").status_code == 404 and _clean(httpx.get(f"{ct2.url}/nowhere"))
    assert httpx.get(f"{ct2.url}/translate").status_code == 405 and _clean(httpx.get(f"{ct2.url}/translate"))
    assert ct2.post(q="still up", source="en", target="de").status_code == 200


def test_keys_are_asked_for_and_never_logged(ct2):
    missing = ct2.post(key=None, q="x", source="en", target="de")
    assert missing.status_code == 403 and "API key" in _clean(missing)["error"]
    wrong = ct2.post(key="k-wrong-key-12345", q="x", source="en", target="de")
    assert wrong.status_code == 403 and _clean(wrong) == {"error": "Invalid API key"}
    assert ct2.post(key=OTHER_KEY, q="x", source="en", target="de").status_code == 200
    assert httpx.get(f"{ct2.url}/languages").status_code == 200   # no key needed, as LibreTranslate
    time.sleep(0.2)
    assert KEY not in ct2.log and OTHER_KEY not in ct2.log and "k-wrong-key" not in ct2.log
    assert '"POST /translate" 403' in ct2.log and SOURCES[0] not in ct2.log   # no text without --log-text


def test_libretranslatepy_talks_to_it(ct2, command):
    from urllib.error import HTTPError

    libretranslatepy = pytest.importorskip("libretranslatepy", reason="pip install -e '.[test]'")
    client = libretranslatepy.LibreTranslateAPI(ct2.url, api_key=KEY)
    assert client.translate(SOURCES[3], "en", "de") == command("ct2")[3]
    assert client.detect("Das ist ein kleines Haus am See.")[0]["language"] == "de"
    assert client.languages() == httpx.get(f"{ct2.url}/languages").json()
    with pytest.raises(HTTPError) as refused:
        libretranslatepy.LibreTranslateAPI(ct2.url, api_key="k-wrong-key-12345").translate("x", "en", "de")
    assert refused.value.code == 403


def test_limits_and_cors(ct2):
    over = ct2.post(q="a" * 601, source="en", target="de")
    assert over.status_code == 400
    assert _clean(over)["error"] == "Invalid request: request (601) exceeds text limit (600)"
    many = ct2.post(q=["a"] * 21, source="en", target="de")
    assert many.status_code == 400
    assert _clean(many)["error"] == "Invalid request: request (21) exceeds text limit (20)"
    body = ct2.post(q=["a " * 200] * 20, source="en", target="de", padding="x" * 40_000)
    assert body.status_code == 413 and "body is over 30000 bytes" in _clean(body)["error"]
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    allowed = httpx.options(f"{ct2.url}/translate", headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{ct2.url}/translate", headers={"Origin": "http://elsewhere.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
    simple = ct2.post(q="x", source="en", target="de")
    assert "access-control-allow-origin" not in simple.headers   # no Origin: no CORS headers


def test_paragraphs_line_breaks_long_sentences_and_html(ct2):
    long = ", ".join(SOURCES[4:12]) + " and so on."   # far over 32 tokens
    text = f"{SOURCES[0]} {SOURCES[5]}\n\n{long}\n{SOURCES[2]}\r\n"
    answer = ct2.post(q=text, source="en", target="de").json()["translatedText"]
    assert answer.count("\n\n") == 1 and answer.count("\n") == 4 and answer.endswith("\r\n")   # JSON: as sent
    first, second = ct2.post(q=[SOURCES[0], SOURCES[5]], source="en", target="de").json()["translatedText"]
    assert answer.startswith(f"{first} {second}\n\n")   # each sentence translated as on its own
    html = (f'<p class="lead">{SOURCES[0][:-1]} <b>now</b>.</p><ul><li>{SOURCES[1]}</li></ul>'
            '<pre>keep   this</pre><script>var a = "<b>x</b>";</script>')
    out = ct2.post(q=html, source="en", target="de", format="html", alternatives=2).json()
    assert out["alternatives"] == [] and out["translatedText"].startswith('<p class="lead">')
    for kept in ("<b>", "</b>", "<ul><li>", '<pre>keep   this</pre><script>var a = "<b>x</b>";</script>'):
        assert kept in out["translatedText"]


def test_a_client_that_goes_away_leaves_the_server_well(ct2):
    before = _metric(ct2.metrics(), "jaxformer_requests_total", endpoint="/translate", status="499")
    body = json.dumps({"q": SOURCES + SOURCES[:4], "source": "en", "target": "de", "api_key": KEY}).encode()
    for _ in range(3):
        host, port = ct2.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as conn:
            conn.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 60
    while _metric(metrics := ct2.metrics(), "jaxformer_requests_total", endpoint="/translate",
                  status="499") < before + 3:
        assert time.monotonic() < deadline, ct2.log[-3000:]
        time.sleep(0.2)
    assert _metric(metrics, "jaxformer_queue_sentences", model="en-de") == 0
    assert ct2.post(q=SOURCES[0], source="en", target="de").status_code == 200


@pytest.mark.parametrize("engine", ["ct2", "jax"])
def test_batched_requests_equal_one_at_a_time_and_the_translate_command(request, engine, command):
    server = request.getfixturevalue("ct2" if engine == "ct2" else "jax_server")
    alone = [server.post(q=s, source="en", target="de").json()["translatedText"] for s in SOURCES]
    assert alone == command(engine)   # jaxformer-translate --max-len-a 0 --max-len-b 32, same engine
    before = server.metrics()

    async def together():
        async with httpx.AsyncClient(timeout=120) as client:
            replies = await asyncio.gather(*(client.post(f"{server.url}/translate", json={
                "q": s, "source": "en", "target": "de", "api_key": KEY}) for s in SOURCES))
        return [r.json()["translatedText"] for r in replies]

    assert asyncio.run(together()) == alone
    after = server.metrics()
    calls = [_metric(m, "jaxformer_batch_sentences_count", model="en-de") for m in (before, after)]
    sentences = [_metric(m, "jaxformer_batch_sentences_sum", model="en-de") for m in (before, after)]
    assert sentences[1] - sentences[0] == len(SOURCES) and calls[1] - calls[0] < len(SOURCES)   # gathered
    assert _metric(after, "jaxformer_requests_total", endpoint="/translate", model="en-de", status="200") >= \
        2 * len(SOURCES)
    if engine == "jax":   # every shape was compiled by the warm-up, before /health said ready
        assert "Compiling " in server.log.split(" ready\n")[0]
        assert "Compiling " not in server.log.split(" ready\n")[1], server.log.split(" ready\n")[1][-2000:]


def test_nllb_serves_its_languages_as_the_translate_command_does(ct2, nllb):
    served = ct2.post(q=GERMAN, source="de", target="en").json()["translatedText"]
    assert served == _translate_command(nllb, GERMAN, "--engine", "ct2", "--src-lang", "deu_Latn",
                                        "--tgt-lang", "eng_Latn", "--max-len-a", "0",
                                        "--max-len-b", str(NLLB_LIMIT))
    assert sum(bool(text) for text in served) > len(served) // 2
    french = ct2.post(q=GERMAN, source="de", target="fr").json()["translatedText"]
    assert len(french) == len(GERMAN) and french != served   # another forced language token


def test_jax_engine_extras_alternatives_and_heat_map(jax_server, command):
    prefixed = jax_server.post(q=SOURCES[4], source="en", target="de", prefix="Heute").json()
    assert prefixed["translatedText"].startswith("Heute")
    termed = jax_server.post(q=[SOURCES[4]], source="en", target="de", terminology={"Python": "Datei"}).json()
    assert "Datei" in termed["translatedText"][0] or termed.get("notes")
    alternatives = jax_server.post(q=SOURCES[6], source="en", target="de", alternatives=2).json()
    assert len(alternatives["alternatives"]) <= 2
    assert alternatives["translatedText"] not in alternatives["alternatives"]
    png = jax_server.post("/attention", q=SOURCES[0], source="en", target="de")
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    assert png.content[:4] == b"\x89PNG"


def test_the_page_translates_in_a_real_browser(jax_server, command, tmp_path):
    """Debian's Chromium (never a downloaded one) opens the page, picks the pair, types, clicks:
    the shown translation is jaxformer-translate's, Copy puts it on the clipboard, the heat map
    draws."""
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).exists():
        pytest.skip("no Chromium here: apt-get install -y chromium chromium-driver (.ci/run does)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[test]'")
    flags = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            tmp_path / "profile", executable_path=chromium, headless=True, args=flags,
            viewport={"width": 1100, "height": 760}, permissions=["clipboard-read", "clipboard-write"])
        try:
            page = browser.new_page()
            page.goto(jax_server.url)
            page.wait_for_function("document.querySelectorAll('#target option').length > 0")
            page.select_option("#source", "en")
            page.select_option("#target", "de")
            page.fill("#text", SOURCES[7])
            page.click("#translate")
            page.wait_for_function("document.getElementById('translation').textContent.length > 0")
            assert page.text_content("#translation") == command("jax")[7]
            page.click("#copy")
            page.wait_for_function("document.getElementById('status').textContent === 'copied'")
            assert page.evaluate("navigator.clipboard.readText()") == command("jax")[7]
            page.click("#heatmap")
            page.wait_for_function("document.getElementById('heatmap-image').naturalWidth > 0")
            page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
        finally:
            browser.close()


def test_rate_limit_full_queue_and_sigterm_drain(run, keys):
    server = Server("--workdir", f"{run}:en-de", "--engine", "ct2", "--api-keys", str(keys),
                    "--req-limit", "3", "--max-queue", "3", "--batch-wait-ms", "1500",
                    "--max-batch-sentences", "4")
    two = f"{SOURCES[0]} {SOURCES[1]}"   # two sentences

    def queued(count: int) -> None:
        deadline = time.monotonic() + 60
        while _metric(server.metrics(), "jaxformer_queue_sentences", model="en-de") != count:
            assert time.monotonic() < deadline, server.log
            time.sleep(0.05)

    try:
        first = {}
        waiting = threading.Thread(target=lambda: first.update(r=server.post(q=two, source="en",
                                                                             target="de")))
        waiting.start()
        queued(2)   # in the batcher's window
        full = server.post(q=two, source="en", target="de")
        assert full.status_code == 503 and full.headers["retry-after"] == "1" and _clean(full)
        waiting.join()
        assert first["r"].status_code == 200
        assert server.post(q="x", source="en", target="de").status_code == 200   # the key's third
        slow = server.post(q="x", source="en", target="de")
        assert slow.status_code == 429 and _clean(slow) == {"error": "Slowdown: 3 per 1 minute"}
        drained = {}   # the other key: a request under way when SIGTERM comes is answered
        waiting = threading.Thread(target=lambda: drained.update(
            r=server.post(key=OTHER_KEY, q=two, source="en", target="de")))
        waiting.start()
        queued(2)
        server.proc.send_signal(signal.SIGTERM)
        waiting.join()
        assert drained["r"].status_code == 200 and len(drained["r"].json()["translatedText"]) > 0
        assert server.proc.wait(60) == 0, server.log
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health")
    finally:
        server.stop(signal.SIGKILL)
