"""The server's Prometheus metrics, under vLLM's names, so dashboards and scrapers built for
vLLM read `labkit serve` too. (`labkit.analysis.metrics` reads TTFT and ITL from a run's log.)

Gauges are set from the scheduler's state as the engine's loop reports it, after every step
and when it goes idle; counters and histograms grow as requests arrive, tokens stream and
preemptions happen. Each server has its own registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's TTFT buckets (s), and its inter-token-latency buckets (s)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class ServerMetrics:
    """vLLM-named metrics for one served model."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = dict(labelnames=["model_name"], registry=self.registry)

        def labelled(metric):
            return metric.labels(model_name=model_name)

        self.running = labelled(Gauge("vllm:num_requests_running", "Requests in slots.", **labels))
        self.waiting = labelled(Gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.", **labels))
        self.kv_usage = labelled(Gauge("vllm:kv_cache_usage_perc", "Share of KV-cache blocks in use (1 = all).", **labels))
        self.preemptions = labelled(Counter("vllm:num_preemptions", "Preemptions.", **labels))
        self.prompt_tokens = labelled(Counter("vllm:prompt_tokens", "Prompt tokens admitted.", **labels))
        self.generation_tokens = labelled(Counter("vllm:generation_tokens", "Tokens generated.", **labels))
        self.ttft = labelled(Histogram("vllm:time_to_first_token_seconds", "Time to first token (s), from arrival.",
                                       buckets=TTFT_BUCKETS, **labels))
        self.itl = labelled(Histogram("vllm:inter_token_latency_seconds", "Gap between two tokens of a request (s).",
                                      buckets=ITL_BUCKETS, **labels))

    def set_state(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
