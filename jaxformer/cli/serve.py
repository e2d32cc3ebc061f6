"""The ``jaxformer-serve`` command: runs served over HTTP with LibreTranslate's API, a web page
and metrics (:mod:`jaxformer.serve.app`, docs/serving.md). The flags are checked and every run
loaded and opened before the server starts (exit status 2 naming the problem); the engine is
chosen as ``jaxformer-translate`` chooses it (:mod:`jaxformer.cli.engine`), with one fixed
output limit per run (``--max-output-tokens``: ``jaxformer-translate --max-len-a 0 --max-len-b
N`` gives the same text). SIGTERM or Ctrl-C: no new connections, the requests under way are
answered, exit 0.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import sys
from pathlib import Path
from typing import Annotated, Literal

import tyro
from annotated_types import Ge, Interval

from jaxformer.cli import fail
from jaxformer.cli.engine import choose_engine, open_engine
from jaxformer.cli.translate_flags import TranslateArgs
from jaxformer.decode.engine import Request
from jaxformer.decode.served_run import ServedRun
from jaxformer.run.config import shown

PROG = "jaxformer-serve"
DESCRIPTION = """\
Serve trained runs over HTTP: jaxformer-serve --workdir RUN [--workdir RUN2 ...].

LibreTranslate's API (POST /translate, /detect; GET /languages), a web page at /, OpenAPI
docs at /docs, /health and Prometheus /metrics. Each run serves its language pair (a run that
records none: --workdir RUN:SRC-TGT); an M2M100/NLLB run serves all its languages. Concurrent
requests to one model are batched. Binds 127.0.0.1 unless --host says otherwise
(docs/serving.md)."""
Switch = tyro.conf.FlagCreatePairsOff


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeArgs:
    """The service's command line (``--help`` prints each field's comment)."""

    # a run directory, or RUN:SRC-TGT for a run that records no pair (repeat for more runs)
    workdir: Annotated[tuple[str, ...], tyro.conf.UseAppendAction]
    host: str = "127.0.0.1"   # the address to listen on (0.0.0.0: every interface)
    port: Annotated[int, Interval(ge=0, le=65535)] = 5000   # 0: any free port (printed)
    # ct2: CTranslate2 on the CPU; jax: ours, any device; auto: as jaxformer-translate chooses
    engine: Literal["auto", "ct2", "jax"] = "auto"
    # CTranslate2 weights (int8 on a CPU is faster)
    quantization: Annotated[Literal["float32", "int8", "int8_float32", "int16"] | None,
                            shown("float32")] = None
    inter_threads: Annotated[int | None, Ge(1), shown("the cores")] = None   # CTranslate2 translators
    intra_threads: Annotated[int | None, Ge(1), shown("1")] = None   # CTranslate2 threads per translator
    checkpoint: str = "auto"   # auto = best by dev BLEU, else latest; best, latest, averaged or a step
    # one output limit for every sentence (the same as jaxformer-translate --max-len-a 0 --max-len-b N)
    max_output_tokens: Annotated[int | None, Ge(1), shown("an imported model's, else max_len")] = None
    # the oldest waiting sentence waits this long for others before a free engine takes it (0: none;
    # batches then form from what waits while the engine is busy)
    batch_wait_ms: Annotated[float, Interval(ge=0, lt=math.inf)] = 0.0
    max_batch_sentences: Annotated[int, Ge(1)] = 32   # most sentences per engine call (JAX: its rows)
    max_queue: Annotated[int, Ge(1)] = 2048   # sentences waiting per model; beyond: 503 Retry-After
    alternatives_limit: Annotated[int, Ge(0)] = 3   # most alternatives; beam widens to N+1 at most
    char_limit: Annotated[int, Ge(0)] = 5000   # characters per text (0: any)
    batch_limit: Annotated[int, Ge(0)] = 100   # texts per request when q is a list (0: any)
    body_limit: Annotated[int, Ge(1)] = 4 << 20   # bytes per request body
    req_limit: Annotated[int, Ge(0)] = 0   # requests per minute per API key or client (0: any)
    api_keys: str | None = None   # a file of API keys, one a line: requests without one get 403
    cors_origin: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()   # allowed origin (*: any)
    trusted_proxies: str | None = None   # addresses whose X-Forwarded-For names the client (e.g. 10.0.0.1)
    log_text: Annotated[bool, Switch] = False   # the access log shows the texts and translations


def parse_serve_args(argv: list[str] | None = None) -> ServeArgs:
    """The checked flags of ``jaxformer-serve``; bad ones exit with status 2 and a message."""
    argv = sys.argv[1:] if argv is None else argv
    return tyro.cli(ServeArgs, args=argv, prog=PROG, description=DESCRIPTION)


def split_workdir(spec: str) -> tuple[str, tuple[str, str] | None]:
    """``RUN`` or ``RUN:SRC-TGT`` as ``(RUN, pair or None)``; ``ValueError`` for a bad pair."""
    from jaxformer.serve.languages import parse_pair

    path, colon, pair = spec.rpartition(":")
    if not colon or Path(spec).exists():
        return spec, None
    return path, parse_pair(pair)


def open_model(args: ServeArgs, spec: str, metrics):
    """The :class:`~jaxformer.serve.served_model.ServedModel` of ``--workdir spec``: the run
    loaded with one fixed output limit, its engine chosen and opened as the translate command's.
    Raises ``ValueError``, ``OSError``, ``ImportError`` naming the problem."""
    from jaxformer.serve.served_model import ServedModel

    path, pair = split_workdir(spec)
    run = ServedRun.load(path, checkpoint=args.checkpoint)
    limit = args.max_output_tokens or (run.max_len_b if run.max_len_a == 0 else run.config.max_len)
    run = dataclasses.replace(run, max_len_a=0.0, max_len_b=limit)
    flags = TranslateArgs(workdir=path, engine=args.engine, quantization=args.quantization,
                          inter_threads=args.inter_threads, intra_threads=args.intra_threads,
                          batch_size=args.max_batch_sentences, checkpoint=args.checkpoint)
    engine_name, why = choose_engine(flags)
    cached = engine_name == "jax" and _jax_cache(run)
    engine = open_engine(flags, run, engine_name, throughput=True, exported=cached, fixed_rows=True)
    workers = engine.threads[0] if engine_name == "ct2" else 1   # CTranslate2's translators side by side
    model = ServedModel(engine, pair=pair, alternatives_limit=args.alternatives_limit,
                        wait_s=args.batch_wait_ms / 1000, max_sentences=args.max_batch_sentences,
                        max_queue=args.max_queue, workers=workers, metrics=metrics)
    print(f"{PROG}: {model.name} ({path}): engine {engine_name} ({why}); {engine.describe()}; "
          f"{engine.rules(Request())}; output limit {limit} tokens", file=sys.stderr)
    return model


def _jax_cache(run: ServedRun) -> bool:
    """JAX kept off an absent TPU, with the run's compilation cache (as the translate command)."""
    from jaxformer.run.directory import RunDir, enable_compilation_cache
    from jaxformer.run.platform import skip_absent_tpu

    skip_absent_tpu()
    return enable_compilation_cache(RunDir(run.root))


def _logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    for name in ("jaxformer.serve", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def main(argv: list[str] | None = None) -> None:
    args = parse_serve_args(argv)
    _logging()
    import uvicorn

    from jaxformer.serve.app import Service, Settings, create_app
    from jaxformer.serve.limits import ApiKeys
    from jaxformer.serve.metrics import Metrics

    metrics, models = Metrics(), []
    try:
        keys = ApiKeys(args.api_keys) if args.api_keys else None
        for spec in args.workdir:
            models.append(open_model(args, spec, metrics))
        settings = Settings(char_limit=args.char_limit, batch_limit=args.batch_limit,
                            alternatives_limit=args.alternatives_limit, req_limit=args.req_limit,
                            api_keys=keys, cors_origins=args.cors_origin, body_limit=args.body_limit,
                            log_text=args.log_text)
        service = Service(models, settings, metrics)
    except (ValueError, OSError, ImportError) as e:   # ConversionError is a ValueError
        fail(PROG, str(e))
    for note in service.catalog.notes:
        print(f"{PROG}: note: {note}", file=sys.stderr)
    config = uvicorn.Config(create_app(service), host=args.host, port=args.port, log_config=None,
                            access_log=False, proxy_headers=bool(args.trusted_proxies),
                            forwarded_allow_ips=args.trusted_proxies, timeout_graceful_shutdown=60)
    for sig in (signal.SIGTERM, signal.SIGINT):   # uvicorn raises the signal again once drained: exit 0
        signal.signal(sig, lambda *_: None)
    _Server(config).run()
    for model in models:
        model.engine.close()


class _Server:
    """uvicorn's server, saying where it listens once it does (the port, when 0 was asked)."""

    def __new__(cls, config):
        import uvicorn

        class Server(uvicorn.Server):
            async def startup(self, sockets=None):
                await super().startup(sockets)
                if self.servers:
                    host, port = self.servers[0].sockets[0].getsockname()[:2]
                    print(f"{PROG}: listening on http://{host}:{port}", file=sys.stderr, flush=True)

        return Server(config)


if __name__ == "__main__":
    main()
