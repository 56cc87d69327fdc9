"""A real `lumen serve` app on loopback for tests: uvicorn in a thread on a free port."""

from __future__ import annotations

import socket
import threading
import time

import lumen_core as lumen


def load_tiny(path, context: int = 512):
    return lumen.load({"model": {"path": str(path), "hidden-layers": {"kv-cache": {"context-size": context}}}},
                      progress=False)


class Server:
    """``Server(engine, api_keys)`` starts; ``.url`` is ``http://127.0.0.1:PORT``; ``.stop()`` stops."""

    def __init__(self, engine, api_keys=None, model_name: str = "tiny"):
        import uvicorn

        from lumen_core.server.app import create_app

        self.app = create_app(engine, api_keys, model_name)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.app.state.service.close()
