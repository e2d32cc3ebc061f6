"""The HTTP service (:func:`create_app`): LibreTranslate's API (``POST /translate``, ``POST
/detect``, ``GET /languages``, ``GET /frontend/settings``, ``GET /health``) over the served
models, with ours beside it: ``GET /metrics`` (Prometheus), ``GET /models``, ``POST /attention``
(a JAX model's heat map), the web page at ``/`` and the OpenAPI docs at ``/docs`` (assets
served here, no CDN). FastAPI on uvicorn; the command is :mod:`jaxformer.cli.serve`.

A request is read (:mod:`~jaxformer.serve.api`), counted against the rate limit, its key
checked, its fields checked, routed to the model of its pair, translated through that model's
batcher, and answered; every error is ``{"error": …}`` with LibreTranslate's status, never a
traceback or a server path (an engine's error is logged, and answered in general words). A
client that goes away mid-request takes its sentences out of the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HttpRequest
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles

from jaxformer.decode.text import TextPlan
from jaxformer.serve import api
from jaxformer.serve.batcher import QueueFull
from jaxformer.serve.languages import Catalog, Detector, language_name
from jaxformer.serve.limits import ApiKeys, BodyLimit, RateLimit
from jaxformer.serve.metrics import CONTENT_TYPE, AccessLog, Metrics
from jaxformer.serve.served_model import Extras, ServedModel

log = logging.getLogger("jaxformer.serve")
STATIC = Path(__file__).parent / "static"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a request may do: ``char_limit`` characters per text and ``batch_limit`` texts per
    request (0: any), ``alternatives_limit``, ``req_limit`` requests per minute per key or client
    (0: any), ``api_keys`` (``None``: none asked for), CORS ``cors_origins``, ``body_limit`` bytes,
    ``log_text``: the access log shows the texts."""

    char_limit: int = 5000
    batch_limit: int = 100
    alternatives_limit: int = 3
    req_limit: int = 0
    api_keys: ApiKeys | None = None
    cors_origins: tuple[str, ...] = ()
    body_limit: int = 4 << 20
    log_text: bool = False


class Service:
    """The served models, their languages and the service's state (ready once warmed up)."""

    def __init__(self, models: list[ServedModel], settings: Settings, metrics: Metrics | None = None):
        self.models, self.settings, self.metrics = models, settings, metrics or Metrics()
        self.catalog = Catalog(models)
        self.detector = Detector(self.catalog.sources())
        self.rate = RateLimit(settings.req_limit) if settings.req_limit else None
        self.ready, self.problem = False, None

    async def warm_up(self) -> None:
        """Each model's warm-up on its engine's thread; then ready (or the problem, logged)."""
        try:
            for model in self.models:
                started = time.perf_counter()
                count = await model.batcher.run(model.warm_up)
                log.info("%s warmed up: %d sentence(s) in %.1f s", model.name, count,
                         time.perf_counter() - started)
        except Exception as e:   # noqa: BLE001 (reported by /health, the server stays up)
            self.problem = f"warm-up failed: {type(e).__name__}"
            log.exception("warm-up failed")
            return
        self.ready = True
        self.metrics.ready.set(1)
        log.info("ready")

    def route(self, source: str, target: str, texts: list[str]):
        """``(route, source code, detected or None)`` of a request's ``source`` (``auto``: detected
        in ``texts``, LibreTranslate's way: one language for them all) and ``target``;
        ``ApiError`` 400 for a language or pair not served, in LibreTranslate's words."""
        detected = self.detector.detect(" ".join(texts))[0] if source == "auto" else None
        source_code = detected["language"] if detected else self.catalog.code(source)
        target_code = self.catalog.code(target)
        for given, code in ((source, source_code), (target, target_code)):
            if code is None:
                raise api.ApiError(400, f"{given} is not supported")
        route = self.catalog.route(source_code, target_code)
        if route is None:
            raise api.ApiError(400, f"{language_name(target_code)} ({target_code}) is not available as a "
                                    f"target language from {language_name(source_code)} ({source_code})")
        return route, source_code, detected

    def admit(self, request: HttpRequest, fields: dict[str, Any], cost: int = 1) -> None:
        """The rate limit (per valid key, else per client) and the key check; ``ApiError`` 429, 403."""
        key, keys = api.api_key(fields), self.settings.api_keys
        valid = keys is not None and keys.valid(key)
        who = f"key {key}" if valid else f"client {request.client.host if request.client else '-'}"
        if self.rate is not None and not self.rate.hit(who, cost):
            raise api.ApiError(429, f"Slowdown: {self.rate}")
        if keys is not None and not valid:
            raise api.ApiError(403, "Invalid API key" if key else
                               "Please contact the server operator to get an API key")


def create_app(service: Service) -> FastAPI:
    """The ASGI app serving ``service`` (its batchers start and stop with the app)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        for model in service.models:
            model.batcher.start()
        warming = asyncio.create_task(service.warm_up())
        yield
        warming.cancel()
        await asyncio.gather(warming, return_exceptions=True)
        for model in service.models:
            await model.batcher.close()

    app = FastAPIOffline(title="jaxformer-serve", lifespan=lifespan, static_url="/static-docs",
                         description="LibreTranslate's API over jaxformer runs (docs/serving.md).")
    settings = service.settings
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                           allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"],
                           max_age=600)
    app.add_middleware(BodyLimit, max_bytes=settings.body_limit)
    app.add_middleware(AccessLog, metrics=service.metrics, log_text=settings.log_text)   # outermost
    _errors(app)
    _routes(app, service)
    _our_routes(app, service)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def _errors(app: FastAPI) -> None:
    """Every error as ``{"error": …}``; the framework's 422 as LibreTranslate's 400."""

    @app.exception_handler(api.ApiError)
    async def api_error(_, e: api.ApiError):
        return JSONResponse({"error": e.message}, e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        return JSONResponse({"error": str(e.detail)}, e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        first = (e.errors() or [{"msg": "invalid request"}])[0]
        return JSONResponse({"error": f"Invalid request: {first['msg']}"}, 400)

    @app.exception_handler(Exception)
    async def internal(_, e: Exception):
        log.error("internal error: %s: %s", type(e).__name__, e)
        return JSONResponse({"error": "Internal error (the server's log says more)"}, 500)


def _routes(app: FastAPI, service: Service) -> None:
    """LibreTranslate's endpoints."""
    settings, catalog = service.settings, service.catalog

    @app.get("/languages", summary="Supported languages: code, name, targets")
    async def languages():
        return catalog.languages()

    @app.post("/translate", summary="Translate text", openapi_extra=_body(api.TranslateFields))
    async def translate(request: HttpRequest):
        fields = await api.read_fields(request)
        q = fields.get("q")
        service.admit(request, fields, cost=max(1, len(q)) if isinstance(q, list) else 1)
        body = api.translate_fields(fields)
        texts = body.q if isinstance(body.q, list) else [body.q]
        _check_limits(settings, texts, body)
        route, source, detected = service.route(body.source, body.target, texts)
        model = route.model
        request.state.model, request.state.texts = model.name, texts
        extras = Extras(tuple((body.terminology or {}).items()), body.prefix or "")
        if extras and (body.format == "html" or body.alternatives):
            raise api.ApiError(400, "Invalid request: terminology and prefix are for format text, "
                                    "without alternatives")
        problem = extras and model.refusal(extras)
        if problem:
            raise api.ApiError(400, f"Invalid request: {problem}")
        _check_ready(service)
        results = await _answer(request, model.translate(
            texts, route, source=source, html=body.format == "html", alternatives=body.alternatives,
            extras=extras))
        request.state.translations = [r.text for r in results]
        return _translate_response(body, results, detected)

    @app.post("/detect", summary="Detect the language of a text", openapi_extra=_body(None))
    async def detect(request: HttpRequest):
        fields = await api.read_fields(request)
        service.admit(request, fields)
        return service.detector.detect(api.detect_text(fields))

    first = catalog.languages()[0]
    target = (first["targets"] or [first["code"]])[0]

    @app.get("/frontend/settings", summary="LibreTranslate's settings for web clients")
    async def frontend_settings():
        return {"charLimit": settings.char_limit or -1, "frontendTimeout": 500,
                "apiKeys": settings.api_keys is not None, "keyRequired": settings.api_keys is not None,
                "suggestions": False, "filesTranslation": False, "supportedFilesFormat": [],
                "language": {"source": {"code": "auto", "name": "Auto Detect"},
                             "target": {"code": target, "name": language_name(target)}}}


def _our_routes(app: FastAPI, service: Service) -> None:
    """Ours: the page, health, metrics, the models, the heat map."""
    settings, catalog = service.settings, service.catalog

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html")

    @app.get("/health", summary="200 once every model is loaded and warmed up, else 503")
    async def health():
        if service.ready:
            return {"status": "ok"}
        return JSONResponse({"status": "error" if service.problem else "loading",
                             **({"error": service.problem} if service.problem else {})}, 503)

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics():
        return Response(service.metrics.text(), media_type=CONTENT_TYPE)

    served = [{"name": m.name, "engine": m.engine.name, "features": sorted(m.features),
               "sources": sorted({src for src, _, _, _ in m.pairs()}),
               "targets": sorted({tgt for _, tgt, _, _ in m.pairs()}),
               "alternatives_limit": settings.alternatives_limit} for m in service.models]

    @app.get("/models", summary="Ours: the served models, their languages and engine features")
    async def models():
        return served

    @app.post("/attention", summary="Ours: a sentence's cross-attention heat map (PNG; JAX engine)",
              response_class=Response, openapi_extra=_body(None))
    async def attention(request: HttpRequest):
        fields = await api.read_fields(request)
        service.admit(request, fields)
        body = api.translate_fields(fields)
        route = catalog.route(body.source, body.target)
        if route is None or isinstance(body.q, list):
            raise api.ApiError(400, "Invalid request: give one text (q) and a served source and target")
        model = route.model
        request.state.model = model.name
        if "attention" not in model.features or model.multilingual:
            raise api.ApiError(400, "the heat map is drawn by the JAX engine for a model of one pair "
                                    "(jaxformer-serve --engine jax)")
        _check_ready(service)
        sentence = (TextPlan(body.q, route.model.pair[0], model.counter(route), model.run.config.max_len)
                    .sentences or [""])[0]
        [result] = await _answer(request, model.translate([sentence], route, source=route.model.pair[0]))
        png = await model.batcher.run(lambda: model.attention_png(sentence, result.text))
        return Response(png, media_type="image/png")


def _body(model) -> dict[str, Any]:
    """The OpenAPI request body of an endpoint reading JSON or a form (``model``'s fields)."""
    schema = model.model_json_schema() if model is not None else {
        "type": "object", "properties": {"q": {"type": "string"}, "api_key": {"type": "string"}},
        "required": ["q"]}
    kinds = ("application/json", "application/x-www-form-urlencoded")
    return {"requestBody": {"required": True, "content": {kind: {"schema": schema} for kind in kinds}}}


def _check_limits(settings: Settings, texts: list[str], body: api.TranslateFields) -> None:
    """LibreTranslate's batch, alternatives and character limits; ``ApiError`` 400."""
    if isinstance(body.q, list) and settings.batch_limit and len(texts) > settings.batch_limit:
        raise api.ApiError(400, f"Invalid request: request ({len(texts)}) exceeds text limit "
                                f"({settings.batch_limit})")
    if body.alternatives > settings.alternatives_limit:
        raise api.ApiError(400, f"Invalid request: alternatives parameter must be <= "
                                f"{settings.alternatives_limit}")
    for text in texts:
        if settings.char_limit and len(text) > settings.char_limit:
            raise api.ApiError(400, f"Invalid request: request ({len(text)}) exceeds text limit "
                                    f"({settings.char_limit})")


def _check_ready(service: Service) -> None:
    if not service.ready:
        raise api.ApiError(503, "The models are still warming up: retry in a few seconds",
                           {"Retry-After": "5"})


async def _answer(request: HttpRequest, work) -> Any:
    """``await work``, unless the client goes away first (then it is cancelled: its sentences
    leave the queue). ``ApiError`` 503 for a full queue, 500 for an engine error (logged)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        request.state.gone = True
        raise api.ApiError(499, "the client closed the connection")
    try:
        return task.result()
    except QueueFull:
        raise api.ApiError(503, "Too many sentences are waiting: retry in a moment",
                           {"Retry-After": "1"}) from None
    except Exception as e:   # noqa: BLE001 (one request's engine error: logged, answered in words)
        log.error("engine error on %s: %s: %s", request.state.model, type(e).__name__, e)
        raise api.ApiError(500, "Cannot translate text: the engine failed (the server's log says "
                                "why)") from None


async def _disconnected(request: HttpRequest) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _translate_response(body: api.TranslateFields, results, detected) -> dict[str, Any]:
    """LibreTranslate's answer: ``translatedText`` (and ``alternatives`` when asked,
    ``detectedLanguage`` for ``auto``) in ``q``'s shape; ours: ``scores``, ``notes``."""
    one = not isinstance(body.q, list)
    shape = (lambda values: values[0]) if one else list   # noqa: E731
    out: dict[str, Any] = {"translatedText": shape([r.text for r in results])}
    if detected is not None:
        out["detectedLanguage"] = shape([detected] * len(results))
    if body.alternatives > 0:
        out["alternatives"] = shape([r.alternatives for r in results])
    if body.scores:
        out["scores"] = shape([r.scores for r in results])
    if any(r.notes for r in results):
        out["notes"] = shape([r.notes for r in results])
    return out
