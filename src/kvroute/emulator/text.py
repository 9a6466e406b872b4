"""What the emulated model writes: a deterministic word per token chained over the text so far,
and the context a chat request is continued from (as vLLM, SGLang and llama-server do)."""

from __future__ import annotations

import xxhash

from kvroute.prefix import chat_key


class TextModel:
    """The emulated model's output: token i is a three-letter word (with a leading space, so one
    token is four characters and counts as one token by kvroute's estimate) picked by a hash
    chained over the context's whitespace-separated words. The chain makes the next word a
    function of the text so far, however that text was split between prompt and output."""

    def __init__(self, context: str):
        state = 0
        for word in context.split():
            state = xxhash.xxh3_64_intdigest(word.encode("utf-8", "surrogatepass"), seed=state)
        self.state = state

    def next(self) -> str:
        """The next token's text, advancing the context by it."""
        s = self.state
        word = chr(97 + s % 26) + chr(97 + s // 26 % 26) + chr(97 + s // 676 % 26)
        self.state = xxhash.xxh3_64_intdigest(word.encode(), seed=s)
        return " " + word


def emulated_text(context: str, tokens: int) -> str:
    """The text the emulator generates for ``context`` (a completion prompt, or a chat key)."""
    model = TextModel(context)
    return "".join(model.next() for _ in range(tokens))


def chat_context(body: dict, engine_type: str) -> tuple[str, str | None]:
    """The key a chat request is processed under, and an error message when the engine would
    refuse it. A trailing assistant message is continued (its text becomes the start of the
    answer) on ``continue_final_message`` (vLLM, SGLang, llama-server), and by llama-server also
    unasked; every engine refuses ``continue_final_message`` together with a generation prompt."""
    messages = body.get("messages")
    continued = bool(body.get("continue_final_message"))
    if continued and body.get("add_generation_prompt", True):
        return "", "continue_final_message and add_generation_prompt cannot both be true"
    if not isinstance(messages, list) or not messages:
        return chat_key(messages), None  # raises the PromptError that names the problem
    last = messages[-1]
    trailing = isinstance(last, dict) and last.get("role") == "assistant"
    if continued and not trailing:
        return "", "continue_final_message needs a final assistant message"
    if trailing and (continued or engine_type == "llamacpp") and len(messages) > 1:
        content = last.get("content")
        return chat_key(messages[:-1]) + (content if isinstance(content, str) else ""), None
    return chat_key(messages), None
