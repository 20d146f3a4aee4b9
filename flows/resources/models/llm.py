"""One client for every LLM call: an OpenAI-compatible endpoint (vLLM's server), over HTTP only.

A hung server is told from a busy one: while a request goes unanswered, the server's health
check is asked every ``hung_after_seconds / 2``; one that answers it is busy and is waited for (up
to ``timeout_seconds``, with a line on the ``ragline.llm`` log at each check), one that does not is
reported at once, after ``hung_after_seconds`` (20 s by default), never retried. Refused connections,
429 and 5xx are retried with exponential backoff (``max_retries``); a timeout is not (the same
request would take as long again). Concurrent requests are capped and served oldest query first in
two lanes (long generations; short checks and /tokenize: see ``FairSlots``). Also: token logprobs
where a stage asks for them, streaming, and token counting with the served model's own tokenizer
(vLLM /tokenize, else a local copy of it; an estimate only where the spec opts in).

Sampling is the resource's (``temperature``, ``seed``) unless a call asks for its own: ``chat`` and
``stream`` take ``temperature`` and ``seed``, and ``samples`` asks for ``n`` completions of one prompt
in one request (OpenAI's ``n``, which vLLM serves as one batch), validated by ``Sampling``; the
resource's defaults stay as they are for every other caller.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import math
import queue
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar

import tenacity
from pydantic import BaseModel, ConfigDict, Field

from ragline.flows import telemetry
from ragline.flows.errors import DependencyUnavailable
from ragline.flows.resources.base import Health, Lazy, Resource
from ragline.flows.resources.models.fair_slots import FairSlots
from ragline.flows.threads import on_own_thread

log = logging.getLogger("ragline.llm")
SHORT_CALL_TOKENS = 16  # completions this short (verify: 2, pointwise rerank: 1) take the short lane
CONNECT_TIMEOUT = 10.0  # seconds to open a connection (retried: the server may be restarting)
HEALTH_REUSE_SECONDS = 2.0  # concurrent waiters share one health check
HEALTH_TIMEOUT_SECONDS = 5.0  # a readiness probe's wait for the endpoint


class LLMSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["openai_compatible"]
    base_url: str = Field("http://127.0.0.1:8000/v1", description="OpenAI-compatible API root (vLLM: .../v1)")
    model: str = Field("smollm2", description="served model name")
    api_key: str = Field("EMPTY", repr=False, description="bearer token, if the server wants one (never shown)")
    timeout_seconds: float = Field(120.0, gt=0, description="longest wait for one answer from a server that is up "
                                                           "(it answers its health check meanwhile); not retried")
    hung_after_seconds: float = Field(
        20.0, gt=0, description="a request unanswered this long is given up, not retried, when the server does not "
                                "answer its health check either (asked every half of this while it is silent)")
    max_retries: int = Field(3, ge=0, le=10, description="retries with exponential backoff of refused connections, "
                                                         "429 and 5xx")
    max_concurrency: int = Field(4, ge=1, le=256, description="requests in flight at once, per lane (long "
                                                              "generations; short checks and /tokenize)")
    temperature: float = Field(0.0, ge=0, le=2)
    max_tokens: int = Field(256, ge=1, description="default completion length")
    seed: int | None = Field(0, description="sampling seed, for repeatable answers")
    tokenizer: str | None = Field(None, description="HF tokenizer (folder or id) of the served model, for "
                                                   "servers without /tokenize")
    chars_per_token: float | None = Field(
        None, gt=0, description="opt-in estimate (e.g. 4) when the server has no /tokenize and no local tokenizer "
                                "exists; unset, that is an error, since token budgets would be guesses")


MAX_SAMPLES = 16  # completions one request may ask for (``n``): a bound on what one call costs
RESOURCE = "resource"  # a per-call ``seed`` left to the resource's


class Sampling(BaseModel):
    """A call's own sampling, checked before anything is sent: ``n`` completions (1..16) at
    ``temperature`` (None: the resource's) with ``seed`` (``"resource"``: the resource's; None: none)."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(1, ge=1, le=MAX_SAMPLES, description="completions of the one prompt")
    temperature: float | None = Field(None, ge=0, le=2, description="None: the resource's")
    seed: int | None | Literal["resource"] = Field(RESOURCE, description="'resource': the resource's; None: unseeded")


class LLMUnavailable(DependencyUnavailable):
    """The endpoint did not answer after every retry; the message names it."""

    dependency = "llm"


class _StreamCut(Exception):
    """A streamed answer ended without a finish reason: the connection closed mid-answer."""


class _NoTokenizeEndpoint(Exception):
    """The server has no (vLLM-style) /tokenize: a fact about the server, not a transient failure."""


TokenCounting = Literal["server", "local", "estimate"]
T = TypeVar("T")
R = TypeVar("R")


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


class LLMClient(Resource):
    """Thread-safe; the HTTP clients are created on first use."""

    preload = ("openai",)

    Spec = LLMSpec

    def __init__(self, spec: LLMSpec, base_dir: Any = None):
        super().__init__(spec, base_dir)
        self._client = Lazy(self._connect)
        # Two lanes, each served oldest query first: long generations (answers, streams) and short
        # calls (verification and pointwise relevance: a token or two; /tokenize), so a query's
        # quick checks never wait behind other queries' long streams.
        self._long = FairSlots(spec.max_concurrency, name="long")
        self._short = FairSlots(spec.max_concurrency, name="short")
        self._local_tokenizer = Lazy(self._load_tokenizer)  # None: there is none
        self._local_tokenizer_lock = threading.Lock()  # a fast tokenizer is not safe to share across threads
        self._tokenize_endpoint: bool | None = None  # None: not asked yet; False: the server has none
        self._health_lock = threading.Lock()
        self._health: tuple[float, bool] = (-math.inf, False)  # (when checked, whether it answered)
        # how the last counts were made, so callers can tell a budget that only holds by an estimate
        self.token_counting: TokenCounting | None = None
        self._estimate_warned = False

    @classmethod
    def fingerprint_fields(cls, spec: LLMSpec) -> dict[str, Any]:
        return spec.model_dump(include={"model", "temperature", "seed"})

    @property
    def location(self) -> str:
        return f"LLM endpoint {without_credentials(self.spec.base_url)} (model '{self.spec.model}')"

    @property
    def client(self):
        """The openai client, retrying nothing itself: ``_retrying`` decides what is worth a retry."""
        return self._client.get()

    def _connect(self):
        from openai import OpenAI, Timeout

        timeout = Timeout(self.spec.timeout_seconds, connect=min(CONNECT_TIMEOUT, self.spec.timeout_seconds))
        return OpenAI(base_url=self.spec.base_url, api_key=self.spec.api_key, timeout=timeout, max_retries=0)

    def warm_up(self) -> None:
        """The HTTP client and its imports; the server itself is not asked (it may still be starting:
        readiness says when it answers)."""
        self.client  # noqa: B018 - creating it is the point

    def close(self) -> None:
        client = self._client.reset()
        if client is not None:
            client.close()
        self._local_tokenizer.reset()

    # ------------------------------------------------------------------ generation
    def chat(self, prompt: str | list[dict[str, str]], *, max_tokens: int | None = None,
             temperature: float | None = None, logprobs: bool = False, top_logprobs: int = 0,
             stop: list[str] | None = None, json_schema: dict[str, Any] | None = None,
             seed: int | None | Literal["resource"] = RESOURCE) -> Completion:
        """One chat completion; ``prompt`` is a user message or a full message list. ``temperature``
        and ``seed`` override the resource's for this call only."""
        return self._complete(prompt, Sampling(temperature=temperature, seed=seed), max_tokens, logprobs, top_logprobs,
                              stop, json_schema)[0]

    def samples(self, prompt: str | list[dict[str, str]], n: int, *, max_tokens: int | None = None,
                temperature: float | None = None, logprobs: bool = False, top_logprobs: int = 0,
                stop: list[str] | None = None, json_schema: dict[str, Any] | None = None,
                seed: int | None | Literal["resource"] = RESOURCE) -> list[Completion]:
        """``n`` completions of one prompt in one request (OpenAI ``n``), in the server's order, each
        with its own text, logprobs and finish reason (with ``json_schema`` each is held to it). With
        a seed (the resource's by default) the same request gives the same samples again; at
        temperature 0 they are all the same text: greedy decoding is asked for once and repeated (vLLM
        refuses ``n`` > 1 with greedy sampling, and N copies of one decoding would cost N for nothing).
        ``n``, ``temperature`` and ``seed`` are checked (``Sampling``) and hold for this call only."""
        return self._complete(prompt, Sampling(n=n, temperature=temperature, seed=seed), max_tokens, logprobs,
                              top_logprobs, stop, json_schema)

    def _complete(self, prompt, sampling: Sampling, max_tokens, logprobs, top_logprobs, stop,
                  json_schema) -> list[Completion]:
        """``chat`` and ``samples``: one request (wrapping either from outside never wraps the other)."""
        wanted = sampling.n
        if (self.spec.temperature if sampling.temperature is None else sampling.temperature) == 0:
            sampling = sampling.model_copy(update={"n": 1})
        kwargs = self._request(prompt, max_tokens, sampling, logprobs, top_logprobs, stop, json_schema)
        lane = self._short if kwargs["max_tokens"] <= SHORT_CALL_TOKENS and sampling.n == 1 else self._long
        with self._observed("chat", kwargs) as call:
            response = self._call(lambda: self.client.chat.completions.create(**kwargs), lane)
            choices = sorted(response.choices, key=lambda c: getattr(c, "index", None) or 0)
            if len(choices) != sampling.n:
                raise LLMUnavailable(f"{self.location} answered {len(choices)} completion(s) where {sampling.n} "
                                     f"were asked for (n): the server does not serve `n`")
            completions = [Completion(text=c.message.content or "", tokens=_tokens(c.logprobs),
                                      finish_reason=c.finish_reason) for c in choices]
            call.done(completions, getattr(response, "usage", None))
        return [replace(completions[0]) for _ in range(wanted)] if sampling.n < wanted else completions

    def stream(self, prompt: str | list[dict[str, str]], *, on_token: Callable[[str], None] | None = None,
               max_tokens: int | None = None, temperature: float | None = None, logprobs: bool = False,
               stop: list[str] | None = None, seed: int | None | Literal["resource"] = RESOURCE) -> Completion:
        """A streamed chat completion: ``on_token`` sees each piece as it arrives."""
        kwargs = self._request(prompt, max_tokens, Sampling(temperature=temperature, seed=seed), logprobs, 0, stop,
                               None)
        kwargs["stream"] = True
        kwargs["stream_options"] = {"include_usage": True}  # vLLM's token counts, in a last chunk
        pieces: list[str] = []
        tokens: list[TokenLogprob] = []
        usage: list[Any] = []

        def read() -> str | None:
            finish = None
            for event in self._events(kwargs):
                if getattr(event, "usage", None) is not None:
                    usage.append(event.usage)
                if not event.choices:
                    continue
                choice = event.choices[0]
                delta = choice.delta.content or ""
                if delta:
                    if not pieces:
                        call.first_token()
                    pieces.append(delta)
                    if on_token:
                        on_token(delta)
                tokens.extend(_tokens(choice.logprobs))
                finish = choice.finish_reason or finish
            if finish is None:  # vLLM ends every answer with a finish reason; without one it was cut
                raise _StreamCut(f"the streamed answer stopped after {len(''.join(pieces))} characters "
                                 f"without an end (the connection closed mid-answer)")
            return finish

        with self._observed("stream", kwargs) as call:
            with self._long.slot() as waited:  # retried before the first token only: shown words stay shown
                call.slot(waited)
                finish = self._retrying(read, "", final=lambda exc: bool(pieces))
            completion = Completion(text="".join(pieces), tokens=tokens, finish_reason=finish)
            call.done([completion], usage[-1] if usage else None)
        return completion

    def _observed(self, call: str, kwargs: dict[str, Any]) -> "_ObservedCall":
        """Metrics and a child span of the running step for one call (see ``flows/telemetry.py``)."""
        return _ObservedCall(self.spec.model, call, kwargs)

    def map(self, fn: Callable[[T], R], items: list[T]) -> list[R]:
        """``fn`` over ``items`` on up to ``max_concurrency`` threads, in order. Each runs in the caller's
        context, so its LLM calls queue as the caller's query (``QUERY_ARRIVAL``), not as a new one."""
        items = list(items)
        if len(items) <= 1:
            return [fn(item) for item in items]
        context = contextvars.copy_context()
        pool = ThreadPoolExecutor(max_workers=min(len(items), self.spec.max_concurrency))
        try:
            return list(pool.map(lambda item: context.copy().run(fn, item), items))
        finally:  # after a failure, the items not started yet are not started at all
            pool.shutdown(cancel_futures=True)

    def _request(self, prompt, max_tokens, sampling: Sampling, logprobs, top_logprobs, stop,
                 json_schema) -> dict[str, Any]:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        kwargs: dict[str, Any] = {
            "model": self.spec.model, "messages": messages,
            "max_tokens": max_tokens or self.spec.max_tokens,
            "temperature": self.spec.temperature if sampling.temperature is None else sampling.temperature,
        }
        if sampling.n > 1:  # one sample: no `n` at all, the request as it always was
            kwargs["n"] = sampling.n
        seed = self.spec.seed if sampling.seed == RESOURCE else sampling.seed
        if seed is not None:
            kwargs["seed"] = seed
        if logprobs:
            kwargs.update(logprobs=True, top_logprobs=top_logprobs or None)
        if stop:
            kwargs["stop"] = stop
        if json_schema is not None:
            kwargs["response_format"] = {"type": "json_schema",
                                         "json_schema": {"name": "output", "schema": json_schema}}
        return kwargs

    def _call(self, request: Callable[[], Any], lane: FairSlots, what: str = "",
              keep: Callable[[Exception], bool] = lambda exc: False) -> Any:
        """``request`` in a slot of ``lane``, watched (see ``_watched``) and retried (see ``_retrying``);
        the observed call this is part of (if any) is told how long the slot took."""
        with lane.slot() as waited:
            observed = _OBSERVED.get()
            if observed is not None:
                observed.slot(waited)
            return self._retrying(lambda: self._watched(request, what), what, keep)

    def _retrying(self, call: Callable[[], T], what: str, keep: Callable[[Exception], bool] = lambda exc: False,
                  final: Callable[[Exception], bool] = lambda exc: False) -> T:
        """``call()``, tried again after a transient failure (``_transient``) up to ``max_retries`` times
        with ``_backoff``; then one clear error, except for errors ``keep`` wants as they are. Errors
        ``final`` names are not retried."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(lambda exc: not keep(exc) and not final(exc) and _transient(exc)),
            stop=tenacity.stop_after_attempt(self.spec.max_retries + 1), wait=_backoff, reraise=True,
            before_sleep=self._log_retry)
        try:
            return retrying(call)
        except Exception as exc:  # noqa: BLE001 - retried where sensible, else one clear error
            failure = exc if keep(exc) else self._failed(exc, what, retrying.statistics["attempt_number"])
            if failure is exc:
                raise
            raise failure from exc

    def _log_retry(self, state: tenacity.RetryCallState) -> None:
        log.info("%s: %s; retrying in %.1f s (attempt %d of %d)", self.location,
                 type(state.outcome.exception()).__name__, state.upcoming_sleep, state.attempt_number + 1,
                 self.spec.max_retries + 1)

    def _failed(self, exc: Exception, request: str, attempts: int) -> Exception:
        """One clear error naming the endpoint (and ``request``, when it is not a completion)."""
        import openai

        where = f" ({request})" if request else ""
        if isinstance(exc, LLMUnavailable):
            return exc
        if isinstance(exc, openai.APITimeoutError) and attempts == 1:
            return LLMUnavailable(f"{self.location} did not answer within {self.spec.timeout_seconds:g} s "
                                  f"(timeout_seconds){where}: {type(exc).__name__}: {exc}")
        if isinstance(exc, (openai.APIConnectionError, openai.APITimeoutError, openai.InternalServerError,
                            openai.RateLimitError)):
            return LLMUnavailable(f"{self.location} did not answer after {attempts} attempt{'s' * (attempts > 1)}"
                                  f"{where}: {type(exc).__name__}: {exc}")
        if isinstance(exc, openai.APIStatusError):
            return RuntimeError(f"{self.location} refused the request{where} (HTTP {exc.status_code}): {exc.message}")
        tried = f" ({attempts} attempt{'s' * (attempts > 1)})"
        if isinstance(exc, (json.JSONDecodeError, openai.APIResponseValidationError)):
            return LLMUnavailable(f"{self.location} sent a malformed response{where}{tried}: {type(exc).__name__}: "
                                  f"{exc}")
        if isinstance(exc, _StreamCut) or _is_transport_error(exc):  # a stream's connection dropped mid-answer
            return LLMUnavailable(f"{self.location}{where}{tried}: {exc}; the partial answer is discarded")
        return exc

    # ------------------------------------------------------------------ hung or busy
    def _watched(self, request: Callable[[], Any], what: str) -> Any:
        """``request()`` on a helper thread, awaited here while checking that a silent server is up.
        A request given up on stays with its thread until its own timeout, unused."""
        answer = on_own_thread(request, "ragline-llm-request")
        return self._await(lambda timeout: _ready(answer, timeout), what)

    def _events(self, kwargs: dict[str, Any]) -> Iterator[Any]:
        """A streamed completion's events, read on a helper thread; each is awaited like ``_watched``."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        opened: list[Any] = []
        end = object()

        def run() -> None:
            try:
                stream = self.client.chat.completions.create(**kwargs)
                opened.append(stream)
                for event in stream:
                    events.put(event)
                events.put(end)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                events.put(exc)

        def take(timeout: float) -> tuple[bool, Any]:
            try:
                return True, events.get(timeout=timeout)
            except queue.Empty:
                return False, None

        on_own_thread(run, "ragline-llm-stream")  # run() hands every outcome over the queue
        finished = False
        try:
            while True:
                item = self._await(take, "")
                if item is end:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished and opened:  # given up (hung, or the consumer stopped): free the connection
                with contextlib.suppress(Exception):
                    opened[0].close()

    def _await(self, poll: Callable[[float], tuple[bool, Any]], what: str) -> Any:
        """``poll(timeout) -> (ready, value)`` until ready. Every ``hung_after_seconds / 2`` of silence the
        server's health check is asked: answered, the server is busy and is waited for (the request's own
        ``timeout_seconds`` bounds it); unanswered, it is hung, and this raises ``LLMUnavailable``."""
        half = self.spec.hung_after_seconds / 2
        started = time.monotonic()
        where = f" ({what})" if what else ""
        while True:
            ready, value = poll(half)
            if ready:
                return value
            up = self._answers_health(half, started, where)
            ready, value = poll(0)
            if ready:
                return value
            silent = time.monotonic() - started
            if not up:
                raise LLMUnavailable(
                    f"{self.location} accepted the request{where} but has not answered in {silent:.0f} s, nor its "
                    f"health check ({self.health_url}): the server is hung or stopped; not retried "
                    f"(hung_after_seconds: {self.spec.hung_after_seconds:g})")
            if silent > self.spec.timeout_seconds + half:  # its own read timeout should have ended it
                raise LLMUnavailable(f"{self.location} did not answer within {self.spec.timeout_seconds:g} s "
                                     f"(timeout_seconds){where}")

    @property
    def health_url(self) -> str:
        return self.spec.base_url.rstrip("/").removesuffix("/v1") + "/health"

    def _answers_health(self, timeout: float, since: float, where: str) -> bool:
        """Whether the server's HTTP layer answers at all (any status below 500, even 404: not hung).
        Waiters share a check made while they were waiting (``since``) and at most 2 s ago; each check
        is one line on the log, so a user waiting sees what is going on (the CLI shows it)."""
        import httpx

        with self._health_lock:
            checked, answered = self._health
            if checked >= since and time.monotonic() - checked < HEALTH_REUSE_SECONDS:
                return answered
            log.info("no answer from %s%s after %.0f s; checking that it is up", self.location, where,
                     time.monotonic() - since)
            try:
                answered = httpx.get(self.health_url, timeout=timeout).status_code < 500
            except httpx.HTTPError:
                answered = False
            self._health = (time.monotonic(), answered)
            if answered:
                log.info("%s answers its health check, so it is busy: waiting for the answer (up to %g s, "
                         "timeout_seconds)", self.location, self.spec.timeout_seconds)
            return answered

    # ------------------------------------------------------------------ tokens
    def count_tokens(self, texts: list[str]) -> list[int]:
        """Token counts with the served model's own tokenizer, so prompt budgets hold.

        The server's /tokenize (vLLM) first, retried like completions; a transient failure is raised
        after the retries and never changes how later calls count. A server without /tokenize
        (404/405) is counted with a local tokenizer: ``tokenizer:``, else the served model's folder
        when ``model`` is one. With neither, ``chars_per_token`` gives an estimate only where the spec
        asks for it (warned once, visible as ``token_counting``); otherwise this is an error, because
        a budget silently counted by a guess overflows or wastes the model's context.
        """
        if not texts:
            return []
        if self._tokenize_endpoint is not False:
            try:
                counts = self._count_remote(texts)
            except _NoTokenizeEndpoint as exc:
                log.warning("%s has no /tokenize (%s); counting tokens locally", self.location, exc)
                self._tokenize_endpoint = False
            else:
                self.token_counting = "server"
                return counts
        return self._count_locally(texts)

    @property
    def tokenize_url(self) -> str:
        return self.spec.base_url.rstrip("/").removesuffix("/v1") + "/tokenize"

    def _count_remote(self, texts: list[str]) -> list[int]:
        return self.map(self._tokenize_remote, texts)  # queued as this query (``map`` carries its context)

    def _tokenize_remote(self, text: str) -> int:
        """One /tokenize request through the openai client: the same watch, retries and errors."""
        import openai

        def absent(exc: Exception) -> bool:
            return isinstance(exc, openai.APIStatusError) and exc.status_code in (404, 405)

        try:
            body = self._call(lambda: self.client.post(self.tokenize_url, body={"model": self.spec.model,
                                                                               "prompt": text}, cast_to=str),
                              self._short, f"POST {self.tokenize_url}", keep=absent)
        except openai.APIStatusError as exc:
            raise _NoTokenizeEndpoint(f"HTTP {exc.status_code}") from exc
        count = _count_field(body)
        if count is None:
            raise _NoTokenizeEndpoint(f"its answer has no token count: {body[:200]!r}")
        self._tokenize_endpoint = True
        return count

    def _count_locally(self, texts: list[str]) -> list[int]:
        tokenizer = self._tokenizer()
        if tokenizer is not None:
            with self._local_tokenizer_lock:
                ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
            self.token_counting = "local"
            return [len(i) for i in ids]
        if self.spec.chars_per_token is None:
            raise RuntimeError(
                f"{self.location} has no /tokenize ({self.tokenize_url}) and no local tokenizer is available, so "
                f"token budgets cannot be counted: set `tokenizer:` on the llm resource to the served model's "
                f"tokenizer (a folder or HF id), or `chars_per_token:` (e.g. 4) to accept an estimate")
        if not self._estimate_warned:
            self._estimate_warned = True
            log.warning("%s: no /tokenize and no local tokenizer; token budgets use an estimate of %g characters "
                        "per token (chars_per_token)", self.location, self.spec.chars_per_token)
        self.token_counting = "estimate"
        return [math.ceil(len(t) / self.spec.chars_per_token) for t in texts]

    def _tokenizer(self) -> Any:
        return self._local_tokenizer.get()

    def _load_tokenizer(self) -> Any:
        """The configured tokenizer, else the served model's own when ``model`` is a local folder."""
        from transformers import AutoTokenizer

        if self.spec.tokenizer:
            try:
                return AutoTokenizer.from_pretrained(self.spec.tokenizer)
            except Exception as exc:  # noqa: BLE001 - a configured tokenizer must load
                raise RuntimeError(f"the tokenizer {self.spec.tokenizer!r} configured for {self.location} "
                                   f"could not be loaded: {type(exc).__name__}: {exc}") from exc
        if Path(self.spec.model).expanduser().is_dir():
            try:
                return AutoTokenizer.from_pretrained(str(Path(self.spec.model).expanduser()))
            except Exception as exc:  # noqa: BLE001 - a model folder without a tokenizer
                log.debug("no tokenizer in the model folder %s: %s", self.spec.model, exc)
        return None

    def health(self, index_state: Any = None) -> Health:
        """The endpoint's /health (vLLM), else its /models (any OpenAI-compatible server); down with
        the reason while the packaged server ``ragline serve`` supervises is starting or gone."""
        import httpx

        detail = {"base_url": without_credentials(self.spec.base_url), "model": self.spec.model}
        supervised = supervisor_of(self.spec.base_url)
        problem = supervised.problem() if supervised is not None else None
        if problem:
            return Health.down(problem, **detail, managed=supervised.state)
        try:
            with httpx.Client(timeout=HEALTH_TIMEOUT_SECONDS) as http:
                response = http.get(self.health_url)
                if response.status_code in (404, 405):  # not vLLM: any OpenAI-compatible server lists models
                    response = http.get(f"{self.spec.base_url.rstrip('/')}/models",
                                        headers={"Authorization": f"Bearer {self.spec.api_key}"})
        except httpx.HTTPError as exc:
            if supervised is not None and supervised.state == "ready" and (problem := _death_soon(supervised)):
                return Health.down(problem, **detail, managed=supervised.state)
            return Health.down(f"{self.location} unreachable: {type(exc).__name__}: {exc or 'no answer'}", **detail)
        if response.status_code != 200:
            return Health.down(f"{self.location} answered HTTP {response.status_code}", **detail)
        return Health.up(**detail)


_OBSERVED: contextvars.ContextVar["_ObservedCall | None"] = contextvars.ContextVar("ragline_llm_call", default=None)


class _ObservedCall:
    """One LLM call's metrics (duration in its slot, tokens) and span (model, tokens in/out, queue
    wait, time to first token; prompt and completion text only with ``trace_content``)."""

    def __init__(self, model: str, call: str, kwargs: dict[str, Any]):
        self.model, self.call, self.kwargs = model, call, kwargs
        self.started = self.in_slot = time.perf_counter()
        self.span: Any = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "_ObservedCall":
        attributes = {"gen_ai.system": "openai", "gen_ai.operation.name": "chat", "gen_ai.request.model": self.model,
                      "gen_ai.request.max_tokens": self.kwargs.get("max_tokens"), "ragline.llm.call": self.call}
        if telemetry.content_on():
            attributes["gen_ai.prompt"] = json.dumps(self.kwargs["messages"], ensure_ascii=False)
        self.span = self._stack.enter_context(telemetry.span(f"llm {self.call}", attributes, kind="CLIENT"))
        token = _OBSERVED.set(self)
        self._stack.callback(_OBSERVED.reset, token)
        return self

    def slot(self, waited: float) -> None:
        self.in_slot = time.perf_counter()
        if self.span is not None:
            self.span.set_attribute("ragline.llm.queue_wait_seconds", waited)

    def first_token(self) -> None:
        if self.span is not None:
            self.span.set_attribute("gen_ai.response.time_to_first_token_seconds", time.perf_counter() - self.in_slot)

    def done(self, completions: list["Completion"], usage: Any) -> None:
        """Every completion of the call (``n`` samples: usage counts their tokens together)."""
        prompt = getattr(usage, "prompt_tokens", None)
        produced = getattr(usage, "completion_tokens", None)
        if produced is None and any(c.tokens for c in completions):
            produced = sum(len(c.tokens) for c in completions)
        telemetry.llm_call_done(self.model, self.call, time.perf_counter() - self.in_slot, prompt, produced)
        if self.span is not None:
            self.span.set_attributes(telemetry.clean({
                "gen_ai.usage.input_tokens": prompt, "gen_ai.usage.output_tokens": produced,
                "gen_ai.response.finish_reasons": [c.finish_reason or "" for c in completions],
                "gen_ai.completion": (completions[0].text if len(completions) == 1 else json.dumps(
                    [c.text for c in completions], ensure_ascii=False)) if telemetry.content_on() else None}))

    def __exit__(self, *exc: Any) -> None:
        self._stack.__exit__(*exc)


def _death_soon(supervised: Any, within: float = 1.0) -> str | None:
    """The supervisor's reason when the server it runs is found dead within ``within`` seconds: a
    refused connection usually means the server just died, and its leader process exits a moment
    after the server itself, so the reason (which signal, the log's tail) beats "unreachable"."""
    deadline = time.monotonic() + within
    while (problem := supervised.problem()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return problem


def _ready(future: Future, timeout: float) -> tuple[bool, Any]:
    """``(True, result)`` once ``future`` is done (its error raised), ``(False, None)`` until ``timeout``."""
    if wait([future], timeout).not_done:
        return False, None
    return True, future.result()


def _transient(exc: BaseException) -> bool:
    """Worth another try: refused or dropped connections, 429, 5xx, a malformed body or a cut stream
    (a proxy's or a restart's). Not a hung server (``LLMUnavailable``) and not a timeout: the same
    request would wait as long."""
    import openai

    if isinstance(exc, LLMUnavailable):
        return False
    if isinstance(exc, openai.APITimeoutError):  # httpx's or httpx2's, as the openai client uses
        return type(exc.__cause__).__name__ == "ConnectTimeout"
    return isinstance(exc, (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError,
                            json.JSONDecodeError, openai.APIResponseValidationError, _StreamCut))


_EXPONENTIAL = tenacity.wait_exponential(multiplier=0.5, max=8.0)


def _backoff(state: tenacity.RetryCallState) -> float:
    """0.5 s, doubling to 8 s; the server's Retry-After instead when it is longer (up to 30 s)."""
    delay = _EXPONENTIAL(state)
    response = getattr(state.outcome.exception(), "response", None)
    with contextlib.suppress(TypeError, ValueError, AttributeError):
        delay = min(30.0, max(delay, float(response.headers.get("retry-after"))))
    return delay


def without_credentials(url: str) -> str:
    """The URL with any ``user:password@`` replaced, so messages and logs never carry them."""
    return re.sub(r"(?<=://)[^/@\s]+@", "<credentials>@", url)


def _is_transport_error(exc: Exception) -> bool:
    """An HTTP transport failure raised while reading a stream (the openai client wraps only those
    raised before the response started)."""
    import httpx

    return isinstance(exc, httpx.TransportError)


def _count_field(body: str) -> int | None:
    """vLLM's /tokenize answers {"count": N, ...}; anything else is not that endpoint."""
    import json

    try:
        count = json.loads(body).get("count")
    except (ValueError, AttributeError):
        return None
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def _tokens(logprobs: Any) -> list[TokenLogprob]:
    if logprobs is None or not getattr(logprobs, "content", None):
        return []
    return [TokenLogprob(t.token, t.logprob, {c.token: c.logprob for c in (t.top_logprobs or [])})
            for t in logprobs.content]


# ----------------------------------------------------------------------------- supervised endpoints
# base URL -> what supervises the server there in this process (``ops.llm_server.ManagedLLM``: its
# ``state`` and ``problem()``), so the client's health says "restarting" rather than "unreachable".
# A registry here, filled by ops, keeps resources below the process supervisors.
_SUPERVISED: dict[str, Any] = {}


def supervise(base_url: str, supervisor: Any) -> None:
    _SUPERVISED[base_url.rstrip("/")] = supervisor


def unsupervise(base_url: str, supervisor: Any) -> None:
    if _SUPERVISED.get(base_url.rstrip("/")) is supervisor:
        del _SUPERVISED[base_url.rstrip("/")]


def supervisor_of(base_url: str) -> Any:
    """What supervises the LLM server at ``base_url`` in this process, or None."""
    return _SUPERVISED.get(base_url.rstrip("/"))
