"""OpenAI-compatible request parsing: which endpoints are proxied, which body fields carry the
prompt, the validation of what routing reads (the rest passes through), and the prompt key and
block hashes of a request (``prefix/keys.py``, ``prefix/blocks.py``). A body that cannot be used
is a :class:`~kvroute.errors.ClientError` naming the field (answered 400).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvroute.errors import ClientError
from kvroute.gateway.config import GatewayConfig
from kvroute.gateway.residency import REGION_HEADER, RESIDENCY_HEADER
from kvroute.gateway.tokens import TokenRatio
from kvroute.model import Request
from kvroute.prefix import BlockHasher, PromptError, chat_key, completion_key


def _fast_decoder() -> tuple[Any, type[Exception]]:
    """msgspec's JSON decoder and its error when the `events` extra is installed (it decodes a
    typical chat body ~3.5x faster than json: 4.7 -> 1.3 us); None and ValueError otherwise."""
    try:
        from msgspec import DecodeError
        from msgspec.json import Decoder
    except ImportError:  # pragma: no cover - the base install
        return None, ValueError
    return Decoder().decode, DecodeError


_FAST: Final = _fast_decoder()  # Final: a C static in a compiled build (a module global is a dict lookup)
_REGION: Final = REGION_HEADER  # an imported name is a module global too: read per request
_RESIDENCY: Final = RESIDENCY_HEADER
monotonic: Final = time.monotonic


@dataclass(frozen=True)
class Kind:
    """A proxied endpoint: its metrics label, the body fields that carry the prompt (the first
    present one is keyed), and what ends a complete stream (None: the engine's own framing)."""

    label: str
    prompt_fields: tuple[str, ...]
    stream_end: bytes | None = b"[DONE]"


PROXIED: Final = {
    "/v1/chat/completions": Kind("chat", ("messages",)),
    "/v1/completions": Kind("completions", ("prompt",)),
    "/v1/embeddings": Kind("embeddings", ("input",)),
    "/v1/responses": Kind("responses", ("input",), None),  # its stream ends with an event, no [DONE]
    "/tokenize": Kind("tokenize", ("prompt", "messages", "content")),  # vLLM, SGLang / llama.cpp names
    "/detokenize": Kind("detokenize", ("tokens",)),
}
MAX_INT32: Final = 2**31 - 1
MAX_N: Final = 128  # OpenAI's limit on choices per request


def prompt_key(field: str, value: Any) -> str | list[int]:
    """The canonical key of a prompt-carrying field (see ``prefix/keys.py``)."""
    if field == "messages" or (field == "input" and isinstance(value, list) and value
                               and all(isinstance(m, dict) and "role" in m for m in value)):
        return chat_key(value)  # chat messages, or a Responses input made of messages
    if field == "input" and isinstance(value, list) and any(isinstance(m, dict) for m in value):
        return json.dumps(value, sort_keys=True)  # other Responses input items: keyed as written
    return completion_key(value)  # text, texts (the first decides), or token ids


def _check_count(name: str, v: Any, top: int) -> None:
    """A count field (``max_tokens``, ``n``, ...) set to anything but an integer from 1 to ``top``: a 400."""
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= top:
        raise ClientError(f"field '{name}' must be an integer from 1 to {top}", param=name)


def _loads(raw: bytes) -> Any:
    """The body as Python values: msgspec's decoder when installed, and ``json`` for whatever it
    refuses (NaN, lone surrogates, nesting past its limit, malformed input), so that what is
    accepted and every error message are the standard library's."""
    fast, error = _FAST
    if fast is not None:
        try:
            return fast(raw)
        except error:
            pass
    return json.loads(raw)


class RequestParsing:
    """Turns a request body into its routing :class:`~kvroute.model.Request` (a base of the
    proxy, which owns one per application); :meth:`reconfigure` follows a reloaded config."""

    config: GatewayConfig
    tokens: TokenRatio  # the online bytes/4 correction (gateway/tokens.py)

    def __init__(self) -> None:
        self.id_prefix = f"{uuid.uuid4().hex[:8]}-"  # request ids: unique per process, cheap per request
        self.issued = 0  # the last request number given out (a plain int: ``next`` of a counter is a generic call)
        self.estimates: dict[str, int] = {}  # request id → its unscaled token estimate, while it runs

    def reconfigure(self, config: GatewayConfig) -> list[str]:
        """(Re)build what parsing depends on: the prompt hasher and the session headers."""
        changes = []
        old = getattr(self, "config", None)
        if old is None or (config.block_tokens, config.tokenizer_path) != (old.block_tokens, old.tokenizer_path):
            path, self.engine_tokens = config.tokenizer_path, None
            if path is not None and Path(path).is_dir():  # the engine's own ids (chat template included)
                from kvroute.kvevents.tokenize import EngineTokenizer

                self.engine_tokens = EngineTokenizer(path)
                path = str(Path(path) / "tokenizer.json")
            self.hasher = BlockHasher(config.block_tokens, path)
            changes.append("prompt hashing")
        if old is None or config.session_headers != old.session_headers:
            self.session_headers = [h.lower() for h in config.session_headers]
            changes.append("session headers")
        self.config = config
        self.tokenizer_path = config.tokenizer_path  # read per request: a plain attribute, not pydantic's
        return changes if old is not None else []

    def next_id(self) -> str:
        """A new request id, unique in this process."""
        self.issued += 1
        return f"{self.id_prefix}{self.issued}"

    def parse(self, raw: bytes, kind: Kind, headers: dict[str, str]) -> tuple[dict, Request]:
        """Validate the body (the fields routing reads; the rest passes through) and key it."""
        try:
            body = _loads(raw)
        except UnicodeDecodeError:
            raise ClientError("request body is not valid UTF-8") from None
        except json.JSONDecodeError as exc:
            raise ClientError(f"request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                           f"column {exc.colno}") from None
        except RecursionError:
            raise ClientError("request body is nested too deeply") from None
        except ValueError as bad:  # e.g. an integer longer than Python's 4,300-digit limit
            raise ClientError(f"request body has an unreadable value: {str(bad)[:120]}") from None
        if not isinstance(body, dict):
            raise ClientError("request body must be a JSON object")
        for field in kind.prompt_fields:
            if field in body:
                break
        else:
            names = " or ".join(f"'{f}'" for f in kind.prompt_fields)
            raise ClientError(f"missing required field {names}", param=kind.prompt_fields[0])
        # body.get written out each time: a compiled build turns it into a dict primitive, where a bound
        # ``get`` is a generic call (sixth round, docs/hot-path.md)
        model, stream, user = body.get("model"), body.get("stream"), body.get("user")
        # the common case (a str model, a bool or no stream, no user) in one test; else field by field
        # (isinstance: a type check in a compiled build, where ``x.__class__`` is a generic attribute read;
        # JSON gives no subclasses of str or bool, so the two tests agree)
        if not isinstance(model, str) or (stream is not None and not isinstance(stream, bool)) or user is not None:
            for name, typ in (("model", str), ("stream", bool), ("user", str)):
                if body.get(name) is not None and not isinstance(body[name], typ):
                    raise ClientError(f"field '{name}' must be a {typ.__name__}, got {type(body[name]).__name__}",
                                      param=name)
        max_tokens, max_completion, n = body.get("max_tokens"), body.get("max_completion_tokens"), body.get("n")
        # each checked written out, not by a loop over (name, limit) pairs: a compiled build boxed the
        # pairs into a tuple and iterated it generically on every request that sets max_tokens
        if max_tokens is not None:
            _check_count("max_tokens", max_tokens, MAX_INT32)
        if max_completion is not None:
            _check_count("max_completion_tokens", max_completion, MAX_INT32)
        if n is not None:
            _check_count("n", n, MAX_N)
        try:
            key = prompt_key(field, body[field])
        except PromptError as exc:
            raise ClientError(str(exc), param=field) from None
        except RecursionError:
            raise ClientError(f"field '{field}' is nested too deeply", param=field) from None
        if self.engine_tokens is not None:  # the ids the engine will cache, as its KV events report them
            ids = self.engine_tokens.prompt_ids(field, body)
            if ids:
                key = ids
        hashes, tokens = self.hasher.of(key)
        block_tokens = self.hasher.block_tokens
        estimated = 0  # the bytes/4 estimate, when that is what counted the prompt
        if isinstance(key, str) and not self.tokenizer_path:
            ratio = self.tokens  # corrected online from the engines' usage (gateway/tokens.py)
            estimated, tokens, block_tokens = tokens, ratio.tokens(tokens), ratio.block_tokens(block_tokens)
        routing_key = None
        for h in self.session_headers:
            if h in headers:
                routing_key = headers[h]
                break
        if routing_key is None and isinstance(user, str):
            routing_key = user
        max_out = max_completion or max_tokens or 256
        req = Request(id=self.next_id(), arrival_s=monotonic(),
                      routing_key=routing_key, block_hashes=hashes, block_tokens=block_tokens,
                      prompt_tokens=tokens, max_output_tokens=max_out,
                      region=headers.get(_REGION), residency=headers.get(_RESIDENCY))
        if estimated:
            self.estimates[req.id] = estimated
        return body, req
