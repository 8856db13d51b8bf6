"""All-reduce mode: the same training loop as standard data parallel (DistributedDataParallel).

The baseline every claim of this project is measured against. Rendezvous is torch.distributed's
``env://`` (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, as torchrun sets them), so the same worker
also runs under torchrun across hosts. gloo on CPU, NCCL on GPU. Records have the same form as a
wave's, so reports treat both modes alike.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from wavelet.common.batches import batch_samples, to_device
from wavelet.common.daemon_config import WorkerConfig
from wavelet.common.evaluation import load_evaluation
from wavelet.common.job import build_dataset_and_model, save_trained_model
from wavelet.common.models import checkpoint_blocks
from wavelet.common.protocol import wave_name
from wavelet.common.records import RecordWriter
from wavelet.common.schedule import lr_factor, progress
from wavelet.common.settings import ConfigError
from wavelet.common.step import AUTOCAST_DTYPES, clip_gradients, load_step
from wavelet.worker.allreduce_checkpoint import RankCheckpoints
from wavelet.worker.evaluate import TestSnapshots, eval_record, evaluate
from wavelet.worker.memory import SavedActivationMeter, cap_cuda_memory, device_memory
from wavelet.worker.metrics import serve_worker_metrics

log = logging.getLogger(__name__)

STORE_TIMEOUT_S = 300  # how long a rank waits for the others to reach the rendezvous


def rendezvous_args() -> dict:
    """``env://``, except under torchrun's shared agent store: there a restarted group would find
    the keys of the group before it, and a rank could dial a dead peer's address (gloo's
    "connection refused", pytorch/pytorch#135712). Each restart keeps to keys of its own."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return {"init_method": "env://"}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=STORE_TIMEOUT_S),
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {
        "store": dist.PrefixStore(f"wavelet/allreduce/attempt-{attempt}", store),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


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
        dist.init_process_group(backend, **rendezvous_args())
        try:
            return self._train(device)
        finally:
            dist.destroy_process_group()

    def _train(self, device: torch.device) -> int:
        rank = _Rank(self.config, device)
        ended = False  # training ran to its end (or a requested stop): evaluate then, else not
        try:
            ended = self._epochs(rank)
            return 0
        finally:
            rank.finish(evaluated=ended, stop=self.stop_event)

    def _epochs(self, r: _Rank) -> bool:
        """Train until the job's end or an agreed stop; True when it got there (not raised)."""
        job = self.config.job
        first = r.resumed.get("iteration", 0)
        started = time.monotonic() - r.resumed.get("elapsed_s", 0.0)  # the budget goes on
        iteration = first
        for epoch in range(first // r.steps, job.epochs if job.epochs else 1 << 30):
            r.ddp.train()
            for skipped, batch in enumerate(
                r.part.batches(job.batch_size, epoch, job.seed + 7919 * r.rank)
            ):
                if epoch == first // r.steps and skipped < first % r.steps:
                    continue  # a resumed group goes on where its checkpoint was
                if self._should_stop(started, r.device):
                    return True
                done = progress(
                    iteration, job.epochs * r.steps, time.monotonic() - started, job.max_seconds
                )
                r.step(epoch, iteration, batch, job.optimizer.lr * lr_factor(job.lr_schedule, done))
                iteration += 1
                r.checkpoints.maybe_save(
                    r.model, r.optimizer, iteration, time.monotonic() - started
                )
                if r.rank == 0:
                    r.tests.maybe_take(r.model, epoch)
            r.end_epoch(epoch)
        return True

    def _should_stop(self, started: float, device: torch.device) -> bool:
        """Every rank must stop at the same step or the others hang in all_reduce: agree on it."""
        budget = self.config.job.max_seconds
        local = self.stop_event.is_set() or bool(budget and time.monotonic() - started >= budget)
        return _any_rank(local, device)


class UnusedParameterError(RuntimeError):
    """DDP could not finish a step's reduction: a trainable parameter got no gradient on some
    rank. Says which setting fixes it, in the words of this project's config."""

    def __init__(self, setting: str, searching: bool, iteration: int):
        if setting == "never":
            fix = 'set find_unused_parameters = "auto" (the default) or "always"'
        elif not searching:  # auto, and the first step gave every parameter a gradient
            fix = (
                "the first step gave every parameter one; for a model whose unused parameters "
                'change from step to step, set find_unused_parameters = "always"'
            )
        else:
            fix = "DDP was looking for unused parameters: let every output of the forward count"
        super().__init__(
            f"all-reduce: a trainable parameter got no gradient in step {iteration} (counting "
            f"from 1), so DDP cannot finish its reduction: {fix} (--set "
            "find_unused_parameters=...), or give every parameter a part in the loss"
        )


def _any_rank(flag: bool, device: torch.device) -> bool:
    """``flag`` on any rank (every rank calls it, or all wait)."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _names(names: list[str], shown: int = 4) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def exit_rank(code: int) -> NoReturn:
    """End an all-reduce rank's process with ``code``, without the interpreter's teardown.

    Every gloo work holds the Python context it was made in (a ``contextvars.Context``), and the
    last works are often freed by gloo's own threads just after the rank stops waiting for them.
    When that falls into the interpreter's shutdown, the thread cannot take the GIL, and the
    process aborts ("terminate called without an active exception", status -6): in 3 of 10
    two-rank runs of the digits job with ``--eval-every-s``, which keeps rank 0 testing while
    rank 1 exits. Everything a rank writes is closed by the time it ends."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_rank(worker: AllReduceWorker) -> int:
    """``worker.run()``'s exit status; where it raises, the error is printed and the process
    ends here (``exit_rank(1)``) while the error is still alive. Its traceback holds the rank's
    DDP, and freeing that (as the interpreter does on its way out) destroys the gloo process
    group, which joins a gloo thread waiting for the GIL the freeing thread holds: the process
    hung for good in 2 of 6 one-core runs of a job that fails in its first step."""
    try:
        return worker.run()
    except Exception:
        traceback.print_exc()
        exit_rank(1)


def compress_gradients(ddp: DistributedDataParallel, wire_dtype: str) -> None:
    """All-reduce gradient buckets in ``wire_dtype``, the baseline a 16-bit parameter server is
    fair to: torch's bf16 and fp16 compression hooks on GPUs; on CPUs (gloo, where torch's bf16
    hook refuses to run) the same steps: divide by the world size, cast, all-reduce, cast back."""
    if wire_dtype == "fp32" or dist.get_world_size() == 1:
        return  # nothing travels between one rank and itself
    if next(ddp.parameters()).device.type == "cuda":
        hook = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}
        ddp.register_comm_hook(None, hook[wire_dtype])
    else:
        ddp.register_comm_hook(None, _cast_hook(AUTOCAST_DTYPES[wire_dtype]))


def _cast_hook(dtype: torch.dtype):
    # no annotations: DDP checks them, and this module's are strings (future annotations)
    def hook(state, bucket):
        group = dist.group.WORLD
        compressed = bucket.buffer().div(dist.get_world_size(group)).to(dtype)
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def widen(f: torch.futures.Future) -> torch.Tensor:
            out = bucket.buffer()
            out.copy_(f.value()[0])
            return out

        return future.then(widen)

    return hook


class _Rank:
    """One DDP rank's training state: its model, optimizer, part of the data and records."""

    def __init__(self, cfg: WorkerConfig, device: torch.device):
        job = cfg.job
        self.job = job
        self.device = device
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.run_dir = Path(cfg.run_dir)
        self.records = RecordWriter(self.run_dir / "records" / f"worker-{self.rank}-wave-0.jsonl")
        self.metrics, self.endpoint = serve_worker_metrics(cfg, self.rank)
        self.dataset, self.model = build_dataset_and_model(job, device)
        if job.activation_checkpointing:
            checkpoint_blocks(self.model)
        self.wire_dtype = job.wire
        # auto: DDP looks for unused parameters in the first step, and keeps looking only where
        # that step left a trainable parameter without a gradient on some rank (DDP alone
        # would fail at the second step); no extra call of the job's step to find out
        self.unused_setting = job.find_unused_parameters
        self.settling = self.unused_setting == "auto"  # until the first step has shown
        self.find_unused = self.unused_setting != "never"
        self.checkpoints = RankCheckpoints(cfg.run_dir, cfg.checkpoint_every_s, self.rank)
        resumed = self.checkpoints.restore_model(self.model) if cfg.resume else {}
        self.ddp = self._wrap(self.find_unused)
        fp16 = job.precision == "fp16"
        # fp16 compute scales the loss as DDP users do; a no-op for fp32 and bf16. Not with a
        # fused optimizer: torch's CPU fused SGD takes a step the scaler skipped into its
        # momentum (NaN weights at the first good step, tests/test_mixed_precision.py).
        params = list(self.ddp.parameters())
        self.optimizer = job.optimizer.build(
            params, fused=not fp16, ndims=[p.dim() for p in params]
        )
        # where a restarted group goes on from: how far training got, its optimizer state
        self.resumed = (
            self.checkpoints.restore_optimizer(self.optimizer, resumed) if cfg.resume else {}
        )
        self.scaler = torch.amp.GradScaler(device.type, enabled=fp16)
        self.skipped = 0
        self.meter = SavedActivationMeter(self.model.parameters())
        self.training_step = load_step(job.step, job.precision)
        self.max_grad_norm = job.max_grad_norm
        self.evaluation = load_evaluation(job)
        self.trace_iters = job.memory_trace_iters
        self.eval_every = job.eval_every
        self.tests = TestSnapshots(job.eval_every_s, self.dataset, device, self.evaluation)
        self.part = self.dataset.part(self.rank, world, job.seed)
        self.steps = self.part.steps_per_epoch(job.batch_size)
        grad_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if job.wire != "fp32":
            grad_bytes //= 2  # float32 gradients travel in 16 bits
        # A ring all-reduce sends 2 (n - 1) / n of the gradient bytes from every rank.
        self.wire_bytes = int(2 * (world - 1) / world * grad_bytes)
        self.records.write(
            {
                "kind": "start",
                "t": time.time(),
                "steps_per_epoch": self.steps,
                "batch_size": job.batch_size,
                "wave": 0,
                "device": str(device),
                "device_index": cfg.device_index,
                "rank": self.rank,
                "world_size": world,
                "precision": job.precision,
                "wire_dtype": job.wire,
            }
        )

    def _wrap(self, find_unused: bool) -> DistributedDataParallel:
        """The model under DDP (every rank at once: DDP broadcasts rank 0's weights)."""
        ddp = DistributedDataParallel(
            self.model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=find_unused,
        )
        compress_gradients(ddp, self.wire_dtype)
        return ddp

    def _settle_unused(self, unused: list[str]) -> dict:
        """After the first step under auto: keep DDP looking for unused parameters where that
        step left some on any rank, else wrap the model again without the search (each step's
        walk of the autograd graph); what was decided, for the step's record."""
        self.settling = False
        self.find_unused = _any_rank(bool(unused), self.device)
        if unused:
            log.info(
                "rank %d: the first step left %s without a gradient: DDP goes on finding unused "
                "parameters",
                self.rank,
                _names(unused),
            )
        if not self.find_unused:
            # (DDP's own warning of no unused parameters, just logged, is answered here)
            log.info("the first step gave every parameter a gradient: DDP stops looking")
            self.ddp = None  # its reducer's hooks go with it, before the new one's are set
            gc.collect()
            self.ddp = self._wrap(False)
        return {"unused_parameters": unused, "find_unused_parameters": self.find_unused}

    def step(self, epoch: int, iteration: int, batch, lr: float) -> None:
        """Forward, backward (DDP all-reduces gradient buckets meanwhile), update, record."""
        batch = to_device(batch, self.device, non_blocking=True)
        self.meter.tracing = iteration < self.trace_iters
        self.meter.reset_peak()
        t0, t_start = time.perf_counter(), time.time()
        with self.meter.hooks():
            try:
                loss, logs = self.training_step(self.ddp, batch)
            except RuntimeError as e:
                if "Expected to have finished reduction" not in str(e):
                    raise
                raise UnusedParameterError(
                    self.unused_setting, self.find_unused, iteration
                ) from None
        t_end, t1 = time.time(), time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        t2 = time.perf_counter()
        grad_norm = None
        if self.max_grad_norm:
            self.scaler.unscale_(self.optimizer)  # fp16: clip the true gradients
            grad_norm = clip_gradients(self.model.parameters(), self.max_grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        unused = None
        if self.settling:  # auto, the first step: which parameters got no gradient
            unused = [
                n for n, p in self.model.named_parameters() if p.requires_grad and p.grad is None
            ]
        scale = self.scaler.get_scale()
        self.scaler.step(self.optimizer)  # skipped when fp16 gradients overflowed
        self.scaler.update()
        skipped = self.scaler.is_enabled() and self.scaler.get_scale() < scale
        self.skipped += skipped
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        t3 = time.perf_counter()
        record = {
            "kind": "step",
            "t": time.time(),
            "wave": 0,
            "epoch": epoch,
            "iter": iteration,
            "clock": iteration,
            "loss": float(loss.detach()),
            "samples": batch_samples(batch),
            "t_forward_start": t_start,
            "t_forward_end": t_end,
            "forward_s": t1 - t0,
            "backward_allreduce_s": t2 - t1,
            "optimizer_s": t3 - t2,
            "saved_bytes_peak": self.meter.peak,
            "wire_bytes": self.wire_bytes,
            "skipped": skipped,
            "loss_scale": self.scaler.get_scale() if self.scaler.is_enabled() else 1.0,
            **device_memory(self.device),
        }
        if logs:
            record["step_logs"] = logs
        if grad_norm is not None:
            record["grad_norm"] = grad_norm
        if unused is not None:
            record.update(self._settle_unused(unused))
        self.records.write(record)
        if self.metrics is not None:
            self.metrics.record(wave_name(f"w{self.rank}", 0), record)

    def end_epoch(self, epoch: int) -> None:
        if self.rank == 0 and self.eval_every and (epoch + 1) % self.eval_every == 0:
            self.tests.test_epoch(self.model, epoch, self.records.write)
        self.records.write({"kind": "epoch", "t": time.time(), "epoch": epoch})

    def finish(self, evaluated: bool, stop: threading.Event | None = None) -> None:
        """Final accuracy (rank 0, only when training got to its end: after a failure the error
        is what matters, not a score), the memory trace, and the records closed."""
        if self.endpoint is not None:
            self.endpoint.stop()
        if self.rank == 0 and evaluated:
            save_trained_model(self.model, self.run_dir)
            metrics = evaluate(self.model, self.dataset, self.device, self.evaluation)
            self.records.write(eval_record("final", self.evaluation, metrics))
            # the copies taken during training (eval_every_s), now that the model is free
            self.tests.test_copies(self.model, self.records.write, stop)
        if self.rank == 0:
            # a rank that failed or was stopped (a peer lost, its group restarted) leaves the
            # copies it has not tested on disk: they still tell when the model reached what
            # (test_saved_copies tests them later), and the restart does not wait for them
            self.tests.save_untested(self.run_dir / "untested", self.job)
        if self.meter.trace:
            self.records.write({"kind": "memory_trace", "wave": 0, "trace": self.meter.trace})
        self.records.close()
