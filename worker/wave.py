"""Wave: one data-parallel training task on a device, with its own model replica and data part.

Per iteration: take the forward baton, forward, backward (passing the baton on once backward has
freed most of the forward's activations, and pushing each shard's gradients as soon as backward
has made them: worker/push_hooks.py), then push the rest and pull the next weights (with
``pull_during_forward``, the next forward takes them layer by layer as they arrive:
worker/pull_hooks.py). Everything a wave does is recorded as one JSON line per iteration in the
run directory.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq

from wavelet.common.batches import batch_samples, to_device
from wavelet.common.config import BOUNDLESS_UPDATES
from wavelet.common.daemon_config import WorkerConfig
from wavelet.common.datasets import Dataset, LoaderDataset
from wavelet.common.evaluation import load_evaluation
from wavelet.common.models import build_model, checkpoint_blocks
from wavelet.common.protocol import ShardError, wave_name
from wavelet.common.records import RecordWriter
from wavelet.common.schedule import lr_factor, progress
from wavelet.common.sharding import ShardingPlan, model_tensors
from wavelet.common.step import clip_gradients, load_step
from wavelet.worker.baton import ForwardBaton, NoBaton
from wavelet.worker.client import PSClient
from wavelet.worker.compute import InlineCompute, SharedCompute
from wavelet.worker.connection import client_keys
from wavelet.worker.evaluate import TestSnapshots
from wavelet.worker.loss_scale import LossScale
from wavelet.worker.memory import SavedActivationMeter, device_memory
from wavelet.worker.pull_hooks import PullDuringForward
from wavelet.worker.push_hooks import PushDuringBackward
from wavelet.worker.rounds import BudgetSpent, PendingPull, PullResult, StopRequested

log = logging.getLogger(__name__)


@dataclass
class WaveIdentity:
    worker: str  # the worker daemon's name on the shards, e.g. "w0"
    local: int  # index among this device's waves (0 is tick, 1 is tock)
    global_index: int  # index among all waves of the job: picks the data part
    total: int  # waves in the job

    @property
    def name(self) -> str:
        return wave_name(self.worker, self.local)


class Wave:
    def __init__(
        self,
        ident: WaveIdentity,
        config: WorkerConfig,
        dataset: Dataset | LoaderDataset,
        baton: ForwardBaton | NoBaton,
        stop: threading.Event,
        context: zmq.Context,
        evaluate: bool = False,
        metrics=None,
        compute: InlineCompute | SharedCompute | None = None,
        on_move=None,
    ):
        self.ident = ident
        self.config = config
        self.job = config.job
        self.dataset = dataset
        self.baton = baton
        self.stop = stop
        self.context = context
        self.evaluate = evaluate
        self.metrics = metrics  # WorkerMetrics (worker/metrics.py), when they are served
        # where forwards, backwards and tests run (worker/compute.py)
        self.compute = compute or InlineCompute()
        self.on_move = on_move  # (shard, address): a standby took a shard over
        self.device = torch.device(config.device)
        self.step = load_step(self.job.step, self.job.precision)
        self.loss_scale = LossScale(enabled=self.job.precision == "fp16")
        self.evaluation = load_evaluation(self.job)
        self.tests = TestSnapshots(
            self.job.eval_every_s, dataset, self.device, self.evaluation, self.compute
        )
        self.keys = client_keys(config)
        self.error: BaseException | None = None
        # balanced batches (synchronous rules): the batch size changes as the shards ask
        job = self.job
        synchronous = job.staleness == 0 or job.updates in BOUNDLESS_UPDATES
        self.balanced = synchronous and job.balance_batches != "off"
        self.batch_size = job.batch_size
        self.last_push_at: float | None = None  # perf_counter() of the last push's finish
        name = f"worker-{config.rank}-wave-{ident.local}"
        self.records = RecordWriter(Path(config.run_dir) / "records" / f"{name}.jsonl")

    def run(self) -> None:
        """Thread body: train, then leave the shards; any failure is kept in ``self.error``."""
        try:
            self.compute.enter_wave_thread()
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self._train()
        except StopRequested:
            log.info("wave %s stopped", self.ident.name)
        except ShardError as e:  # unreachable or refusing shards: the daemon reports it once
            self.error = e
        except BaseException as e:
            self.error = e
            log.exception("wave %s failed", self.ident.name)
            # the progress line and reports stop counting this wave's last loss as current
            self.records.write({"kind": "failed", "t": time.time(), "error": _one_line(e)})
        finally:
            self.baton.leave(self.ident.local)
            self.records.close()

    def _train(self) -> None:
        job, ident = self.job, self.ident
        model = build_model(
            job.model,
            self.dataset.input_shape,
            self.dataset.num_classes,
            job.seed,
            **job.model_kwargs,
        ).to(self.device)
        if job.activation_checkpointing:
            checkpoint_blocks(model)
        part = self.dataset.part(ident.global_index, ident.total, job.seed)
        steps = part.steps_per_epoch(job.batch_size)
        if steps == 0:
            raise ValueError(
                f"batch size {job.batch_size} exceeds this wave's "
                f"{len(part)} samples; lower --batch-size"
            )
        meter = SavedActivationMeter(model.parameters())
        plan = ShardingPlan.for_job(model, job)
        tensors = {name: t for name, t, _ in model_tensors(model)}
        client = PSClient(
            self.config.shard_addresses,
            plan,
            tensors,
            ident.worker,
            ident.local,
            job.request_timeout_s,
            self.stop,
            self.context,
            self.keys,
            self.config.transport,
            job.wire_error_feedback,
            part_bytes=job.pull_part_kib * 1024 if job.pull_during_forward else 0,
            push_part_bytes=job.push_part_kib * 1024,
            lost_after_s=job.shard_timeout_s,
            on_move=self.on_move,
        )
        self.pusher = None
        # fp16's skip and clipping's norm need every gradient: those push after backward
        if job.push_during_backward and not self.loss_scale.enabled and not job.max_grad_norm:
            self.pusher = PushDuringBackward(dict(model.named_parameters()), client.chunks)
        self.puller = None
        if job.pull_during_forward:
            self.puller = PullDuringForward(model, tensors, client.chunks)
        try:
            last = self._run_epochs(model, meter, client, part, steps)
            client.budget_ends = None  # what is left to say to the shards may take its time
            if not self.stop.is_set():
                _settle(last)  # the model ends on the last weights
                client.leave()
                self.baton.leave(ident.local)  # the other waves go on while this one tests
                # the copies taken during training (eval_every_s)
                self.tests.test_copies(model, self.records.write, self.stop)
        except StopRequested:
            client.goodbye()  # a stop (SIGTERM: preemption) leaves now, not after the lease
            raise
        except ShardError:
            raise  # the shards do not answer: leaving would wait on them again
        except Exception:
            # the wave itself failed (its data, its step): it leaves, so that the waves it would
            # hold back (wave turns, the staleness bound) go on now, not after wave_timeout_s
            if not self.stop.is_set():
                _leave_quietly(client, ident.name)
            raise
        finally:
            self.baton.leave(ident.local)
            if self.pusher is not None:
                self.pusher.close()
            if self.puller is not None:
                self.puller.close()
            client.close()
            if meter.trace:
                self.records.write(
                    {
                        "kind": "memory_trace",
                        "wave": ident.local,
                        "wave_name": ident.name,
                        "trace": meter.trace,
                    }
                )

    def _run_epochs(
        self, model, meter, client, part, steps: int
    ) -> PullResult | PendingPull | None:
        """Train until the budget is spent; returns the last pull (maybe still on its way; None
        where the budget ended while it was)."""
        job, ident = self.job, self.ident
        clock = max(client.register(0, resume=self.config.resume))
        # Resuming, the wave goes on from the iteration its clock says it had reached.
        first = clock if self.config.resume else 0
        t = time.perf_counter()
        pulled = client.pull(clock)
        self.records.write(
            {
                "kind": "start",
                "t": time.time(),
                "pull_s": time.perf_counter() - t,
                "versions_read": pulled.versions,
                "steps_per_epoch": steps,
                "batch_size": job.batch_size,
                "wave": ident.local,
                "wave_name": ident.name,
                "device": str(self.device),
                "device_index": self.config.device_index,
                "tcp_reasons": client.tcp_reasons,  # shards reached over TCP on this host, why
                "precision": job.precision,
                "wire_dtype": job.wire,
            }
        )
        started = time.monotonic()
        if job.max_seconds:
            client.budget_ends = started + job.max_seconds
        iteration = first
        try:
            for epoch in range(first // steps, job.epochs if job.epochs else 1 << 30):
                model.train()
                seed = job.seed + 7919 * ident.global_index
                # balanced batches: each batch as large as the shards last asked
                sizes = (lambda: self.batch_size) if self.balanced else None
                batches = part.batches(job.batch_size, epoch, seed, sizes)
                for skipped, batch in enumerate(batches):
                    if epoch == first // steps and skipped < first % steps:
                        continue
                    if self.stop.is_set():
                        raise StopRequested()
                    if job.max_seconds and time.monotonic() - started >= job.max_seconds:
                        return pulled
                    meter.tracing = iteration < job.memory_trace_iters
                    done = progress(
                        iteration, job.epochs * steps, time.monotonic() - started, job.max_seconds
                    )
                    lr_scale = lr_factor(job.lr_schedule, done)
                    pulled = self._step(
                        model, meter, client, batch, clock, pulled, epoch, iteration, lr_scale
                    )
                    clock += 1
                    iteration += 1
                    if self.evaluate:
                        if self.tests.due():
                            _settle(pulled)  # a copy of the weights this step's push made
                        self.tests.maybe_take(model, epoch)
                if self.evaluate and job.eval_every and (epoch + 1) % job.eval_every == 0:
                    _settle(pulled)
                    self.tests.test_epoch(model, epoch, self.records.write)
                self.records.write({"kind": "epoch", "t": time.time(), "epoch": epoch})
        except BudgetSpent:
            # the budget ended while the shards held an answer back (a bound, a turn, a shard
            # being taken over): the push went out; its weights are not waited for
            log.info("wave %s: the budget ended while it waited for the shards", ident.name)
            return None
        return pulled

    def _step(self, model, meter, client, batch, clock, pulled, epoch, iteration, lr_scale):
        """One iteration: forward while holding the baton (taking the weights of a deferred
        pull as they come), backward, push, and pull (deferred to the next forward with
        ``pull_during_forward``), record."""
        batch = to_device(batch, self.device, non_blocking=True)
        rec = {
            "kind": "step",
            "wave": self.ident.local,
            "wave_name": self.ident.name,
            "epoch": epoch,
            "iter": iteration,
            "clock": clock,
        }
        pending = pulled if isinstance(pulled, PendingPull) else None
        baton_wait = self.baton.acquire(
            self.ident.local, meanwhile=pending.take_arrived if pending is not None else None
        )
        t0 = time.perf_counter()
        loss, forward_s = self.compute(self._forward, model, meter, batch, rec, pending)
        t1 = time.perf_counter()
        if pending is not None:
            pulled = pending.result()  # all in already: the forward's end waited for the rest
        rec["versions_read"] = pulled.versions
        client.step_samples = batch_samples(batch)
        client.step_forward_s = forward_s
        push = client.start_push(clock, pulled.versions, lr_scale)
        if self.pusher is not None:
            # each shard's push as soon as backward made it, over TCP in parts as it goes
            self.pusher.arm(push.send, push.part)
        try:
            backward_run_s = self.compute(
                self._backward, model, meter, self.loss_scale.scale(loss), client
            )
        finally:
            if self.pusher is not None:
                self.pusher.disarm()
        backward_end = time.perf_counter()
        # told with the next push (this one may have left during backward), with its batch:
        # balanced batches change size from one step to the next
        client.step_compute_s = forward_s + backward_run_s
        client.step_compute_samples = client.step_samples
        if self.ident.global_index == self.job.slow_wave:  # a straggler, on request
            time.sleep((self.job.slow_factor - 1.0) * (backward_end - t0))
        finite = self.loss_scale.unscale(model)  # fp16: an overflowing step is skipped
        if self.job.max_grad_norm and finite:
            rec["grad_norm"] = clip_gradients(model.parameters(), self.job.max_grad_norm)
        t2 = time.perf_counter()
        compute_wait = (t1 - t0 - forward_s - rec["pull_wait_s"]) + (
            backward_end - t1 - backward_run_s
        )
        if self.last_push_at is not None:
            # the step's cost besides computing, waiting for its turn and for the device: the
            # wire both ways, the loop's own work (balanced batches weigh it: ps/balance.py)
            cycle = t2 - self.last_push_at
            client.step_overhead_s = max(
                0.0, cycle - client.step_compute_s - pulled.parked_s - baton_wait - compute_wait
            )
        self.last_push_at = t2
        next_pull = push.finish(skip=not finite, defer=self.puller is not None)
        self.loss_scale.update(finite)
        t3 = time.perf_counter()
        # a deferred pull's bound and drops are known once it is in: they are recorded with the
        # step it feeds, as the pull this step read
        answered = pulled if isinstance(next_pull, PendingPull) else next_pull
        if answered.batch:  # balanced batches: the size the shards ask for next
            self.batch_size = answered.batch
        rec.update(
            t=time.time(),
            loss=float(loss.detach()),
            samples=batch_samples(batch),
            baton_wait_s=baton_wait,
            forward_s=forward_s,
            backward_s=backward_run_s + (t2 - backward_end),
            # waiting for the thread that computes for every wave (worker/compute.py)
            compute_wait_s=compute_wait,
            push_pull_s=t3 - t2,
            pushed_in_backward=push.early,  # shards pushed from gradient hooks
            pushed_in_parts=sum(map(len, push.parted)),  # chunks that went ahead (TCP)
            # how long backward went on after the first of them: the overlap gained
            push_overlap_s=backward_end - push.first_sent_at if push.first_sent_at else 0.0,
            wire_bytes=client.round_trip_bytes // (1 if finite else 2),  # a skip sends nothing
            skipped=not finite,
            loss_scale=self.loss_scale.value,
            wire_overflows=client.data.wire_overflows,
            transport=client.transports,
            lr_scale=lr_scale,
            bound_wait_s=answered.parked_s,
            dropped=answered.dropped,
            lost_updates=client.lost_updates,
            lost_pushes=client.lost_pushes,
            saved_bytes_peak=meter.peak,
            **device_memory(self.device),
        )
        self.records.write(rec)
        if self.metrics is not None:
            self.metrics.record(self.ident.name, rec)
        return next_pull

    def _forward(
        self, model, meter, batch, rec: dict, pending: PendingPull | None = None
    ) -> tuple[torch.Tensor, float]:
        """The loss and how long it took (less any wait for ``pending``'s weights), computed
        while this wave holds the baton (acquired by the caller); the baton passes on once
        backward has freed enough of these activations."""
        wave = self.ident.local
        began = time.perf_counter()
        waited_before = pending.waited_s if pending is not None else 0.0
        try:
            meter.reset_peak()
            rec["t_forward_start"] = time.time()
            pulling = self.puller.during(pending) if self.puller else contextlib.nullcontext()
            with meter.hooks(), pulling:
                loss, logs = self.step(model, batch)
            rec["t_forward_end"] = time.time()
            if logs:
                rec["step_logs"] = logs
            # Hand the baton over once backward has freed all but a fraction of this forward's
            # activations, so the next forward never stacks on a full set (docs/design.md).
            handoff = self.job.baton_handoff
            if handoff >= 1.0:
                self.baton.release(wave)
            else:
                meter.when_below(int(handoff * meter.current), lambda: self.baton.release(wave))
        except BaseException:
            self.baton.release(wave)
            raise
        # what the forward waited for weights still on the wire: not part of forward_s
        waited = pending.waited_s - waited_before if pending is not None else 0.0
        rec["pull_wait_s"] = waited
        return loss, time.perf_counter() - began - waited

    def _backward(self, model, meter, loss: torch.Tensor, client: PSClient) -> float:
        """Backward (pushing as it goes, where the pusher is armed); how long it took."""
        began = time.perf_counter()
        model.zero_grad(set_to_none=True)
        client.backward_began = began  # the pushes it makes tell the compute so far
        try:
            loss.backward()
        finally:
            client.backward_began = None
            meter.cancel_watch()
            self.baton.release(self.ident.local)  # a no-op if the watch already passed it on
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter() - began


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0]


def _leave_quietly(client: PSClient, name: str) -> None:
    try:
        client.leave()
    except Exception as e:  # the wave's own failure is what the daemon reports
        log.warning("wave %s failed and could not leave the shards: %s", name, e)


def _settle(pulled: PullResult | PendingPull | None) -> None:
    """Wait for a deferred pull's weights, where the model must hold them now."""
    if isinstance(pulled, PendingPull):
        pulled.result()
