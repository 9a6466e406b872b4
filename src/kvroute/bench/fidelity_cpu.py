"""The background load a live fidelity run measured (issue 21): what else used the cores the
engines share — the ledger itself is calibrate/host_cpu.py, which the calibration sweep uses too."""

from __future__ import annotations

from kvroute.calibrate.host_cpu import LOCAL, CpuLedger, listening_pid, machine_busy_s, thread_cpu_s

__all__ = ["LOCAL", "CpuLedger", "background", "listening_pid", "machine_busy_s", "thread_cpu_s"]


def background(live: dict, host_cores: int | None) -> float:
    """The background load a live run measured on the engines' shared machine (bench/fidelity_cpu.py;
    a run stored before it: its gateway's and client's CPU), kept below the cores; 0 without
    ``host_cores``."""
    if not host_cores:
        return 0.0
    cpu = live.get("host_cpu") or {}
    got = cpu.get("background", live.get("gateway_cpu_share", 0.0) + live.get("client_cpu_share", 0.0))
    return min(max(0.0, float(got)), 0.9 * host_cores)
