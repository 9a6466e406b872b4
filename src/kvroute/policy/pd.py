"""Prefill/decode disaggregation: choosing a prefill engine, a decode engine, and whether to split.

In a disaggregated deployment some engines only prefill (role ``prefill``) and hand the
prompt's KV cache to an engine that decodes (role ``decode``); ``mixed`` engines do both. A
:class:`PDRouter` is the decode side's :class:`~kvroute.policy.router.Router` (every request
ends on a decode or mixed engine, so the gateway's and the simulator's accounting stay as they
are) holding a second Router for the prefill side. For each request it

1. asks the prefill policy (any preset; default SGLang's ``cache_aware``, which SGLang's router
   recommends for prefill) for a prefill engine — prefix cache and queue decide;
2. asks the decode policy (default ``pd_decode``: load, KV headroom, proximity to that prefill
   engine) for a decode engine, with the prefill choice on the request (``Request.pd_prefill``);
3. asks the *decider* whether to split at all: ``always``, ``never``, or conditions that must
   all hold — llm-d's threshold on uncached tokens (``pd_uncached_at_least``), Dynamo's
   conditional disaggregation (``pd_dynamo``), kvroute's own cost rule (``pd_adaptive``); see
   :mod:`kvroute.policy.builtin.pd`;
4. commits: a split request is in flight on both engines (the decode engine with no prefill
   of its own: its KV arrives), an unsplit one only on the decode engine, which prefills it.

Sources: SGLang ``python/sglang/srt/disaggregation/mini_lb.py`` (pick a prefill and a decode
server per request), llm-d-router ``pkg/epp/framework/plugins/scheduling/profilehandler/disagg``
(decode profile, then a decider, then the prefill profile), Dynamo's ``PyDisaggregatedRouter``.
Everything here is pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import Field, field_validator

from kvroute.errors import ConfigError
from kvroute.model import Decision, DecisionKind, Endpoint, Request
from kvroute.policy.base import Policy
from kvroute.policy.builtin.pd import PDState, kv_transfer_s
from kvroute.policy.compiler import make_plugin
from kvroute.policy.hooks import Lifecycle
from kvroute.policy.params import PolicyParams
from kvroute.policy.plugins import Condition
from kvroute.policy.registry import policy_from_config
from kvroute.policy.router import Router
from kvroute.schema import StrictModel, checked

__all__ = ["LOCAL", "ROLES", "SPLIT", "PDPolicySpec", "PDRouter", "PDState", "compile_decider", "kv_transfer_s",
           "pd_listeners", "role_check"]

ROLES = ("mixed", "prefill", "decode")
SPLIT = "pd-split"  # branch of a disaggregated request
LOCAL = "pd-local"  # branch of a request the decider kept on one engine


def compile_decider(spec: Any, where: str = "disaggregate") -> tuple[Condition, ...] | bool:
    """``always`` → True, ``never`` → False, else the condition plugins (a name, ``{name: args}``
    or a list of them) that must all hold for a request to be split."""
    if spec == "always":
        return True
    if spec == "never":
        return False
    if isinstance(spec, Mapping):
        items: list[Any] = [{k: v} for k, v in spec.items()]
    elif isinstance(spec, list):
        items = list(spec)
    elif isinstance(spec, str):
        items = [spec]
    else:
        raise ConfigError(f"{where}: expected always, never, a condition or a list of conditions, got {spec!r}")
    if not items:
        raise ConfigError(f"{where}: an empty list of conditions; give always or never instead")
    out = []
    for i, item in enumerate(items):
        cond = make_plugin("condition", item, PolicyParams(), (where, i))
        assert isinstance(cond, Condition)
        out.append(cond)
    return tuple(out)


class PDPolicySpec(StrictModel):
    """How a disaggregated deployment routes: the prefill and decode engines' policies and the
    rule that decides whether a request is split at all."""

    prefill_policy: str | dict[str, Any] = Field(
        "sglang_cache_aware", description="chooses the prefill engine among prefill and mixed engines (any "
        "preset or composition; SGLang's router recommends cache_aware for prefill)")
    decode_policy: str | dict[str, Any] = Field(
        "pd_decode", description="chooses the decode engine among decode and mixed engines; pd_decode weighs "
        "load, KV headroom and proximity to the prefill engine")
    disaggregate: str | dict[str, Any] | list[Any] = Field(
        "always", description="always | never | conditions that must all hold to split a request: "
        "{pd_uncached_at_least: 256} (llm-d), {pd_dynamo: {max_local_prefill: 1000, max_prefill_queue: 2}}, "
        "pd_adaptive (kvroute's cost rule); docs/policies.md")

    @field_validator("prefill_policy", "decode_policy")
    @classmethod
    def _policy(cls, v: Any) -> Any:
        return checked(policy_from_config, v)

    @field_validator("disaggregate")
    @classmethod
    def _decider(cls, v: Any) -> Any:
        return checked(compile_decider, v)


class PDRouter(Router):
    """The decode side's Router with a prefill-side Router inside (module docstring).

    The runtime reports a split request's prefill leg with :meth:`on_prefill_done` (its KV is
    ready: the prefill engine's part is over) and the rest as for any request: the decode
    engine's first token (``on_first_token``), completion (``on_finish``) or failure
    (``on_failed``), which also close the prefill leg if it is still open.
    """

    def __init__(self, decode_policy: Policy, prefill_policy: Policy, decider: tuple[Condition, ...] | bool,
                 endpoints: Iterable[Endpoint] = (), *, decode_alone: bool = True, **kwargs: Any):
        """``decode_alone``: a decode engine may serve a request whole when no prefill engine can
        (vLLM's ``kv_both`` engines; SGLang's decode engines cannot)."""
        self.prefill = Router(prefill_policy, **kwargs)
        super().__init__(decode_policy, **kwargs)
        self.decider = decider
        self.decode_alone = decode_alone
        self.splits = 0
        self.locals = 0
        for ep in endpoints:
            self.add_endpoint(ep)

    @classmethod
    def from_spec(cls, spec: PDPolicySpec, seed: int = 0, endpoints: Iterable[Endpoint] = (),
                  decode_overrides: dict[str, Any] | None = None, **kwargs: Any) -> PDRouter:
        """Build from a :class:`PDPolicySpec` (the prefill policy seeded ``seed + 1``)."""
        return cls(policy_from_config(spec.decode_policy, seed=seed, overrides=decode_overrides),
                   policy_from_config(spec.prefill_policy, seed=seed + 1),
                   compile_decider(spec.disaggregate), endpoints, **kwargs)

    def _no_prefill(self, req: Request, why: str) -> Decision | None:
        """Without a prefill engine: None (the decode engine serves alone) or a refusal."""
        if self.decode_alone or not any(e.role == "decode" for e in self.endpoints):
            return None
        return Decision.none(f"no prefill engine can take the request ({why}); decode engines cannot prefill "
                             "alone in this protocol")

    # -- the prefill side follows the decode side's settings ------------------------------------
    @property
    def index_block_tokens(self) -> int:
        """Tokens per prefix block, on both sides."""
        return self._block_tokens

    @index_block_tokens.setter
    def index_block_tokens(self, value: int) -> None:
        self._block_tokens = value
        self.prefill.index_block_tokens = value

    def add_endpoint(self, ep: Endpoint, _ring: bool = True) -> None:
        """Route to ``ep`` on the side(s) its role allows (a mixed engine on both, one Endpoint
        object, so both sides see one load)."""
        if ep.role not in ROLES:
            raise ValueError(f"endpoint {ep.id!r}: role {ep.role!r}; allowed: {', '.join(ROLES)}")
        if ep.role != "prefill":
            super().add_endpoint(ep, _ring)
        if ep.role != "decode":
            self.prefill.add_endpoint(ep, _ring)

    def remove_endpoint(self, endpoint_id: str) -> Endpoint | None:
        """Stop routing to ``endpoint_id`` on both sides."""
        a = super().remove_endpoint(endpoint_id)
        b = self.prefill.remove_endpoint(endpoint_id)
        return a or b

    def endpoint(self, endpoint_id: str) -> Endpoint | None:
        """The endpoint called ``endpoint_id`` on either side."""
        return super().endpoint(endpoint_id) or self.prefill.endpoint(endpoint_id)

    @property
    def all_endpoints(self) -> list[Endpoint]:
        """Every endpoint of both sides, once each."""
        seen = {id(e): e for e in (*self.endpoints, *self.prefill.endpoints)}
        return list(seen.values())

    def reset_index(self, block_tokens: int, max_prefix_blocks: int) -> None:
        """Empty both sides' prefix indexes."""
        super().reset_index(block_tokens, max_prefix_blocks)
        self.prefill.reset_index(block_tokens, max_prefix_blocks)

    def resize_index(self, endpoint_id: str) -> None:
        """Re-bound the endpoint's index on each side that routes to it."""
        if super().endpoint(endpoint_id) is not None:
            super().resize_index(endpoint_id)
        if self.prefill.endpoint(endpoint_id) is not None:
            self.prefill.resize_index(endpoint_id)

    def forget_cache(self, endpoint_id: str) -> None:
        """The endpoint's cache is gone: forget it on both sides."""
        super().forget_cache(endpoint_id)
        self.prefill.forget_cache(endpoint_id)

    def use_cache_table(self, endpoint_id: str, table: dict[int, int] | None) -> None:
        """The endpoint's exact table (or None) on each side that routes to it."""
        super().use_cache_table(endpoint_id, table)
        self.prefill.use_cache_table(endpoint_id, table)

    def policy_state(self) -> dict[str, float]:
        """Both sides' plugin state (the prefill side's under ``prefill/``) and the split counts."""
        out = super().policy_state()
        out.update({f"prefill/{k}": v for k, v in self.prefill.policy_state().items()})
        out["pd.split"] = float(self.splits)
        out["pd.local"] = float(self.locals)
        return out

    # -- deciding ---------------------------------------------------------------------------------
    def route(self, req: Request) -> Decision:
        """Choose a prefill engine, then a decode engine near it, then whether to split; commit.

        No prefill engine available (none configured, all unhealthy or excluded, or the
        prefill policy refuses): the decode engine serves the whole request, as llm-d's
        sidecar falls back to decode-only. A prefill policy that holds holds the request."""
        pdec: Decision | None = None
        if self.prefill.endpoints:
            pdec = self.prefill.policy.decide(req, self.prefill.view)
            if pdec.kind is DecisionKind.HOLD:
                return pdec
            if pdec.kind is not DecisionKind.DISPATCH:
                refused = self._no_prefill(req, pdec.reason)
                if refused is not None:
                    return refused
                pdec = None
        p_ep = self.prefill.endpoint(pdec.target) if pdec is not None and pdec.target else None
        req.pd_prefill = p_ep.id if p_ep is not None else None
        req.pd_prefill_region = p_ep.region if p_ep is not None else None
        try:
            ddec = self.policy.decide(req, self.view)
        finally:
            req.pd_prefill = req.pd_prefill_region = None
        if ddec.kind is not DecisionKind.DISPATCH or ddec.target is None:
            return ddec
        d_ep = self._eps[ddec.target]
        split = p_ep is not None and p_ep is not d_ep and self._split(req, p_ep, pdec, d_ep, ddec)
        if not split:
            self.locals += 1
            self.commit(req, d_ep.id, ddec.matched_blocks or None)
            return Decision.dispatch(d_ep.id, LOCAL, self.tickets[req.id].matched_blocks)
        assert p_ep is not None and pdec is not None
        self.splits += 1
        self.prefill.commit(req, p_ep.id, pdec.matched_blocks or None)
        self.commit(req, d_ep.id, ddec.matched_blocks or None, prefill_tokens=0)
        d = Decision.dispatch(d_ep.id, SPLIT, self.tickets[req.id].matched_blocks)
        d.prefill = p_ep.id
        return d

    def _split(self, req: Request, p_ep: Endpoint, pdec: Decision | None, d_ep: Endpoint, ddec: Decision) -> bool:
        decider = self.decider
        if isinstance(decider, bool):
            return decider
        p_match = pdec.matched_blocks if pdec is not None and pdec.matched_blocks else \
            self.prefill.prefix.match_one(p_ep.id, req.block_hashes)
        d_match = ddec.matched_blocks or self.prefix.match_one(d_ep.id, req.block_hashes)
        st = PDState(req, self, self.policy.rng, p_ep, d_ep, p_match, d_match)
        eps = [d_ep]
        return all(c.holds(st, eps) for c in decider)

    # -- lifecycle --------------------------------------------------------------------------------
    def on_prefill_done(self, req_id: str, ttft_s: float | None = None) -> None:
        """The prefill engine computed the prompt and its KV is handed over: its part is done
        (``ttft_s``: prefill latency at the load balancer, for the prefill side's learners)."""
        self.prefill.on_first_token(req_id, ttft_s)
        self.prefill.on_finish(req_id, ttft_s, 1 if ttft_s is not None else 0)

    def on_failed(self, req_id: str, *, notify: bool = True) -> None:
        """Neither engine served the request: undo both sides."""
        self.prefill.on_failed(req_id, notify=notify)
        super().on_failed(req_id, notify=notify)

    def on_finish(self, req_id: str, e2e_s: float | None = None, output_tokens: int = 0, *,
                  notify: bool = True) -> None:
        """The request is over (or re-routed): undo both sides (the prefill side only if its
        leg never reported done)."""
        self.prefill.on_finish(req_id, notify=notify)
        super().on_finish(req_id, e2e_s, output_tokens, notify=notify)

    def prefill_ticket(self, req_id: str) -> str | None:
        """The prefill engine a request's open prefill leg is on, or None."""
        t = self.prefill.tickets.get(req_id)
        return t.endpoint_id if t is not None else None


def pd_listeners(router: Router) -> tuple[Lifecycle, ...]:
    """Every lifecycle listener of a router, both sides of a PDRouter."""
    extra = router.prefill.policy.listeners if isinstance(router, PDRouter) else ()
    return (*router.policy.listeners, *extra)


def role_check(roles: Iterable[str]) -> str | None:
    """Why a set of engine roles cannot serve (prefill engines and nothing to decode their
    requests, or decode engines and nothing to prefill for them), or None when it can."""
    present = set(roles)
    if "prefill" in present and not present & {"decode", "mixed"}:
        return "prefill engines are declared but no decode (or mixed) engine to hand their KV cache to"
    if "decode" in present and not present & {"prefill", "mixed"}:
        return "decode engines are declared but no prefill (or mixed) engine to prefill for them"
    return None


Role = Literal["mixed", "prefill", "decode"]
