"""What a request may do (:class:`ApiKeys`, :class:`RateLimit`) and how big it may be
(:class:`BodyLimit`).

Keys are read once from a file, one a line (``#`` comments and blank lines skipped), and
compared in constant time (``hmac.compare_digest``, every stored key, no early exit); they are
never logged or echoed. The rate limit counts requests per key, else per client address, in
a moving window of one minute (LibreTranslate's ``--req-limit``, through ``limits``, the
library behind its Flask-Limiter): a list ``q`` costs one request per text, as there.
"""

from __future__ import annotations

import hmac
import json
from pathlib import Path

from limits import RateLimitItemPerMinute
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter


class ApiKeys:
    """The keys of ``path``. Raises ``ValueError`` for a file without a key, ``OSError`` for
    one that cannot be read."""

    def __init__(self, path: str | Path):
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        self._keys = [line.strip().encode() for line in lines if line.strip() and not line.startswith("#")]
        if not self._keys:
            raise ValueError(f"--api-keys {str(path)!r} holds no key: write one key per line.")

    def valid(self, key: str | None) -> bool:
        """Whether ``key`` is one of the keys (compared with every key, in constant time)."""
        given = (key or "").encode()
        found = False
        for stored in self._keys:
            found |= hmac.compare_digest(given, stored)
        return found and bool(given)


class RateLimit:
    """At most ``per_minute`` requests per key or client in any minute (moving window)."""

    def __init__(self, per_minute: int):
        self.item = RateLimitItemPerMinute(per_minute)
        self._limiter = MovingWindowRateLimiter(MemoryStorage())

    def hit(self, who: str, cost: int = 1) -> bool:
        """Counts a request of ``cost`` for ``who``; ``False`` when it is over the limit."""
        return self._limiter.hit(self.item, who, cost=cost)

    def __str__(self) -> str:
        return str(self.item)   # "60 per 1 minute", as LibreTranslate words it


class BodyTooLarge(Exception):
    """A request body over the limit."""


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is answered 413 ``{"error": …}`` (by
    its Content-Length before it is read, or once the bytes read pass the limit). Not FastAPI's
    ``max_body_size``: Starlette's limiter answers in plain text, which a LibreTranslate client
    cannot read as an error."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(send)
        seen, started = 0, False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyTooLarge
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send):
        body = json.dumps({"error": f"Invalid request: the body is over {self.max_bytes} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
