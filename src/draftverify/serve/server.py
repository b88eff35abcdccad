"""uvicorn's server with a drain step: on shutdown (SIGINT/SIGTERM or `should_exit`), first
stop taking requests and refuse the waiting ones, give the running generation the grace
period, then let uvicorn wait for the open connections and run the app's shutdown (which
stops the worker and saves the pool)."""

from __future__ import annotations

import signal
import threading

import uvicorn
from fastapi import FastAPI

DRAIN_MARGIN_S = 5.0  # beyond the grace period, for the last chunks to reach the clients


class Server(uvicorn.Server):
    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int = 8000,
        log_level: str = "info",
        announce=None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
    ):
        """`ssl_certfile` and `ssl_keyfile` (PEM, both or neither): serve HTTPS with them, as uvicorn does."""
        self.service = app.state.service
        grace = self.service.config.shutdown_grace_s
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            timeout_graceful_shutdown=int(grace + DRAIN_MARGIN_S) + 1,
            ssl_certfile=ssl_certfile,
            ssl_keyfile=ssl_keyfile,
        )
        super().__init__(config)
        self.announce = announce  # called with the bound port once the server listens

    @property
    def port(self) -> int:
        """The port it listens on (the real one when started with port 0)."""
        return self.servers[0].sockets[0].getsockname()[1]

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.announce is not None:
            self.announce(self.port)

    async def shutdown(self, sockets=None) -> None:
        self.service.drain(self.service.config.shutdown_grace_s)
        await super().shutdown(sockets)

    def run_on_main(self) -> None:
        """Serve until SIGINT/SIGTERM with the decoding on THIS thread (the main one: see `Scheduler.work`) and
        uvicorn on another. The signals are caught here and handed to uvicorn's shutdown (drain, grace, close);
        afterwards the signal is raised again, as uvicorn does, so the process ends the way it was told to."""
        caught = []

        def handle(sig, frame):
            caught.append(sig)
            self.force_exit = self.should_exit  # a second signal: stop waiting
            self.should_exit = True

        previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        self.service.scheduler.own_thread = False
        http = threading.Thread(target=self.run, name="draftverify-http", daemon=True)
        http.start()
        try:
            self.service.scheduler.work(alive=http.is_alive)
            http.join()
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)
        for sig in caught[:1]:
            signal.raise_signal(sig)
