"""Stream continuation: one client stream spliced from several upstream legs.

Engines cannot hand a running sequence's KV cache to another engine, so the gateway moves a
stream by *continuation*: it stops the upstream leg at an event (token) boundary and asks another
replica to go on from the prompt plus the text generated so far, with ``max_tokens`` reduced by
what was already generated. Completions append the text to the prompt; chat appends it as a
trailing assistant message that the engine continues instead of answering, asked for with
``continue_final_message: true`` and ``add_generation_prompt: false`` — the same two fields in
vLLM, SGLang and llama-server (which also continues a trailing assistant message unasked, and
refuses ``continue_final_message`` with a generation prompt, as vLLM does). The new replica
prefills the whole context again (its prefix cache may hold the prompt): that is the price of a
move without KV transfer.

Two things move a stream (in CascadeInfer, §3 "runtime request processing", a sequence whose
length passes its instance's range migrates to the next stage, by KV live migration, §4.4;
behind an HTTP API this continuation is the gateway's form of that move):

- **migrate**: the sequence (prompt + generated tokens) reached the ``context_limit`` of its
  replica's stage;
- **recover**: the replica failed after the client had bytes (connection lost, stream cut short,
  an in-stream error event).

The client sees one stream: only whole events are forwarded (a leg that dies mid-event leaves no
fragment), later legs carry the ``id``, ``created`` and ``model`` the client saw first, the
assistant role is announced once, ``[DONE]`` comes once, and a final usage chunk counts the
original prompt (the leg's prompt minus the tokens it was given back) and every generated token.

Tokens are counted by stream events, not by text: the engines stream one event per token, and
many carry empty text — vLLM's detokenizer holds back a token that ends inside a character (or
is skipped as special) and sends its text with a later event; 663–727 of 900 events were empty
in one run (shared/design/real-vllm-cpu.md). An event counts one token unless it only announces
the role or only carries the ending (empty text with ``finish_reason``); where an event reports
``usage.completion_tokens`` (vLLM's ``continuous_usage_stats``, which the gateway asks vLLM
replicas for: vLLM merges tokens into one event when its reader lags) that count is taken
instead, so an engine sending several tokens per event is counted exactly too; what the client
did not ask for is taken out again. Empty events are forwarded
on every leg like the others (a client may count tokens by events, as benchmark clients do).

Not continued (the stream ends with an SSE error as before): ``n``/``best_of`` > 1, ``echo``,
token-id or batched prompts, structured output (a grammar would restart in mid-answer), and
streams that produced tool calls or reasoning deltas, which no engine accepts back as a prefill.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final, Literal

from kvroute.gateway.http import error_object
from kvroute.gateway.tokens import token_events

Reason = Literal["migrate", "recover"]
RAW_LIMIT: Final = 64 * 1024  # bytes of first-leg events kept unparsed; beyond, they are parsed and dropped
GENERATED: Final = ("content", "reasoning_content", "reasoning", "tool_calls", "function_call")  # a chat delta's output
_STRUCTURED: Final = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "json_schema", "regex", "ebnf")
_STRUCTURED_SET: Final = frozenset(_STRUCTURED)


@dataclass
class Break:
    """A leg that stopped after the client had bytes: why, and what to log or tell the client."""

    reason: Reason
    message: str


class Splice:
    """The state of one streamed request across its legs (see the module docstring)."""

    def __init__(self, chat: bool, body: dict[str, Any], prompt_tokens: int):
        self.chat = chat
        self.body = body
        self.prompt_tokens = prompt_tokens  # the original prompt, as the gateway counted it
        self.pieces: list[str] = []  # generated text forwarded to the client, per event
        self.count = 0  # tokens generated (and forwarded) over every leg, counted by events
        self.leg_start = 0  # tokens generated before the current leg
        self._finished = False  # an event carried finish_reason: nothing is left to generate
        self.legs = 1
        self.ident: dict[str, Any] | None = None  # id, created, model, ... of the first event
        self.partial = b""  # an event not complete yet
        self.done = False  # [DONE] forwarded
        self._continuable = True  # false once the stream carries what a prefill cannot restore
        # first-leg events forwarded as they came and not parsed yet (``_event``'s fast path):
        # the events (whole ``data:`` events, one or several per entry), bytes, and the tokens
        # ``token_events`` counted in them
        self._raw: list[bytes] = []
        self._raw_len = 0
        self._raw_tokens = 0
        self.error: str | None = None  # an in-stream error event the engine sent
        self.limit: int | None = None  # the current leg's replica's context limit
        self.outgrown = False  # the sequence reached ``limit``: the leg stops at this event
        opts = body.get("stream_options")
        opts = opts if isinstance(opts, dict) else {}
        self.client_usage = bool(opts.get("include_usage"))  # what the client asked for
        self.client_continuous = self.client_usage and bool(opts.get("continuous_usage_stats"))
        self.usage_added = False  # this attempt asked its engine for usage the client did not
        self.prompt_reported: int | None = None  # the original prompt, as the first leg's engine counted it

    @classmethod
    def open(cls, route: str, body: dict[str, Any], prompt_tokens: int) -> Splice | None:
        """A splice for a streamed chat or completions request that can be continued, else None."""
        if route not in ("chat", "completions") or not body.get("stream"):
            return None
        if (body.get("n") or 1) > 1 or (body.get("best_of") or 1) > 1 or body.get("echo"):
            return None
        if route == "completions" and not isinstance(body.get("prompt"), str):
            return None  # token ids or a batch: nothing to append text to
        fmt = body.get("response_format")
        if (isinstance(fmt, dict) and fmt.get("type") not in (None, "text")) or \
                (not _STRUCTURED_SET.isdisjoint(body) and any(body.get(k) for k in _STRUCTURED)):
            return None
        return cls(route == "chat", body, prompt_tokens)

    @property
    def tokens(self) -> int:
        """Tokens generated (and forwarded) so far, over every leg (events not parsed yet are
        counted by ``token_events``, exact for one token per event; :meth:`settle` makes it exact)."""
        return self.count

    @property
    def text(self) -> str:
        """The text generated so far."""
        self.settle()
        return "".join(self.pieces)

    @property
    def continuable(self) -> bool:
        """Whether the stream can still be continued elsewhere (nothing a prefill cannot restore)."""
        self.settle()
        return self._continuable

    @continuable.setter
    def continuable(self, value: bool) -> None:
        self._continuable = value

    @property
    def finished(self) -> bool:
        """Whether an event carried ``finish_reason``: nothing is left to generate."""
        self.settle()
        return self._finished

    @finished.setter
    def finished(self, value: bool) -> None:
        self._finished = value

    def settle(self) -> None:
        """Parse the events the fast path forwarded unparsed: text, exact token count, the
        finish and what makes a stream not continuable. Needed only when a stream is continued
        (or the kept bytes pass ``RAW_LIMIT``), so a stream that ends well never pays for it."""
        raw = self._raw
        if not raw:
            return
        self._raw = []
        self.count -= self._raw_tokens
        self._raw_len = self._raw_tokens = 0
        for block in raw:
            for event in block.split(b"\n\n"):
                self._parse(event[5:].strip(), b"")

    def max_tokens(self) -> int | None:
        """The client's output limit, if it set one."""
        value = self.body.get("max_completion_tokens") or self.body.get("max_tokens")
        return value if isinstance(value, int) else None

    def length(self) -> int:
        """The sequence's length now: prompt plus generated tokens."""
        return self.prompt_tokens + self.tokens

    def outgrew(self, limit: int | None) -> bool:
        """Whether the sequence reached ``limit`` with tokens still to generate (a stream that is
        about to finish anyway is not moved) and this leg generated one at least (so a stage
        bound below the prompt cannot bounce a stream without progress)."""
        if limit is None or self.done or self.length() < limit or self.tokens == self.leg_start:
            return False
        top = self.max_tokens()
        return top is None or self.tokens < top

    # -- one leg's bytes ------------------------------------------------------------------------
    def feed(self, chunk: bytes) -> bytes:
        """The bytes of ``chunk`` to forward: whole events only, rewritten on later legs, and
        none past the event that brings the sequence to ``limit`` (then ``outgrown`` is set)."""
        data = self.partial + chunk
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self.partial = data
            return b""
        self.partial = data[cut + 2:]
        block = data[:cut]
        if self.legs == 1 and self.limit is None and b'"error"' not in block and b'"usage"' not in block \
                and block.startswith(b"data:") and block.count(b"\n\ndata:") == block.count(b"\n\n"):
            return self._plain(block)
        out = []
        for event in block.split(b"\n\n"):
            kept = self._event(event) if event.strip() else None
            if kept is not None:
                out.append(kept + b"\n\n")
            if self.error is not None:
                break  # nothing after an error event is forwarded
            if self.outgrew(self.limit):
                self.outgrown, self.partial = True, b""  # the rest is this leg's, not the client's
                break
        return b"".join(out)

    def _plain(self, block: bytes) -> bytes:
        """The first leg's events when none carries an error or usage, each is ``data:`` and no
        context limit is watched (``feed`` checked): ``_event``'s fast path for a whole read at
        once — the block passes unchanged, its tokens counted by ``token_events`` in one call and
        its events kept as bytes. The stream's first event is parsed (its id and model), and a
        final ``[DONE]`` is noted; anything else unusual goes one event at a time."""
        out = block + b"\n\n"
        head = b""  # forwarded before the block that is kept
        if self.ident is None:
            first, _, block = block.partition(b"\n\n")
            head = self._event(first) or b""  # legs == 1, no error: forwarded as it came
            head += b"\n\n"
            if not self._identified():  # not a stream of JSON objects: one event at a time
                return head + b"".join(e + b"\n\n" for e in self._each(block) if e is not None)
            if not block:
                return out
        if b"[DONE]" in block:
            body, _, last = block.rpartition(b"\n\n")
            if last[5:].strip() != b"[DONE]" or b"[DONE]" in body:
                return head + b"".join(e + b"\n\n" for e in self._each(block) if e is not None)
            self.done = True
            block = body
        if block:
            self._keep(block, token_events(block))
        return out

    def _identified(self) -> bool:
        # a call, not ``self.ident is None`` inline: after ``_event`` set it, mypy (and so a
        # mypyc-compiled build, which checks the narrowed type) would still take it for None
        return self.ident is not None

    def _keep(self, raw: bytes, n: int) -> None:
        """Keep a first-leg piece of ``n`` plain token events unparsed (settled past RAW_LIMIT)."""
        self._raw.append(raw)
        self._raw_len += len(raw)
        self._raw_tokens += n
        self.count += n
        if self._raw_len > RAW_LIMIT:
            self.settle()

    def _each(self, block: bytes) -> list[bytes | None]:
        return [self._event(e) for e in block.split(b"\n\n")] if block else []

    def _event(self, event: bytes) -> bytes | None:
        if not event.startswith(b"data:"):
            return event  # comments, event names: passed as they are
        payload = event[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return event
        if self.legs == 1 and self.ident is not None and self.limit is None \
                and b'"error"' not in payload and b'"usage"' not in payload:
            # the first leg's plain token events pass unchanged: nothing to rewrite or check, so they are
            # kept as bytes and counted cheaply; their text is parsed only if the stream is continued
            self._keep(event, token_events(payload))
            return event
        self.settle()
        return self._parse(payload, event)

    def _parse(self, payload: bytes, event: bytes) -> bytes | None:
        """Account one event's payload (text, tokens, finish, usage, error) and return the event to
        forward: ``event`` itself, rewritten, or None."""
        try:
            obj = json.loads(payload)
        except ValueError:
            self.continuable = False  # cannot tell what it generated: pass it on, never continue
            return event
        if not isinstance(obj, dict):
            return event
        if "error" in obj and "choices" not in obj:
            self.error = str((obj.get("error") or {}).get("message", obj["error"]))[:300]
            return None
        later = self.legs > 1
        choices = obj.get("choices")
        announcement = self.chat and later and bool(choices) and isinstance(choices, list) \
            and all(_role_only(c) for c in choices)
        if self.ident is None:
            self.ident = {k: obj[k] for k in ("id", "created", "model", "system_fingerprint") if k in obj}
        elif later:
            obj.update({k: v for k, v in self.ident.items() if k in obj})
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            piece, token = self._piece(choice, later)
            if piece:
                self.pieces.append(piece)
            self.count += token
            if choice.get("finish_reason"):
                self.finished = True
        usage = obj.get("usage")
        reported = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if isinstance(reported, int) and not isinstance(reported, bool) and reported >= 0:
            self.count = self.leg_start + reported  # the engine's own count of this leg beats ours
        if isinstance(usage, dict) and not later and self.prompt_reported is None:
            prompt = usage.get("prompt_tokens")
            self.prompt_reported = prompt if isinstance(prompt, int) and not isinstance(prompt, bool) else None
        changed = False
        if isinstance(usage, dict) and self.usage_added:  # usage the client did not ask for
            if not choices:
                if not self.client_usage:
                    return None  # the final usage chunk
            elif not self.client_continuous and not any(isinstance(c, dict) and c.get("finish_reason")
                                                        for c in choices):
                del obj["usage"]  # a token event's running usage
                usage, changed = None, True
        if not later and not changed:
            return event
        if later and isinstance(usage, dict):
            self._correct(usage)
        elif announcement:
            return None  # the new leg's role announcement: the client has had one
        return b"data: " + json.dumps(obj).encode()

    def _piece(self, choice: dict[str, Any], later: bool) -> tuple[str, int]:
        """The text one choice of an event adds, and whether it is a token (see the module
        docstring: every generation event is, empty or not, but a role announcement or a bare
        ending is not)."""
        ending = bool(choice.get("finish_reason"))
        if not self.chat:
            text = choice.get("text")
            if not isinstance(text, str):
                return "", 0
            return text, int(bool(text) or not ending)
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return "", 0
        role = (delta.pop("role", None) if later else delta.get("role")) is not None
        if delta.get("tool_calls") or delta.get("function_call") or delta.get("reasoning_content") \
                or delta.get("reasoning"):
            self.continuable = False
        fields = [delta[k] for k in GENERATED if delta.get(k) is not None]
        if not fields:
            return "", 0
        text = delta.get("content")
        text = text if isinstance(text, str) else ""
        return text, int(any(fields) or not (role or ending))

    def _correct(self, usage: dict[str, Any]) -> None:
        """Usage of the whole request from a later leg's: that leg's prompt held the tokens it was
        given back, which the client counts as completion tokens. The prompt is the first leg's
        own count when it reported one (vLLM's running usage), else the later leg's prompt less
        the tokens given back (exact when the text re-tokenizes to as many tokens)."""
        before = self.leg_start
        prompt = self.prompt_reported  # the first leg's engine counted the original prompt itself
        if prompt is None:
            prompt = max(0, int(usage.get("prompt_tokens") or 0) - before)
        completion = int(usage.get("completion_tokens") or 0) + before
        usage.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            details["cached_tokens"] = min(details["cached_tokens"], prompt)

    def exact_body(self, raw: bytes) -> bytes:
        """``raw`` asking a vLLM engine for its running usage on every event
        (``stream_options.continuous_usage_stats``), so tokens are counted exactly even when vLLM
        sends several per event (its output collector merges them when the reader lags); what
        the client did not ask for is taken out again (:meth:`feed`)."""
        self.usage_added = not self.client_continuous
        if not self.usage_added:
            return raw
        if b'"stream_options"' not in raw:  # the usual case: the field is added to the bytes as they are
            end = raw.rstrip()
            if end.endswith(b"}") and end[:-1].rstrip()[-1:] not in (b"{", b""):
                return end[:-1] + b',"stream_options":{"include_usage":true,"continuous_usage_stats":true}}'
        body = json.loads(raw)
        opts = body.get("stream_options")
        body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True,
                                  "continuous_usage_stats": True}
        return json.dumps(body).encode()

    # -- the next leg ---------------------------------------------------------------------------
    def next_body(self) -> dict[str, Any] | None:
        """The body that continues this stream on any replica; None when the client's limit is
        already spent or the engine said it finished (the stream is complete but for its ending)."""
        self.settle()
        body = dict(self.body)
        top = self.max_tokens()
        if self.finished or (top is not None and self.tokens >= top):
            return None
        for field in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(field), int):
                body[field] -= self.tokens
        if isinstance(body.get("min_tokens"), int):
            body["min_tokens"] = max(0, body["min_tokens"] - self.tokens)
        if self.chat:
            body["messages"] = [*body["messages"], {"role": "assistant", "content": self.text}]
            body.update(continue_final_message=True, add_generation_prompt=False)
        else:
            body["prompt"] = body["prompt"] + self.text
        return body

    def begin_leg(self) -> None:
        """Start counting a new leg."""
        self.settle()
        self.legs += 1
        self.leg_start = self.tokens
        self.partial = b""
        self.error = None
        self.outgrown = False

    # -- endings the gateway writes itself ------------------------------------------------------
    def length_ending(self) -> bytes:
        """The final chunk and ``[DONE]`` of a stream whose every token was delivered before its
        replica failed: ``finish_reason`` is ``length``, as the engine would have said (only
        ``[DONE]`` when the engine had sent its finishing event already)."""
        self.settle()
        if self.finished:
            return b"data: [DONE]\n\n"
        ident = self.ident or {}
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        choice: dict[str, Any] = ({"index": 0, "delta": {}, "finish_reason": "length"} if self.chat
                                  else {"index": 0, "text": "", "finish_reason": "length"})
        event = {**ident, "object": obj, "choices": [choice]}
        return f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()


def _role_only(choice: Any) -> bool:
    """A chat choice that only announces the role (``role`` and no generated text); an
    empty-text token event, which has no ``role``, is not one."""
    if not isinstance(choice, dict) or choice.get("finish_reason") or choice.get("logprobs"):
        return False
    delta = choice.get("delta")
    return isinstance(delta, dict) and "role" in delta and not any(delta.get(k) for k in GENERATED)


def error_event(message: str, code: str) -> bytes:
    """An OpenAI-style SSE error event followed by ``[DONE]``: how a stream that cannot go on ends."""
    return f"data: {json.dumps(error_object(message, 'server_error', code=code))}\n\ndata: [DONE]\n\n".encode()
