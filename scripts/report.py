"""What a job shows and leaves: the progress line read from the workers' records as they grow,
and at the end the summary (the shards' test metrics, samples/s, lost updates, staleness per
wave) printed and written to ``summary.json``. ``wavelet launch`` and ``wavelet run`` share it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from wavelet.common.config import JobConfig
from wavelet.common.evaluation import format_value
from wavelet.common.figures import push_staleness
from wavelet.common.job import MODEL_FILE
from wavelet.common.messages import AdminRequest
from wavelet.common.protocol import Op, ShardError
from wavelet.common.records import write_text_whole
from wavelet.scripts.plots import staleness_histograms
from wavelet.scripts.stats import fetch_stats, format_wave_table, merge_wave_stats
from wavelet.scripts.tensorboard_log import RunBoard
from wavelet.worker.connection import call_shard, client_keys
from wavelet.worker.evaluate import evaluate_shards


def summarize(
    run_dir: Path,
    mode: str,
    job_cfg: JobConfig,
    addresses: list[str],
    progress: Progress,
    keys=None,
    admin_token: str = "",
    job_wide: dict | None = None,
    stop_shards: bool = True,
    throughput_of: str = "this machine's workers",
    also_stop: list[str] = (),
) -> dict:
    """The end of a job: with shards, test their weights, fetch their statistics and stop them
    (unless not ``stop_shards``); then write and return summary.json (accuracy, samples/s, lost
    updates, staleness per wave). ``job_wide``: samples and samples/s of every node's workers
    (under torchrun; the records here are this node's only)."""
    progress.read()
    membership, update_rule = {}, ""
    if addresses:
        metrics = evaluate_shards(addresses, job_cfg, keys=keys, save_to=run_dir)
        shard_stats = fetch_stats(addresses, keys=keys)
        stats = merge_wave_stats(shard_stats)
        membership = merge_membership(shard_stats)
        update_rule = describe_rules(shard_stats)
        for a in addresses if stop_shards else ():
            call_shard(a, Op.SHUTDOWN, keys=keys, body=AdminRequest(token=admin_token).to_wire())
        # the processes whose shard moved to a standby still run (they host standbys): their
        # own addresses, where one still answers
        for a in [a for a in also_stop if a not in addresses] if stop_shards else ():
            try:
                body = AdminRequest(token=admin_token).to_wire()
                call_shard(a, Op.SHUTDOWN, timeout_s=2.0, keys=keys, body=body)
            except ShardError:
                pass  # gone with its node
        staleness = push_staleness(run_dir)  # the shards' records, where they share the run dir
        if staleness:
            staleness_histograms(staleness, run_dir / "staleness.png")
    else:
        metrics = progress.final_metrics
        stats = {}
    score = metrics.get(job_cfg.target_metric) if metrics else None
    if progress.board is not None and score is not None:
        progress.board.final(job_cfg.target_metric, score)
    summary = {
        "run_dir": str(run_dir),
        "mode": mode,
        "test_accuracy": metrics.get("accuracy") if metrics else None,
        "target_metric": job_cfg.target_metric,
        "score": score,  # the target metric's final value
        "metrics": metrics or {},
        "samples": progress.samples,
        "train_seconds": progress.elapsed(),
        "samples_per_s": progress.samples / max(progress.elapsed(), 1e-9),
        "lost_updates": progress.lost_updates,
        "lost_pushes": sum(progress.lost_pushes.values()),
        "precision": job_cfg.precision,
        "wire_dtype": job_cfg.wire,
        "wire_bytes": progress.wire_bytes,
        "skipped_steps": dict(progress.skipped),
        "wire_overflows": sum(progress.wire_overflows.values()),
        "waves": stats,
        "membership": membership,  # epoch, joins and leaves the shards saw
        "update_rule": update_rule,
        "throughput_of": throughput_of,
        # the trained model's state_dict: the shards' weights pulled above, or all-reduce's
        # rank 0's (wavelet.load_model builds the model with it)
        "model": str(run_dir / MODEL_FILE) if (run_dir / MODEL_FILE).exists() else None,
    }
    if job_wide is not None:
        summary.update(
            samples=job_wide["samples"],
            samples_per_s=job_wide["samples_per_s"],
            train_seconds=job_wide["train_seconds"],
            throughput_of=f"the job's {job_wide['workers']} workers on every node",
        )
        if job_wide.get("workers_lost"):
            summary["workers_lost"] = job_wide["workers_lost"]
            # a lost worker published nothing, and one that joined in its place (wavelet worker
            # --join) is outside torchrun's store: their samples are in their own run dirs
            summary["throughput_of"] += (
                f" that finished under torchrun (without the {job_wide['workers_lost']} lost "
                "and any that joined: see their own run dirs' records)"
            )
    write_text_whole(run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def train_and_report(daemon) -> int:
    """A worker started by hand (``wavelet worker``): its waves' progress while it trains,
    then the summary of its run dir (the test metrics of the shards' weights as they are when
    it ends, samples/s, staleness per wave) printed and written to summary.json. The shards
    keep serving: they are the user's to stop."""
    cfg, started = daemon.config, time.time()
    run_dir = Path(cfg.run_dir)
    progress = Progress(run_dir, cfg.job.epochs, since=started)
    print(
        f"worker {cfg.rank} of {cfg.num_workers}: {cfg.job.waves} wave(s) on {cfg.device}, "
        f"records in {run_dir / 'records'}",
        flush=True,
    )
    with ProgressLines(progress, started):
        code = daemon.run()
    if code or daemon.stop_requested:
        return code
    try:
        summary = summarize(
            run_dir,
            f"ps (worker {cfg.rank})",
            cfg.job,
            daemon.shard_addresses,  # where the shards are now (a standby took one over?)
            progress,
            client_keys(cfg),
            stop_shards=False,
            throughput_of=f"the waves recorded in {run_dir}",
        )
    except ShardError as e:
        print(f"wavelet worker: trained, but the shards could not be tested: {e}", file=sys.stderr)
        return 1
    print("\n" + format_summary(summary), flush=True)
    return 0


def describe_rules(shard_stats: list[dict]) -> str:
    """What the shards' update rule did: once where every shard says the same, else shard by
    shard (k of n counts the late pushes each shard saw); then how the waves' batches were
    sized, as shard 0, which sizes them, says (balanced batches: when and why)."""
    rules = {s.get("shard", i): s.get("update_rule", "") for i, s in enumerate(shard_stats)}
    said = {r for r in rules.values() if r}
    if len(said) <= 1:
        rule = next(iter(said), "")
    else:
        rule = "; ".join(f"shard {shard}: {r}" for shard, r in sorted(rules.items()) if r)
    batches = next((s.get("batches", "") for s in shard_stats if s.get("shard") == 0), "")
    # after a rule said shard by shard, the batches are the job's, not the last shard's
    return ("; " if len(said) > 1 else ", ").join(part for part in (rule, batches) if part)


def merge_membership(shards: list[dict]) -> dict[str, int]:
    """The membership the shards saw: each sees every wave, so the largest counts are the job's
    (a standby that took a shard over saw only what came after)."""
    out: dict[str, int] = {}
    for shard in shards:
        for key, value in (shard.get("members") or {}).items():
            out[key] = max(out.get(key, 0), value)
    return out


def format_summary(s: dict) -> str:
    metric = s.get("target_metric", "accuracy")
    score = s.get("score", s["test_accuracy"])
    others = ", ".join(
        f"{k} {format_value(k, v)}" for k, v in s.get("metrics", {}).items() if k != metric
    )
    lines = [
        f"final test {metric}: {format_value(metric, score)}"
        if score is not None
        else f"no final {metric}",
        *([f"other test metrics: {others}"] if others else []),
        f"throughput: {s['samples_per_s']:.0f} samples/s ({s['samples']} samples in "
        f"{s['train_seconds']:.1f}s, all waves)",
    ]
    if s.get("update_rule"):
        lines.append(f"update rule: {s['update_rule']}")
    members = s.get("membership") or {}
    # every wave joins once and leaves once when it is done: only more than that is news
    if members.get("joins", 0) > len(s["waves"]) or s.get("workers_lost"):
        lines.append(
            f"membership: {members.get('joins', 0)} join(s) and {members.get('leaves', 0)} "
            f"leave(s) of the job's {len(s['waves'])} waves (membership epoch "
            f"{members.get('epoch', 0)})"
            + (
                f"; {s['workers_lost']} worker(s) lost with their node"
                if s.get("workers_lost")
                else ""
            )
        )
    if s.get("lost_updates"):
        lines.append(f"restarted shards lost {s['lost_updates']} update(s) (see the records)")
    if s.get("lost_pushes"):
        lines.append(
            f"shards taken over lost {s['lost_pushes']} push(es) the waves could not give again "
            "(late ones folded into the step their primary died with; see the workers' logs)"
        )
    lines.append(_precision_line(s))
    if s["waves"]:
        lines += [
            "staleness per wave (updates applied between a wave's read and its push):",
            format_wave_table(s["waves"]),
        ]
    kept = ["records"]
    if (Path(s["run_dir"]) / "logs").is_dir():  # a launcher's daemons log there
        kept.append("logs")
    if s.get("model"):
        kept.append(f"the trained model ({MODEL_FILE})")
    lines.append(f"{', '.join(kept)} and summary.json: {s['run_dir']}")
    return "\n".join(lines)


def _precision_line(s: dict) -> str:
    """Precision, wire dtype, bytes moved and fp16 trouble, in one line."""
    per_sample = s["wire_bytes"] / s["samples"] if s.get("samples") else 0.0
    line = (
        f"precision {s['precision']}, wire {s['wire_dtype']}: {s['wire_bytes'] / 1e6:.1f} MB "
        f"of tensors over TCP ({per_sample / 1e3:.1f} kB/sample; shared memory not counted)"
    )
    skipped = {w: n for w, n in s.get("skipped_steps", {}).items() if n}
    if skipped:
        each = ", ".join(f"{w}: {n}" for w, n in sorted(skipped.items()))
        line += f"; {sum(skipped.values())} step(s) skipped on fp16 overflow ({each})"
    if s.get("wire_overflows"):
        line += f"; {s['wire_overflows']} gradient(s) clamped to fp16's range"
    return line


class ProgressLines:
    """Prints ``progress``'s line every ``every_s`` from a thread of its own, while the caller
    trains on its thread: the one whose torch threads the computation uses (worker/compute.py)."""

    def __init__(self, progress: Progress, started: float, every_s: float = 2.0):
        self.progress, self.started, self.every_s = progress, started, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._show, name="progress", daemon=True)

    def __enter__(self) -> ProgressLines:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _show(self) -> None:
        while not self._stop.wait(self.every_s):
            self.progress.read()
            print(self.progress.line(time.time() - self.started), flush=True)


def _metrics_of(r: dict) -> dict[str, float]:
    """An eval or final record's metrics (records before --evaluate hold test_acc alone)."""
    return r.get("metrics") or {"accuracy": r["test_acc"]}


class Progress:
    """Reads the workers' records as they grow and summarises them in one line."""

    def __init__(
        self,
        run_dir: Path,
        epochs: int,
        every_s: float = 2.0,
        since: float = 0.0,
        board: RunBoard | None = None,
    ):
        self.dir = run_dir / "records"
        self.board = board  # TensorBoard scalars, written from the same records
        self._board_t: float | None = None
        self.since = since  # records from before (a resumed run's first part) do not count
        self.epochs = epochs
        self.every_s = every_s
        self._offsets: dict[Path, int] = {}
        self._next = time.monotonic() + every_s
        self.samples = 0
        self.first_t: float | None = None
        self.last_t: float | None = None
        self.loss: dict[str, float] = {}
        self.epoch = 0
        self.steps = 0
        self.metric = "accuracy"  # the job's headline metric, as its eval records name it
        self.score: float | None = None  # its latest value during training
        self.final_metrics: dict[str, float] | None = None
        self.lost_updates = 0  # most updates any wave saw a restarted shard lose
        self.lost_pushes: dict[str, int] = {}  # per wave, folded pushes a take-over lost
        self.wire_bytes = 0  # tensor bytes the waves moved over TCP
        self.skipped: dict[str, int] = {}  # per wave, steps skipped on fp16 overflow
        self.wire_overflows: dict[str, int] = {}  # per wave, fp16 gradients clamped (running)
        self.tcp_reasons: list[str] = []  # why waves that could use shared memory do not
        self._told_tcp = False

    def due(self) -> bool:
        if time.monotonic() < self._next:
            return False
        self._next = time.monotonic() + self.every_s
        return True

    def read(self) -> None:
        for path in sorted(self.dir.glob("worker-*.jsonl")):
            wave = path.stem.replace("worker-", "w").replace("-wave-", "/")
            for r in self._new_records(path):
                self._take(wave, r)
        if self.board:
            for path in sorted(self.dir.glob("ps-*-pushes.jsonl")):
                for r in self._new_records(path):
                    if r.get("t", self.since) >= self.since:
                        self.board.push(r)
            if self.elapsed() > 0 and self.last_t != self._board_t:
                self._board_t = self.last_t
                self.board.throughput(self.samples / self.elapsed(), self.elapsed(), self.last_t)

    def _new_records(self, path: Path):
        with open(path) as f:
            f.seek(self._offsets.get(path, 0))
            for line in f:
                if not line.endswith("\n"):
                    break
                self._offsets[path] = self._offsets.get(path, 0) + len(line.encode())
                yield json.loads(line)

    def _take(self, wave: str, r: dict) -> None:
        if r.get("t", self.since) < self.since:
            return
        if self.board:
            if r["kind"] == "step":
                self.board.step(wave, r)
            elif r["kind"] in ("eval", "final") and (r.get("epoch_end") or not r.get("timed")):
                # per epoch; tests between epochs (eval_every_s) are for time to target
                self.board.evaluation(r.get("epoch", self.epoch) + 1, _metrics_of(r), r["t"])
        if r["kind"] == "start":
            self.first_t = r["t"] if self.first_t is None else min(self.first_t, r["t"])
            self.tcp_reasons += [
                f"{wave} to {shard}: {why}" for shard, why in r.get("tcp_reasons", {}).items()
            ]
        elif r["kind"] == "step":
            self.samples += r["samples"]
            self.steps += 1
            self.epoch = max(self.epoch, r["epoch"] + 1)
            self.loss[wave] = r["loss"]
            self.lost_updates = max(self.lost_updates, r.get("lost_updates", 0))
            self.lost_pushes[wave] = r.get("lost_pushes", 0)
            self.wire_bytes += r.get("wire_bytes", 0)
            self.skipped[wave] = self.skipped.get(wave, 0) + int(r.get("skipped", False))
            self.wire_overflows[wave] = r.get("wire_overflows", 0)
            self.last_t = r["t"] if self.last_t is None else max(self.last_t, r["t"])
        elif r["kind"] == "eval":
            self.metric = r.get("metric", "accuracy")
            self.score = r.get("score", r.get("test_acc"))
        elif r["kind"] == "final":
            self.final_metrics = _metrics_of(r)
        elif r["kind"] == "failed":  # the line's loss is the waves' still training
            self.loss.pop(wave, None)

    def shared_memory_note(self) -> str:
        """Once, the first time waves fell back to TCP on a full shared-memory folder: one line
        saying why and what to do ("" otherwise)."""
        full = [r for r in self.tcp_reasons if "--shm-size" in r]
        if self._told_tcp or not full:
            return ""
        self._told_tcp = True
        return f"shared memory is full; {len(full)} wave link(s) use TCP instead ({full[0]})"

    def elapsed(self) -> float:
        if self.first_t is None or self.last_t is None:
            return 0.0
        return self.last_t - self.first_t

    def line(self, wall: float) -> str:
        # "-" until there is a number: no "loss nan  0 samples/s" before the first step
        loss = f"{sum(self.loss.values()) / len(self.loss):.4f}" if self.loss else "-"
        rate = f"{self.samples / self.elapsed():.0f}" if self.elapsed() > 0 else "-"
        acc = ""
        if self.score is not None and self.metric == "accuracy":
            acc = f"  test acc {100 * self.score:.1f}%"
        elif self.score is not None:
            acc = f"  test {self.metric} {self.score:.4g}"
        epochs = f"/{self.epochs}" if self.epochs else ""
        return (
            f"[{wall:6.1f}s] epoch {self.epoch}{epochs}  steps {self.steps}  "
            f"loss {loss}  {rate} samples/s{acc}"
        )
