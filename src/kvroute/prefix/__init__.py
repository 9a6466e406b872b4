"""Prompt keys, chained block hashes, the bounded prefix index and the consistent-hash ring."""

from kvroute.prefix.blocks import DEFAULT_BLOCK_TOKENS, BlockHasher, hash_text, hash_token_ids
from kvroute.prefix.index import PrefixIndex
from kvroute.prefix.keys import PromptError, chat_key, completion_key, estimate_tokens
from kvroute.prefix.ring import HashRing

__all__ = [
    "DEFAULT_BLOCK_TOKENS", "BlockHasher", "HashRing", "PrefixIndex", "PromptError",
    "chat_key", "completion_key", "estimate_tokens", "hash_text", "hash_token_ids",
]
