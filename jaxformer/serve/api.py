"""LibreTranslate's request fields, read and checked at the edge (:func:`read_fields`,
:class:`TranslateFields`), and its error answers (:class:`ApiError`).

As LibreTranslate's ``app.py`` reads them: a JSON object (``application/json``; anything else
there is "Invalid JSON format"), else the query string's fields over the form's (deep-translator
sends them as query parameters); ``q`` a string, or in JSON a list of strings (answered in the
same shape); a form's ``q`` with its line ends made ``\\n``. Errors are ``{"error": "…"}`` with
its status codes and words (400 bad input, 403 keys, 429 "Slowdown: …").
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request as HttpRequest


class ApiError(Exception):
    """An answer ``{"error": message}`` with ``status`` (and ``headers``, e.g. Retry-After)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def is_json(request: HttpRequest) -> bool:
    """Whether the body is JSON by its content type (Flask's ``request.is_json``)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


async def read_fields(request: HttpRequest) -> dict[str, Any]:
    """The request's fields (module docstring); ``ApiError`` 400 for a body that is not a JSON
    object under a JSON content type (Starlette's ``HTTPException`` 400 for a malformed form;
    :class:`~jaxformer.serve.limits.BodyTooLarge` for a body over the limit)."""
    if is_json(request):
        try:
            fields = json.loads(await request.body() or b"null")
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "Invalid JSON format") from None
        if not isinstance(fields, dict):
            raise ApiError(400, "Invalid JSON format")
        return fields
    fields: dict[str, Any] = {}
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind in ("application/x-www-form-urlencoded", "multipart/form-data"):   # a malformed one: 400
        fields.update((k, v) for k, v in (await request.form()).items() if isinstance(v, str))
    fields.update(request.query_params.items())   # the query string first, as Flask's request.values
    if isinstance(fields.get("q"), str):
        fields["q"] = "\n".join(fields["q"].splitlines())
    return fields


def api_key(fields: dict[str, Any]) -> str | None:
    """The request's ``api_key`` (a string), or ``None``."""
    key = fields.get("api_key")
    return key if isinstance(key, str) and key else None


class TranslateFields(BaseModel):
    """``POST /translate``'s fields: LibreTranslate's (``q``, ``source``, ``target``, ``format``,
    ``alternatives``, ``api_key``) and ours (``terminology``, ``prefix``, ``scores``). Others are
    ignored, as LibreTranslate ignores them."""

    model_config = ConfigDict(extra="ignore")

    q: str | list[str] = Field(description="Text(s) to translate: a string, or in JSON a list of strings")
    source: str = Field(description='Source language code, or "auto" to detect it', examples=["en"])
    target: str = Field(description="Target language code", examples=["de"])
    format: Literal["text", "html"] | None = Field(
        "text", description="text: plain text; html: markup, its text translated, tags and code kept")
    alternatives: int = Field(0, description="Alternative translations wanted (text format)")
    api_key: str | None = Field(None, description="API key (where the server asks for one)")
    terminology: dict[str, str] | None = Field(
        None, description="Ours (JAX engine): source term -> target term, the target term held by each "
                          "sentence whose source has the term as whole words")
    prefix: str | None = Field(None, description="Ours (JAX engine): each text's first sentence starts "
                                                 "with this target text")
    scores: bool = Field(False, description="Ours: add each sentence's score (log-probability over the "
                                            "length penalty)")


def translate_fields(fields: dict[str, Any]) -> TranslateFields:
    """``fields`` checked as LibreTranslate checks them, in its order and words; ``ApiError`` 400."""
    for name in ("q", "source", "target"):
        if not fields.get(name):
            raise ApiError(400, f"Invalid request: missing {name} parameter")
    fields = dict(fields)
    if fields.get("format") in ("", None):
        fields.pop("format", None)
    elif fields.get("format") not in ("text", "html"):
        raise ApiError(400, f"{fields['format']} format is not supported")
    try:
        fields["alternatives"] = max(0, int(fields.get("alternatives") or 0))
    except (TypeError, ValueError):
        raise ApiError(400, "Invalid request: alternatives parameter is not a number") from None
    try:
        return TranslateFields.model_validate(fields)
    except ValidationError as e:
        error = e.errors()[0]
        name = ".".join(str(part) for part in error["loc"][:1]) or "request"
        raise ApiError(400, f"Invalid request: {name} parameter is not valid ({error['msg']})") from None


def detect_text(fields: dict[str, Any]) -> str:
    """``POST /detect``'s ``q`` (a string); ``ApiError`` 400 without one."""
    q = fields.get("q")
    if not q:
        raise ApiError(400, "Invalid request: missing q parameter")
    if not isinstance(q, str):
        raise ApiError(400, "Invalid request: q parameter is not valid (a string)")
    return q
