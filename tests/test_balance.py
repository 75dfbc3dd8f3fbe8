"""Where rows run on mixed devices, at run time (evenrl.train.balance): the plan's token caps and weights, and what a
checkpoint keeps of auto's measured weights. The measuring itself runs in tests/test_heterogeneous.py."""

from __future__ import annotations

from evenrl.config import load_config


def test_balance_state_follows_the_ranks(monkeypatch):
    from evenrl.distributed import collectives as dist
    from evenrl.distributed.mesh import Mesh
    from evenrl.train.balance import Balance, make_balance

    class P:
        weights, token_caps = [1.0, 0.5], [80, 40]

    cfg = load_config(None, ["parallel.capacity_weights=auto"])
    monkeypatch.setattr(dist, "world", lambda: 2)
    auto = Mesh(capacity_mode="auto")  # what the mesh states for the config (dist.from_config)
    b = make_balance(auto, P, colocated=True)
    assert (b.auto, b.measured, b.update, b.rollout, b.token_cap(cfg, 1), b.schedule_caps(cfg)) == (
        True, True, [1.0, 0.5], [1.0, 0.5], 40, [80, 40])
    fresh = make_balance(auto, P, colocated=True)
    fresh.load_state_dict({"update": [0.25, 1.0], "rollout": [1.0, 0.75]})
    assert (fresh.update, fresh.rollout) == ([0.25, 1.0], [1.0, 0.75])
    fresh.load_state_dict({"update": [1.0, 1.0, 1.0], "rollout": None})  # saved on 3 ranks: the plan's stay
    assert fresh.update == [0.25, 1.0]
    reserved = make_balance(auto, P, colocated=False)
    assert reserved.rollout is None  # the rollout ranks split by the configured weights alone
    fixed = make_balance(Mesh(capacity=[1.0, 2.0], capacity_mode="fixed"), P, colocated=False)
    assert (fixed.auto, fixed.measured, fixed.rollout) == (False, True, [1.0, 2.0])
    assert not make_balance(Mesh(), P, colocated=True).measured  # no weights: nothing measured, no collective
    fixed.load_state_dict({"update": [9.0, 9.0]})
    assert fixed.update == [1.0, 0.5]  # only auto restores measured weights
    assert Balance().schedule_caps(cfg) == cfg.train.token_cap_per_micro_batch



def test_the_mesh_states_the_capacity_mode():
    """parallel.capacity_weights is read once, where the mesh is built (one process here: no group joined)."""
    from evenrl.distributed import mesh

    got = []
    for value in ("auto", "[1, 2]", "null"):
        try:
            m = mesh.from_config(load_config(None, [f"parallel.capacity_weights={value}"]))
            got.append((m.capacity_mode, m.capacity))
        finally:
            mesh.shutdown()
    assert got == [("auto", None), ("fixed", [1.0, 2.0]), ("none", None)]

def test_report_plots_the_weights(tmp_path):
    import json

    from evenrl.report import write_plots

    rows = [{"step": s, "reward/mean": 0.5, "load/rank_tokens": [10, 5], "load/capacity_weight/0": 1.0,
             "load/capacity_weight/1": w, **({"devices": [{"ranks": [0, 1], "device": "cpu-8 (1 thread)"}]}
                                              if s == 1 else {})} for s, w in ((1, 1.0), (2, 0.6), (3, 0.5))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert {p.name for p in write_plots(tmp_path)} >= {"capacity.png", "reward.png", "rank_load.png"}
