"""Files written whole (checkpoints, the trained model, summary.json, ready files): a reader
never sees half of one, and two writers of one path (two workers started by hand with one run
dir each save the shards' model there) never trip over each other's aside file."""

import json
import multiprocessing
import pickle

import pytest
import torch

from wavelet.common.records import save_whole, write_text_whole

ROUNDS = 200


def _write_often(folder, who: int) -> None:
    for i in range(ROUNDS):
        save_whole({"w": torch.full((64,), float(who)), "i": i}, folder / "model.pt")
        write_text_whole(folder / "summary.json", json.dumps({"writer": who, "i": i}))


@pytest.mark.timeout(120)
def test_two_processes_writing_one_file_whole_both_finish_and_leave_one_whole_file(tmp_path):
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_write_often, args=(tmp_path, who)) for who in (1, 2)]
    for p in writers:
        p.start()
    for p in writers:
        p.join(timeout=100)
    assert [p.exitcode for p in writers] == [0, 0]  # before: FileNotFoundError on the rename
    model = torch.load(tmp_path / "model.pt")
    assert model["i"] == ROUNDS - 1 and model["w"].unique().numel() == 1
    assert json.loads((tmp_path / "summary.json").read_text())["i"] == ROUNDS - 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "summary.json"]


def test_a_write_that_fails_leaves_the_old_file_and_no_aside_file(tmp_path):
    path = tmp_path / "summary.json"
    write_text_whole(path, "old")
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError)):
        save_whole(lambda: None, path)  # a lambda cannot be pickled: fails mid-write
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]
