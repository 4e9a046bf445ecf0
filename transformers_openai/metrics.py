"""Prometheus metrics, named after vLLM's (`vllm:` becomes `transformers_openai:`) so dashboards carry over."""

from __future__ import annotations

import copy

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from transformers_openai.engine.stats import FinishedRequest, SpecCounts, StepStats

PREFIX = "transformers_openai:"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
_PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

# The load a balancer reads: gauges by their name after the prefix (ours, vLLM's with --metrics-compat vllm, and the
# named metrics of an ORCA load report).
LOAD_GAUGES = {
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting for a row.",
    "kv_cache_usage_perc": "Fraction of the K/V pool's blocks held by requests (1 = full).",
}


class Metrics:
    """All metrics of one server, in their own registry (no process-global state).

    It observes the engine (an `EngineObserver`, called on the engine thread) and is told by the
    API layer about rejected requests.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, compat: str = "none") -> None:
        self.registry = registry or CollectorRegistry()
        # The last step's load, for load reports in response headers (read on the event loop: replaced whole).
        self.load: dict[str, float] = dict.fromkeys(LOAD_GAUGES, 0.0)
        labels = ["model_name"]
        self._model = model_name
        self._prefix_seen = {"queries": 0, "hits": 0}  # the engine reports running totals; counters take the rise
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", LOAD_GAUGES["num_requests_running"])
        self.waiting = gauge("num_requests_waiting", LOAD_GAUGES["num_requests_waiting"])
        self.kv_rows = gauge(
            "kv_cache_rows_in_use", "KV-cache rows in use (one per admitted request, prefilling or generating)."
        )
        self.kv_usage = gauge("kv_cache_usage_perc", LOAD_GAUGES["kv_cache_usage_perc"])
        self.kv_blocks_used = gauge("kv_cache_blocks_used", "K/V pool blocks held by requests.")
        self.kv_blocks_free = gauge(
            "kv_cache_blocks_free", "K/V pool blocks free to take (cached prefixes nobody holds included)."
        )
        self.kv_blocks_cached = gauge(
            "kv_cache_blocks_cached", "Free K/V blocks keeping a prefix for reuse until the pool needs them."
        )
        self.preemptions = counter(
            "num_preemptions_total", "Requests preempted (K/V blocks freed, recomputed later) when the pool was full."
        )
        self.prefix_queries = counter("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.")
        self.success = counter("request_success_total", "Finished requests by finish reason.", ("finished_reason",))
        self.rejected = counter("request_rejected_total", "Requests rejected with 429 (server at capacity).")
        self.disconnected = counter("request_client_disconnected_total", "Requests aborted by a client disconnect.")
        self.stalled = counter(
            "request_stream_stalled_total", "Streams aborted: the client stopped reading (--stream-stall-timeout)."
        )
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time spent waiting for a row.", _LATENCY_BUCKETS)
        self.batch = histogram("batch_size", "Rows advanced per decode step.", _BATCH_BUCKETS)
        self.step_phase = Histogram(
            PREFIX + "engine_step_phase_seconds",
            "Seconds of each engine step spent per phase: prefill, forward, sample, output, total.",
            [*labels, "phase"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.requests = counter("requests_total", "Requests received, by endpoint.", ("endpoint",))
        self.torch_threads = gauge("engine_torch_threads", "torch threads the engine's CPU steps run on now.")
        self.thread_fallbacks = counter(
            "engine_thread_fallbacks_total",
            "Times the engine's CPU steps fell back to fewer torch threads (another process took a core).",
        )
        self.thread_fallbacks.labels(model_name)  # reads 0 from the start
        self._fallbacks_seen = 0
        # Speculative decoding (--speculative-config), as vLLM counts it.
        self.spec_drafts = counter("spec_decode_num_drafts", "Drafts verified (one per row per speculative step).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft.", ("position",)
        )
        # The same gauges under vLLM's names, which routers and the Gateway API inference extension read by default.
        self._compat = (
            {name: Gauge(f"vllm:{name}", doc, labels, registry=r) for name, doc in LOAD_GAUGES.items()}
            if compat == "vllm"
            else {}
        )
        # The load gauges read 0 from the start (before any step): a router reading them finds them at once.
        for load_gauge in (self.running, self.waiting, self.kv_usage, *self._compat.values()):
            load_gauge.labels(model_name).set(0)
        self.model_info = Gauge(
            PREFIX + "model_info",
            "The served model: 1, labelled with its kind and quantization.",
            [*labels, "kind", "quantization"],
            registry=r,
        )
        self.decode_step_compiled = gauge(
            "decode_step_compiled",
            "Whether decode steps run compiled (1) or eagerly (0), on a CPU: eager from the start while the compiled "
            "step is made in the background, then 1 once it is swapped in.",
        )
        self.decode_step_compiled.labels(model_name).set(0)
        self.decode_step_compiling = gauge(
            "decode_step_compiling",
            "Whether the compiled decode step is being made in the background (1, eager steps serving meanwhile), on a "
            "CPU: 0 once it is made (the next step swaps it in) or cannot be had.",
        )
        self.decode_step_compiling.labels(model_name).set(0)
        self.audio_seconds = counter("audio_seconds_total", "Seconds of audio transcribed or translated.")
        self.real_time_factor = histogram(
            "audio_real_time_factor", "Processing time over audio duration, per transcription.", _RTF_BUCKETS
        )

    def for_model(self, model_name: str) -> Metrics:
        """The same metrics (one registry) as another served model observes and labels them: its own running totals
        and load, its own `model_name` label."""
        view = copy.copy(self)
        view._model = model_name
        view.load = dict.fromkeys(LOAD_GAUGES, 0.0)
        view._prefix_seen = {"queries": 0, "hits": 0}
        view._fallbacks_seen = 0
        for load_gauge in (self.running, self.waiting, self.kv_usage, *self._compat.values()):
            load_gauge.labels(model_name).set(0)
        self.thread_fallbacks.labels(model_name)
        self.decode_step_compiled.labels(model_name).set(0)
        self.decode_step_compiling.labels(model_name).set(0)
        return view

    def on_model_unloaded(self) -> None:
        """The model's gauges back to 0 (its counters keep their totals): an unloaded model runs and holds nothing."""
        for load_gauge in (self.running, self.waiting, self.kv_usage, *self._compat.values()):
            load_gauge.labels(self._model).set(0)
        self.load = dict.fromkeys(LOAD_GAUGES, 0.0)
        for info in next(iter(self.model_info.collect())).samples:
            if info.labels.get("model_name") == self._model:
                self.model_info.labels(self._model, info.labels["kind"], info.labels["quantization"]).set(0)

    def on_model_loaded(self, kind: str, quantization: str) -> None:
        self.model_info.labels(self._model, kind, quantization).set(1)

    def on_decode_step(self, step: str) -> None:
        """The decode step in use: "compiling" or "ready" (eager meanwhile), "compiled" or "eager"."""
        self.decode_step_compiled.labels(self._model).set(1 if step == "compiled" else 0)
        self.decode_step_compiling.labels(self._model).set(1 if step == "compiling" else 0)

    # -- EngineObserver
    def on_step(self, stats: StepStats) -> None:
        model = self._model
        kv = stats.kv
        usage = kv.blocks_used / kv.blocks_total if kv is not None and kv.blocks_total else 0.0
        load = {
            "num_requests_running": float(stats.running),
            "num_requests_waiting": float(stats.waiting),
            "kv_cache_usage_perc": usage,
        }
        self.load = load
        for name, value in load.items():
            if name in self._compat:
                self._compat[name].labels(model).set(value)
        self.running.labels(model).set(stats.running)
        self.waiting.labels(model).set(stats.waiting)
        self.kv_rows.labels(model).set(stats.rows_in_use)
        if kv is not None:
            self.kv_usage.labels(model).set(usage)
            self.kv_blocks_used.labels(model).set(kv.blocks_used)
            self.kv_blocks_free.labels(model).set(kv.blocks_total - kv.blocks_used)
            self.kv_blocks_cached.labels(model).set(kv.blocks_cached)
            for total, counter, seen in (
                (kv.prefix_queries, self.prefix_queries, "queries"),
                (kv.prefix_hits, self.prefix_hits, "hits"),
            ):
                if total > self._prefix_seen[seen]:
                    counter.labels(model).inc(total - self._prefix_seen[seen])
                    self._prefix_seen[seen] = total
        if stats.threads is not None:
            self.torch_threads.labels(model).set(stats.threads.threads)
            if stats.threads.fallbacks > self._fallbacks_seen:
                self.thread_fallbacks.labels(model).inc(stats.threads.fallbacks - self._fallbacks_seen)
                self._fallbacks_seen = stats.threads.fallbacks
        if stats.preemptions:
            self.preemptions.labels(model).inc(stats.preemptions)
        if stats.prompt_tokens:
            self.prompt_tokens.labels(model).inc(stats.prompt_tokens)
        if stats.generation_tokens:
            self.generation_tokens.labels(model).inc(stats.generation_tokens)
        if stats.batch_size:
            self.batch.labels(model).observe(stats.batch_size)
        if stats.spec is not None:
            self._on_spec(stats.spec)
        itl = self.itl.labels(model)
        for gap in stats.inter_token_latencies_s:
            itl.observe(gap)
        if stats.batch_size or stats.prompt_tokens:  # a step that did work (an idle one reports freed rows only)
            for phase, seconds in stats.phase_s.items():
                self.step_phase.labels(model, phase).observe(seconds)

    def _on_spec(self, spec: SpecCounts) -> None:
        model = self._model
        self.spec_drafts.labels(model).inc(spec.drafts)
        self.spec_draft_tokens.labels(model).inc(spec.draft_tokens)
        self.spec_accepted.labels(model).inc(spec.accepted)
        for position, accepted in enumerate(spec.accepted_per_pos):
            self.spec_accepted_per_pos.labels(model, str(position)).inc(accepted)

    def on_finished(self, request: FinishedRequest) -> None:
        model = self._model
        self.success.labels(model, request.finish_reason).inc()
        if request.time_to_first_token_s is not None:
            self.ttft.labels(model).observe(request.time_to_first_token_s)
        self.e2e.labels(model).observe(request.e2e_latency_s)
        self.queue.labels(model).observe(request.queue_time_s)

    # -- API side
    def on_request(self, endpoint: str) -> None:
        self.requests.labels(self._model, endpoint).inc()

    def on_transcription(self, endpoint: str, audio_seconds: float, real_time_factor: float) -> None:
        self.audio_seconds.labels(self._model).inc(audio_seconds)
        self.real_time_factor.labels(self._model).observe(real_time_factor)

    def on_rejected(self) -> None:
        self.rejected.labels(self._model).inc()

    def on_client_disconnected(self) -> None:
        self.disconnected.labels(self._model).inc()

    def on_stream_stalled(self) -> None:
        self.stalled.labels(self._model).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
