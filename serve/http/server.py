"""The app under uvicorn: shutting down drains open requests and then stops the engine; `ServerThread` runs one
on a background thread (tests, notebooks).

A drain is the engine's: from the moment uvicorn stops listening, requests in flight have `drain_seconds` to
finish; then the engine ends the rest, so every open stream gets an error event and `[DONE]` rather than being
cut. uvicorn's own graceful timeout, a little longer, only backs that up.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import uvicorn

from serve.http.routes import Service, create_app

FINAL_EVENTS_SECONDS = 5.0  # past the drain, for the ended requests' last events to go out


def serving_app(service: Service):
    """The app; shutting it down under `Server` drains the engine, and then the lifespan stops it."""

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        service.engine.shutdown(drain_seconds=0.0)

    app = create_app(service, lifespan=lifespan)
    app.state.drain = service.engine.drain
    return app


class Server(uvicorn.Server):
    """uvicorn, whose shutdown first drains the app's engine (`app.state.drain`, where the app has one)."""

    def __init__(self, app, host: str, port: int, drain_seconds: float, log_level: str = "warning"):
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                        timeout_graceful_shutdown=drain_seconds + FINAL_EVENTS_SECONDS))
        self.drain = getattr(app.state, "drain", None)
        self.drain_seconds = drain_seconds

    async def shutdown(self, sockets=None) -> None:
        if self.drain is None:
            return await super().shutdown(sockets)
        drained = asyncio.get_running_loop().run_in_executor(None, self.drain, self.drain_seconds)
        await super().shutdown(sockets)  # stops listening, then waits for the requests the drain ends
        await drained


class ServerThread:
    """A server on a background thread (tests, notebooks): `with ServerThread(app) as s: s.url`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, drain_seconds: float = 10.0):
        self.server = Server(app, host, port, drain_seconds)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    @property
    def url(self) -> str:
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
