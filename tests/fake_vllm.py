"""A stand-in for vLLM's server in tests of the managed LLM (no GPU, starts in a second): a real
child process answering /health, /v1/models and completions like vLLM, on the port it is given.

    deploy = fake_deploy(tmp_path)           # deploy/vllm/ whose serve.sh execs this module
    monkeypatch.setenv("RAGLINE_VLLM_DEPLOY", str(deploy))

``before`` is shell run first (``"exit 3\n"``: a server that cannot start; ``"export
FAKE_VLLM_BROKEN=1\n"``: one that lists its model but answers completions 500; ``"export
FAKE_VLLM_DIE_AFTER=1\n"``: one that exits 3 at its second completion request).
``engine=True`` makes serve.sh first start an "engine" process in the same process group that
ignores SIGTERM, as vLLM's EngineCore does; its pid is written to ``deploy/engine.pid``.
"""
from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ENGINE = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)")


def fake_deploy(root: Path, *, engine: bool = False, before: str = "") -> Path:
    """A deploy/vllm/ folder under ``root`` whose serve.sh runs this server on $VLLM_PORT."""
    folder = root / "deploy" / "vllm"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "setup.sh").write_text("exit 0\n")
    start_engine = f"{sys.executable} -c '{ENGINE}' &\necho $! > {folder / 'engine.pid'}\n" if engine else ""
    (folder / "serve.sh").write_text(
        "set -eu\n" + before + start_engine +
        f'echo "fake vLLM starting on port $VLLM_PORT"\n'
        f'PYTHONPATH={REPO} exec {sys.executable} -m tests.fake_vllm "$VLLM_PORT" "${{VLLM_SERVED_NAME:-smollm2}}"\n')
    return folder


def main(port: int, model: str) -> None:
    served: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": model, "object": "model"}]})
            else:
                self._send(404, {"error": {"message": "not found"}})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if os.environ.get("FAKE_VLLM_BROKEN"):  # lists its model, cannot generate
                self._send(500, {"error": {"message": "engine dead"}})
                return
            served.append(self.path)
            if len(served) > int(os.environ.get("FAKE_VLLM_DIE_AFTER", "1000000")):  # dies as vLLM can
                print("fake vLLM: engine core died unexpectedly", flush=True)
                os._exit(3)
            usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
            if self.path == "/v1/chat/completions":
                self._send(200, {"id": "x", "object": "chat.completion", "created": int(time.time()), "model": model,
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": "ok"}}], "usage": usage})
            elif self.path == "/v1/completions":
                self._send(200, {"id": "x", "object": "text_completion", "created": int(time.time()), "model": model,
                                 "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}], "usage": usage})
            else:
                self._send(404, {"error": {"message": "not found"}})

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(f"fake vLLM serving '{model}' on 127.0.0.1:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
