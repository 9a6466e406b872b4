"""Engine KV-cache events in (issue 19): the exact prefix cache of each replica from vLLM's (and
SGLang's) event stream, instead of the gateway's guess.

* ``wire``      — decoding both payload generations; a byte-exact vLLM encoder (emulator, tests)
* ``index``     — one replica's table in kvroute's own keys (engine hash → own key), speculation
* ``consumer``  — ZMQ SUB per replica and rank, replay on gaps, stale marking, status (its
  docstring is the API: ``KVEventConsumer`` / ``EventSource``)
* ``publisher`` — a vLLM-compatible PUB + replay ROUTER (the emulator publishes through it)
* ``tokenize``  — the engine's token ids in the gateway (tokenizer + chat template), so that
  prompts key like the events

Needs the ``events`` extra (pyzmq, msgspec, jinja2); ``tokenize`` alone needs only tokenizers
(and jinja2 for chat templates), so the consumer's names load on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EventSource", "KVEventConsumer", "rank_endpoint"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvroute.kvevents import consumer

        return getattr(consumer, name)
    raise AttributeError(name)
