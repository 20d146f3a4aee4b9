"""Checks the API's guard makes before FastAPI sees a request (issue 16).

- **Host and Origin without a token.** A tokenless API listens on loopback only, but a web page
  the user visits can still reach it by DNS rebinding (``attacker.example`` re-resolved to
  127.0.0.1: the browser then sends ``Host: attacker.example``) and read their documents. So
  without a token only loopback names are served (127.0.0.0/8, ::1, ``localhost``, any port), and
  a browser request that carries ``Origin`` must come from a loopback origin or one the server
  allows by CORS. With a token the token is the defence (a page cannot know it).
- **The JSON body.** FastAPI answers a body it cannot parse with a generic 400 "There was an
  error parsing the body" (invalid UTF-8, nesting ~1,000 deep, a 5,000-digit number), and parses
  ``NaN``, ``Infinity`` and lone surrogates (``"\\ud800"``) into values that make a later step fail
  with a 500. The body is parsed here once more, and the first problem is answered with a 4xx
  naming it, and the field when there is one.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from ragline.flows.errors import InputError
from ragline.flows.net import is_loopback

MAX_JSON_DEPTH = 64  # a query's filters at their limit nest ~20 levels; a bomb is refused before any walk
INT64 = 2**63
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+)(:\d{1,5})?$")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _host_name(value: str) -> str | None:
    """The name in a Host header (``name``, ``name:port``, ``[v6]:port``), None when malformed."""
    if not _HOST.match(value):
        return None
    name = value.rsplit(":", 1)[0] if not value.startswith("[") else value[: value.index("]") + 1]
    if not value.startswith("[") and value.count(":") > 1:
        return None
    return name


def foreign_host(headers: Iterable[tuple[bytes, bytes]], allowed_origins: Iterable[str]) -> tuple[str, str] | None:
    """Why a tokenless server must not answer this request: (code, message), or None."""
    hosts = [v.decode("latin-1") for k, v in headers if k == b"host"]
    origins = [v.decode("latin-1") for k, v in headers if k == b"origin"]
    if len(hosts) > 1 or len(origins) > 1:  # which one a proxy or the browser meant is anyone's guess
        return "host_not_allowed", "more than one Host or Origin header: send one of each"
    host, origin = (hosts or [None])[0], (origins or [None])[0]
    if host is not None:
        name = _host_name(host)
        if name is None or not is_loopback(name):
            return "host_not_allowed", (f"Host {host[:100]!r} is not served: without a token this API answers only "
                                        f"loopback names (127.0.0.1, [::1], localhost); set RAGLINE_API_TOKEN to "
                                        f"serve it under other names")
    if origin is not None and origin not in set(allowed_origins):
        try:
            parts = urlsplit(origin)
            allowed = parts.scheme in ("http", "https") and parts.hostname is not None and \
                is_loopback(parts.hostname) and (parts.port is None or parts.port > 0)
        except ValueError:
            allowed = False
        if not allowed:
            return "origin_not_allowed", (f"Origin {origin[:100]!r} is not allowed: without a token this API answers "
                                          f"only pages served from loopback (or origins allowed with --cors-origin)")
    return None


# ----------------------------------------------------------------------------- the JSON body
class BodyProblem(InputError):
    """A JSON body the API refuses: ``field`` is None when the body as a whole is at fault."""

    def __init__(self, message: str, code: str, field: str | None = None):
        super().__init__(message, field=field)
        self.message, self.code, self.field = message, code, field


class _BigNumber:
    """An integer literal too long to be converted (Python refuses beyond 4,300 digits)."""

    def __init__(self, digits: int):
        self.digits = digits


def _parse_int(text: str) -> int | _BigNumber:
    digits = len(text.lstrip("-"))
    return int(text) if digits <= 20 else _BigNumber(digits)


def check_json(body: bytes) -> None:
    """Raise BodyProblem for a body that is not UTF-8, nests too deep, or holds a value no field
    can take (NaN, Infinity, a number beyond 64 bits, a lone surrogate). A syntax error is left
    to FastAPI, which names its position.

    The common case costs about what FastAPI's own parse does: the C parser, plus scans of the
    text for what could be a problem; only a body that has one is walked in Python, to name the
    field (a walk of a 1 MB body takes a second: never on every request)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyProblem(f"the body is not valid UTF-8: byte 0x{body[exc.start]:02x} at offset {exc.start} "
                          f"(send JSON encoded as UTF-8)", "invalid_utf8") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise BodyProblem(f"the JSON body is nested too deeply: the limit is {MAX_JSON_DEPTH} levels",
                          "json_too_deep") from None
    except json.JSONDecodeError:  # a syntax error: FastAPI reports it with its position
        return
    except ValueError:  # NaN/Infinity, or an integer beyond Python's 4,300 digits: find the field
        return _walk(json.loads(text, parse_int=_parse_int, parse_constant=float))
    if _too_deep(text) or _long_numbers(body) or _lone_surrogate(body, value):
        _walk(json.loads(text, parse_int=_parse_int, parse_constant=float))


def _refuse_constant(name: str) -> float:
    raise ValueError(name)


# digits become 1, exponent letters 2, signs 3 (raw control bytes cannot be in valid JSON): a run of
# 19 digits (2^63 has 19) or a 3-digit exponent (a float overflows from e+309) is found by a byte search
_NUMBER_CLASSES = bytes.maketrans(b"0123456789eE+-", b"\x01" * 10 + b"\x02\x02\x03\x03")
_LONG_NUMBER_SIGNS = (b"\x01" * 19, b"\x02\x01\x01\x01", b"\x02\x03\x01\x01\x01")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_INNERMOST = re.compile(r"\[\]|\{\}")


def _long_numbers(body: bytes) -> bool:
    """Whether the body may hold a number beyond 64 bits (may: the digits can be inside a string)."""
    classes = body.translate(_NUMBER_CLASSES)
    return any(sign in classes for sign in _LONG_NUMBER_SIGNS)


def _lone_surrogate(body: bytes, value: Any) -> bool:
    """Escaped surrogates are usually pairs (an emoji, as ``ensure_ascii`` clients send it)."""
    if b"\\u" not in body or not _SURROGATE_ESCAPE.search(body):
        return False
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _too_deep(text: str) -> bool:
    """Whether the (valid) JSON text nests beyond the limit: brackets outside strings, innermost
    pairs removed once per level (C-speed passes, at most the limit of them)."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return False
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    for _ in range(MAX_JSON_DEPTH):
        brackets = _INNERMOST.sub("", brackets)
        if not brackets:
            return False
    return True


def _walk(root: Any) -> None:
    stack: list[tuple[str, Any, int]] = [("", root, 1)]
    while stack:
        path, value, depth = stack.pop()
        if isinstance(value, dict | list) and depth > MAX_JSON_DEPTH:
            top = re.split(r"[.\[]", path, maxsplit=1)[0]  # the request field it is in
            raise _field_problem(top, f"nested more than {MAX_JSON_DEPTH} levels deep (the limit of a JSON body)",
                                 "json_too_deep")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_string(key, path or "body", what="a key")
                stack.append((f"{path}.{key}" if path else key, item, depth + 1))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item, depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_string(value, path)
        elif isinstance(value, _BigNumber):
            raise _field_problem(path, f"a number with {value.digits:,} digits; numbers must fit in 64 bits",
                                 "number_too_large")
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int) and not -INT64 <= value < INT64:
            raise _field_problem(path, f"the integer {value} does not fit in 64 bits", "number_too_large")
        elif isinstance(value, float) and not math.isfinite(value):
            spelled = "NaN" if math.isnan(value) else "a number too large for a 64-bit float (Infinity)"
            raise _field_problem(path, f"{spelled} is not a value JSON allows: send a finite number",
                                 "invalid_number")


def _check_string(text: str, path: str, what: str = "the text") -> None:
    found = _SURROGATE.search(text)
    if found:
        raise _field_problem(path, f"{what} holds a lone surrogate (\\u{ord(found.group()):04x} at character "
                                   f"{found.start()}), which is not Unicode: send whole characters",
                             "invalid_unicode")


def _field_problem(path: str, message: str, code: str) -> BodyProblem:
    field = _printable(path) if path else None
    return BodyProblem(f"field '{field}': {message}" if field else f"the body: {message}", code, field)


def _printable(text: str) -> str:
    """A field path for a message: surrogates and control characters escaped, clipped."""
    escaped = "".join(c if c.isprintable() and not _SURROGATE.match(c) else ascii(c)[1:-1] for c in text)
    return escaped if len(escaped) <= 120 else escaped[:120] + "…"
