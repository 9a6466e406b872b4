"""What a discovery source reports about one engine, before it becomes a replica."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["both", "prefill", "decode"]

# role label values as llm-d spells them (llm-d.ai docs, "vLLM in llm-d"); SGLang's router takes
# prefill/decode selectors with the same two words
ROLE_VALUES: dict[str, Role] = {"prefill": "prefill", "decode": "decode", "prefill-decode": "both",
                                "both": "both", "": "both"}


@dataclass(frozen=True)
class Engine:
    """One engine a source found: its replica id, base URL, role and KV-event endpoint, plus any
    ``replicas:`` fields the source itself supplies (a file source's entries carry their own)."""

    id: str
    url: str
    role: Role = "both"
    kv_events: str | None = None  # tcp://host:port of its KV-event publisher, when known
    fields: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def same(self, other: Engine) -> bool:
        """Equal in everything that would make the runtime rebuild the replica."""
        return (self.url, self.role, self.kv_events, self.fields) == (other.url, other.role, other.kv_events,
                                                                       other.fields)


def host_port(host: str, port: int) -> str:
    """``host:port`` with an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
