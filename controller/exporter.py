"""The controller's Prometheus exporter: `/metrics`, computed from Redis at every scrape.

One collector (prometheus_client's custom-Collector interface) reads the job's keys when
Prometheus scrapes, so what it shows is what the store says now, whichever controller leads:
a standby serves the same numbers with `optimus_controller_leader 0`. Nothing is kept between
scrapes but the commit time of the newest checkpoint. A scrape costs a fixed number of round
trips, O(nodes) only for two sorted-set reads and one field per node (docs/monitoring.md);
there are no per-rank labels, so series stay few at 131,072 ranks.

Names follow Prometheus's conventions: the `optimus_` prefix, base units (seconds, bytes),
`_total` on counters, ratios 0..1. docs/monitoring.md lists them all.

What agents wrote is read as untrusted: a record a scrape cannot read (a node's `rank_states`,
rank 0's heartbeat or its stability figures) is skipped and counted in
`optimus_exporter_unreadable_records`, and the scrape goes on; one bad record never takes the
others, or `optimus_controller_up`, with it. The job record's list of rewinds is read with a
bound on its size, and counted there too when it cannot be read.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from controller.control.detect import CAUSES
from controller.control.view import STATES
from controller.store.store import Store, StoreUnavailable
from optimus.checkpoint.manifest import CheckpointError, committed_steps, read_manifest, step_dir
from optimus.config import JobConfig

log = logging.getLogger("optimus.exporter")

AGE_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RANK_STATES = ("startup", "training", "checkpoint", "paused", "stopping", "done")
NODE_STATES = ("active", "spare", "excluded", "draining", "silent", "unhealthy")
UNREADABLE = ("rank_states", "rank_beat", "stability", "restarts", "rewinds")  # records parsed
RESTART_KINDS = ("in_process", "process")
TRAINING = (  # rank 0's logged figures (its heartbeat's `metrics`), as gauges; and "tokens"
    ("loss", "optimus_loss", "The last logged training loss"),
    ("tokens_per_s", "optimus_tokens_per_second", "Tokens per second, whole job"),
    ("mfu", "optimus_mfu_ratio", "Model FLOPs utilisation, 0..1"),
    ("step_time_s", "optimus_step_time_seconds", "Wall time of the last logged step"),
    ("checkpoint_s", "optimus_checkpoint_duration_seconds",
     "The last save, from its start to rank 0's files written"),
    ("moe_alltoall_bytes", "optimus_moe_alltoall_bytes",
     "Bytes the experts' all-to-alls sent between ranks in the last logged step, every rank "
     "and MoE layer, forward and backward (0 without expert parallelism)"),
    ("val_loss", "optimus_validation_loss",
     "The last validation loss: mean cross-entropy of the held-out tokens (eval.every)"))
# Rank 0's heartbeat's "stability" (optimus/stability.py): its verdicts along the run's line,
# carried through checkpoints, so a rewind or a restart takes them back to its resume point's
# (a counter reset to Prometheus); and the spike thresholds the next step is judged by.
STABILITY = (
    ("spikes", "optimus_loss_spikes", "Loss spikes judged along the run's line (a rewind or a "
     "restart takes the count back to its checkpoint's)"),
    ("divergences", "optimus_divergences", "Divergences judged along the run's line"),
    ("skipped_steps", "optimus_skipped_steps", "Steps whose update a spike left out, along the "
     "run's line"))
THRESHOLDS = (
    ("loss_threshold", "optimus_stability_loss_threshold",
     "The loss above which the next step is a spike (absent: rule off or not armed yet)"),
    ("grad_norm_threshold", "optimus_stability_grad_norm_threshold",
     "The gradient norm above which the next step is a spike (absent: rule off or not armed)"))
MAX_REWINDS_CHARS = 1 << 20  # the job record's list of rewinds: ~150 bytes each


class JobCollector(Collector):
    def __init__(self, store: Store, job: JobConfig, *, leading: Callable[[], bool],
                 agent_timeout_s: float):
        self.store, self.job = store, job
        self.leading = leading
        self.agent_timeout_s = agent_timeout_s
        self._committed_at: dict[int, float] = {}

    def collect(self) -> Iterator:
        leader = GaugeMetricFamily("optimus_controller_leader",
                                   "1 when this controller holds the leader lease")
        leader.add_metric([], 1.0 if self.leading() else 0.0)
        yield leader
        info = GaugeMetricFamily("optimus_job_info", "The job this controller supervises",
                                 labels=["name"])
        info.add_metric([self.job.name], 1.0)
        yield info
        try:
            families = list(self._job_families())
            up = 1.0
        except StoreUnavailable as e:
            log.warning("scrape without Redis: %s", e)
            families, up = [], 0.0
        yield _gauge("optimus_controller_up", "1 when this exporter could read Redis", up)
        yield from families

    # --- from Redis ----------------------------------------------------------------------------

    def _job_families(self) -> Iterator:
        store, now = self.store, time.time()
        unreadable: Counter[str] = Counter()  # per scrape: scrapes run in threads of their own
        record = store.job_record()
        plan = store.plan() or {}
        state = record.get("state", "PENDING")

        states = GaugeMetricFamily("optimus_job_state", "1 for the job's current state",
                                   labels=["state"])
        for name in STATES:
            states.add_metric([name], 1.0 if name == state else 0.0)
        yield states
        yield _gauge("optimus_generation", "The current generation (a restart starts the next)",
                     float(record.get("generation", -1)))
        yield _gauge("optimus_target_steps", "optim.steps of the job", self.job.optim.steps)

        running = plan.get("action") == "run"
        step = store.summaries.furthest_step() if running else None
        if step is not None:
            yield _gauge("optimus_step", "The furthest step any rank has reached", step)
        yield from self._training(plan if running else {}, unreadable)
        if running:
            yield from self._memory()

        causes = _json(record.get("restart_causes"), {})
        if not isinstance(causes, dict):  # the controller writes an object: left out if not
            causes = {}
        yield from _rewinds(record.get("rewinds"), causes.get("rewind", 0), unreadable)
        restarts = CounterMetricFamily("optimus_restarts", "Restarts of the job, by cause",
                                       labels=["cause"])
        for cause in CAUSES:
            count = causes.get(cause, 0)
            restarts.add_metric([cause], float(count) if type(count) is int else 0.0)
        yield restarts
        yield from _time_lost(record)

        beats = store.agent_beats()  # node -> its agent's last beat: read once a scrape
        yield from self._rank_restarts(beats, unreadable)
        yield from self._ranks_and_nodes(plan if running else {}, now, beats, unreadable)
        yield _gauge("optimus_stragglers", "Nodes reported as stragglers now",
                     len(_json(record.get("stragglers"), [])))
        yield from self._checkpoints(now)
        if record.get("memory_snapshot"):  # the controller's record, kept while a job runs
            yield _gauge("optimus_memory_snapshot_step", "Step of the newest usable in-memory "
                         "snapshot", float(record["memory_snapshot"]))
        yield _gauge("optimus_heartbeat_timeout_seconds", "supervision.heartbeat_timeout_s",
                     self.job.supervision.heartbeat_timeout_s)
        skipped = GaugeMetricFamily("optimus_exporter_unreadable_records", "Records (agents', "
                                    "the job record's rewinds) that this scrape could not "
                                    "read, and skipped",
                                    labels=["record"])
        for name in UNREADABLE:
            skipped.add_metric([name], float(unreadable[name]))
        yield skipped

    def _training(self, plan: dict, unreadable: Counter) -> Iterator:
        """Rank 0's last logged step: loss, throughput, MFU, step time, tokens, last save,
        stability counts and thresholds; its last validation."""
        beat = self._rank0_metrics(plan) if plan.get("nodes") else {}
        metrics = _figures(beat)
        if metrics is None:
            unreadable["rank_beat"] += 1
            metrics = {}
        for key, name, text in TRAINING:
            if metrics.get(key) is not None:
                yield _gauge(name, text, metrics[key])
        if metrics.get("tokens") is not None:  # a gauge: a restart goes back to its checkpoint's
            yield _gauge("optimus_tokens", "Tokens trained up to the last logged step",
                         metrics["tokens"])
        raw = beat.get("stability") if isinstance(beat, dict) else None
        if raw is None:  # stability off, or a rank from before it was sent
            return
        stability = _stability(raw)
        if stability is None:  # the other figures stand: only these are left out
            unreadable["stability"] += 1
            return
        for key, name, text in STABILITY:
            yield CounterMetricFamily(name, text, value=float(stability[key]))
        for key, name, text in THRESHOLDS:
            if stability[key] is not None:
                yield _gauge(name, text, stability[key])

    def _rank0_metrics(self, plan: dict):
        """Rank 0's heartbeat's `metrics` when that heartbeat is of the plan's generation ({}
        when there is none), as it came; None when that heartbeat cannot be read."""
        node = plan["nodes"][0]
        beat = self.store.rank_beats(node).get(0)
        if beat is None:  # none, or one the store skipped: not a JSON object
            return None if self.store.rank_beat_stored(node, 0) else {}
        if beat.get("generation") != plan.get("generation"):
            return {}
        return beat.get("metrics") or {}

    def _memory(self) -> Iterator:
        """The largest peak memory of any rank, each over its last logged step: how near the
        fullest rank is to its device's capacity. One series each, whatever the ranks."""
        peak = self.store.summaries.peak_memory()
        if peak is None:
            return
        yield _gauge("optimus_memory_peak_allocated_bytes", "The largest peak memory held by "
                     "tensors on any rank in its last logged step (CPU: peak RSS so far)",
                     peak["allocated_bytes"])
        yield _gauge("optimus_memory_peak_reserved_bytes", "The largest peak memory reserved "
                     "by the allocator on any rank in its last logged step (CPU: peak RSS so "
                     "far)", peak["reserved_bytes"])

    def _rank_restarts(self, beats: dict[str, float], unreadable: Counter) -> Iterator:
        """Ranks of generations after the first, by how they started: in the process of the
        last generation (supervision.restart in_process) or as a new one. Summed over the
        agents that beat (an agent's counts start again with it)."""
        kinds = dict.fromkeys(RESTART_KINDS, 0)
        for raw in self.store.agent_field(sorted(beats), "restarts").values():
            counts = _json(raw, None)
            if not isinstance(counts, dict) or not all(
                    isinstance(counts.get(k), int) and 0 <= counts[k] < 10**9
                    for k in RESTART_KINDS):
                unreadable["restarts"] += 1
                continue
            for kind in RESTART_KINDS:
                kinds[kind] += counts[kind]
        family = CounterMetricFamily("optimus_rank_restarts", "Ranks of later generations, by "
                                     "how they started: in_process or a new process",
                                     labels=["kind"])
        for kind, count in kinds.items():
            family.add_metric([kind], float(count))
        yield family

    def _ranks_and_nodes(self, plan: dict, now: float, beats: dict[str, float],
                         unreadable: Counter) -> Iterator:
        store = self.store
        plan_nodes = plan.get("nodes", [])
        ranks = dict.fromkeys(RANK_STATES, 0)
        for raw in store.agent_field(plan_nodes, "rank_states").values():
            counts = _rank_states(raw)
            if counts is None:
                unreadable["rank_states"] += 1
                continue
            for name, count in counts.items():
                ranks[name] += count
        family = GaugeMetricFamily("optimus_ranks", "Ranks of the running generation, by state",
                                   labels=["state"])
        for name, count in ranks.items():
            family.add_metric([name], float(count))
        yield family

        ages = sorted(max(now - t, 0.0) for t in store.summaries.oldest_beats().values())
        timeout = self.job.supervision.heartbeat_timeout_s
        yield _gauge("optimus_heartbeat_overdue_nodes", "Nodes whose oldest rank heartbeat is "
                     "older than heartbeat_timeout_s", sum(a > timeout for a in ages))
        buckets, i = [], 0
        for bound in AGE_BUCKETS:
            while i < len(ages) and ages[i] <= bound:
                i += 1
            buckets.append((str(bound), float(i)))
        buckets.append(("+Inf", float(len(ages))))
        yield HistogramMetricFamily(
            "optimus_heartbeat_age_seconds", "Per node of the running generation: the age of "
            "its oldest rank heartbeat", buckets=buckets, sum_value=sum(ages))

        excluded = store.excluded()
        unhealthy = set(store.summaries.sweep([]).unhealthy)
        in_plan = set(plan_nodes)
        counts = dict.fromkeys(NODE_STATES, 0)
        for node in set(beats) | set(excluded) | in_plan:
            entry = excluded.get(node)
            if entry is not None:
                counts["draining" if entry.get("mode") == "drain" else "excluded"] += 1
            elif now - beats.get(node, 0.0) > self.agent_timeout_s:
                counts["silent"] += 1
            elif node in unhealthy:
                counts["unhealthy"] += 1
            else:
                counts["active" if node in in_plan else "spare"] += 1
        nodes = GaugeMetricFamily("optimus_nodes", "Nodes by state", labels=["state"])
        for name, count in counts.items():
            nodes.add_metric([name], float(count))
        yield nodes
        yield _gauge("optimus_excluded_nodes", "Nodes excluded, by operators or the controller",
                     sum(1 for e in excluded.values() if e.get("mode") != "drain"))

    def _checkpoints(self, now: float) -> Iterator:
        root = self.job.resolved_checkpoint_dir
        yield _gauge("optimus_checkpoint_interval_steps", "checkpoint.interval (0: off)",
                     self.job.checkpoint.interval)
        steps = committed_steps(root)
        if not steps:
            return
        latest = steps[-1]
        if latest not in self._committed_at:
            try:
                manifest = read_manifest(step_dir(root, latest))
                self._committed_at = {latest: float(manifest.get("committed_at", now))}
            except (CheckpointError, OSError, ValueError):
                return  # deleted by retention between the listing and the read
        yield _gauge("optimus_checkpoint_step", "Step of the newest committed checkpoint", latest)
        yield _gauge("optimus_checkpoint_age_seconds", "Since the newest checkpoint committed",
                     max(now - self._committed_at[latest], 0.0))


def serve(store: Store, job: JobConfig, *, leading: Callable[[], bool],
          agent_timeout_s: float, port: int | None = None) -> str | None:
    """Serve /metrics on monitoring.metrics_port (or `port`) in a daemon thread; its URL, or
    None when off or the port is taken (the controller runs on without it, and says so)."""
    port = job.monitoring.metrics_port if port is None else port
    if not port:
        return None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(store, job, leading=leading, agent_timeout_s=agent_timeout_s))
    host = job.monitoring.metrics_host
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        log.warning("no /metrics: cannot listen on %s:%d (%s); set monitoring.metrics_port to "
                    "a free port (0: off)", host, port, e)
        return None
    return f"http://{host}:{port}/metrics"


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=float(value))


def _rank_states(raw: str) -> dict[str, int] | None:
    """A node's count of its ranks by state (states this exporter does not know are left out);
    None when it is not a JSON object of counts."""
    counts = _json(raw, None)
    if not isinstance(counts, dict):
        return None
    known = {k: v for k, v in counts.items() if k in RANK_STATES}
    if not all(type(v) is int and 0 <= v < 1 << 31 for v in known.values()):
        return None
    return known


def _figures(metrics) -> dict | None:
    """Rank 0's logged figures that are served, each a number or absent; None when one is
    neither."""
    if not isinstance(metrics, dict):
        return None
    served = {key: metrics.get(key) for key, _, _ in TRAINING} | {"tokens": metrics.get("tokens")}
    if not all(v is None or (isinstance(v, int | float) and not isinstance(v, bool))
               for v in served.values()):
        return None
    return served


def _stability(raw) -> dict | None:
    """Rank 0's stability figures: three counts and two thresholds (each a finite number or
    None; absent reads as None); None when they are not that."""
    if not isinstance(raw, dict):
        return None
    counts = [raw.get(key) for key, _, _ in STABILITY]
    if not all(type(v) is int and 0 <= v < 1 << 53 for v in counts):
        return None
    limits = {key: raw.get(key) for key, _, _ in THRESHOLDS}
    if not all(v is None or (type(v) in (int, float) and math.isfinite(v))
               for v in limits.values()):
        return None
    return {key: raw[key] for key, _, _ in STABILITY} | limits


def _rewinds(raw: str | None, restarts, unreadable: Counter) -> Iterator:
    """The job's rewinds so far: the restarts whose cause was a rewind (each rewind is one),
    or the job record's list's length where that is more (a record from before the cause was
    counted). The list keeps only the newest 100 (controller/control/rewind.py), so it alone
    would stop a counter there. A list too long or not a JSON list of objects is skipped and
    counted."""
    rewinds = [] if not raw else _json(raw, None) if len(raw) <= MAX_REWINDS_CHARS else None
    if not isinstance(rewinds, list) or not all(isinstance(r, dict) for r in rewinds):
        unreadable["rewinds"] += 1
        return
    counted = restarts if type(restarts) is int and 0 <= restarts < 1 << 53 else 0
    yield CounterMetricFamily("optimus_rewinds", "Rewinds of the job: a generation planned "
                              "from an earlier checkpoint past a loss spike or divergence",
                              value=float(max(len(rewinds), counted)))


def _time_lost(record: dict) -> Iterator:
    """Seconds lost to restarts, by cause (watching.track_progress: from where the job was when
    the restart was decided until a later generation passed that step), and the last one."""
    lost = _json(record.get("lost_s"), {})
    lost = lost if isinstance(lost, dict) else {}
    family = CounterMetricFamily(
        "optimus_restart_lost_seconds", "Wall time lost to restarts, by cause: from the step "
        "the job was at when a restart was decided until a later generation passed it, less "
        "those steps at the usual step time", labels=["cause"])
    for cause in CAUSES:
        seconds = lost.get(cause, 0.0)
        ok = type(seconds) in (int, float) and math.isfinite(seconds) and seconds >= 0
        family.add_metric([cause], float(seconds) if ok else 0.0)
    yield family
    last = _json(record.get("last_recovery"), None)
    seconds = last.get("seconds") if isinstance(last, dict) else None
    if type(seconds) in (int, float) and math.isfinite(seconds) and seconds >= 0:
        yield _gauge("optimus_last_recovery_seconds", "Time lost to the last restart the job "
                     "recovered from (see optimus_restart_lost_seconds_total)", seconds)


def _json(raw: str | None, default):
    try:
        return json.loads(raw) if raw else default
    except ValueError:
        return default
