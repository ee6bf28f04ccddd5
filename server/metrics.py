"""Prometheus metrics of the sidecar, read from the supervisor's state at scrape time.

Everything lives in the sidecar's own :class:`CollectorRegistry` (nothing in the process-global
default registry), so two sidecars in one process, or tests, never collide.

| metric                                          | type    | labels        |
|-------------------------------------------------|---------|---------------|
| gdsload_ready                                   | gauge   |               |
| gdsload_rank_ready                              | gauge   | rank          |
| gdsload_rank_state                              | gauge   | rank, state   |
| gdsload_load_phase_seconds                      | gauge   | rank, phase   |
| gdsload_load_seconds                            | gauge   | rank          |
| gdsload_load_bytes                              | gauge   | rank, kind    |
| gdsload_load_read_bytes                         | gauge   | rank          |
| gdsload_load_throughput_bytes_per_second        | gauge   | rank          |
| gdsload_load_failures_total                     | counter | rank          |
| gdsload_worker_restarts_total                   | counter | rank          |
| gdsload_time_to_ready_seconds                   | gauge   | scope         |
| gdsload_ipc_leases                              | gauge   | rank          |
| gdsload_model_generation_total                  | counter |               |
| gdsload_build_info                              | gauge   | version       |

Phase and throughput figures are those of the last completed load of each rank. Names follow Prometheus'
naming guide: the unit last (``_seconds``, ``_bytes``, ``_bytes_per_second``), counters end in ``_total``.

>>> body, content_type = render(make_registry(supervisor))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..loader.pipeline.result import PHASES

if TYPE_CHECKING:
    from .supervisor import Supervisor

__all__ = ["SidecarCollector", "make_registry", "render"]

_STATES = ("pending", "loading", "ready", "failed")


class SidecarCollector(Collector):
    """Turns one :meth:`Supervisor.status` snapshot into metric families."""

    def __init__(self, supervisor: Supervisor):
        self._supervisor = supervisor

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._supervisor.status()
        ranks = s["ranks"]

        yield GaugeMetricFamily(
            "gdsload_ready",
            "1 when every served rank is loaded (what /readyz answers 200 to)",
            value=1.0 if s["ready"] else 0.0,
        )
        ready = GaugeMetricFamily("gdsload_rank_ready", "1 when the rank's tensors are loaded", labels=["rank"])
        state = GaugeMetricFamily("gdsload_rank_state", "1 for the rank's current state", labels=["rank", "state"])
        phase = GaugeMetricFamily(
            "gdsload_load_phase_seconds", "Seconds of each phase of the rank's last load", labels=["rank", "phase"]
        )
        seconds = GaugeMetricFamily(
            "gdsload_load_seconds", "Seconds of the rank's last load (all phases)", labels=["rank"]
        )
        nbytes = GaugeMetricFamily(
            "gdsload_load_bytes", "Bytes of the rank: logical (in memory) and stored (on disk)", labels=["rank", "kind"]
        )
        done = GaugeMetricFamily(
            "gdsload_load_read_bytes", "Stored bytes read so far by the rank's current or last load", labels=["rank"]
        )
        rate = GaugeMetricFamily(
            "gdsload_load_throughput_bytes_per_second",
            "Logical bytes per second of the rank's last load",
            labels=["rank"],
        )
        leases = GaugeMetricFamily("gdsload_ipc_leases", "IPC exports of the rank not yet released", labels=["rank"])
        for key, r in ranks.items():
            ready.add_metric([key], 1.0 if r["state"] == "ready" else 0.0)
            for st in _STATES:
                state.add_metric([key, st], 1.0 if r["state"] == st else 0.0)
            nbytes.add_metric([key, "logical"], float(r["logical_bytes"]))
            nbytes.add_metric([key, "stored"], float(r["stored_bytes"]))
            done.add_metric([key], float(r["bytes_done"]))
            leases.add_metric([key], float(r["leases"]))
            if r["report"] is not None:
                for name in PHASES:
                    phase.add_metric([key, name], float(r["phases"].get(name, 0.0)))
                seconds.add_metric([key], float(r["seconds"]))
                rate.add_metric([key], float(r["gbps"]) * 1e9)
        yield from (ready, state, phase, seconds, nbytes, done, rate, leases)

        # Every served rank has both counters from the start, at 0: rate() and increase() cannot count the
        # first event of a series that appears with it.
        failures = CounterMetricFamily(
            "gdsload_load_failures", "Loads that failed or workers that died, per rank", labels=["rank"]
        )
        restarts = CounterMetricFamily(
            "gdsload_worker_restarts", "Workers restarted after a crash, per rank", labels=["rank"]
        )
        for family, counts in ((failures, s["failures_total"]), (restarts, s["restarts_total"])):
            for key in sorted(set(ranks) | set(counts), key=int):
                family.add_metric([key], float(counts.get(key, 0)))
        yield failures
        yield restarts

        ttr = GaugeMetricFamily(
            "gdsload_time_to_ready_seconds",
            "Seconds to readiness: from process start (scope=process, first time only) and "
            "from the start of the current load or reload (scope=load)",
            labels=["scope"],
        )
        if s["process"]["time_to_ready_s"] is not None:
            ttr.add_metric(["process"], float(s["process"]["time_to_ready_s"]))
        if s["load"]["time_to_ready_s"] is not None:
            ttr.add_metric(["load"], float(s["load"]["time_to_ready_s"]))
        yield ttr
        yield CounterMetricFamily(
            "gdsload_model_generation", "Loads and reloads so far (unload counts too)", value=float(s["generation"])
        )
        info = GaugeMetricFamily("gdsload_build_info", "The gdsload version serving", labels=["version"])
        info.add_metric([s["version"]], 1.0)
        yield info


def make_registry(supervisor: Supervisor) -> CollectorRegistry:
    """A fresh registry with the sidecar's metrics and the server process's CPU and memory."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SidecarCollector(supervisor))
    ProcessCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """``(body, content type)`` of the Prometheus text exposition."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
