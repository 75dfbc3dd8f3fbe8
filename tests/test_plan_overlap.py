"""The planner's overlap section (evenrl.planner.timing): the step-time model against hand computations, the best
split, the findings of rollout.max_staleness at their boundaries, --json / the CLI / --fit, and the peers' async
and importance-sampling keys. No torch."""

import json
import math
from dataclasses import replace

import pytest
from evenrl.cli import main as cli_main
from evenrl.config import load_config
from evenrl.planner.fit import fit
from evenrl.planner.layout import make_layout
from evenrl.planner.dims import dims_from_config
from evenrl.planner.plan import make_plan, render
from evenrl.planner.rules import rule_overlap
from evenrl.planner.timing import (Overlap, RateFlags, Rates, StepTime, assumed_rates, estimate_overlap,
                                   step_time)
from test_foreign import QWEN7B, config_only_model, run
from test_plan import BASE, TINY, make, rules

# TINY by hand: per layer q 64x64 + k 64x32 + v 64x32 + o 64x64 = 12,288, MLP 3 x 64x128 = 24,576, 2 norms 128;
# untied embeddings 2 x 100x64 = 12,800, final norm 64. All 86,848; the matmul weights leave out the norms
# (2 x 128 + 64) and the input embedding (6,400): 80,128.
N, P = 80_128, 86_848
RATES = Rates(tflops=1.0, gbps=1.0, link_gbps=2.0, floor_s=0.0, basis="test")


def test_dims_match_the_hand_count():
    d = dims_from_config(TINY)
    assert (d.linear_params, d.params) == (N, P)


def test_step_time_against_hand_computation():
    """8 prompts x 4 samples, prompt 64 + new 64, fp32, 4 ranks as 1 rollout + 3 training, 1 TFLOP/s, 1 GB/s."""
    cfg = load_config(None, BASE)
    s = step_time(cfg, dims_from_config(TINY), [32], world=4, rollout=1, rates=RATES)
    # generation: all 32 samples on the one replica, 8 prompts prefilled once each
    assert s.samples_per_replica == 32
    prefill = max(2 * N * 8 * 64 / 1e12, 4 * N / 1e9)  # memory-bound: reading the weights once
    assert s.prefill_s == pytest.approx(prefill) and prefill == 4 * N / 1e9
    kv = 32 * (64 + 64 / 2) * 2 * 2 * 2 * 16 * 4  # samples x mean context x layers x (k, v) x kv heads x dim x fp32
    assert s.decode_s == pytest.approx(64 * (4 * N + kv) / 1e9)
    # training: ceil(32 / 3) = 11 rows of 128 tokens on the busiest rank, forward + backward = 3 passes
    assert s.training_tokens == 11 * 128
    assert s.training_s == pytest.approx(2 * N * 11 * 128 * 3 / 1e12)
    assert s.push_s == pytest.approx(4 * P / 2e9)
    assert s.sync_s == pytest.approx(s.generation_s + s.push_s + s.training_s)
    assert s.overlapped_s == pytest.approx(max(s.generation_s, s.training_s) + s.push_s)
    assert s.saved_s == pytest.approx(min(s.generation_s, s.training_s))


def test_passes_and_the_latency_floor():
    cfg = load_config(None, BASE + ["algo.minibatches_per_step=2", "algo.kl_coef=0.1", "algo.advantage=gae",
                                    "model.gradient_checkpointing=true", "algo.epochs_per_step=2"])
    ov = estimate_overlap(cfg, make_layout(1, 4, rollout_devices=1), dims_from_config(TINY), [16, 16], RATES)
    # update (3 + 1 recompute) x 2 epochs = 8; old log-probs 1; reference 1; critic values 1 + its update 8
    assert ov.passes == {"update": 8, "old log-probs": 1, "reference": 1, "critic": 9}
    assert ov.at.training_tokens == 2 * math.ceil(16 / 3) * 128
    assert ov.at.training_s == pytest.approx(2 * N * ov.at.training_tokens * 19 / 1e12)
    floored = step_time(load_config(None, BASE), dims_from_config(TINY), [32], 4, 1, replace(RATES, floor_s=0.01))
    assert floored.training_s == pytest.approx(2 * 3 * 0.01)  # 11 rows, 8 per micro-batch: 2 micro-steps x 3
    assert floored.decode_s == pytest.approx(64 * max(0.01, (4 * N + 32 * 96 * 512) / 1e9))


def test_best_split_is_the_argmin_of_the_overlapped_step():
    cfg = load_config(None, ["data.prompts_per_step=64", "rollout.samples_per_prompt=8", "model.dtype=bfloat16",
                             "data.max_prompt_tokens=512", "rollout.max_new_tokens=1024",
                             "train.token_cap_per_micro_batch=16384"])
    dims, lay = dims_from_config(QWEN7B), make_layout(2, 8, device="cuda", rollout_devices=4)
    rates = assumed_rates(lay, "bfloat16")
    ov = estimate_overlap(cfg, lay, dims, [512], rates)
    every = [step_time(cfg, dims, [512], 16, r, rates) for r in range(1, 16)]
    assert ov.best.overlapped_s == min(s.overlapped_s for s in every)
    r = ov.best.rollout_devices
    assert 1 < r < 15  # interior: fewer replicas make generation the longer side, more make training
    assert every[r - 2].generation_s > every[r - 2].training_s or every[r - 2].overlapped_s > ov.best.overlapped_s
    assert ov.at.rollout_devices == 4 and ov.at.training_ranks == 12
    # gen falls and training rises with R
    gens, trains = [s.generation_s for s in every], [s.training_s for s in every]
    assert gens == sorted(gens, reverse=True) and trains == sorted(trains)


def test_best_split_search_stops_at_one_sample_per_replica_and_ties_go_to_fewer():
    cfg = load_config(None, ["data.prompts_per_step=1", "rollout.samples_per_prompt=2"])
    ov = estimate_overlap(cfg, make_layout(1, 8, rollout_devices=1), dims_from_config(TINY), [2],
                          replace(RATES, floor_s=1.0))  # every part at the floor: all splits tie
    assert ov.best.rollout_devices == 1
    assert estimate_overlap(cfg, make_layout(1, 1), dims_from_config(TINY), [2], RATES) is None  # nothing to split


def test_cpu_processes_share_the_cores_and_flags_are_taken_as_given():
    lay = make_layout(1, 4, device="cpu")
    one = assumed_rates(make_layout(1, 2, device="cpu"), "float32", cpus=2)
    four = assumed_rates(lay, "float32", cpus=2)
    assert (one.tflops, one.gbps, one.floor_s) == (0.04, 10.0, 0.005)
    assert (four.tflops, four.gbps, four.floor_s) == pytest.approx((0.02, 5.0, 0.01))
    assert "2 cores shared by 4 processes" in four.basis
    told = assumed_rates(lay, "float32", RateFlags(tflops=3.0, link_gbps=7.0), cpus=2)
    assert (told.tflops, told.gbps, told.link_gbps) == (3.0, 5.0, 7.0)
    assert "--device-tflops, --link-gbps as given" in told.basis
    assert assumed_rates(make_layout(2, 8, device="cuda"), "bfloat16").link_gbps == 25.0  # across nodes
    assert assumed_rates(make_layout(1, 8, device="cuda"), "float32").tflops == 27.0


# ------------------------------------------------------------------------------------------ findings

def test_staleness_needs_reserved_devices():
    p = make(["rollout.max_staleness=1"], TINY)
    found = rules(p)
    f = found["staleness-needs-reserved"]
    assert f.level == "error" and "rollout.max_staleness=1" in f.message
    # the fix's best R: the overlap section's one line when none is reserved
    best = p.overlap.best.rollout_devices
    assert p.overlap.at is None and "best split" in render(p) and f"--rollout-devices {best}:" in render(p)
    assert "--rollout-devices" in f.fix and "parallel.rollout_devices=" in f.fix and "rollout.max_staleness=0" in f.fix
    assert "staleness-needs-reserved" not in rules(make([], TINY))  # k = 0: synchronous, nothing to reserve
    assert "staleness-needs-reserved" not in rules(make(["rollout.max_staleness=1"], TINY, rollout_devices=1))
    assert "staleness-needs-reserved" not in rules(make(["rollout.max_staleness=1", "parallel.rollout_devices=1"],
                                                         TINY))  # the config's field counts as the flag does
    alone = rules(make(["rollout.max_staleness=1"], nproc_per_node=1))["staleness-needs-reserved"]
    assert "at least 2 processes" in alone.fix  # the table's row (evenrl.config.compatibility), one fix for all


def test_reserved_filter_groups_is_refused_by_the_plan():
    f = rules(make(["algo.filter_groups=true"], rollout_devices=1))["reserved-filter-groups"]
    assert f.level == "error" and "one generation round per step" in f.message
    assert "--rollout-devices 0" in f.fix and "algo.filter_groups=false" in f.fix
    assert "reserved-filter-groups" not in rules(make(["algo.filter_groups=true"]))
    assert "reserved-filter-groups" not in rules(make([], rollout_devices=1))
    assert "reserved-filter-groups" in rules(make(["algo.filter_groups=true", "parallel.rollout_devices=1"]))


def _with_times(gen: float, train: float, push: float = 0.0, best_r: int = 2):
    """A reserved plan (1 of 4 ranks, max_staleness=1) whose estimate is set by hand."""
    p = make(["rollout.max_staleness=1"], TINY, rollout_devices=1)
    at = StepTime(1, 3, 32, 0.0, gen, 1000, train, push)
    best = StepTime(best_r, 4 - best_r, 16, 0.0, gen / 2, 1000, train * 1.5, push)
    p.overlap = Overlap(p.overlap.rates, {"update": 3}, at, best, 1, 0.5)
    return p


@pytest.mark.parametrize("gen, train, fires", [(10.0, 1.0, True), (9.0, 1.0, False), (1.0, 9.0, False),
                                               (1.0, 10.0, True), (1.0, 1.0, False)])
def test_overlap_no_gain_at_the_10_percent_boundary(gen, train, fires):
    """Saved = min(gen, train) of sync = gen + train: 1/11 = 9.1% fires, 1/10 = 10% does not."""
    found = {f.rule: f for f in rule_overlap(_with_times(gen, train))}
    assert ("overlap-no-gain" in found) == fires
    if fires:
        f = found["overlap-no-gain"]
        side = "generation dominates" if gen > train else "training dominates"
        assert f.level == "warning" and side in f.message and "9%" in f.message
        assert "rollout.max_staleness=0" in f.fix
        best = _with_times(gen, train).overlap.best
        assert ("--rollout-devices 2" in f.fix) == (best.overlapped_s < 0.95 * (max(gen, train)))


def test_overlap_no_gain_counts_the_push():
    assert "overlap-no-gain" in {f.rule for f in rule_overlap(_with_times(1.0, 1.0, push=9.0))}  # 1 of 11


def test_off_policy_note_and_the_synchronous_note():
    p = make(["rollout.max_staleness=2"], TINY, rollout_devices=1)
    f = rules(p)["off-policy-overlap"]
    assert f.level == "note" and "up to 2 steps off-policy" in f.message and "importance_correction=stale" in f.message
    gib = 2 * 4 * P / 1024**3
    assert f"2 earlier weight versions in float32 (+{gib * 1024:.3g} MiB per checkpoint)" in f.message
    assert "rollout-reserved" not in rules(p)  # no longer synchronous
    none = rules(make(["rollout.max_staleness=1", "algo.importance_correction=none"], TINY, rollout_devices=1))
    assert "not corrected" in none["off-policy-overlap"].message
    assert none["off-policy-overlap"].fix == "algo.importance_correction=stale"
    assert "off-policy-overlap" not in rules(make([], TINY, rollout_devices=1))
    sync = rules(make([], TINY, rollout_devices=1))["rollout-reserved"]
    assert "rollout.max_staleness=1" in sync.fix
    no_dims = rules(make(["rollout.max_staleness=1"], rollout_devices=1))["off-policy-overlap"]
    assert "GiB" not in no_dims.message and "MiB" not in no_dims.message  # no model: no size


@pytest.mark.parametrize("overrides, layout, kept", [
    (["rollout.max_staleness=1"], {}, "rollout.max_staleness"),
    (["algo.filter_groups=true"], {"rollout_devices": 1}, "algo.filter_groups"),
    (["algo.filter_groups=true", "rollout.max_staleness=1"], {"rollout_devices": 1}, "algo.filter_groups"),
])
def test_fit_keeps_staleness_and_dynamic_sampling_and_their_errors(overrides, layout, kept):
    """Staleness without reserved rollout devices, dynamic sampling with them: the experiment's choices. --fit
    changes neither; the refusal stays in the fitted plan with its own fix (the layout, or the setting)."""
    p = make(overrides, TINY, **layout)
    assert not p.runnable
    cfg, changes = fit(p)
    again = make_plan(cfg, p.layout, model_config=TINY)
    assert not again.runnable and kept not in {k for k, _, _ in changes}
    assert {f.rule for f in again.findings if f.level == "error"} == {f.rule for f in p.findings if f.level == "error"}


# ------------------------------------------------------------------------------------------ output

def test_render_and_json_have_the_section():
    p = make(["rollout.max_staleness=1"], TINY, rollout_devices=1)
    text = render(p)
    for part in ("overlap    estimates at assumed rates", "generation", "training", "weight push",
                 "overlapped (max_staleness=1)", "idle time removed per step", "best split",
                 "--device-tflops, --device-gbps, --link-gbps"):
        assert part in text, (part, text)
    assert max(map(len, text.splitlines())) <= 120
    d = p.to_dict()["overlap"]
    assert d["estimate"] is True and d["max_staleness"] == 1
    assert {"device_tflops", "device_gbps", "link_gbps", "forward_floor_s", "basis"} == set(d["rates"])
    split = {"rollout_devices", "training_ranks", "samples_per_replica", "training_tokens_per_rank", "generation_s",
             "prefill_s", "decode_s", "training_s", "push_s", "sync_step_s", "overlapped_step_s", "saved_s"}
    assert set(d["planned"]) == split == set(d["best_split"])
    assert d["step_s"] == d["planned"]["overlapped_step_s"]
    sync = make([], TINY, rollout_devices=1)
    assert "synchronous = generation + push + training" in render(sync)
    assert sync.to_dict()["overlap"]["step_s"] == sync.to_dict()["overlap"]["planned"]["sync_step_s"]
    assert make(["rollout.max_staleness=1"], TINY).to_dict()["overlap"] is None  # nothing reserved: no section
    json.dumps(p.to_dict())


def test_cli_prints_the_section_with_the_rates_given(tmp_path, capsys):
    model = config_only_model(tmp_path / "m", TINY)
    (tmp_path / "c.yaml").write_text("{}\n")
    args = ["plan", str(tmp_path / "c.yaml"), "--nproc-per-node", "4", "--rollout-devices", "1", "--device", "cuda",
            "--device-memory-gib", "80", "rollout.max_staleness=1", f"model.path={model}", *BASE,
            "--device-tflops", "100", "--device-gbps", "1000", "--link-gbps", "50"]
    cli_main(args)
    out = capsys.readouterr().out
    assert "overlap    estimates at assumed rates: 100 TFLOP/s, 1,000 GB/s per device, push 50 GB/s" in out
    assert "--device-tflops, --device-gbps, --link-gbps as given" in out
    cli_main(args + ["--json"])
    d = json.loads(capsys.readouterr().out)["overlap"]
    assert d["rates"]["device_tflops"] == 100 and d["planned"]["rollout_devices"] == 1
    assert cli_main(args + ["--device-tflops", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device-tflops" in err


# ------------------------------------------------------------------------------------------ peers

VERL = {"data": {"train_batch_size": 64, "max_prompt_length": 512, "max_response_length": 1024},
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 16, "ppo_micro_batch_size_per_gpu": 4},
                              "rollout": {"n": 8, "log_prob_micro_batch_size_per_gpu": 4}},
        "algorithm": {"adv_estimator": "grpo"}, "trainer": {"nnodes": 1, "n_gpus_per_node": 4}}


def _verl(**extra):
    cfg = json.loads(json.dumps(VERL))
    for key, value in extra.items():
        node = cfg
        *path, last = key.split("__")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return cfg


def test_verl_one_step_off_reserves_its_rollout_gpus(tmp_path):
    t, cfg, plan = run(tmp_path, "verl", _verl(rollout__nnodes=1, rollout__n_gpus_per_node=2))
    assert (t.layout.world, t.layout.rollout_devices, t.layout.training_ranks) == (6, 2, 4)
    assert cfg.rollout.max_staleness == 1 and any("one_step_off_policy" in n for n in t.notes)
    assert not t.checks and "staleness-needs-reserved" not in rules(plan)
    plain, cfg0, _ = run(tmp_path, "verl", VERL)
    assert plain.layout.rollout_devices == 0 and cfg0.rollout.max_staleness == 0


@pytest.mark.parametrize("threshold, k", [(0.1, 1), (1.0, 1), (1.5, 2), (0, 0)])
def test_verl_fully_async_staleness(tmp_path, threshold, k):
    t, cfg, _ = run(tmp_path, "verl", _verl(rollout__n_gpus_per_node=4,
                                            async_training__staleness_threshold=threshold))
    assert cfg.rollout.max_staleness == k and t.layout.rollout_devices == 4
    assert any("staleness_threshold" in n and "share of samples" in n for n in t.notes)
    assert any("trigger_parameter_sync_step=4" in n for n in t.notes)  # verl's default: a push every 4 updates


@pytest.mark.parametrize("extra, cap, note", [
    ({"actor_rollout_ref__actor__tis_imp_ratio_cap": 2.0}, 2.0, None),
    ({"algorithm__rollout_is": True, "algorithm__rollout_is_threshold": 3.0}, 3.0, None),
    ({"algorithm__rollout_is": True, "algorithm__rollout_is_threshold": 3.0, "algorithm__rollout_is_level": "sequence"},
     3.0, None),
    ({"algorithm__rollout_correction__rollout_is": "token", "algorithm__rollout_correction__rollout_is_threshold": 5.0},
     5.0, None),
])
def test_verl_truncated_importance_sampling(tmp_path, extra, cap, note):
    t, cfg, _ = run(tmp_path, "verl", _verl(**extra))
    assert (cfg.algo.importance_correction, cfg.algo.importance_cap) == ("all", cap)
    assert any(note in n for n in t.notes) if note else not any("importance_cap" in n for n in t.notes)
    level = extra.get("algorithm__rollout_is_level", extra.get("algorithm__rollout_correction__rollout_is", "token"))
    assert cfg.algo.importance_level == level  # verl's level is evenrl's, no longer a note


def test_verl_without_importance_sampling_keeps_the_defaults(tmp_path):
    for extra in ({}, {"actor_rollout_ref__actor__tis_imp_ratio_cap": -1},
                  {"algorithm__rollout_is": False, "algorithm__rollout_is_threshold": 2.0}):
        _, cfg, _ = run(tmp_path, "verl", _verl(**extra))
        assert (cfg.algo.importance_correction, cfg.algo.importance_cap) == ("stale", 2.0)


def test_openrlhf_async_and_importance_correction(tmp_path):
    text = ("python3 -m openrlhf.cli.train_ppo_ray --actor_num_gpus_per_node 4 --vllm_num_engines 2 "
            "--colocate_all_models --async_train --async_queue_size 2 --enable_vllm_is_correction "
            "--vllm_is_truncated_threshold 0.5 5.0 --rollout_batch_size 16 --n_samples_per_prompt 4 "
            "--train_batch_size 64 --micro_train_batch_size 2 --advantage_estimator group_norm\n")
    t, cfg, plan = run(tmp_path, "openrlhf", text)
    assert t.layout.rollout_devices == 2  # async: the engines get their own GPUs even with colocate_all_models
    assert cfg.rollout.max_staleness == 2 and any("async_queue_size=2" in n for n in t.notes)
    assert (cfg.algo.importance_correction, cfg.algo.importance_cap) == ("all", 5.0)
    assert cfg.algo.importance_floor == 0.5  # the lower bound of [0.5, 5.0]
    assert "staleness-needs-reserved" not in rules(plan)
    nested = {"train": {"async_enable": True, "async_queue_size": 3}, "vllm": {"num_engines": 1},
              "algo": {"advantage": {"is_correction_enable": True, "is_correction_threshold": [0.5, 4.0],
                                     "is_correction_type": "icepop"}}}
    t2, cfg2, _ = run(tmp_path, "openrlhf", nested)
    assert cfg2.rollout.max_staleness == 3 and cfg2.algo.importance_cap == 4.0
    assert (cfg2.algo.importance_mode, cfg2.algo.importance_floor) == ("mask", 0.5)  # icepop masks outside [0.5, 4]
    old, cfg3, _ = run(tmp_path, "openrlhf", {"enable_vllm_is_correction": True, "vllm_is_truncated_threshold": 2})
    assert (cfg3.algo.importance_cap, cfg3.rollout.max_staleness) == (2.0, 0)
    sync, cfg4, _ = run(tmp_path, "openrlhf", {"colocate_all_models": True, "vllm_num_engines": 2})
    assert sync.layout.rollout_devices == 0 and cfg4.rollout.max_staleness == 0


def test_parse_flags_takes_two_values():
    from evenrl.planner.peers import parse_flags

    assert parse_flags("--t 0.5 5.0 --a 1 --b") == {"t": [0.5, 5.0], "a": 1, "b": True}

