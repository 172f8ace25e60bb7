"""Prometheus metrics of the server (`tandem:` prefix, names modelled on vLLM's).

Gauges come from the engine's latest stats (sent with every step's outputs and whenever they change while
idle); token counters and latency histograms are observed in the frontend as outputs arrive.

With data-parallel replicas (--dp D > 1) every engine gauge and counter has one series per replica (label
`replica`) beside the one without it, which is the whole server's: the sum, or for fractions (KV usage,
device idle) the mean over live replicas. `sum(x{replica!=""})` and `x{replica=""}` so agree, never count
twice. `tandem:replica_up{replica}` is 1 while a replica lives.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..request import StepOutput
from ..speculative.config import MAX_SPECULATIVE_TOKENS
from ..replicas.engine_client import RequestStream
from ..replicas.replica_set import MEANS

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)

# gauge name -> (engine stats key, help)
GAUGES = {
    "tandem:num_requests_running": ("num_running", "Requests in the running batch."),
    "tandem:num_requests_waiting": ("num_waiting", "Requests waiting to be scheduled."),
    "tandem:kv_cache_usage_perc": ("kv_usage", "Fraction of KV cache slots in use (1 = full)."),
    "tandem:state_bytes": ("state_bytes", "Hybrid models: bytes of the linear-attention states held now (the running "
                           "requests' and the prefix cache's checkpoints)."),
    "tandem:state_checkpoints_held": ("held_state_checkpoints", "Hybrid models: saved linear-attention states the "
                                      "prefix cache holds (of state_checkpoints, each one request's state)."),
    "tandem:kv_disk_entries": ("disk_entries", "Disk tier (--kv-disk-dir): entries (64-token chunks) on disk."),
    "tandem:kv_disk_bytes": ("disk_bytes", "Disk tier: bytes its entries take (queued writes at their expected size)."),
    "tandem:kv_disk_enabled": ("disk_enabled", "Disk tier: 1 while it writes, 0 once a write error disabled it."),
    "tandem:device_idle_fraction": ("device_idle_fraction",
                                    "Fraction of the last window (device steps of the last 10 s) the device idled."),
}
# counter name (the client adds _total) -> (engine stats key, help): running totals kept by the engine
ENGINE_COUNTERS = {
    "tandem:prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "tandem:prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens whose KV the prefix cache held."),
    "tandem:num_preemptions": ("num_preemptions", "Running requests retracted (their KV freed, re-prefilled when "
                               "they resume): the KV cache ran short or a request that outranks them needed room."),
    "tandem:state_checkpoints_saved": ("state_checkpoints_saved", "Hybrid models: states saved as prefix-cache "
                                       "checkpoints (where requests end and at prefill chunk ends)."),
    "tandem:state_checkpoints_restored": ("state_checkpoints_restored", "Hybrid models: requests resumed from a "
                                          "prefix-cache state checkpoint."),
    "tandem:kv_disk_hit_tokens": ("disk_hits", "Disk tier: prompt tokens whose KV was read back from disk."),
    "tandem:kv_disk_misses": ("disk_misses", "Disk tier: admissions that found nothing on disk past the RAM hit."),
    "tandem:kv_disk_bytes_written": ("disk_bytes_written", "Disk tier: bytes of entries written."),
    "tandem:kv_disk_bytes_read": ("disk_bytes_read", "Disk tier: bytes of entries read back (checked)."),
    "tandem:kv_disk_restore_seconds": ("disk_restore_seconds", "Disk tier: seconds spent reading and checking "
                                       "entries for restores."),
    "tandem:kv_disk_bad_entries": ("disk_bad_entries", "Disk tier: entries dropped as missing, truncated, corrupt "
                                   "or another engine's (their prefix recomputed)."),
    "tandem:kv_disk_evictions": ("disk_evicted", "Disk tier: entries removed to stay within --kv-disk-size."),
    "tandem:kv_disk_dropped": ("disk_dropped", "Disk tier: chunks not written (no room in a step, a lost write)."),
    "tandem:spec_decode_num_draft_tokens": ("spec_draft_tokens", "Draft tokens verified by speculative decoding."),
    "tandem:spec_decode_num_accepted_tokens": ("spec_accepted_tokens",
                                               "Draft tokens speculative decoding accepted."),
}
MAX_CLASSES = 64          # distinct priorities or tenants labelled apiece; the rest are counted under "other"
SPEC_ACCEPTED_LEN = ("tandem:spec_decode_accepted_length", "Accepted drafts per verified speculative run "
                     "(its tokens are that plus one).")


# (engine stats, open requests in the frontend, alive) of each replica, read at scrape time
ReplicaStats = Callable[[], "list[tuple[dict, int, bool]]"]


def _total(key: str, replicas: list[tuple[dict, int, bool]]) -> float:
    """The server's value of an engine stat: the sum over replicas, or for a fraction the mean over live ones."""
    if key in MEANS:
        live = [float(stats.get(key, 0.0)) for stats, _, alive in replicas if alive]
        return sum(live) / len(live) if live else 0.0
    return sum(float(stats.get(key, 0.0)) for stats, _, _ in replicas)


class _EngineGauges:
    """Reads the replicas' latest stats, and the frontend's open requests, at scrape time."""

    def __init__(self, model_name: str, replicas: ReplicaStats) -> None:
        self.model_name, self.replicas = model_name, replicas

    def collect(self):
        reps = self.replicas()
        many = len(reps) > 1
        series = [(GaugeMetricFamily, name, doc, key) for name, (key, doc) in GAUGES.items()]
        series += [(CounterMetricFamily, name, doc, key) for name, (key, doc) in ENGINE_COUNTERS.items()]
        series.append((GaugeMetricFamily, "tandem:frontend_open_requests", "Requests the frontend holds state for "
                       "(submitted, not yet finished); 0 when idle.", None))
        for kind, name, doc, key in series:
            per = [float(n) if key is None else float(stats.get(key, 0.0)) for stats, n, _ in reps]
            total = sum(per) if key is None else _total(key, reps)
            f = kind(name, doc, labels=["model_name"])
            f.add_metric([self.model_name], total)
            if many:                   # the same family, one more label: samples may differ in labels
                for i, v in enumerate(per):
                    f.add_sample(f.samples[0].name, {"model_name": self.model_name, "replica": str(i)}, v)
            yield f
        yield _accepted_length(self.model_name, reps)
        if many:
            g = GaugeMetricFamily("tandem:replica_up", "1 while the data-parallel replica lives, 0 once it died.",
                                  labels=["model_name", "replica"])
            for i, (_, _, alive) in enumerate(reps):
                g.add_metric([self.model_name, str(i)], 1.0 if alive else 0.0)
            yield g


def _accepted_length(model_name: str, reps: list[tuple[dict, int, bool]]) -> HistogramMetricFamily:
    """The accepted-length histogram, from the engines' spec_accepted_len_{a} run counts (summed over replicas)."""
    runs: dict[int, float] = {}
    for stats, _, _ in reps:
        for key, n in stats.items():
            if key.startswith("spec_accepted_len_"):
                a = int(key.rsplit("_", 1)[1])
                runs[a] = runs.get(a, 0.0) + float(n)
    buckets, total = [], 0.0
    for le in range(MAX_SPECULATIVE_TOKENS + 1):
        total += runs.get(le, 0.0)
        buckets.append((str(le), total))
    buckets.append(("+Inf", total))
    h = HistogramMetricFamily(*SPEC_ACCEPTED_LEN, labels=["model_name"])
    h.add_metric([model_name], buckets, sum_value=sum(a * n for a, n in runs.items()))
    return h


class ServerMetrics:
    def __init__(self, model_name: str, replicas: ReplicaStats) -> None:
        self.registry = r = CollectorRegistry()
        m = [model_name]
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prefilled prompt tokens.", ["model_name"],
                                     registry=r).labels(*m)
        self.generation_tokens = Counter("tandem:generation_tokens", "Generated tokens.", ["model_name"],
                                         registry=r).labels(*m)
        self._success = Counter("tandem:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Time to first token (frontend arrival to "
                              "first token back).", ["model_name"], buckets=TTFT_BUCKETS, registry=r).labels(*m)
        self.itl = Histogram("tandem:inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             ["model_name"], buckets=ITL_BUCKETS, registry=r).labels(*m)
        self.model_name = model_name
        r.register(_EngineGauges(model_name, replicas))
        # Per class (a request's priority and tenant, --scheduling-policy): who waits, who is served.
        by = ["model_name", "priority", "tenant"]
        self.class_queue = Histogram("tandem:class_queue_time_seconds", "Time from arrival at the engine to first "
                                     "admission, by priority and tenant (user).", by, buckets=TTFT_BUCKETS, registry=r)
        self.class_ttft = Histogram("tandem:class_time_to_first_token_seconds", "Time to first token, by priority "
                                    "and tenant (user).", by, buckets=TTFT_BUCKETS, registry=r)
        self.class_tokens = Counter("tandem:class_generation_tokens", "Generated tokens, by priority and tenant "
                                    "(user).", by, registry=r)
        self._seen: dict[str, set[str]] = {"priority": set(), "tenant": set()}

    def _label(self, kind: str, value: str) -> str:
        """The value as a label, or "other" once MAX_CLASSES others were seen (clients name tenants freely)."""
        seen = self._seen[kind]
        if value in seen or len(seen) < MAX_CLASSES:
            seen.add(value)
            return value
        return "other"

    def _class(self, st: RequestStream) -> tuple[str, str, str]:
        return self.model_name, self._label("priority", str(st.priority)), self._label("tenant", st.tenant)

    def on_output(self, st: RequestStream, o: StepOutput, t: float) -> None:
        """Called by the EngineClient's reader for every StepOutput of a live request."""
        if o.new_token_ids:
            cls = self._class(st)
            if st.first_token is None:
                st.first_token = t
                self.ttft.observe(t - st.arrival)
                self.class_ttft.labels(*cls).observe(t - st.arrival)
                if o.queue_time is not None:
                    self.class_queue.labels(*cls).observe(o.queue_time)
                self.prompt_tokens.inc(o.num_prompt_tokens)
            else:
                self.itl.observe(t - st.last_token)
            st.last_token = t
            self.generation_tokens.inc(len(o.new_token_ids))
            self.class_tokens.labels(*cls).inc(len(o.new_token_ids))
        elif o.embedding is not None:      # an embeddings request: prefilled, nothing generated
            self.prompt_tokens.inc(o.num_prompt_tokens)
        if o.finished:
            self._success.labels(self.model_name, o.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
