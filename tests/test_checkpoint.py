"""Checkpoints are atomic: a save that dies half-way leaves the previous checkpoint and `latest` intact."""

import pytest
import torch

from evenrl.train import checkpoint
from evenrl.errors import UsageError


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def test_round_trip_and_pruning(tmp_path):
    m = _model(0)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, model=m, trainer_state={"optimizer": opt.state_dict(), "n": step,
                                                                  "rng": checkpoint.rng_state()}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000002", "step-000003"]
    other = _model(1)
    step, state = checkpoint.load(checkpoint.latest(tmp_path), other)
    assert step == 3 and state["n"] == 3
    for a, b in zip(m.parameters(), other.parameters()):
        assert torch.equal(a, b)
    opt2 = torch.optim.AdamW(other.parameters())
    opt2.load_state_dict(state["optimizer"])
    checkpoint.set_rng_state(state["rng"])


def test_a_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    m = _model(0)
    checkpoint.save(tmp_path, 1, model=m, trainer_state={"n": 1})
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)

    def dies(*a, **k):
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(checkpoint.torch, "save", dies)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 2, model=m, trainer_state={"n": 2})
    monkeypatch.undo()
    found = checkpoint.latest(tmp_path)
    assert found.name == "step-000001"
    fresh = _model(0)
    step, state = checkpoint.load(found, fresh)
    assert step == 1 and state == {"n": 1}
    assert not (tmp_path / "step-000002").exists()


def test_corrupt_checkpoint_is_a_one_line_error(tmp_path):
    m = _model(0)
    path = checkpoint.save(tmp_path, 1, model=m, trainer_state={})
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UsageError, match="unreadable checkpoint"):
        checkpoint.load(path, m)


def test_other_model_is_refused(tmp_path):
    checkpoint.save(tmp_path, 1, model=_model(0), trainer_state={})
    with pytest.raises(UsageError, match="does not match"):
        checkpoint.load(checkpoint.latest(tmp_path), torch.nn.Linear(4, 3))
