"""A shard's Prometheus metrics, read from its ``ShardService`` when scraped (nothing is counted
twice: the service's own statistics are the source, as for ``wavelet stats``).

Names follow Prometheus conventions: ``wavelet_shard_*``, counters end in ``_total``, times in
``_seconds``, sizes in ``_bytes``; every series carries ``shard``, per-wave ones ``wave``.
"""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from wavelet.common.prometheus import MetricsEndpoint
from wavelet.common.protocol import wave_name

STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)


class ShardCollector:
    """Collects from ``service`` (and the transport's byte counts) at scrape time."""

    def __init__(self, service, transport=None):
        self.service = service
        self.transport = transport  # ShardServer: bytes in and out

    def collect(self):
        svc = self.service
        shard = str(svc.config.shard_index)
        yield from self._shard_wide(svc, shard)
        yield from self._transport(shard)
        yield from self._per_wave(list(svc.stats.items()), shard)  # copied: waves may join

    @staticmethod
    def _shard_wide(svc, shard: str):
        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["shard"])
            g.add_metric([shard], value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["shard"])
            c.add_metric([shard], value)
            return c

        yield gauge(
            "wavelet_shard_version", "updates this shard's weights carry", svc.shard.version
        )
        yield counter(
            "wavelet_shard_updates", "updates applied by this process", svc.updates_applied
        )
        yield gauge("wavelet_shard_live_waves", "waves in the membership", len(svc.clocks.live))
        members = svc.members.summary()
        yield gauge(
            "wavelet_shard_membership_epoch",
            "changes of the membership so far (each join and each leave bumps it)",
            members["epoch"],
        )
        yield counter("wavelet_shard_joins", "waves that joined (or re-joined)", members["joins"])
        yield counter(
            "wavelet_shard_leaves",
            "waves that left: goodbye, closed connection, or silent past the lease",
            members["leaves"],
        )
        yield gauge("wavelet_shard_parked_pulls", "pulls the bound holds now", len(svc.parked))
        yield counter(
            "wavelet_shard_checkpoint_failures",
            "checkpoints that could not be written",
            svc.checkpoints.failures,
        )
        yield gauge(
            "wavelet_shard_checkpoint_age_seconds",
            "seconds since the last checkpoint that succeeded (or the shard's start)",
            time.monotonic() - svc.checkpoints.ok_at,
        )
        yield gauge(
            "wavelet_shard_checkpoint_duration_seconds",
            "how long the last checkpoint took",
            svc.checkpoints.seconds,
        )
        errors = CounterMetricFamily(
            "wavelet_shard_error_replies",
            "requests refused, by error code",
            labels=["shard", "code"],
        )
        for code, n in sorted(svc.rejected_by_code.items()):
            errors.add_metric([shard, code], n)
        yield errors

    def _transport(self, shard: str):
        if self.transport is None:
            return
        for name, doc, value in (
            (
                "wavelet_shard_received_bytes",
                "bytes of requests received over ZeroMQ",
                self.transport.bytes_in,
            ),
            (
                "wavelet_shard_sent_bytes",
                "bytes of replies sent over ZeroMQ",
                self.transport.bytes_out,
            ),
        ):
            c = CounterMetricFamily(name, doc, labels=["shard"])
            c.add_metric([shard], value)
            yield c

    @staticmethod
    def _per_wave(waves, shard: str):
        per_wave = ["shard", "wave"]
        pushes = CounterMetricFamily("wavelet_shard_pushes", "gradients pushed", labels=per_wave)
        pulls = CounterMetricFamily("wavelet_shard_pulls", "weights served", labels=per_wave)
        parked = CounterMetricFamily(
            "wavelet_shard_pulls_parked",
            "pulls held back by the staleness bound or the turn order",
            labels=per_wave,
        )
        parked_s = CounterMetricFamily(
            "wavelet_shard_parked_seconds", "time pulls were held back", labels=per_wave
        )
        dropped = CounterMetricFamily(
            "wavelet_shard_dropped", "gradients the drop policy refused", labels=per_wave
        )
        skipped = CounterMetricFamily(
            "wavelet_shard_skipped_steps",
            "steps a wave skipped (fp16 gradients overflowed): its clock passed, no gradient",
            labels=per_wave,
        )
        staleness = HistogramMetricFamily(
            "wavelet_shard_staleness",
            "updates applied between a wave's read and its push",
            labels=per_wave,
        )
        for wave, st in waves:
            key = [shard, wave_name(*wave)]
            pushes.add_metric(key, st.pushes)
            pulls.add_metric(key, st.reads_total)
            parked.add_metric(key, st.parked)
            parked_s.add_metric(key, st.parked_s)
            dropped.add_metric(key, st.dropped)
            skipped.add_metric(key, st.skipped)
            hist = dict(st.staleness)
            buckets = [
                (str(b), sum(n for tau, n in hist.items() if tau <= b)) for b in STALENESS_BUCKETS
            ]
            buckets.append(("+Inf", sum(hist.values())))
            staleness.add_metric(key, buckets, sum(tau * n for tau, n in hist.items()))
        yield from (pushes, pulls, parked, parked_s, dropped, skipped, staleness)


def serve_shard_metrics(server, config) -> MetricsEndpoint:
    """Serve ``server``'s metrics on ``config.metrics_port``; the host is the shard's own (a shard
    bound to loopback serves metrics on loopback) unless ``metrics_host`` says otherwise."""
    host = config.metrics_host or urlsplit(config.bind).hostname or "127.0.0.1"
    if host == "*":
        host = "0.0.0.0"
    registry = CollectorRegistry()
    registry.register(ShardCollector(server.service, server))
    endpoint = MetricsEndpoint(registry, host, config.metrics_port, f"shard {config.shard_index}")
    if config.run_dir:
        endpoint.write_address(Path(config.run_dir) / "metrics" / f"ps-{config.shard_index}.url")
    return endpoint
