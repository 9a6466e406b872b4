"""Chained block hashes over fixed-size blocks, with xxhash.

Block i's hash is ``xxh3_64(block_i_bytes, seed=hash_{i-1})``: it covers the whole prefix, so
equal hashes mean equal prefixes (vLLM's and llm-d's scheme). Only full blocks are hashed — a
partial tail block is never reused by an engine either.

Without a tokenizer a block is ``block_tokens * 4`` UTF-8 bytes of the key (4 bytes ≈ 1 token);
with a tokenizer, ``block_tokens`` token ids packed as uint32. ``hash_text_spans`` cuts blocks of
a fractional byte length (an engine's own cache block, in its tokens: the simulator's engines).
"""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Any, Final

import xxhash

from kvroute.prefix.keys import CHARS_PER_TOKEN, estimate_tokens

DEFAULT_BLOCK_TOKENS: Final = 64
_xxh3: Final = xxhash.xxh3_64_intdigest


def _chain(data: bytes, block_bytes: int) -> tuple[int, ...]:
    out = []
    h = 0
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        h = _xxh3(data[start:start + block_bytes], h)
        out.append(h)
    return tuple(out)


def hash_text(text: str, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> tuple[int, ...]:
    """Chained block hashes of text, a block being ``block_tokens`` × 4 bytes (the token estimate)."""
    return _chain(text.encode("utf-8", "surrogatepass"), block_tokens * CHARS_PER_TOKEN)


def hash_text_spans(text: str, block_bytes: float) -> tuple[int, ...]:
    """Chained hashes of text cut into blocks of ``block_bytes`` ≥ 1 bytes on average (block *i*
    ends at byte ``floor((i + 1) * block_bytes)``): an engine's cache block of a whole number of
    *its* tokens, which are a fractional number of bytes each. Only full blocks are hashed."""
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be at least 1, got {block_bytes}")
    data = text.encode("utf-8", "surrogatepass")
    out = []
    h, start, i = 0, 0, 1
    end = int(block_bytes)
    while end <= len(data):
        h = _xxh3(data[start:end], h)
        out.append(h)
        start, i = end, i + 1
        end = int(i * block_bytes)
    return tuple(out)


def hash_token_ids(ids: list[int], block_tokens: int = DEFAULT_BLOCK_TOKENS) -> tuple[int, ...]:
    """Chained block hashes of token ids, ``block_tokens`` ids per block."""
    return _chain(array("I", ids).tobytes(), block_tokens * 4)


class BlockHasher:
    """Turns a prompt key into ``(block_hashes, prompt_tokens)``.

    ``tokenizer_path`` names a local HF ``tokenizer.json``; it is never fetched from a hub.
    Tokenizing is exact but costs far more than the byte estimate, so it is opt-in.
    """

    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS, tokenizer_path: str | None = None):
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.block_tokens = block_tokens
        self._tokenizer = None
        if tokenizer_path:
            path = Path(tokenizer_path)
            if not path.is_file():
                raise ValueError(f"tokenizer_path: no such file {tokenizer_path!r} "
                                 "(a local tokenizer.json is required; hubs are not contacted)")
            try:
                from tokenizers import Tokenizer
            except ImportError as exc:  # optional dependency
                raise ValueError("tokenizer_path needs the optional 'tokenizers' package: "
                                 "pip install 'kvroute[tokenizers]'") from exc
            self._tokenizer = Tokenizer.from_file(str(path))

    @property
    def tokenizer(self) -> Any:
        """The local tokenizer (a ``tokenizers.Tokenizer``), None without ``tokenizer_path``."""
        return self._tokenizer

    def __call__(self, key: str | list[int]) -> tuple[tuple[int, ...], int]:
        return self.of(key)

    def of(self, key: str | list[int]) -> tuple[tuple[int, ...], int]:
        """``(block_hashes, prompt_tokens)`` of a prompt key (``hasher(key)`` is the same; the gateway
        calls this name because a compiled build calls a method directly and ``__call__`` generically)."""
        if isinstance(key, list):
            return hash_token_ids(key, self.block_tokens), len(key)
        if self._tokenizer is not None:
            ids = self._tokenizer.encode(key, add_special_tokens=False).ids
            return hash_token_ids(ids, self.block_tokens), len(ids)
        return hash_text(key, self.block_tokens), estimate_tokens(key)
