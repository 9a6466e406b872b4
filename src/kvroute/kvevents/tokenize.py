"""The engine's token ids for a request, computed in the gateway.

KV events carry the token ids the engine cached, and the consumer keys blocks by them
(``kvevents.index``); a prompt matches only if the gateway derives the *same* ids. That needs
what the engine uses: its tokenizer and its chat template. This is what the routers that read
engine events do: llm-d's precise prefix scorer tokenizes in the scheduler (a tokenizer pool with
chat-template rendering), Dynamo's frontend applies the chat template and tokenizes before its KV
router, and AIBrix asks the engine (``AIBRIX_USE_REMOTE_TOKENIZER``) at the price of a round trip.
kvroute does it in process from a local model folder, as vLLM itself would for the request:

* ``/v1/completions`` text: ``tokenizer.encode(prompt, add_special_tokens=True)`` (vLLM's default;
  the tokenizer's post-processor adds BOS if the model has one); token-id prompts as given;
* ``/v1/chat/completions``: the template rendered with jinja2 as transformers renders it
  (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, ``raise_exception``,
  ``strftime_now``, the special tokens as variables), with ``add_generation_prompt`` (default
  true) and ``continue_final_message`` as the body asks, then encoded without special tokens
  (the template writes them). Text parts of a content list are joined with newlines (vLLM's
  "string" content format); other parts are not supported for exact keys.

The folder holds ``tokenizer.json`` and optionally ``tokenizer_config.json`` (special tokens, and
``chat_template`` in older layouts) and ``chat_template.jinja`` (transformers ≥ 4.43). Nothing is
ever downloaded. A request this cannot render (no template, a template error) falls back to the
gateway's canonical key: it simply matches nothing in an event-built table.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from kvroute.errors import ConfigError


class TokenizerFolderError(ConfigError):
    """The folder is not a usable tokenizer folder; the message names the file and why."""


def _special(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config.json files
        value = value.get("content")
    return value if isinstance(value, str) else None


class EngineTokenizer:
    """Token ids as the engine computes them (module docstring), from ``folder``."""

    def __init__(self, folder: str | Path):
        path = Path(folder)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerFolderError(f"{path}: no tokenizer.json (a local model or tokenizer folder is required; "
                                       "hubs are never contacted)")
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise TokenizerFolderError("tokenizer_path needs the optional 'tokenizers' package: "
                                       "pip install 'kvroute[tokenizers]'") from exc
        self.tokenizer = Tokenizer.from_file(str(tok_file))
        cfg: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text())
            except (OSError, ValueError) as exc:
                raise TokenizerFolderError(f"{cfg_file}: {exc}") from None
        self.special = {name: tok for name in ("bos_token", "eos_token", "unk_token", "pad_token")
                        if (tok := _special(cfg.get(name))) is not None}
        template = cfg.get("chat_template")
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        self._template = None
        if isinstance(template, str) and template:
            self._template = self._compile(template)

    @staticmethod
    def _compile(source: str) -> Any:
        try:
            import jinja2
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as exc:
            raise TokenizerFolderError("a chat template needs jinja2: pip install 'kvroute[events]'") from exc

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise TokenizerFolderError(f"chat template does not compile: {exc}") from None

    @property
    def has_chat_template(self) -> bool:
        """Whether chat requests can be rendered exactly."""
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The tokenizer's ids for ``text``."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def completion_ids(self, prompt: Any) -> list[int] | None:
        """A completions ``prompt`` as the engine tokenizes it (a batch by its first prompt);
        None when it is not text or ids."""
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0] if not isinstance(prompt[0], int) else prompt
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        return None

    def chat_ids(self, body: dict[str, Any]) -> list[int] | None:
        """A chat request's prompt ids: the template rendered, then encoded; None when it
        cannot be rendered (no template, non-text content, a template error)."""
        if self._template is None:
            return None
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        plain = []
        for m in messages:
            if not isinstance(m, dict):
                return None
            content = m.get("content")
            if isinstance(content, list):
                texts = [t for p in content if isinstance(p, dict) and p.get("type") == "text"
                         and isinstance(t := p.get("text"), str)]
                if len(texts) != len(content):
                    return None
                content = "\n".join(texts)
            plain.append({**m, "content": content})
        cont = bool(body.get("continue_final_message"))
        gen = bool(body.get("add_generation_prompt", True)) and not cont
        kwargs = body.get("chat_template_kwargs")
        extra = kwargs if isinstance(kwargs, dict) else {}
        try:
            text = self._template.render(messages=plain, tools=body.get("tools"), documents=None,
                                         add_generation_prompt=gen, **self.special, **extra)
        except Exception:  # a template that raises for this request: no exact key
            return None
        if cont and plain and isinstance(plain[-1].get("content"), str):
            final = plain[-1]["content"]
            at = text.rfind(final)
            if at >= 0:  # transformers cuts the rendering right after the final message's content
                text = text[:at + len(final)]
        return self.encode(text, add_special_tokens=False)

    def prompt_ids(self, field: str, body: dict[str, Any]) -> list[int] | None:
        """The engine's ids for a request body's prompt field (``messages`` or ``prompt``)."""
        if field == "messages":
            return self.chat_ids(body)
        if field == "prompt":
            return self.completion_ids(body.get("prompt"))
        return None
