"""Prometheus metrics of the server (`tandem:` prefix, names modelled on vLLM's).

Gauges come from the engine's latest stats (sent with every step's outputs and whenever they change while
idle); token counters and latency histograms are observed in the frontend as outputs arrive.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..request import StepOutput
from .client import RequestStream

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)

# gauge name -> (engine stats key, help)
GAUGES = {
    "tandem:num_requests_running": ("num_running", "Requests in the running batch."),
    "tandem:num_requests_waiting": ("num_waiting", "Requests waiting to be scheduled."),
    "tandem:kv_cache_usage_perc": ("kv_usage", "Fraction of KV cache slots in use (1 = full)."),
    "tandem:device_idle_fraction": ("device_idle_fraction",
                                    "Fraction of the last window (device steps of the last 10 s) the device idled."),
}
# counter name (the client adds _total) -> (engine stats key, help): running totals kept by the engine
ENGINE_COUNTERS = {
    "tandem:prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "tandem:prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens whose KV the prefix cache held."),
}


class _EngineGauges:
    """Reads the engine's latest stats, and the frontend's open requests, at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], dict], open_requests: Callable[[], int]) -> None:
        self.model_name, self.stats, self.open_requests = model_name, stats, open_requests

    def collect(self):
        stats = self.stats()
        for name, (key, doc) in GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], float(stats.get(key, 0.0)))
            yield g
        g = GaugeMetricFamily("tandem:frontend_open_requests", "Requests the frontend holds state for "
                              "(submitted, not yet finished); 0 when idle.", labels=["model_name"])
        g.add_metric([self.model_name], float(self.open_requests()))
        yield g
        for name, (key, doc) in ENGINE_COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], float(stats.get(key, 0.0)))
            yield c


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], dict],
                 open_requests: Callable[[], int] = lambda: 0) -> None:
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
        r.register(_EngineGauges(model_name, stats, open_requests))

    def on_output(self, st: RequestStream, o: StepOutput, t: float) -> None:
        """Called by the EngineClient's reader for every StepOutput of a live request."""
        if o.new_token_ids:
            if st.first_token is None:
                st.first_token = t
                self.ttft.observe(t - st.arrival)
                self.prompt_tokens.inc(o.num_prompt_tokens)
            else:
                self.itl.observe(t - st.last_token)
            st.last_token = t
            self.generation_tokens.inc(len(o.new_token_ids))
        if o.finished:
            self._success.labels(self.model_name, o.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
