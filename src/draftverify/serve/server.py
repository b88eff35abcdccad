"""uvicorn's server with a drain step: on shutdown (SIGINT/SIGTERM or `should_exit`), first
stop taking requests and refuse the waiting ones, give the running generation the grace
period, then let uvicorn wait for the open connections and run the app's shutdown (which
stops the worker and saves the pool)."""

from __future__ import annotations

import uvicorn
from fastapi import FastAPI

DRAIN_MARGIN_S = 5.0  # beyond the grace period, for the last chunks to reach the clients


class Server(uvicorn.Server):
    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", announce=None):
        self.service = app.state.service
        grace = self.service.config.shutdown_grace_s
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=int(grace + DRAIN_MARGIN_S) + 1)
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
