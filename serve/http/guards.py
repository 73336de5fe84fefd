"""What every request passes on its way to the routes and back: the body-size limit, the Host check and the last
resort that turns any exception into an OpenAI-shaped 500.

Each is an ASGI middleware, so it holds for every path, the unknown ones included, and every answer it gives is
the JSON error body of `APIError`. The connection is kept (uvicorn drops a keep-alive connection whose handler
raised), except after a 413, whose unread body has to go with it.
"""

from __future__ import annotations

import ipaddress
import logging

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from serve.http.protocol import APIError

log = logging.getLogger("serve.http")

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class BodyTooLarge(HTTPException):
    """Raised while the body is read: an HTTPException, which FastAPI passes on as it is (other errors there
    become a 400 about parsing); the app answers it with `error`."""

    def __init__(self, error: APIError):
        super().__init__(error.status, error.message, error.headers)
        self.error = error


class BodyLimit:
    """413 for a body over `max_bytes`: at once when Content-Length says so, else (chunked, or a Content-Length
    that lies short) as soon as the bytes received pass it. Nothing past the limit is read."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = APIError(413, f"the request body is larger than this server's limit of {self.max_bytes} bytes "
                         "(--max-body-mb)", code="request_too_large", headers={"Connection": "close"})
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await error_response(error)(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            event = await receive()
            received += len(event.get("body", b""))
            if received > self.max_bytes:
                raise BodyTooLarge(error)
            return event

        await self.app(scope, counted, send)


class HostCheck:
    """Refuses requests whose Host header names another server than this one: a page on another site that makes
    its name resolve to 127.0.0.1 (DNS rebinding) would otherwise reach a keyless local server from the browser."""

    def __init__(self, app, names: frozenset[str]):
        self.app, self.names = app, names

    async def __call__(self, scope, receive, send):
        host = Headers(scope=scope).get("host") if scope["type"] == "http" else None
        if host is not None and _hostname(host) not in self.names:
            error = APIError(400, f"the Host header {host!r} does not name this server; without an API key it "
                             f"answers only to {', '.join(sorted(self.names))}", code="invalid_host")
            return await error_response(error)(scope, receive, send)
        await self.app(scope, receive, send)


class CatchAll:
    """Any exception that a route lets through: logged, and answered as a 500 in JSON."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(event):
            nonlocal started
            started = started or event["type"] == "http.response.start"
            await send(event)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if started:  # half a response is out: only closing the connection can tell the client
                raise
            error = APIError(500, "the server failed on this request (its log says why)", kind="server_error")
            await error_response(error)(scope, receive, send)


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def local_host_names(bind_host: str) -> frozenset[str]:
    """The Host names a server bound to a loopback address answers to: the usual ones and the bound address."""
    bound = bind_host.lower()
    return LOOPBACK_NAMES | {f"[{bound}]" if ":" in bound and not bound.startswith("[") else bound}


def _hostname(host: str) -> str:
    """A Host header without its port: `[::1]:8000` -> `[::1]`, `localhost:8000` -> `localhost`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1]
    return host.partition(":")[0]
