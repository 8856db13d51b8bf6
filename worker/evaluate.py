"""The job's test metrics (common/evaluation.py): of a wave's replica during training, and of
the shards' weights at the end."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import zmq

from wavelet.common.batches import to_device
from wavelet.common.config import JobConfig
from wavelet.common.datasets import Dataset, LoaderDataset
from wavelet.common.evaluation import Evaluation, Metrics, load_evaluation
from wavelet.common.job import build_dataset_and_model, save_trained_model
from wavelet.common.security import ClientKeys
from wavelet.common.sharding import ShardingPlan, model_tensors
from wavelet.worker.client import PSClient


def evaluate(
    model: torch.nn.Module,
    dataset: Dataset | LoaderDataset,
    device: torch.device,
    evaluation: Evaluation | None = None,
    batch_size: int = 512,
) -> Metrics:
    """The job's metrics on the test set (model in eval mode: BatchNorm uses running
    statistics); top-1 accuracy unless the job names its own evaluation."""
    evaluation = evaluation or Evaluation()
    batches = (to_device(batch, device) for batch in dataset.test_batches(batch_size))
    return evaluation(model, batches)


def timed_eval(
    model: torch.nn.Module,
    dataset: Dataset | LoaderDataset,
    device: torch.device,
    evaluation: Evaluation,
    epoch: int,
    taken_at: float | None = None,
    epoch_end: bool = False,
) -> dict:
    """The ``eval`` record of testing ``model`` now, stamped with the time its weights were
    current (so time to target does not include the test itself): when the test began, or
    ``taken_at`` for a copy taken between epochs (then marked ``timed``); and how long the test
    took (``eval_s``); ``epoch_end``: the copy is its epoch's end-of-epoch test."""
    began, clock = time.time(), time.perf_counter()
    metrics = evaluate(model, dataset, device, evaluation)
    record = eval_record("eval", evaluation, metrics, epoch=epoch)
    record.update(t=began if taken_at is None else taken_at, eval_s=time.perf_counter() - clock)
    if taken_at is not None:
        record["timed"] = True
    if epoch_end:
        record["epoch_end"] = True
    return record


class TestSnapshots:
    """The tests of a replica during training: at an epoch's end (``test_epoch``) and, every
    ``every_s`` seconds in between (``eval_every_s``; then the epochs' tests too), on copies of
    the model's state taken to host memory and tested once training is over (``test_copies``),
    each record stamped with the time its copy was taken. Time to target is then known to
    ``every_s``, and no mode pays for these tests in training time (a test of the narrow ResNet
    takes 0.7 s here: run inline every 2 s, it cost a quarter of the training time).
    ``compute`` runs each test (worker/compute.py; default: on the calling thread)."""

    def __init__(
        self,
        every_s: float,
        dataset: Dataset | LoaderDataset,
        device: torch.device,
        evaluation: Evaluation,
        compute: Callable[..., dict] | None = None,
    ):
        self.every_s = every_s
        self.dataset, self.device, self.evaluation = dataset, device, evaluation
        self.compute = compute
        # (time taken, epoch, state, whether it is the epoch's end-of-epoch test)
        self.taken: list[tuple[float, int, dict[str, torch.Tensor], bool]] = []
        self.restart()

    def restart(self) -> None:
        """Count the next interval from now."""
        self.last = time.monotonic()

    def due(self) -> bool:
        """A copy is due: ``maybe_take`` would take one now."""
        return bool(self.every_s) and time.monotonic() - self.last >= self.every_s

    def maybe_take(self, model: torch.nn.Module, epoch: int) -> None:
        if self.due():
            self._take(model, epoch)

    def test_epoch(self, model: torch.nn.Module, epoch: int, write: Callable[[dict], None]):
        """The test at an epoch's end: now, with its record written, or, where copies are
        taken (``every_s``), as one more copy tested after training. Inline it stalls the
        replica for a whole test (0.7-2 s of the narrow ResNet here), and under a synchronous
        rule every other replica with it. The next copy is due ``every_s`` later."""
        if self.every_s:
            self._take(model, epoch, epoch_end=True)
            return
        write(self._test(model, epoch))
        self.restart()

    def _take(self, model: torch.nn.Module, epoch: int, epoch_end: bool = False) -> None:
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        self.taken.append((time.time(), epoch, state, epoch_end))
        self.restart()

    def test_copies(
        self,
        model: torch.nn.Module,
        write: Callable[[dict], None],
        stop: threading.Event | None = None,
    ) -> None:
        """Test every copy in order and ``write`` its record (``model`` is left holding the last
        one); none after ``stop`` is set (a daemon asked to stop does not test on)."""
        for taken, epoch, state, epoch_end in self.taken:
            if stop is not None and stop.is_set():
                break
            model.load_state_dict(state)
            write(self._test(model, epoch, taken, epoch_end))
        self.taken.clear()

    def save_untested(self, folder: Path, job: JobConfig) -> None:
        """Keep the copies not tested yet on disk, with the job (a rank stopped or failed
        early: its group restarts, and its copies still tell when the model reached what), for
        ``test_saved_copies``."""
        if not self.taken:
            return
        folder.mkdir(parents=True, exist_ok=True)
        saved = {"job": dataclasses.asdict(job), "copies": self.taken}
        torch.save(saved, folder / f"copies-{time.time():.3f}.pt")
        self.taken = []

    def _test(
        self,
        model: torch.nn.Module,
        epoch: int,
        taken_at: float | None = None,
        epoch_end: bool = False,
    ) -> dict:
        args = (model, self.dataset, self.device, self.evaluation, epoch, taken_at, epoch_end)
        return self.compute(timed_eval, *args) if self.compute else timed_eval(*args)


def eval_record(kind: str, evaluation: Evaluation, metrics: Metrics, **fields) -> dict:
    """The record of one evaluation (``eval`` during training, ``final``): every metric, the
    headline as ``score``, and ``test_acc`` where accuracy was measured."""
    return {
        "kind": kind,
        "t": time.time(),
        **fields,
        "metrics": metrics,
        "metric": evaluation.metric,
        "score": evaluation.headline(metrics),
        "test_acc": metrics.get("accuracy"),
    }


def evaluate_shards(
    addresses: list[str],
    job: JobConfig,
    device: str = "cpu",
    context: zmq.Context | None = None,
    keys: ClientKeys | None = None,
    save_to: Path | None = None,
) -> Metrics:
    """Pull the shards' current weights and buffers (as an observer) and test them; with
    ``save_to`` (a run dir) the model they make is written there first (``model.pt``)."""
    dataset, model = build_dataset_and_model(job, device)
    plan = ShardingPlan.for_job(model, job)
    tensors = {name: t for name, t, _ in model_tensors(model)}
    client = PSClient(
        addresses,
        plan,
        tensors,
        "eval",
        0,
        job.request_timeout_s,
        context=context,
        keys=keys,
        lost_after_s=job.shard_timeout_s,
    )
    try:
        client.pull(0, observer=True, master=True)  # the trained model, not its wire copy
    finally:
        client.close()
    if save_to is not None:
        save_trained_model(model, save_to)
    return evaluate(model, dataset, torch.device(device), load_evaluation(job))


def test_saved_copies(run_dir: str | Path, device: str = "cpu") -> int:
    """Test the copies a stopped rank saved (``TestSnapshots.save_untested``) with the run's
    job, append their records to ``records/worker-0-saved-copies.jsonl`` (each stamped with the
    time its copy was taken), remove them; returns how many were tested."""
    from wavelet.common.records import RecordWriter
    from wavelet.common.settings import from_dict

    run_dir = Path(run_dir)
    files = sorted((run_dir / "untested").glob("copies-*.pt"))
    if not files:
        return 0
    records = RecordWriter(run_dir / "records" / "worker-0-saved-copies.jsonl")
    tested = 0
    try:
        for path in files:
            saved = torch.load(path, weights_only=True)
            job = from_dict(JobConfig, saved["job"])
            dataset, model = build_dataset_and_model(job, torch.device(device))
            evaluation = load_evaluation(job)
            for taken, epoch, state, *epoch_end in saved["copies"]:
                model.load_state_dict(state)
                args = (model, dataset, torch.device(device), evaluation, epoch, taken)
                records.write(timed_eval(*args, *epoch_end))
                tested += 1
            path.unlink()
    finally:
        records.close()
    return tested
