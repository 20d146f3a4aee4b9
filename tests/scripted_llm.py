"""A scripted OpenAI-compatible HTTP server for faults a real model cannot be made to produce on
demand: malformed structured output, slowness, 5xx. Real HTTP on 127.0.0.1, real openai client."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from tests.helpers.net import serve_in_thread


def _usage(body: dict, pieces: list[str]) -> dict:
    """Token counts as vLLM reports them (here: words of the messages, pieces answered)."""
    prompt = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
    return {"prompt_tokens": prompt, "completion_tokens": len(pieces), "total_tokens": prompt + len(pieces)}


class ScriptedLLM:
    """``reply(prompt) -> str`` decides each answer; ``delay`` and ``status`` simulate faults.
    ``tokenize(body) -> (status, payload) | None`` scripts /tokenize (None: the default answer,
    vLLM's shape counting words); ``paths`` lists every request's path, in order.

    ``"stream": true`` requests are answered as server-sent chunks, one per word (``chunk_delay``
    seconds apart), ending in ``data: [DONE]``; ``GET /health`` and ``GET /v1/models`` answer like vLLM.

    A hung server: while ``hung`` is true, every request (health checks too) is accepted and read but
    never answered; its connection is dropped unanswered when ``hung`` is cleared or the server
    closes. ``hang_after_chunks=N`` hangs each stream after N chunks the same way.

    A broken server: ``malformed`` answers 200 with a body that is not JSON; ``cut_after_chunks=N``
    closes each stream's connection after N chunks, without the end of the answer or [DONE].

    ``top(prompt) -> {token: logprob}`` scripts the first token's top_logprobs (a judge reading P(yes)
    from them); without it each token's top list is the token itself.

    ``cut_at_max_tokens``: a (non-streamed) reply longer than the request's ``max_tokens`` words is cut
    there and finishes with ``"length"``, as a real server does; off, every reply is whole.

    ``"n": N`` is answered with N choices, ``reply`` asked for each; ``ignore_n`` answers one whatever
    ``n`` says (a server without it)."""

    def __init__(self, reply: Callable[[str], str] = lambda prompt: "ok", delay: float = 0.0, status: int = 200,
                 logprob: float = -0.1, tokenize: Callable[[dict], tuple[int, dict] | None] | None = None,
                 chunk_delay: float = 0.0, hung: bool = False, hang_after_chunks: int | None = None,
                 malformed: bool = False, cut_after_chunks: int | None = None,
                 top: Callable[[str], dict[str, float]] | None = None, cut_at_max_tokens: bool = False,
                 ignore_n: bool = False):
        self.top, self.cut_at_max_tokens, self.ignore_n = top, cut_at_max_tokens, ignore_n
        self.reply, self.delay, self.status, self.logprob = reply, delay, status, logprob
        self.malformed, self.cut_after_chunks = malformed, cut_after_chunks
        self.hung, self.hang_after_chunks = hung, hang_after_chunks
        self._closing = threading.Event()
        self.chunk_delay = chunk_delay
        self.tokenize = tokenize
        self.requests: list[dict] = []
        self.paths: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                server.paths.append(self.path)
                if server.hold():
                    return
                time.sleep(server.delay)
                scripted = server.tokenize(body) if server.tokenize and self.path.endswith("/tokenize") else None
                if scripted is not None:
                    self._send(*scripted)
                    return
                if server.status != 200:
                    self._send(server.status, {"error": {"message": "scripted failure", "type": "server_error"}})
                    return
                if server.malformed:
                    self._send(200, None, raw=b'{"id": "x", "choices": [{"index": 0, "message": {"content": "Par')
                    return
                if self.path.endswith("/tokenize"):
                    self._send(200, {"count": len(body["prompt"].split()), "max_model_len": 2048})
                    return
                prompt = body["messages"][-1]["content"]
                choices, produced = [], []
                for index in range(1 if server.ignore_n else body.get("n") or 1):  # `n`: reply() asked anew each
                    text = server.reply(prompt)
                    lp = server.logprob
                    pieces = [w + " " for w in text.split(" ")[:-1]] + text.split(" ")[-1:]
                    finish = "stop"
                    if server.cut_at_max_tokens and body.get("max_tokens") and len(pieces) > body["max_tokens"]:
                        pieces, finish = pieces[: body["max_tokens"]], "length"
                        text = "".join(pieces)
                    if body.get("stream"):
                        self._stream(body, pieces, lp)
                        return
                    logprobs = {"content": [{"token": w, "logprob": lp, "top_logprobs": [{"token": w, "logprob": lp}]}
                                            for w in pieces]} if body.get("logprobs") else None
                    if logprobs and server.top is not None:
                        logprobs["content"][0]["top_logprobs"] = [{"token": t, "logprob": v}
                                                                  for t, v in server.top(prompt).items()]
                    choices.append({"index": index, "finish_reason": finish, "logprobs": logprobs,
                                    "message": {"role": "assistant", "content": text}})
                    produced += pieces
                self._send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                                 "choices": choices, "usage": _usage(body, produced)})

            def do_GET(self):
                server.paths.append(self.path)
                if server.hold():
                    return
                if self.path.endswith("/health"):
                    self._send(200, {})
                elif self.path.endswith("/models"):
                    self._send(200, {"object": "list", "data": [{"id": "scripted", "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": "not found", "type": "not_found"}})

            def _stream(self, body, pieces, lp):
                """Server-sent chunks as vLLM sends them: the role, one word each, the finish, [DONE]."""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                base = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
                deltas = [({"role": "assistant", "content": ""}, None, None)]
                deltas += [({"content": w}, {"content": [{"token": w, "logprob": lp, "top_logprobs": []}]}
                            if body.get("logprobs") else None, None) for w in pieces if w]
                deltas.append(({}, None, "stop"))
                for sent, (delta, logprobs, finish) in enumerate(deltas):
                    if sent == server.hang_after_chunks:
                        server._closing.wait()
                        return
                    if sent == server.cut_after_chunks:
                        self.close_connection = True
                        return
                    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                    self.wfile.write(f"data: {json.dumps({**base, 'choices': [choice]})}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(server.chunk_delay)
                if (body.get("stream_options") or {}).get("include_usage"):  # vLLM's last chunk: counts only
                    last = {**base, "choices": [], "usage": _usage(body, pieces)}
                    self.wfile.write(f"data: {json.dumps(last)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

            def _send(self, status, payload, raw: bytes | None = None):
                data = raw if raw is not None else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> "ScriptedLLM":
        self.thread = serve_in_thread(self.httpd)  # its 20 ms poll: shutdown returns at once
        return self

    def hold(self) -> bool:
        """While ``hung``: wait, answering nothing; True if the request is to be dropped unanswered."""
        held = False
        while self.hung and not self._closing.is_set():
            held = True
            time.sleep(0.02)
        return held or self._closing.is_set()

    def __exit__(self, *exc) -> None:
        self._closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()
