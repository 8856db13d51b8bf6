import torch

from wavelet.common.models import build_model
from wavelet.common.sharding import ShardingPlan, chunk_view, model_tensors


def _resnet():
    return build_model("resnet18", (3, 32, 32), 10, seed=0)


def test_chunks_cover_every_tensor_exactly_once():
    model = _resnet()
    plan = ShardingPlan.for_model(model, 3, 1 << 20)
    tensors = {n: t for n, t, _ in model_tensors(model)}
    covered = {n: torch.zeros(t.numel(), dtype=torch.int32) for n, t in tensors.items()}
    for c in plan.chunks:
        assert c.nbytes <= 1 << 20
        covered[c.name][c.offset : c.offset + c.numel] += 1
    for n, cov in covered.items():
        assert bool((cov == 1).all()), n
    assert [c.key for c in plan.chunks] == list(range(len(plan.chunks)))


def test_bytes_are_balanced_across_shards():
    plan = ShardingPlan.for_model(_resnet(), 4, 1 << 20)
    load = plan.bytes_per_shard()
    biggest_chunk = max(c.nbytes for c in plan.chunks)
    # greedy largest-first: no shard exceeds another by more than one chunk
    assert max(load) - min(load) <= biggest_chunk
    assert sum(load) == sum(c.nbytes for c in plan.chunks)


def test_plan_is_deterministic_and_fingerprinted():
    a = ShardingPlan.for_model(_resnet(), 2, 4 << 20)
    b = ShardingPlan.for_model(_resnet(), 2, 4 << 20)
    assert a == b and a.fingerprint == b.fingerprint
    assert ShardingPlan.for_model(_resnet(), 3, 4 << 20).fingerprint != a.fingerprint
    assert ShardingPlan.for_model(_resnet(), 2, 1 << 20).fingerprint != a.fingerprint


def test_buffers_are_planned_as_non_trainable():
    plan = ShardingPlan.for_model(_resnet(), 2, 4 << 20)
    names = {c.name: c.trainable for c in plan.chunks}
    assert names["stem.1.running_mean"] is False
    assert names["stem.1.num_batches_tracked"] is False
    assert names["stem.0.weight"] is True


def test_chunk_view_writes_through():
    t = torch.zeros(2, 5)
    plan = ShardingPlan.build([("t", t, True)], 1, chunk_bytes=12)  # 3 floats a chunk
    for c in plan.chunks:
        chunk_view(t, c).fill_(c.key + 1)
    assert t.flatten().tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4]


def test_the_layers_placement_gives_each_shard_one_contiguous_run_of_the_model():
    model = _resnet()
    for shards in (2, 4):
        plan = ShardingPlan.for_model(model, shards, 1 << 20, placement="layers")
        owners = [c.shard for c in plan.chunks]
        assert owners == sorted(owners) and set(owners) == set(range(shards))  # in model order
        load = plan.bytes_per_shard()
        biggest_chunk = max(c.nbytes for c in plan.chunks)
        assert max(load) - min(load) <= 2 * biggest_chunk  # a cut moves at most a chunk each
    size = ShardingPlan.for_model(model, 2, 1 << 20)
    layers = ShardingPlan.for_model(model, 2, 1 << 20, placement="layers")
    # the same chunks elsewhere: a shard seeded by one placement refuses the other's pushes
    assert [(c.name, c.offset) for c in size.chunks] == [(c.name, c.offset) for c in layers.chunks]
    assert size.fingerprint != layers.fingerprint


def test_the_size_placement_keeps_its_fingerprint():
    # shards checkpointed before placements existed must still accept their workers
    plan = ShardingPlan.build([("t", torch.zeros(10), True)], 1, chunk_bytes=12)
    assert plan.fingerprint == "0c0b072e66df1e8f"  # as computed before placements existed
