"""Re-simulate a stored `kvroute bench fidelity` run against its recorded live side.

A fidelity JSON keeps every repeat's live numbers, its seed and the token ratio the live run
observed; the conversations are a function of the workload and the seed alone (the salt that
makes each run's system prompts fresh only prefixes their text), so the simulated side can be
rebuilt with another profile or simulator without running the engines again. Each repeat's salt
is stored with it; a JSON from before that lacks it, and then a rebuilt system prompt may differ
from the live one by a few tokens.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from kvroute.bench.fidelity import METRICS, Workload, conversations, simulate, summarize, with_as_calibrated
from kvroute.bench.fidelity_calibration import replay_factors
from kvroute.bench.fidelity_cpu import background


def replay(stored: dict, profile: str, noise: bool | None = None, salt: str = "",
           with_background: bool = True, with_speed: bool = False) -> dict:
    """``stored`` (a fidelity JSON) with its simulated side run again with ``profile``; ``noise``:
    the profile's engine noise on or off (None: as the stored run had it); ``salt``: for runs
    stored without their salts (older JSONs), what opens the rebuilt system prompts;
    ``with_background``: the host's background load each live run measured (bench/fidelity.py
    ``background``), or none; ``with_speed``: the engines' speed factors each live run measured
    (calibrate/speed_probe.py; runs stored before it have none), or none.
    A different salt shifts the prompts by a few tokens, and a 60-request run's simulated
    medians move with it (by up to ~30 % per repeat on issue 21's llama.cpp run): compare
    profiles over several salts, not one."""
    wd = dict(stored["workload"])
    wd["turns"] = tuple(wd["turns"])
    w = Workload(**wd)
    noise = stored.get("engine_noise", True) if noise is None else noise
    out = {k: v for k, v in stored.items() if k not in ("policies", "as_calibrated")}  # both made anew
    out.update(profile=profile, engine_noise=noise, replayed_from=stored.get("profile"))
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="kvroute-fidelity-replay-") as tmp:
        for policy, row in stored["policies"].items():
            runs[policy] = []
            for rep in row["repeats"]:
                live = rep["live"]
                opening = rep.get("salt", f"{policy}{salt}")
                convs = conversations(replace(w, seed=rep["seed"]), stored["bytes_per_token"], salt=opening)
                cores = stored.get("host_cores")
                bg = background(live, cores) if with_background else 0.0
                factors = replay_factors(live, profile, len(stored["engines"]), cores, bg) if with_speed else None
                sim = simulate(convs, policy, profile, len(stored["engines"]), live["token_ratio"],
                               w.max_tokens, Path(tmp), rep["seed"], cores, noise, bg, factors)
                ratio = {k: sim[k] / live[k] if live[k] else None for k, _ in METRICS}
                rec = {"seed": rep["seed"], "salt": opening, "live": live, "sim": sim, "sim_over_live": ratio}
                if factors:
                    rec["sim_as_calibrated"] = simulate(convs, policy, profile, len(stored["engines"]),
                                                        live["token_ratio"], w.max_tokens, Path(tmp), rep["seed"],
                                                        cores, noise, bg)
                runs[policy].append(rec)
    return with_as_calibrated(summarize(out, runs), runs)
