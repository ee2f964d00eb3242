"""A treedec server on the loopback in a background thread, for tests (uvicorn on a free port)."""
from __future__ import annotations

import threading
import time

import uvicorn

from treedec import LLM
from treedec.serve import build_app


class RunningServer:
    """``build_app(llm, name, **kwargs)`` served by uvicorn on 127.0.0.1 (a free port) until :meth:`stop`."""

    def __init__(self, llm: LLM, name: str = "tiny", **kwargs):
        self.llm, self.name = llm, name
        self.app = build_app(llm, name, **kwargs)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.base_url = f"{self.url}/v1"

    @property
    def online(self):
        return self.app.state.online

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
