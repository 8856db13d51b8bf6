"""A worker's Prometheus metrics, per wave, updated from the same numbers as its step records.

``wavelet_worker_*{worker="w0", wave="w0/1"}``: samples and steps (counters: ``rate()`` gives
samples/s), samples/s over the last step, seconds spent in forward, backward, push+pull, waiting
for the baton and for the staleness bound (counters), saved-activation bytes at the last step's
peak, the last loss, bytes of tensors moved, steps skipped on fp16 overflow and the loss scale,
and on a GPU the allocator's bytes.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from wavelet.common.prometheus import MetricsEndpoint

TIMES = (
    "forward_s",
    "backward_s",
    "push_pull_s",
    "pull_wait_s",  # pull_during_forward: the forward waiting for weights still on the wire
    "baton_wait_s",
    "bound_wait_s",
    "compute_wait_s",
)


class WorkerMetrics:
    def __init__(self, worker: str):
        self.registry = CollectorRegistry()
        self.worker = worker
        labels = ["worker", "wave"]
        r = self.registry
        self.samples = Counter("wavelet_worker_samples", "samples trained", labels, registry=r)
        self.steps = Counter("wavelet_worker_steps", "steps (push+pull) done", labels, registry=r)
        self.rate = Gauge(
            "wavelet_worker_samples_per_second", "samples/s over the last step", labels, registry=r
        )
        self.seconds = {
            name: Counter(
                f"wavelet_worker_{name[:-2]}_seconds",
                f"time spent in {name[:-2].replace('_', ' ')}",
                labels,
                registry=r,
            )
            for name in TIMES
        }
        self.saved = Gauge(
            "wavelet_worker_saved_activation_bytes",
            "peak bytes of activations saved for backward in the last step",
            labels,
            registry=r,
        )
        self.loss = Gauge(
            "wavelet_worker_loss", "training loss of the last step", labels, registry=r
        )
        self.wire = Counter(
            "wavelet_worker_wire_bytes",
            "tensor bytes pushed and pulled over TCP",
            labels,
            registry=r,
        )
        self.skipped = Counter(
            "wavelet_worker_skipped_steps",
            "steps skipped because fp16 gradients overflowed",
            labels,
            registry=r,
        )
        self.loss_scale = Gauge(
            "wavelet_worker_loss_scale",
            "the wave's fp16 loss scale (1 otherwise)",
            labels,
            registry=r,
        )
        self.cuda = {
            key: Gauge(f"wavelet_worker_{key}_bytes", f"torch.cuda {key}", labels, registry=r)
            for key in ("cuda_allocated", "cuda_reserved", "nvml_used")
        }
        self._last_t: dict[str, float] = {}
        self._series: dict[str, dict] = {}  # per wave, its labelled children (looked up once)

    def _of(self, wave: str) -> dict:
        series = self._series.get(wave)
        if series is None:
            key = (self.worker, wave)
            series = {
                "samples": self.samples.labels(*key),
                "steps": self.steps.labels(*key),
                "rate": self.rate.labels(*key),
                "saved": self.saved.labels(*key),
                "loss": self.loss.labels(*key),
                "wire": self.wire.labels(*key),
                "skipped": self.skipped.labels(*key),
                "loss_scale": self.loss_scale.labels(*key),
                "seconds": {n: c.labels(*key) for n, c in self.seconds.items()},
                "cuda": {n: g.labels(*key) for n, g in self.cuda.items()},
            }
            self._series[wave] = series
        return series

    def record(self, wave: str, step: dict) -> None:
        """Account one step record (worker/wave.py writes the same dict to its records)."""
        s = self._of(wave)
        s["samples"].inc(step["samples"])
        s["steps"].inc()
        for name, counter in s["seconds"].items():
            counter.inc(step.get(name, 0.0))
        s["saved"].set(step.get("saved_bytes_peak", 0))
        s["loss"].set(step["loss"])
        s["wire"].inc(step.get("wire_bytes", 0))
        s["skipped"].inc(int(step.get("skipped", False)))
        s["loss_scale"].set(step.get("loss_scale", 1.0))
        for name, gauge in s["cuda"].items():
            if name in step:
                gauge.set(step[name])
        last = self._last_t.get(wave)
        if last is not None and step["t"] > last:
            s["rate"].set(step["samples"] / (step["t"] - last))
        self._last_t[wave] = step["t"]


def serve_worker_metrics(config, rank: int) -> tuple[WorkerMetrics | None, MetricsEndpoint | None]:
    """Metrics of worker ``rank`` and their endpoint, when ``config.metrics_port`` asks for them
    (the address also goes to RUN_DIR/metrics/worker-<rank>.url); (None, None) otherwise."""
    if config.metrics_port < 0:
        return None, None
    metrics = WorkerMetrics(f"w{rank}")
    endpoint = MetricsEndpoint(
        metrics.registry, config.metrics_host, config.metrics_port, f"worker {rank}"
    )
    endpoint.write_address(Path(config.run_dir) / "metrics" / f"worker-{rank}.url")
    return metrics, endpoint
