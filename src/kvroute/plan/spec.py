"""`kvroute plan` files: the workload, the SLO, candidate hardware with prices, regions and residency.

    name: SkyWalker's cost question
    scenario: reproduce/skywalker-fig10      # workload, network (RTTs), topology, seed, limits
    requests: 3000                           # per simulated run (default: the scenario's)
    regions: [us, eu, asia]                  # where replicas may go (default: the scenario's)
    residency: {eu: eu}                      # clients in eu are served only in eu
    hardware:
      - {profile: l4-llama3.1-8b, price_per_hour: 0.80}
    policies: [skywalker, {preset: skywalker, topology: regional}]
    layouts: [even]                          # how replicas spread over regions: even, by-clients
    max_replicas: 24
    slo:
      ttft_s: {p90: 3.0}                      # percentile bounds: mean, p50, p90, p95, p99
      e2e_s: {p50: 60}
      goodput: {ttft_s: 5, tpot_s: 0.1, share: 0.9}   # share of requests meeting both per-request bounds

Unknown keys are errors naming file:line and the allowed keys (``yamlconf``); an unknown hardware
profile names the bundled ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PositiveFloat

from kvroute import yamlconf
from kvroute.perf.loader import ProfileError, available_profiles, load_profile
from kvroute.plan import MIN_REQUESTS
from kvroute.schema import StrictModel
from kvroute.sim.scenario import Scenario, ScenarioError, load_scenario, parse_scenario

PlanError = ScenarioError  # one line, exit 2: same handling as a bad scenario
Stat = Literal["mean", "p50", "p90", "p95", "p99"]
Layout = Literal["even", "by-clients"]


class GoodputSLO(StrictModel):
    """Per-request bounds and the share of requests that must meet both (the simulator's goodput)."""

    ttft_s: float = Field(5.0, gt=0, description="a request's time to first token bound")
    tpot_s: float = Field(0.1, gt=0, description="a request's time per output token bound")
    share: float = Field(0.9, gt=0, le=1, description="share of issued requests that must meet both")


class PlanSLO(StrictModel):
    """What a deployment must meet: latency percentiles (seconds) and, optionally, goodput."""

    ttft_s: dict[Stat, PositiveFloat] = Field(default_factory=dict,
                                            description="time to first token: stat → bound (s)")
    tpot_s: dict[Stat, PositiveFloat] = Field(default_factory=dict,
                                            description="time per output token: stat → bound (s)")
    e2e_s: dict[Stat, PositiveFloat] = Field(default_factory=dict,
                                           description="end to end: stat → bound (s)")
    goodput: GoodputSLO | None = Field(None, description="share of requests within per-request bounds")

    def objectives(self) -> list[tuple[str, str, float]]:
        """``(metric, stat, bound)`` for every percentile bound, in file order."""
        return [(m, s, b) for m in ("ttft_s", "tpot_s", "e2e_s") for s, b in getattr(self, m).items()]


class Hardware(StrictModel):
    """A candidate replica kind: a hardware profile (bundled name or YAML file) and what one costs per hour."""

    profile: str = Field(description="bundled profile name (`kvroute/profiles/`) or a profile YAML file")
    price_per_hour: float = Field(gt=0, description="price of one replica per hour (any currency)")


class PlanSpec(StrictModel):
    """A `kvroute plan` file (see the module docstring)."""

    name: str = Field("plan", description="title of the tables and plot")
    scenario: str | None = Field(None, description="base scenario (file or bundled name): workload, network, "
                                 "topology, seed, limits; its replicas and policies are replaced")
    workload: dict[str, Any] | None = Field(None, description="replaces the scenario's workload (scenario keys)")
    network: dict[str, Any] | None = Field(None, description="replaces the scenario's network: rtt_ms, in_region_ms")
    requests: int | None = Field(None, ge=MIN_REQUESTS, description="requests per simulated run (default: the "
                                 "scenario's max_requests, else 2000)")
    seed: int | None = Field(None, description="replaces the scenario's seed")
    regions: list[str] | None = Field(None, description="regions replicas may go to (default: the scenario's)")
    residency: dict[str, str] = Field(default_factory=dict, description="client region → the region its "
                                      "requests must be served in")
    hardware: list[Hardware] = Field(min_length=1, description="candidate hardware with hourly prices")
    policies: list[str | dict[str, Any]] = Field(default_factory=lambda: list[str | dict[str, Any]](["round_robin"]),
                                                 description="candidate policies (scenario `policies` entries)")
    layouts: list[Literal["even", "by-clients"]] = Field(default_factory=lambda: list[Layout](["even"]),
                                                         description="how replicas spread over the regions")
    min_per_region: int = Field(1, ge=1, description="replicas every region gets at least")
    max_replicas: int = Field(32, ge=1, description="the search's upper bound on total replicas")
    prune: bool = Field(True, description="stop sizing a candidate once it cannot beat the cheapest passing "
                        "deployment; false sizes every candidate (to compare them, e.g. cross-region vs local)")
    slo: PlanSLO = Field(description="what the deployment must meet")


def load_plan(path: str) -> PlanSpec:
    """A plan from a YAML file; errors name file:line (PlanError)."""
    if not Path(path).is_file():
        raise PlanError(f"{path}: no such plan file")
    try:
        spec = yamlconf.load(PlanSpec, path)
    except yamlconf.ConfigFileError as exc:
        raise PlanError(str(exc)) from None
    check(spec, path)
    return spec


def check(spec: PlanSpec, where: str = "plan") -> None:
    """What the schema cannot say: hardware that exists, an SLO with something in it, residency regions."""
    for i, hw in enumerate(spec.hardware):
        try:
            load_profile(hw.profile)
        except ProfileError:
            raise PlanError(f"{where}: hardware[{i}].profile: unknown hardware {hw.profile!r}; allowed: "
                            f"{', '.join(available_profiles())}, or a profile YAML file") from None
    if not spec.slo.objectives() and spec.slo.goodput is None:
        raise PlanError(f"{where}: slo: give at least one bound (ttft_s / tpot_s / e2e_s: {{p90: S}}) or goodput")
    regions = regions_of(spec, base_scenario(spec))
    for client, zone in spec.residency.items():
        if zone not in regions:
            raise PlanError(f"{where}: residency.{client}: {zone!r} is not a replica region; regions: "
                            f"{', '.join(regions)}")
    if spec.min_per_region * len(regions) > spec.max_replicas:
        raise PlanError(f"{where}: max_replicas {spec.max_replicas} < min_per_region × regions "
                        f"({spec.min_per_region} × {len(regions)})")


def base_scenario(spec: PlanSpec) -> Scenario:
    """The scenario the plan varies: its base file with the plan's workload, network, seed and request count."""
    sc = load_scenario(spec.scenario) if spec.scenario else Scenario()
    data = sc.model_dump(exclude_none=True)
    for key in ("workload", "network", "seed"):
        if getattr(spec, key) is not None:
            data[key] = getattr(spec, key)
    n = spec.requests or data.get("limits", {}).get("max_requests") or 2000
    data.setdefault("limits", {})["max_requests"] = n
    if spec.slo.goodput:
        g = spec.slo.goodput
        data["slo"] = {"ttft_s": g.ttft_s, "tpot_s": g.tpot_s, "target": g.share}
    return parse_scenario(data, spec.scenario or "plan")


def regions_of(spec: PlanSpec, sc: Scenario) -> list[str]:
    """Replica regions: the plan's, else the base scenario's."""
    return list(spec.regions or sc.regions())
