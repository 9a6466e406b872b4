"""Canonical prompt keys.

A key is a string rendering of the prompt such that a conversation's turn n+1 starts with turn
n's key: each message renders on its own and messages are concatenated, with no trailing
"assistant is next" marker. Keys never leave the process (logs do not print them by default).
"""

from __future__ import annotations

from typing import Any, Final

from kvroute.errors import ClientError

CHARS_PER_TOKEN: Final = 4  # GORGO's estimate: tokens ≈ (chars + 3) / 4


class PromptError(ClientError):
    """The request body has no usable prompt; the message names the offending field."""


def estimate_tokens(text: str) -> int:
    """Token estimate without a tokenizer (GORGO v1 proxy: (chars + 3) // 4)."""
    return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict):
                raise PromptError(f"{where}.content[{i}] must be an object, got {type(part).__name__}")
            kind = part.get("type")
            if kind == "text":
                parts.append(str(part.get("text", "")))
            elif kind in ("image_url", "input_audio", "file"):
                # Media is keyed by its reference: equal references share a prefix.
                parts.append(f"<{kind}:{part.get(kind)!s}>")
            else:
                raise PromptError(f"{where}.content[{i}].type must be one of "
                                  f"text, image_url, input_audio, file; got {kind!r}")
        return "".join(parts)
    raise PromptError(f"{where}.content must be a string or a list of parts, "
                      f"got {type(content).__name__}")


def chat_key(messages: Any) -> str:
    """Render OpenAI chat ``messages`` into a canonical key (turn n+1 extends turn n)."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise PromptError(f"{where} must be an object")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise PromptError(f"{where}.role must be a non-empty string")
        text = _content_text(m.get("content"), where)
        extra = ""
        if m.get("name"):
            extra += f" name={m['name']}"
        if m.get("tool_calls"):
            extra += f" tool_calls={m['tool_calls']!s}"
        out.append(f"<|{role}{extra}|>{text}<|end|>\n")
    return "".join(out)


def completion_key(prompt: Any) -> str | list[int]:
    """Key for a completions ``prompt``: text as is; a token-id list is returned as ids.

    A batch (list of strings) is keyed by its first prompt, which is what decides placement.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise PromptError("prompt must not be empty")
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return _token_ids(prompt, "prompt")
        first = prompt[0]
        if isinstance(first, str) and first:
            return first
        if isinstance(first, list) and first and all(isinstance(t, int) and not isinstance(t, bool) for t in first):
            return _token_ids(first, "prompt[0]")
    raise PromptError("prompt must be a non-empty string, list of strings or list of token ids")


MAX_TOKEN_ID: Final = 2**32 - 1  # ids are hashed as unsigned 32-bit integers


def _token_ids(ids: list[int], where: str) -> list[int]:
    for i, t in enumerate(ids):
        if not 0 <= t <= MAX_TOKEN_ID:
            raise PromptError(f"{where}[{i}] is not a token id: {str(t)[:24]} (allowed: 0 to {MAX_TOKEN_ID})")
    return list(ids)
