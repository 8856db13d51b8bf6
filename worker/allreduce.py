"""All-reduce mode: the same training loop as standard data parallel (DistributedDataParallel).

The baseline every claim of this project is measured against. Rendezvous is torch.distributed's
``env://`` (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, as torchrun sets them), so the same worker
also runs under torchrun across hosts. gloo on CPU, NCCL on GPU. Records have the same form as a
wave's, so reports treat both modes alike.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from wavelet.common.config import ConfigError, WorkerConfig
from wavelet.common.job import build_dataset_and_model
from wavelet.common.models import checkpoint_blocks
from wavelet.common.protocol import wave_name
from wavelet.common.records import RecordWriter
from wavelet.common.schedule import lr_factor, progress
from wavelet.worker.evaluate import evaluate
from wavelet.worker.memory import SavedActivationMeter, cap_cuda_memory, device_memory
from wavelet.worker.metrics import serve_worker_metrics
from wavelet.worker.step import training_step

log = logging.getLogger(__name__)


class AllReduceWorker:
    """One rank of a DDP job (several ranks may share a device: ``config.device_index``)."""

    def __init__(self, config: WorkerConfig):
        missing = [
            v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if v not in os.environ
        ]
        if missing:
            raise ConfigError(
                f"all-reduce mode needs {', '.join(missing)} in the environment "
                "(torchrun and wavelet launch set them)"
            )
        self.config = config
        self.stop_event = threading.Event()

    def stop(self) -> None:
        self.stop_event.set()

    def run(self) -> int:
        cfg = self.config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        device = torch.device(cfg.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            cap_cuda_memory(device, cfg.cuda_memory_gib)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method="env://")
        try:
            return self._train(device)
        finally:
            dist.destroy_process_group()

    def _train(self, device: torch.device) -> int:
        cfg, job = self.config, self.config.job
        rank, world = dist.get_rank(), dist.get_world_size()
        records = RecordWriter(Path(cfg.run_dir) / "records" / f"worker-{rank}-wave-0.jsonl")
        metrics, endpoint = serve_worker_metrics(cfg, rank)
        dataset, model = build_dataset_and_model(job, device)
        if job.activation_checkpointing:
            checkpoint_blocks(model)
        ddp = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
        optimizer = job.optimizer.build(list(ddp.parameters()))
        meter = SavedActivationMeter(model.parameters())
        part = dataset.part(rank, world, job.seed)
        steps = part.steps_per_epoch(job.batch_size)
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # A ring all-reduce sends 2 (n - 1) / n of the gradient bytes from every rank.
        wire_bytes = int(2 * (world - 1) / world * grad_bytes)
        records.write(
            {
                "kind": "start",
                "t": time.time(),
                "steps_per_epoch": steps,
                "batch_size": job.batch_size,
                "wave": 0,
                "device": str(device),
                "device_index": cfg.device_index,
                "rank": rank,
                "world_size": world,
            }
        )
        started = time.monotonic()
        iteration = 0
        ended = False  # training ran to its end (or a requested stop): evaluate then, else not
        try:
            for epoch in range(job.epochs if job.epochs else 1 << 30):
                ddp.train()
                seed = job.seed + 7919 * rank
                for x, y in part.batches(job.batch_size, epoch, seed):
                    if self._should_stop(started, device):
                        ended = True
                        return 0
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    meter.tracing = iteration < job.memory_trace_iters
                    meter.reset_peak()
                    t0 = time.perf_counter()
                    t_start = time.time()
                    with meter.hooks():
                        loss = training_step(ddp, (x, y))
                    t_end = time.time()
                    t1 = time.perf_counter()
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()  # DDP all-reduces gradient buckets during backward
                    t2 = time.perf_counter()
                    done = progress(
                        iteration, job.epochs * steps, time.monotonic() - started, job.max_seconds
                    )
                    for group in optimizer.param_groups:
                        group["lr"] = job.optimizer.lr * lr_factor(job.lr_schedule, done)
                    optimizer.step()
                    if device.type == "cuda":
                        torch.cuda.current_stream(device).synchronize()
                    t3 = time.perf_counter()
                    step = {
                        "kind": "step",
                        "t": time.time(),
                        "wave": 0,
                        "epoch": epoch,
                        "iter": iteration,
                        "clock": iteration,
                        "loss": float(loss.detach()),
                        "samples": len(y),
                        "t_forward_start": t_start,
                        "t_forward_end": t_end,
                        "forward_s": t1 - t0,
                        "backward_allreduce_s": t2 - t1,
                        "optimizer_s": t3 - t2,
                        "saved_bytes_peak": meter.peak,
                        "wire_bytes": wire_bytes,
                        **device_memory(device),
                    }
                    records.write(step)
                    if metrics is not None:
                        metrics.record(wave_name(f"w{rank}", 0), step)
                    iteration += 1
                if rank == 0 and job.eval_every and (epoch + 1) % job.eval_every == 0:
                    records.write(
                        {
                            "kind": "eval",
                            "t": time.time(),
                            "epoch": epoch,
                            "test_acc": evaluate(model, dataset, device),
                        }
                    )
                records.write({"kind": "epoch", "t": time.time(), "epoch": epoch})
            ended = True
            return 0
        finally:
            if endpoint is not None:
                endpoint.stop()
            if rank == 0 and ended:  # after a failure, the error is what matters, not a score
                records.write(
                    {
                        "kind": "final",
                        "t": time.time(),
                        "test_acc": evaluate(model, dataset, device),
                    }
                )
            if meter.trace:
                records.write({"kind": "memory_trace", "wave": 0, "trace": meter.trace})
            records.close()

    def _should_stop(self, started: float, device: torch.device) -> bool:
        """Every rank must stop at the same step or the others hang in all_reduce: agree on it."""
        budget = self.config.job.max_seconds
        local = self.stop_event.is_set() or bool(budget and time.monotonic() - started >= budget)
        flag = torch.tensor([1.0 if local else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
