"""One client for every LLM call: an OpenAI-compatible endpoint (vLLM's server), over HTTP only.

Retries with exponential backoff on connection errors, timeouts, 429 and 5xx (the openai
client's own policy), a cap on concurrent requests, token logprobs where a stage asks for
them, streaming, and token counting with the served model's own tokenizer (vLLM /tokenize).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("ragline.llm")


class LLMSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["openai_compatible"]
    base_url: str = Field("http://127.0.0.1:8000/v1", description="OpenAI-compatible API root (vLLM: .../v1)")
    model: str = Field("smollm2", description="served model name")
    api_key: str = Field("EMPTY", description="bearer token, if the server wants one")
    timeout_seconds: float = Field(120.0, gt=0, description="per request")
    max_retries: int = Field(3, ge=0, le=10, description="retries with exponential backoff")
    max_concurrency: int = Field(4, ge=1, le=256, description="requests in flight at once")
    temperature: float = Field(0.0, ge=0, le=2)
    max_tokens: int = Field(256, ge=1, description="default completion length")
    seed: int | None = Field(0, description="sampling seed, for repeatable answers")
    tokenizer: str | None = Field(None, description="local HF tokenizer path if the server has no /tokenize")

    def fingerprint_fields(self) -> dict[str, Any]:
        return self.model_dump(include={"model", "temperature", "seed"})


class LLMUnavailable(RuntimeError):
    """The endpoint did not answer after every retry; the message names it."""


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: dict[str, float] = field(default_factory=dict)

    @property
    def prob(self) -> float:
        return math.exp(self.logprob)


@dataclass
class Completion:
    text: str
    tokens: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def mean_prob(self) -> float | None:
        """Geometric-mean token probability: a cheap confidence signal."""
        if not self.tokens:
            return None
        return math.exp(sum(t.logprob for t in self.tokens) / len(self.tokens))


class LLMClient:
    """Thread-safe; the HTTP clients are created on first use."""

    def __init__(self, spec: LLMSpec, base_dir: Any = None):
        self.spec = spec
        self._client = None
        self._http = None
        self._slots = threading.BoundedSemaphore(spec.max_concurrency)
        self._local_tokenizer = None
        self._tokenize_endpoint: bool | None = None
        self._lock = threading.Lock()

    @property
    def location(self) -> str:
        return f"LLM endpoint {self.spec.base_url} (model '{self.spec.model}')"

    @property
    def client(self):
        if self._client is None:
            from openai import OpenAI

            with self._lock:
                if self._client is None:
                    self._client = OpenAI(base_url=self.spec.base_url, api_key=self.spec.api_key,
                                          timeout=self.spec.timeout_seconds, max_retries=self.spec.max_retries)
        return self._client

    # ------------------------------------------------------------------ generation
    def chat(self, prompt: str | list[dict[str, str]], *, max_tokens: int | None = None,
             temperature: float | None = None, logprobs: bool = False, top_logprobs: int = 0,
             stop: list[str] | None = None, json_schema: dict[str, Any] | None = None) -> Completion:
        """One chat completion; ``prompt`` is a user message or a full message list."""
        kwargs = self._request(prompt, max_tokens, temperature, logprobs, top_logprobs, stop, json_schema)
        response = self._call(lambda: self.client.chat.completions.create(**kwargs))
        choice = response.choices[0]
        return Completion(text=choice.message.content or "", tokens=_tokens(choice.logprobs),
                          finish_reason=choice.finish_reason)

    def stream(self, prompt: str | list[dict[str, str]], *, on_token: Callable[[str], None] | None = None,
               max_tokens: int | None = None, temperature: float | None = None, logprobs: bool = False,
               stop: list[str] | None = None) -> Completion:
        """A streamed chat completion: ``on_token`` sees each piece as it arrives."""
        kwargs = self._request(prompt, max_tokens, temperature, logprobs, 0, stop, None)
        kwargs["stream"] = True
        pieces: list[str] = []
        tokens: list[TokenLogprob] = []
        finish = None
        with self._slots:
            try:
                for event in self.client.chat.completions.create(**kwargs):
                    if not event.choices:
                        continue
                    choice = event.choices[0]
                    delta = choice.delta.content or ""
                    if delta:
                        pieces.append(delta)
                        if on_token:
                            on_token(delta)
                    tokens.extend(_tokens(choice.logprobs))
                    finish = choice.finish_reason or finish
            except Exception as exc:  # noqa: BLE001 - translated to one clear error
                raise self._unavailable(exc) from exc
        return Completion(text="".join(pieces), tokens=tokens, finish_reason=finish)

    def _request(self, prompt, max_tokens, temperature, logprobs, top_logprobs, stop, json_schema) -> dict[str, Any]:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        kwargs: dict[str, Any] = {
            "model": self.spec.model, "messages": messages,
            "max_tokens": max_tokens or self.spec.max_tokens,
            "temperature": self.spec.temperature if temperature is None else temperature,
        }
        if self.spec.seed is not None:
            kwargs["seed"] = self.spec.seed
        if logprobs:
            kwargs.update(logprobs=True, top_logprobs=top_logprobs or None)
        if stop:
            kwargs["stop"] = stop
        if json_schema is not None:
            kwargs["response_format"] = {"type": "json_schema",
                                         "json_schema": {"name": "output", "schema": json_schema}}
        return kwargs

    def _call(self, request: Callable[[], Any]) -> Any:
        with self._slots:
            try:
                return request()
            except Exception as exc:  # noqa: BLE001 - translated to one clear error
                raise self._unavailable(exc) from exc

    def _unavailable(self, exc: Exception) -> Exception:
        import openai

        if isinstance(exc, (openai.APIConnectionError, openai.APITimeoutError, openai.InternalServerError,
                            openai.RateLimitError)):
            return LLMUnavailable(f"{self.location} did not answer after {self.spec.max_retries + 1} attempts: "
                                  f"{type(exc).__name__}: {exc}")
        if isinstance(exc, openai.APIStatusError):
            return RuntimeError(f"{self.location} refused the request (HTTP {exc.status_code}): {exc.message}")
        return exc

    @property
    def http(self):
        """A pooled HTTP client for the server's non-OpenAI endpoints (/tokenize, /health)."""
        if self._http is None:
            import httpx

            with self._lock:
                if self._http is None:
                    self._http = httpx.Client(timeout=self.spec.timeout_seconds,
                                              headers={"Authorization": f"Bearer {self.spec.api_key}"},
                                              limits=httpx.Limits(max_connections=self.spec.max_concurrency))
        return self._http

    # ------------------------------------------------------------------ tokens
    def count_tokens(self, texts: list[str]) -> list[int]:
        """Token counts with the served model's tokenizer (vLLM /tokenize, else a local one)."""
        if self._local_tokenizer is None and self._tokenize_endpoint is not False:
            try:
                if len(texts) <= 1:
                    return [self._tokenize_remote(t) for t in texts]
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(max_workers=self.spec.max_concurrency) as pool:
                    return list(pool.map(self._tokenize_remote, texts))
            except LLMUnavailable:
                raise
            except Exception as exc:  # noqa: BLE001 - a server without /tokenize
                log.warning("%s has no usable /tokenize (%s); counting with a local tokenizer", self.location, exc)
                self._tokenize_endpoint = False
        tokenizer = self._tokenizer()
        if tokenizer is None:
            return [max(1, len(t) // 4) for t in texts]
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []

    def _tokenize_remote(self, text: str) -> int:
        import httpx

        root = self.spec.base_url.rstrip("/").removesuffix("/v1")
        for attempt in range(self.spec.max_retries + 1):
            try:
                response = self.http.post(f"{root}/tokenize", json={"model": self.spec.model, "prompt": text})
                if response.status_code < 500:
                    break
            except httpx.HTTPError as exc:
                if attempt == self.spec.max_retries:
                    raise LLMUnavailable(f"{self.location} did not answer after {attempt + 1} attempts "
                                         f"(/tokenize): {type(exc).__name__}: {exc}") from exc
            time.sleep(min(8.0, 0.5 * 2 ** attempt))
        response.raise_for_status()
        self._tokenize_endpoint = True
        return int(response.json()["count"])

    def _tokenizer(self):
        if self._local_tokenizer is None and self.spec.tokenizer:
            from transformers import AutoTokenizer

            self._local_tokenizer = AutoTokenizer.from_pretrained(self.spec.tokenizer)
        if self._local_tokenizer is None:
            log.warning("no tokenizer for %s: approximating 4 characters per token", self.location)
        return self._local_tokenizer

    def health(self) -> bool:
        import httpx

        root = self.spec.base_url.rstrip("/").removesuffix("/v1")
        try:
            return httpx.get(f"{root}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False


def _tokens(logprobs: Any) -> list[TokenLogprob]:
    if logprobs is None or not getattr(logprobs, "content", None):
        return []
    return [TokenLogprob(t.token, t.logprob, {c.token: c.logprob for c in (t.top_logprobs or [])})
            for t in logprobs.content]


