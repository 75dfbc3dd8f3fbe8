"""Checkpoints are atomic: a save that dies half-way leaves the previous checkpoint and `latest` intact; what they
hold (weights and optimizer moments) comes back exactly; a damaged or foreign one is a one-line error."""

import pickle

import pytest
import torch

from e2e import Saved
from evenrl.train import checkpoint
from evenrl.errors import RunStopped, UsageError


def load(path, model, optimizer, critic=None):
    """(step, the small state) of the checkpoint at `path`, loaded into `model` and `optimizer` (and the critic)."""
    state = Saved({"policy": (model, optimizer), **({"critic": critic} if critic else {})})
    return checkpoint.load(path, state), state.extra


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _trained(seed=0):
    m = _model(seed)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    return m, opt


def test_round_trip_and_pruning(tmp_path):
    m, opt = _trained()
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, Saved({"policy": (m, opt)}, {"n": step, "rng": checkpoint.rng_state()}, step=step),
                        keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000002", "step-000003"]
    other = _model(1)
    opt2 = torch.optim.AdamW(other.parameters(), lr=0.5)
    step, state = load(checkpoint.latest(tmp_path), other, opt2)
    assert step == 3 and state["n"] == 3
    for a, b in zip(m.parameters(), other.parameters()):
        assert torch.equal(a, b)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]  # hyper-parameters come back too
    for p, q in zip(m.parameters(), other.parameters()):
        s, t = opt.state[p], opt2.state[q]
        assert torch.equal(s["exp_avg"], t["exp_avg"]) and torch.equal(s["exp_avg_sq"], t["exp_avg_sq"])
        assert float(s["step"]) == float(t["step"]) == 1.0
    checkpoint.set_rng_state(state["rng"])


def test_an_optimizer_saved_before_its_first_step_stays_unstepped(tmp_path):
    """A checkpoint before the first optimizer step (rollout.partial: no group finished yet): DCP initialises the
    optimizer's state to save it (a zero step), which would make Adam's next step its second; the save leaves the
    optimizer as it was, and the resumed one is the same, so the next step is the first on both."""
    m = _model(0)
    opt = torch.optim.AdamW(m.parameters())
    checkpoint.save(tmp_path, Saved({"policy": (m, opt)}, step=1))
    assert not opt.state
    other = _model(1)
    opt2 = torch.optim.AdamW(other.parameters())
    load(checkpoint.latest(tmp_path), other, opt2)
    assert not opt2.state
    x = torch.randn(2, 4)
    for model, o in ((m, opt), (other, opt2)):
        model(x).sum().backward()
        o.step()
    for p, q in zip(m.parameters(), other.parameters()):
        assert torch.equal(p, q) and float(opt.state[p]["step"]) == float(opt2.state[q]["step"]) == 1.0


def test_a_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    m, opt = _trained()
    checkpoint.save(tmp_path, Saved({"policy": (m, opt)}, {"n": 1}, step=1))
    want = [p.detach().clone() for p in m.parameters()]
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)

    def dies(*a, **k):
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(checkpoint, "fsync_dir", dies)  # everything written but the rename into place
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, Saved({"policy": (m, opt)}, {"n": 2}, step=2))
    monkeypatch.undo()
    assert any(p.name.startswith(".tmp-step-000002") for p in tmp_path.iterdir())  # it did die half-way
    found = checkpoint.latest(tmp_path)
    assert found.name == "step-000001"
    fresh, fresh_opt = _trained(5)
    step, state = load(found, fresh, fresh_opt)
    assert step == 1 and state["n"] == 1
    assert all(torch.equal(a, b) for a, b in zip(want, fresh.parameters()))
    assert not (tmp_path / "step-000002").exists()


def test_a_crash_inside_the_sharded_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    m, opt = _trained()
    checkpoint.save(tmp_path, Saved({"policy": (m, opt)}, {"n": 1}, step=1))

    def dies(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", dies)  # DCP writes each tensor with torch.save
    with pytest.raises(RunStopped, match="step-000002.*disk full.*previous checkpoint stays"):
        checkpoint.save(tmp_path, Saved({"policy": (m, opt)}, {"n": 2}, step=2))
    monkeypatch.undo()
    assert checkpoint.latest(tmp_path).name == "step-000001"
    assert load(checkpoint.latest(tmp_path), m, opt)[0] == 1


def test_corrupt_checkpoint_is_a_one_line_error(tmp_path):
    m, opt = _trained()
    path = checkpoint.save(tmp_path, Saved({"policy": (m, opt)}, {}, step=1))
    (path / "state" / ".metadata").write_bytes(b"not a checkpoint index")
    with pytest.raises(UsageError, match="unreadable checkpoint") as e:
        load(path, m, opt)
    assert "\n" not in str(e.value)


def test_an_index_that_would_run_code_is_refused(tmp_path):
    """DCP's index is a pickle; ours is read by an unpickler that builds only DCP's metadata records."""
    m, opt = _trained()
    path = checkpoint.save(tmp_path, Saved({"policy": (m, opt)}, {}, step=1))

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (path / "state" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(UsageError, match="refused checkpoint index.*builtins.print"):
        load(path, m, opt)


def test_other_model_is_refused(tmp_path):
    m, opt = _trained()
    checkpoint.save(tmp_path, Saved({"policy": (m, opt)}, {}, step=1))
    other = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
    with pytest.raises(UsageError, match="does not match"):
        load(checkpoint.latest(tmp_path), other, torch.optim.AdamW(other.parameters()))


def test_extra_models_are_saved_and_restored_by_name(tmp_path):
    policy, critic = _model(0), _model(1)
    popt, copt = torch.optim.AdamW(policy.parameters()), torch.optim.AdamW(critic.parameters(), lr=0.5)
    critic(torch.randn(2, 4)).sum().backward()
    copt.step()
    path = checkpoint.save(tmp_path, Saved({"policy": (policy, popt), "critic": (critic, copt)}, {"n": 3}, step=3))
    assert (tmp_path / "latest").read_text().strip() == "step-000003"
    p2, c2 = _model(2), _model(3)
    popt2, copt2 = torch.optim.AdamW(p2.parameters()), torch.optim.AdamW(c2.parameters())
    step, _ = load(path, p2, popt2, critic=(c2, copt2))
    assert step == 3
    assert all(torch.equal(a, b) for a, b in zip(c2.parameters(), critic.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(p2.parameters(), policy.parameters()))
    assert copt2.param_groups[0]["lr"] == 0.5
    moments = [copt.state[p]["exp_avg"] for p in critic.parameters()]
    assert all(torch.equal(copt2.state[q]["exp_avg"], m) for q, m in zip(c2.parameters(), moments))
    plain = checkpoint.save(tmp_path, Saved({"policy": (policy, popt)}, {"n": 4}, step=4))
    with pytest.raises(UsageError, match="holds no critic"):
        load(plain, p2, popt2, critic=(c2, copt2))


def test_a_kill_while_pruning_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    """kill -9 while step-000001 is pruned (keep 2, just after step-000003 was saved): no step-000001/ that holds
    state/ without meta.json or trainer.pt is left to look like a checkpoint; the next start clears what is left,
    and debris of an older prune (a step directory missing either file) is never the resume point."""
    import shutil

    from evenrl.train import rundir

    run = tmp_path / "run"
    m, opt = _trained()

    def save(step):
        checkpoint.save(run / "checkpoints", Saved({"policy": (m, opt)}, {"n": step}, step=step), keep=2)

    save(1)
    save(2)

    def killed(path, *args, **kwargs):  # rmtree gets as far as the small files, then the process dies
        for name in ("meta.json", "trainer.pt"):
            (path / name).unlink()
        raise KeyboardInterrupt("kill -9")

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        save(3)
    monkeypatch.undo()
    ckpts = run / "checkpoints"
    assert not (ckpts / "step-000001").exists()
    assert checkpoint.latest(ckpts).name == "step-000003"
    for name, keep in (("step-000004", "meta.json"), ("step-000005", "trainer.pt")):  # an older version's debris
        shutil.copytree(ckpts / "step-000003", ckpts / name)
        for f in ("meta.json", "trainer.pt"):
            if f != keep:
                (ckpts / name / f).unlink()
    (ckpts / "latest").write_text("step-000005\n")
    assert checkpoint.latest(ckpts).name == "step-000003"
    rundir.prepare(run, overwrite=False)
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-000002", "step-000003"]
