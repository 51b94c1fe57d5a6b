"""Run an ASGI app under uvicorn in a background thread of this process (tests, notebooks).

    with BackgroundServer(build_app(llm)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="...")

`stop()` does what SIGTERM does to `sparsex serve`: stop accepting, finish in-flight responses,
run the app's shutdown (which drains the engine).
"""
from __future__ import annotations

import signal
import socket
import threading
import time

import uvicorn


class BackgroundServer:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 60.0):
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))          # port 0: the OS picks a free one, no races
        self.host, self.port = self._sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name=f"uvicorn-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + startup_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.02)

    def stop(self, timeout: float | None = None) -> None:
        """Graceful shutdown, exactly as on SIGTERM."""
        self.server.handle_exit(signal.SIGTERM, None)
        self._thread.join(timeout)
        self._sock.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
