"""The modes of the cluster benchmark (``benchmarks/cluster.py``): what each runs on every node,
and the job's batch and learning rate the modes that average more samples scale.

Each mode's description (printed in the report) says what it runs on every node.
The learning rate is the job's, except where one update averages more samples than all-reduce's
at one wave's batch: ``bsp`` (all waves of a clock) and ``allreduce-2x`` take it times the
samples per update over all-reduce's (linear scaling, as ``wavelet compare --memory-budget``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    description: str
    processes: int  # per node
    args: tuple[str, ...]
    batch_factor: int = 1
    lr_factor: float = 1.0  # the job's lr times this: samples per update over all-reduce's


MODES = {
    "ticktock": Mode(
        "PS: 1 shard + 1 worker of 2 waves per node, the default update rule (--updates auto)",
        2,
        ("--shards-per-node", "1"),
    ),
    "ticktock-stay": Mode(
        "the default with every shard kept on its node (--move-slow-shards false): a co-tenant "
        "that comes and goes leaves the shards where they started",
        2,
        ("--shards-per-node", "1", "--move-slow-shards", "false"),
    ),
    "ticktock-fp32": Mode(
        "the default with gradients and weights in fp32 on the wire (--wire-dtype fp32; the "
        "default between nodes is bf16)",
        2,
        ("--shards-per-node", "1", "--wire-dtype", "fp32"),
    ),
    "ticktock-patient": Mode(
        "the default with a group's update going ahead without a wave later than a quarter of "
        "its usual turn (--turn-patience 0.25), its push folded into the next",
        2,
        ("--shards-per-node", "1", "--turn-patience", "0.25"),
    ),
    "ticktock-async": Mode(
        "PS: 1 shard + 1 worker of 2 waves per node, asynchronous updates",
        2,
        ("--shards-per-node", "1", "--updates", "async"),
    ),
    "ticktock-layers": Mode(
        "the same with chunks placed by layers: the push to the last layers' shard leaves "
        "while backward goes on",
        2,
        ("--shards-per-node", "1", "--placement", "layers", "--updates", "async"),
    ),
    "ticktock-after": Mode(
        "the same as ticktock-layers, pushing only after backward (the old way)",
        2,
        ("--shards-per-node", "1", "--placement", "layers", "--updates", "async")
        + ("--push-during-backward", "false"),
    ),
    "ticktock-pull": Mode(
        "the same as ticktock-layers, each layer's forward starting as soon as its own weights "
        "are in (pull during forward, parts of 256 KiB)",
        2,
        ("--shards-per-node", "1", "--placement", "layers", "--updates", "async")
        + ("--pull-during-forward", "true"),
    ),
    "ticktock-groups": Mode(
        "PS, wave groups: the tick waves of all nodes average into one update, the tock waves "
        "into the next (the paper's synchronous design)",
        2,
        ("--shards-per-node", "1", "--updates", "wave-groups"),
    ),
    "ticktock-groups-mc": Mode(
        "wave groups with momentum corrected for their two asynchronous update streams",
        2,
        ("--shards-per-node", "1", "--updates", "wave-groups", "--momentum-correction", "true"),
    ),
    "ticktock-turns": Mode(
        "PS, wave groups in strict turns: each group reads the other's latest update (no "
        "staleness; a group's forward waits for the other's update)",
        2,
        ("--shards-per-node", "1", "--updates", "wave-turns"),
    ),
    "ticktock-turns-pull": Mode(
        "wave turns, each layer's forward starting as soon as its own weights are in (pull "
        "during forward)",
        2,
        ("--shards-per-node", "1", "--updates", "wave-turns", "--pull-during-forward", "true"),
    ),
    "bsp": Mode(
        "PS, bulk-synchronous: the waves of all nodes average into one update per clock "
        "(staleness 0; the lr times 2: twice all-reduce's samples per update)",
        2,
        ("--shards-per-node", "1", "--staleness", "0"),
        lr_factor=2.0,
    ),
    "ticktock-kofn": Mode(
        "PS, k of n: a step of all waves closes once half of them pushed it; late pushes are "
        "folded into the next step (the lr times 2, as bsp)",
        2,
        ("--shards-per-node", "1", "--updates", "k-of-n"),
        lr_factor=2.0,
    ),
    "single": Mode(
        "PS: 1 shard + 1 worker of 1 wave per node", 2, ("--shards-per-node", "1", "--waves", "1")
    ),
    "single-pull": Mode(
        "the same as single, each layer's forward starting as soon as its own weights are in "
        "(pull during forward)",
        2,
        ("--shards-per-node", "1", "--waves", "1", "--pull-during-forward", "true"),
    ),
    "allreduce": Mode("DDP: 1 rank per node at one wave's batch", 1, ("--mode", "allreduce")),
    "allreduce-bf16": Mode(
        "DDP with its gradient buckets in bf16 on the wire, the 16-bit wire's own baseline",
        1,
        ("--mode", "allreduce", "--wire-dtype", "bf16"),
    ),
    "allreduce-2x": Mode(
        "DDP: 1 rank per node at the batch of both waves (2x activations)",
        1,
        ("--mode", "allreduce"),
        batch_factor=2,
        lr_factor=2.0,
    ),
}


def job_config(config: str | None):
    """The job a config file (None or "": the default job) describes."""
    from wavelet.common.config import JobConfig
    from wavelet.common.settings import from_dict, load_toml

    return from_dict(JobConfig, load_toml(config) if config else {})


def job_lr(config: str | None, extra: list[str]) -> float:
    """The job's learning rate: from ``--lr`` among the extra job flags, else the config file,
    else the default."""
    if "--lr" in extra:
        return float(extra[extra.index("--lr") + 1])
    return job_config(config).optimizer.lr


def job_batch_size(config: str | None) -> int:
    return job_config(config).batch_size
