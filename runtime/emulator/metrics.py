"""The emulator's `/metrics`: SGLang 0.5.23's metric names, types, label sets and buckets
(as the CPU harness's SGLang exposes them), rendered by prometheus-client.

Request metrics are observed when a request finishes, like SGLang's: counters
`sglang:num_requests_total`, `prompt_tokens_total`, `generation_tokens_total`,
`cached_tokens_total{cache_source="device"}`, `prefill_effective_tokens_total{mode}`;
histograms `sglang:time_to_first_token_seconds`, `e2e_request_latency_seconds`,
`request_time_per_output_token_seconds`, `inter_token_latency_seconds`,
`queue_time_seconds`. Scheduler gauges are read from the replica at each scrape:
`sglang:num_running_reqs`, `num_queue_reqs`, `token_usage`, `num_used_tokens`,
`kv_used_tokens`, `kv_available_tokens`, `kv_evictable_tokens`, `cache_hit_rate`,
`gen_throughput`, `new_token_ratio`, `num_retracted_reqs`, `max_total_num_tokens`,
`context_len`, `page_size`. The users' metrics under the names `twin.monitoring` exports
for a twin run: `queue_duration_seconds` (histogram), `memory_pressure_score`,
`kv_external_fragmentation`, `radix_sharing_ratio`, `batch_efficiency`. Every time is on
the emulated server's clock (simulated seconds: at `--speed F` a client's wall clock sees
1/F of them).
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from twin.monitoring import E2E_BUCKETS, ITL_BUCKETS, QUEUE_BUCKETS, TTFT_BUCKETS

TPOT_BUCKETS = ITL_BUCKETS  # SGLang uses the same buckets for per-request TPOT
SCHED = ("engine_type", "model_name", "moe_ep_rank", "pp_rank", "tp_rank")
REQ = ("engine_type", "is_streaming", "model_name")
GAUGES = {
    "num_running_reqs": "The number of running requests.",
    "num_queue_reqs": "The number of requests in the waiting queue.",
    "token_usage": "The token usage.",
    "num_used_tokens": "The number of used tokens.",
    "kv_used_tokens": "Number of actively used token slots in the KV cache pool.",
    "kv_available_tokens": "Number of free token slots in the KV cache pool.",
    "kv_evictable_tokens": "Number of evictable (radix-cached) token slots in the KV cache "
                           "pool.",
    "cache_hit_rate": "The prefix cache hit rate.",
    "gen_throughput": "The generation throughput (token/s).",
    "new_token_ratio": "The new token ratio.",
    "max_total_num_tokens": "Maximum total number of tokens in the KV cache pool.",
    "context_len": "Maximum context length.",
    "page_size": "KV cache page size in tokens.",
}

OURS_DOCS = {
    "memory_pressure_score": "servetwin: allocated KV tokens over the pool's capacity.",
    "kv_external_fragmentation": "servetwin: 1 - largest free run / free KV tokens.",
    "radix_sharing_ratio": "servetwin: cached prompt tokens over prompt tokens.",
    "batch_efficiency": "servetwin: mean running requests over max_running_requests.",
}


class EmulatorMetrics:
    """One emulated server's registry (no process-wide registry: several emulators may
    share a process)."""

    def __init__(self, engine, model_name: str) -> None:
        self.engine = engine
        self.model = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.prompt = Counter("sglang:prompt_tokens", "Number of prefill tokens processed.",
                              REQ, registry=reg)
        self.gen = Counter("sglang:generation_tokens", "Number of generation tokens "
                           "processed.", REQ, registry=reg)
        self.reqs = Counter("sglang:num_requests", "Number of requests processed.", REQ,
                            registry=reg)
        self.cached = Counter("sglang:cached_tokens", "Number of cached prompt tokens by "
                              "source (device/host/storage).",
                              ("cache_source", "engine_type", "model_name"), registry=reg)
        self.effective = Counter(
            "sglang:prefill_effective_tokens", "Effective prefill tokens with "
            "retracted-request re-counts excluded. mode: device_hit, host_hit, storage_hit, "
            "input.", ("engine_type", "mode", "model_name", "moe_ep_rank", "pp_rank",
                       "tp_rank"), registry=reg)
        for mode in ("input", "device_hit", "host_hit", "storage_hit"):
            self.effective.labels(**self._sched(), mode=mode)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to "
                              "first token in seconds.", REQ, buckets=TTFT_BUCKETS,
                              registry=reg)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end "
                             "request latency in seconds", REQ, buckets=E2E_BUCKETS,
                             registry=reg)
        self.tpot = Histogram("sglang:request_time_per_output_token_seconds", "Per-request "
                              "TPOT in seconds: (finished_time - first_token_time) / "
                              "(completion_tokens - 1).", REQ, buckets=TPOT_BUCKETS,
                              registry=reg)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "Histogram of "
                             "inter-token latency in seconds.", ("engine_type", "model_name"),
                             buckets=ITL_BUCKETS, registry=reg)
        self.queue = Histogram("sglang:queue_time_seconds", "Histogram of queueing time in "
                               "seconds.", SCHED, buckets=QUEUE_BUCKETS, registry=reg)
        self.prompt_total = self.cached_total = 0
        self._tp_mark = (0.0, 0)  # (simulated time, tokens out) at the last scrape
        # the users' metrics, under the names twin.monitoring exports for the twin
        self.queue_duration = Histogram("queue_duration_seconds", "servetwin: time in the "
                                        "waiting queue (every round), seconds.",
                                        ("engine_type", "model_name"), buckets=QUEUE_BUCKETS,
                                        registry=reg)
        reg.register(_SchedulerGauges(self))

    def _sched(self) -> dict[str, str]:
        return {"engine_type": "unified", "model_name": self.model, "moe_ep_rank": "0",
                "pp_rank": "0", "tp_rank": "0"}

    def finished(self, t) -> None:
        """A request left the server (its ticket, engine.Ticket)."""
        r = t.final
        if r is None or r.status != "ok":
            return
        lab = {"engine_type": "unified", "is_streaming": str(t.stream).lower(),
               "model_name": self.model}
        n_out = t.reported if t.reported is not None else r.generated_tokens
        self.reqs.labels(**lab).inc()
        self.prompt.labels(**lab).inc(r.prompt_tokens)
        self.gen.labels(**lab).inc(n_out)
        self.cached.labels(cache_source="device", engine_type="unified",
                           model_name=self.model).inc(r.cached_tokens)
        sched = self._sched()
        self.effective.labels(**sched, mode="device_hit").inc(r.cached_tokens)
        self.effective.labels(**sched, mode="input").inc(r.prompt_tokens - r.cached_tokens)
        self.prompt_total += r.prompt_tokens
        self.cached_total += r.cached_tokens
        self.queue.labels(**sched).observe(r.queued_s)
        self.queue_duration.labels(engine_type="unified", model_name=self.model).observe(
            r.queued_s)
        first = t.token_s[0] if t.token_s else r.finish_s
        self.ttft.labels(**lab).observe(first - r.arrival_s)
        self.e2e.labels(**lab).observe(r.finish_s - r.arrival_s)
        if n_out > 1:
            self.tpot.labels(**lab).observe((r.finish_s - first) / (n_out - 1))
        itl = self.itl.labels(engine_type="unified", model_name=self.model)
        for a, b in zip(t.token_s, t.token_s[1:], strict=False):
            itl.observe(b - a)

    def gauges(self) -> dict[str, float]:
        eng = self.engine
        rep, cap = eng.rep, eng.rep.cap
        avail = rep.alloc.available()
        evict = rep.tree.evictable_tokens if rep.tree is not None else 0
        used = max(cap.max_total_num_tokens - avail - evict, 0)
        now, out = eng.env.now, eng.tokens_out
        t0, n0 = self._tp_mark
        rate = (out - n0) / (now - t0) if now > t0 else 0.0
        if now - t0 >= 1.0:
            self._tp_mark = (now, out)
        return {
            "num_running_reqs": len(rep.running), "num_queue_reqs": len(rep.waiting),
            "token_usage": used / cap.max_total_num_tokens, "num_used_tokens": used,
            "kv_used_tokens": used, "kv_available_tokens": avail,
            "kv_evictable_tokens": evict,
            "cache_hit_rate": self.cached_total / self.prompt_total if self.prompt_total
            else 0.0,
            "gen_throughput": rate, "new_token_ratio": rep.new_token_ratio,
            "max_total_num_tokens": cap.max_total_num_tokens,
            "context_len": cap.context_len, "page_size": cap.page_size,
        }

    def ours(self) -> dict[str, float]:
        """The users' gauges (docs/monitoring.md): memory pressure (allocated KV over the
        pool), external fragmentation, the radix sharing ratio (cached over prompt tokens of
        the finished requests) and batch efficiency (the time-average running batch over
        max_running_requests), each over the run so far."""
        eng = self.engine
        st, cap = eng.rep.alloc.stats(), eng.rep.cap
        now = eng.env.now
        return {
            "memory_pressure_score": st.allocated / cap.max_total_num_tokens,
            "kv_external_fragmentation": st.external_fragmentation,
            "radix_sharing_ratio": self.cached_total / self.prompt_total if self.prompt_total
            else 0.0,
            "batch_efficiency": eng.batch_seconds / now / cap.max_running_requests
            if now > 0 else 0.0,
        }

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SchedulerGauges:
    """prometheus-client's custom-collector protocol: the gauges, read at each scrape."""

    def __init__(self, metrics: EmulatorMetrics) -> None:
        self.m = metrics

    def collect(self):
        values = self.m.gauges()
        labels = self.m._sched()
        for name, doc in GAUGES.items():
            fam = GaugeMetricFamily(f"sglang:{name}", doc, labels=list(labels))
            fam.add_metric(list(labels.values()), float(values[name]))
            yield fam
        ours = {"engine_type": "unified", "model_name": self.m.model}
        for name, value in self.m.ours().items():
            fam = GaugeMetricFamily(name, OURS_DOCS[name], labels=list(ours))
            fam.add_metric(list(ours.values()), float(value))
            yield fam
        fam = GaugeMetricFamily("sglang:num_retracted_reqs", "The number of retracted "
                                "requests.", labels=[*labels, "pid"])
        fam.add_metric([*labels.values(), str(os.getpid())],
                       float(self.m.engine.rep.counters.retractions))
        yield fam
