"""Scenario files: the whole simulated deployment and workload in one YAML document.

    name: 3-region chat
    seed: 1
    network: {rtt_ms: {us-eu: 80, us-asia: 150, eu-asia: 200}, in_region_ms: 2}
    replicas: [{region: us, count: 4, profile: l4-llama3.1-8b}, ...]
    balancers: [{region: us, manages: [us], probe_interval_s: 0.1, forward: true}, ...]
    workload: {kind: chat, clients: {us: 120, eu: 40, asia: 40}}
    policies: [round_robin, skywalker, {preset: sglang_cache_aware, params: {balance_abs: 16}}]
    limits: {max_requests: 3000}

Unknown keys are errors that name the key, the allowed keys and the file line (``yamlconf``).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from kvroute import yamlconf
from kvroute.errors import ConfigError
from kvroute.perf.loader import ProfileError, load_profile
from kvroute.perf.network import NetworkSpec
from kvroute.policyfiles import load_entry_points
from kvroute.schema import StrictModel
from kvroute.sim import migration_settings
from kvroute.sim.chat_spec import ConversationSpec, ShapeSpec
from kvroute.sim.disagg import PDSetup
from kvroute.sim.noise import NoiseConfig, resolve
from kvroute.sim.policy_entries import PolicyEntry, policy_entry
from kvroute.sim.replica_group import ReplicaGroup
from kvroute.sim.simulation import BalancerSpec, Limits, ReplicaSpec, Setup
from kvroute.sim.stress import BurstSpec, RagSpec, WorkloadKind, open_loop_workload
from kvroute.sim.tracefiles import ScenarioError, resolve_trace
from kvroute.workload import Workload
from kvroute.workload.synthetic import ChatWorkload, ConversationShape
from kvroute.workload.traces import AzureTrace, MooncakeTrace, OpenAIConversations, TraceError

SCENARIO_DIR = Path(str(resources.files("kvroute") / "scenarios"))  # package data
TOPOLOGIES = ("regional", "global", "two-layer", "distributed")


class BalancerGroup(StrictModel):
    """A load balancer listed by hand: its region, the replica regions it manages, probing, forwarding and
    pacing."""

    region: str = Field(description="region the load balancer is in")
    manages: list[str] | Literal["all"] | None = None  # replica regions; default: its own
    probe_interval_s: float = Field(0.1, gt=0, description="how often it reads its replicas' indicators")
    forward: bool = Field(False, description="held requests may go to a peer load balancer (SkyWalker's two layers)")
    dispatch_tick_s: float = Field(0.01, ge=0, description="at most one dispatch per tick when the "
                                   "policy can hold (SkyWalker's 10 ms queue processor); 0 = unpaced")
    share_interval_s: float | None = Field(None, ge=0, description="tell the other sharing load balancers where "
                                           "it sent work, publishing every this many seconds (0: each message at "
                                           "once; sim/share.py); unset: it does not share")


class TopologySpec(StrictModel):
    """Where the load balancers are, without listing them (``balancers`` lists them by hand).

    * ``regional``: one LB per region, managing only that region's replicas;
    * ``global``: ONE LB, placed in ``region`` (default: the first region), managing every
      replica — clients elsewhere pay the RTT to it, and it pays the RTT to remote replicas
      (SkyWalker Fig. 8's baselines, GORGO's central proxy);
    * ``two-layer``: one LB per region with forwarding to peer LBs (SkyWalker; with the ``gorgo``
      preset GORGO v1's distributed mode, local first, a held request to a cheaper peer);
    * ``distributed``: one LB per region, each managing every replica with its own, unshared
      accounting (each region's LB may send anywhere: GORGO v1's least-load and prefix-trie
      baselines).
    """

    kind: Literal["regional", "global", "two-layer", "distributed"] = Field(
        "regional", description="`regional`: one LB per region for its replicas; `global`: one LB for all; "
        "`two-layer`: regional LBs that forward to peers; `distributed`: one LB per region, each for all replicas")
    region: str | None = Field(None, description="`global`: where the one LB is (default: the first region)")
    probe_interval_s: float = Field(0.1, gt=0, description="how often each LB reads its replicas' indicators")
    dispatch_tick_s: float = Field(0.01, ge=0, description="at most one dispatch per tick when the policy can hold; "
                                   "0 = unpaced")
    share: bool = Field(False, description="`distributed`: the LBs tell each other where they sent work — the fleet "
                        "ledger across regions (NATS): each mirrors the others' dispatches, first tokens and "
                        "completions into its own accounting one WAN hop after they happen (sim/share.py)")
    share_interval_s: float = Field(0.0, ge=0, description="`share`: publish every this many seconds (0: each "
                                    "message at once, as the gateway's fleet sync does)")


class WorkloadSpec(StrictModel):
    """What the simulated clients send: a synthetic kind or a trace file, clients per region and the knobs of
    each kind."""

    kind: WorkloadKind = Field(
        "chat", description="synthetic closed-loop chat, trees of thought or a mix; open-loop Poisson chat; "
        "open-loop long-context requests up to 128K (CascadeInfer, workload/long_context.py); open-loop RAG "
        "over a shared corpus (workload/rag.py); or a trace: Mooncake JSONL, Azure CSV, OpenAI-messages JSONL")
    clients: dict[str, int] = Field(default_factory=dict, description="per region: concurrent clients (closed "
                                    "loop) or the weight of trace requests assigned there; default 16 per "
                                    "replica region. Each region needs replicas or a load balancer")
    path: str | None = Field(None, description="trace file; relative paths are also looked up under "
                             "$KVROUTE_TRACES (default: mooncake and azure use the bundled traces there)")
    time_scale: float = Field(1.0, gt=0, description="traces: stretch inter-arrival times by this factor")
    rate: float | None = Field(None, gt=0, description="open loop: Poisson arrivals at this many requests/s "
                               "(traces: replaces their timestamps)")
    tree_fraction: float = Field(0.5, ge=0, le=1, description="`mixed`: share of programs that are trees of thought")
    depth: int = Field(4, ge=1, description="trees of thought: levels")
    branching: int = Field(2, ge=1, description="trees of thought: branches per node")
    think_time_s: float = Field(0.0, ge=0, description="closed loop: pause between a response and the next turn")
    load_generator: str | None = Field(
        None, description="region of ONE load generator that sends every request, each through the load "
        "balancer nearest its client region (GORGO v1 §4.3: one GuideLLM instance behind a geo-routing "
        "tunnel); unset: each client sends from its own region")
    concurrency: int | None = Field(
        None, ge=1, description="open loop: at most this many requests in flight; later arrivals wait at the "
        "client and their latencies count from the send (GORGO v2's replay client, 64 workers)")
    skip_bad: bool = Field(False, description="skip and count malformed trace lines instead of failing "
                           "(`--skip-bad`)")
    shapes: dict[str, ShapeSpec] = Field(default_factory=dict)  # per client region (chat/tot/mixed)
    conversation: ConversationSpec = Field(default_factory=ConversationSpec)  # chat, tot, mixed
    rag: RagSpec = Field(default_factory=RagSpec, description="`rag`: corpus, retrieval and hot prefix")
    bursts: BurstSpec | None = Field(None, description="chat-poisson, long-context, rag: bursty arrivals")
    max_prompt_tokens: int | None = Field(None, gt=0, description="traces: drop longer prompts (GORGO v2: 24,000)")
    max_output_tokens: int | None = Field(None, gt=0, description="traces: cap output lengths (GORGO v2: 128)")
    token_ratio: float | None = Field(None, ge=0.25, le=4, description="`openai` traces: engine tokens per bytes/4 "
                                      "estimated token (what the gateway learns from usage.prompt_tokens), so the "
                                      "simulator counts the engine's tokens")
    tokenizer_path: str | None = Field(None, description="`openai` traces: a local HF tokenizer.json to count "
                                       "prompt tokens exactly (instead of token_ratio)")
    engine_block_tokens: int | None = Field(None, gt=0, description="`openai` traces: the engines' prefix cache "
                                            "keeps blocks of this many engine tokens (vLLM: its block size; "
                                            "llama-server: 1, any prefix), finer than the router's index blocks; "
                                            "unset: the engines cache the index's blocks")


class LimitSpec(StrictModel):
    """When a simulated run stops issuing requests, and how long in-flight ones then get."""

    max_requests: int | None = Field(None, ge=1, description="stop issuing after this many requests "
                                     "(`--max-requests`)")
    max_sim_s: float | None = Field(None, gt=0, description="stop issuing at this simulated time")
    drain_s: float = Field(3600.0, gt=0, description="simulated time allowed for in-flight requests to finish "
                           "after the last one is issued")


class SLOSpec(StrictModel):
    """Service-level objective for goodput and the capacity knee (``--slo-ttft``/``--slo-tpot``).

    Defaults: TTFT ≤ 5 s — an interactive bound that still admits the tens-of-thousands-token
    prompts of the Mooncake traces on the bundled profiles when idle — and TPOT ≤ 100 ms, about
    10 tokens/s, faster than people read. ``target`` is the share of requests that must meet
    both for a load to count as under the knee.
    """

    ttft_s: float = Field(5.0, gt=0, description="time to first token bound (`--slo-ttft`)")
    tpot_s: float = Field(0.1, gt=0, description="time per output token bound (`--slo-tpot`)")
    target: float = Field(0.9, gt=0, le=1, description="share of requests that must meet both for a load to be "
                          "under the SLO knee (`--slo-target`)")


class PDSpec(StrictModel):
    """Prefill/decode disaggregation in a scenario: how the prefill engine is chosen, when a
    request is split (the scenario's policies choose the decode engine), and the KV links."""

    prefill_policy: str | dict[str, Any] = Field("sglang_cache_aware", description="chooses the prefill engine "
                                                 "among prefill and mixed replicas")
    disaggregate: str | dict[str, Any] | list[Any] = Field(
        "always", description="always | never | conditions that must all hold to split a request "
        "({pd_uncached_at_least: N}, {pd_dynamo: {...}}, pd_adaptive; docs/pd.md)")
    link_gb_s: float = Field(25.0, gt=0, description="KV transfer bandwidth between engines of one region, GB/s "
                             "(assumed: 200 Gb/s InfiniBand)")
    cross_region_link_gb_s: float = Field(1.25, gt=0, description="KV transfer bandwidth between regions, GB/s "
                                          "(assumed: 10 Gb/s)")

    def validated(self) -> PDSpec:
        """Check the policies and the decider now (a typo fails before any run)."""
        from kvroute.policy.pd import PDPolicySpec

        PDPolicySpec(prefill_policy=self.prefill_policy, disaggregate=self.disaggregate)
        return self


_DEFAULT_POLICIES: list[str | dict[str, Any]] = ["auto"]  # the default policy (policy/presets/auto.py)


class Scenario(StrictModel):
    """A `kvroute simulate` file: replicas, balancers or topology, network, workload, limits, SLOs and the
    policies to compare, all on one seed."""

    name: str = Field("scenario", description="title of the result tables and plots")
    seed: int = Field(0, description="seeds the workload and the policies; one seed, one identical workload "
                      "for every policy")
    network: NetworkSpec = Field(default_factory=NetworkSpec, description="round-trip times between regions")
    replicas: list[ReplicaGroup] = Field(default_factory=lambda: [ReplicaGroup(count=4)],
                                         description="groups of identical simulated engine replicas")
    balancers: list[BalancerGroup] | None = Field(None, description="load balancers listed by hand (else "
                                                  "`topology`, else one per replica region)")
    topology: TopologySpec | None = Field(None, description="where the load balancers are, without listing them")
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec, description="what the clients send")
    policies: list[str | dict[str, Any]] = Field(
        default_factory=lambda: _DEFAULT_POLICIES.copy(),
        description="each run on the identical workload: a preset name, `{preset, params, topology}`, or a "
        "composition of plugins with a `name` (docs/policies.md; `kvroute policies`)")
    limits: LimitSpec = Field(default_factory=LimitSpec, description="when a run stops")
    sample_interval_s: float = Field(1.0, gt=0, description="simulated seconds between load-over-time samples")
    index_block_tokens: int | None = Field(None, gt=0, description="tokens per prefix-index block (default: 512 "
                                           "for mooncake, whose hash ids cover 512 tokens; else 64)")
    slo: SLOSpec = Field(default_factory=SLOSpec, description="service-level objective for goodput and the "
                         "capacity knee")
    simulator: dict[str, Any] | None = Field(
        None, description="simulator settings for every policy that migrates sequences (cascadeinfer, llumnix: "
        "layout, max_stage_instances, stages, replan_interval_s, refinement, bidask, ...; "
        "sim/migration_settings.py); a policy's own `simulator:` overrides them, and they do not enter its label")
    engine_noise: NoiseConfig | Literal["profile"] | None = Field(
        None, description="timing noise and request reordering in the engines (sim/noise.py): `profile` (each "
        "replica's measured `noise_*`, from `kvroute calibrate`) or {step_sigma, api_delay_s}; unset: none")
    pd: PDSpec | None = Field(None, description="prefill/decode disaggregation: replica groups with role prefill "
                              "and decode, the prefill policy, when to split, the KV links (sim/disagg.py); "
                              "`policies` then choose the decode engine")

    @model_validator(mode="after")
    def _simulator_settings(self) -> Scenario:
        """The scenario's simulator settings are valid (one line, at the key)."""
        if self.simulator:
            try:
                migration_settings.split(None, self.simulator)
            except ValueError as exc:
                where, msg = str(exc).split(": ", 1)
                raise yamlconf.AtItem(msg, tuple(where.split("."))) from None
        return self

    @model_validator(mode="after")
    def _host_background(self) -> Scenario:
        """A background load needs the group's shared machine and leaves it some core (one line, at the key)."""
        for i, g in enumerate(self.replicas):
            if g.host_background_cores and not (g.host_cores and g.host_background_cores < g.host_cores):
                need = f"below host_cores ({g.host_cores})" if g.host_cores else "host_cores (the shared machine)"
                raise yamlconf.AtItem(f"host_background_cores {g.host_background_cores:g} needs {need}",
                                      ("replicas", i, "host_background_cores"))
        return self

    @model_validator(mode="after")
    def _pd_roles(self) -> Scenario:
        """Roles need `pd:`, and each side needs the other (one line, at the group's role)."""
        from kvroute.policy.pd import role_check

        roles: list[str] = [g.role for g in self.replicas]
        split = [i for i, r in enumerate(roles) if r != "mixed"]
        if self.pd is None and split:
            raise yamlconf.AtItem(f"role {roles[split[0]]} needs a `pd:` section (prefill policy, when to split, "
                                  "links)", ("replicas", split[0], "role"))
        why = role_check(roles)
        if why is not None:
            lonely = "prefill" if "no decode" in why else "decode"
            raise yamlconf.AtItem(why, ("replicas", roles.index(lonely), "role"))
        if self.pd is not None:
            try:
                self.pd.validated()
            except ValidationError as err:
                e = err.errors()[0]
                raise yamlconf.AtItem(e["msg"].removeprefix("Value error, "), ("pd", *e["loc"])) from None
        return self

    # -- derived ---------------------------------------------------------------------------------
    def regions(self) -> list[str]:
        """Regions that have replicas, in the order the file first names them."""
        return list(dict.fromkeys(g.region for g in self.replicas))

    def policy_list(self) -> list[PolicyEntry]:
        """One entry per policy, validated now so a typo fails before any run.

        An entry is a preset name, ``{preset, params, topology, simulator}`` or a composition of
        plugins (``{name, rules, cost, ...}``, docs/policies.md); ``topology`` (regional,
        global, two-layer) runs that policy on its own LB layout, so one table can put SkyWalker's
        two-layer LBs beside baselines behind one global LB, as its Fig. 8 does; ``simulator``
        holds the simulator-only settings of the migrating presets (``sim/migration_settings.py``).
        """
        out: list[PolicyEntry] = []
        seen: set[str] = set()
        for i, entry in enumerate(self.policies):
            e = policy_entry(i, entry, TOPOLOGIES, bool(self.balancers), self.simulator)
            if e.label in seen:
                raise ScenarioError(f"policies[{i}]: {e.label} is listed twice")
            seen.add(e.label)
            out.append(e)
        return out

    def balancer_groups(self, topology: str | None = None) -> list[BalancerGroup]:
        """The LB layout: a policy's topology, else the scenario's, else ``balancers``, else regional."""
        spec = self.topology or TopologySpec()
        kind = topology or (self.topology.kind if self.topology else None)
        if kind is None:
            return self.balancers or [BalancerGroup(region=r) for r in self.regions()]
        if self.balancers and self.topology is not None:
            raise ScenarioError("topology: give either 'balancers' or 'topology', not both")
        common = {"probe_interval_s": spec.probe_interval_s, "dispatch_tick_s": spec.dispatch_tick_s}
        if kind == "global":
            region = spec.region or self.regions()[0]
            if region not in self.regions() and region not in self.clients():
                raise ScenarioError(f"topology.region: {region!r} has no replicas or clients; "
                                    f"regions: {', '.join(self.regions())}")
            return [BalancerGroup(region=region, manages="all", **common)]
        if spec.share and spec.kind != "distributed":
            raise ScenarioError(f"topology.share: LBs share their dispatches only with kind: distributed (every LB "
                                f"over every replica), not {spec.kind!r}")
        if kind == "distributed":
            share = spec.share_interval_s if spec.share else None
            return [BalancerGroup(region=r, manages="all", share_interval_s=share, **common) for r in self.regions()]
        return [BalancerGroup(region=r, forward=kind == "two-layer", **common) for r in self.regions()]

    def setup(self, topology: str | None = None) -> Setup:
        """The simulator's Setup for ``topology`` (default: the scenario's): replica and balancer specs,
        network, limits; a bad profile or region is a ScenarioError."""
        replicas: list[ReplicaSpec] = []
        for g in self.replicas:
            try:
                prof = load_profile(g.profile)
            except ProfileError as exc:
                raise ScenarioError(f"replicas: {exc}") from None
            if g.max_running is not None:  # the engine's own batch limit (a setup fact, not the hardware's)
                prof = prof.model_copy(update={"max_running": g.max_running})
            if g.kv_blocks is not None:  # the engine's memory flag sizes its KV pool, not the hardware alone
                prof = prof.model_copy(update={"kv_blocks": g.kv_blocks})
            if g.admission is not None:  # the serving engine's scheduler (vLLM or SGLang), not the hardware's
                prof = prof.model_copy(update={"admission": g.admission})
            if g.waiting_gauge is not None:  # an engine setting (the exported metrics), not the hardware's
                prof = prof.model_copy(update={"waiting_gauge": g.waiting_gauge})
            n0 = sum(1 for r in replicas if r.region == g.region and r.role == g.role)
            host = (f"group-{len(replicas)}", g.host_cores, g.host_background_cores) if g.host_cores else None
            role = "" if g.role == "mixed" else f"{g.role[0]}-"  # p-us-0, d-us-0: the role in the id
            replicas += [ReplicaSpec(f"{role}{g.region}-{n0 + i}", g.region, prof, host, g.role,
                                     resolve(self.engine_noise, prof), g.accelerator, g.batch_limit_known)
                         for i in range(g.count)]
        groups = self.balancer_groups(topology)
        self._check_client_regions(groups)
        balancers = []
        for b in groups:
            manages = self.regions() if b.manages == "all" else (b.manages or [b.region])
            unknown = sorted(set(manages) - set(self.regions()))
            if unknown:
                raise ScenarioError(f"balancers[{b.region}].manages: no replicas in region(s) "
                                    f"{', '.join(unknown)}; regions: {', '.join(self.regions())}")
            ids = [r.id for r in replicas if r.region in manages]
            balancers.append(BalancerSpec(f"lb-{b.region}", b.region, ids, b.probe_interval_s, b.forward,
                                          b.dispatch_tick_s, b.share_interval_s))
        bt = self.index_block_tokens or (512 if self.workload.kind == "mooncake" else 64)
        pd = None
        if self.pd is not None:
            if any(b.share_interval_s is not None for b in groups):
                raise ScenarioError("share: not with pd (prefill/decode legs are not mirrored across balancers)")
            p = self.pd
            pd = PDSetup(p.prefill_policy, p.disaggregate, p.link_gb_s, p.cross_region_link_gb_s)
        return Setup(replicas, balancers, self.network.model(),
                     Limits(self.limits.max_requests, self.limits.max_sim_s, self.limits.drain_s),
                     self.seed, self.sample_interval_s, bt, self.slo.ttft_s, self.slo.tpot_s, pd,
                     origin=self.workload.load_generator, client_concurrency=self.workload.concurrency)

    def _check_client_regions(self, groups: list[BalancerGroup]) -> None:
        """Clients in a region with neither replicas nor a load balancer are a typo more often
        than a plan (they would silently pay the default cross-region RTT): name the region."""
        known = set(self.regions()) | {b.region for b in groups}
        gen = self.workload.load_generator
        if gen is not None and gen not in known:
            raise ScenarioError(f"workload.load_generator: no replicas (and no load balancer) in region {gen!r}; "
                                f"regions: {', '.join(sorted(known))}")
        for region in self.workload.clients:
            if region not in known:
                raise ScenarioError(f"workload.clients.{region}: no replicas (and no load balancer) in region "
                                    f"{region!r}; replica regions: {', '.join(self.regions())}. Add replicas "
                                    f"there ({{region: {region}, count: N}}) or move the clients")

    def clients(self) -> dict[str, int]:
        """Clients (or trace weights) per region: as given, else 16 in every replica region."""
        return dict(self.workload.clients) or {r: 16 for r in self.regions()}

    def make_workload(self) -> Workload:
        """A fresh workload as the file describes it, seeded with ``seed`` (called once per policy so each
        sees the same requests)."""
        w = self.workload
        clients = self.clients()
        try:
            if (w.token_ratio or w.tokenizer_path or w.engine_block_tokens) and w.kind != "openai":
                raise ScenarioError(f"workload.token_ratio / tokenizer_path / engine_block_tokens apply to openai "
                                    f"traces (text), not "
                                    f"{w.kind!r}, whose requests are counted in tokens already")
            if w.shapes and w.kind not in ("chat", "tot", "mixed"):
                raise ScenarioError(f"workload.shapes: per-region shapes apply to chat, tot and mixed "
                                    f"workloads, not {w.kind!r}")
            if (synthetic := open_loop_workload(w, clients, self.seed, self.limits.max_requests)) is not None:
                return synthetic
            if w.kind in ("chat", "tot", "mixed"):
                fractions = {"chat": 0.0, "tot": 1.0, "mixed": w.tree_fraction}
                frac = fractions[w.kind]
                shapes = {}
                for region, sh in w.shapes.items():
                    if region not in clients:
                        raise ScenarioError(f"workload.shapes.{region}: no clients in that region; "
                                            f"regions with clients: {', '.join(clients)}")
                    f = sh.tree_fraction if sh.tree_fraction is not None else (
                        fractions[sh.kind] if sh.kind and sh.kind != "mixed" else frac)
                    shapes[region] = (f, sh.depth or w.depth, sh.branching or w.branching)
                c = w.conversation
                return ChatWorkload(clients, self.seed, w.think_time_s, frac, w.depth, w.branching, shapes,
                                    ConversationShape(**c.model_dump()))
            path = resolve_trace(w.path, w.kind)
            if (w.max_prompt_tokens or w.max_output_tokens) and w.kind not in ("mooncake", "azure"):
                raise ScenarioError(f"workload.max_prompt_tokens / max_output_tokens apply to mooncake and "
                                    f"azure traces, not {w.kind!r}")
            if w.kind == "mooncake":
                return MooncakeTrace(path, w.time_scale, w.rate, clients, self.seed, w.skip_bad,
                                     self.limits.max_requests, w.max_prompt_tokens, w.max_output_tokens)
            if w.kind == "azure":
                return AzureTrace(path, w.time_scale, w.rate, clients, self.seed, w.skip_bad,
                                  self.limits.max_requests, w.max_prompt_tokens, w.max_output_tokens)
            try:
                return OpenAIConversations(path, clients, self.seed, w.skip_bad, token_ratio=w.token_ratio,
                                           tokenizer_path=w.tokenizer_path,
                                           engine_block_tokens=w.engine_block_tokens)
            except ValueError as exc:
                if isinstance(exc, TraceError):
                    raise
                raise ScenarioError(f"workload.{exc}") from None
        except TraceError as exc:
            raise ScenarioError(str(exc)) from None


def parse_scenario(data: Any, source: str = "scenario", text: str | None = None) -> Scenario:
    """Validate scenario data (a dict from YAML); errors become a ScenarioError naming ``source``:line and the
    key. Presets shipped outside kvroute (entry points) are loaded first, so the scenario may name them."""
    try:
        load_entry_points()
        return yamlconf.validate(Scenario, data, source, text)
    except (yamlconf.ConfigFileError, ConfigError) as exc:
        raise ScenarioError(str(exc)) from None


def load_scenario(path: str) -> Scenario:
    """A scenario from a YAML file, or from a bundled scenario's name (``chat-3region-skewed``); a missing one
    names the bundled ones."""
    p = Path(path)
    if not p.exists() and (SCENARIO_DIR / f"{path}.yaml").exists():
        p = SCENARIO_DIR / f"{path}.yaml"
    if not p.is_file():
        bundled = ", ".join(sorted(x.stem for x in SCENARIO_DIR.glob("*.yaml")))
        raise ScenarioError(f"{path}: no such scenario file; bundled scenarios: {bundled}")
    try:
        return yamlconf.load(Scenario, p)
    except yamlconf.ConfigFileError as exc:
        raise ScenarioError(str(exc)) from None
