"""The app under uvicorn: shutting down drains open requests and then stops the engine; `ServerThread` runs one
on a background thread (tests, notebooks)."""

from __future__ import annotations

import contextlib
import threading
import time

import uvicorn

from serve.http.routes import Service, create_app


def serving_app(service: Service):
    """The app; shutting it down drains (uvicorn waits for open requests) and then stops the engine."""

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        service.engine.shutdown(drain_seconds=0.0)

    return create_app(service, lifespan=lifespan)


class ServerThread:
    """A uvicorn server on a background thread (tests, notebooks): `with ServerThread(app) as s: s.url`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, drain_seconds: float = 10.0):
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=drain_seconds)
        self.server = uvicorn.Server(config)
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
