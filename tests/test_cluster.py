"""Mixed devices in the planner: `evenrl plan --nodes` (evenrl.planner.cluster), each device group's memory and
token cap (evenrl.planner.groups), the overlap section's per-side rates, and the records evenrl train gathers
(evenrl.distributed.devices, the probe in evenrl.distributed.ops) planned the same way. No subprocess."""

from __future__ import annotations

import json

import pytest
import torch

from evenrl.cli import main as cli_main
from evenrl.config import load_config
from evenrl.distributed.devices import Device, cpu_share, device_groups, host_memory_gib, model_of
from evenrl.errors import UsageError
from evenrl.planner.cluster import datasheet_weights, parse_nodes
from evenrl.planner.layout import make_layout
from evenrl.planner.plan import make_plan, render
from test_foreign import QWEN7B, config_only_model, ns, run
from test_plan import EXAMPLE

H100, A10 = Device("cuda", "H100", 80.0), Device("cuda", "A10", 24.0)
# a 7B model in bf16 over 16 ranks: the H100s fit 6 samples per micro-batch, the A10s not even one until the sharded
# state moves to the host; then they run one
SEVEN_B = ["model.dtype=bfloat16", "parallel.sharding=fsdp", "train.token_cap_per_micro_batch=9216",
           "data.prompts_per_step=64", "algo.minibatches_per_step=2"]


@pytest.fixture(scope="module")
def seven_b(tmp_path_factory):
    return str(config_only_model(tmp_path_factory.mktemp("m") / "qwen7b", QWEN7B))


def plan_7b(seven_b, overrides=(), nodes="8xH100-80,8xA10-24", **flags):
    cfg = load_config(EXAMPLE, [f"model.path={seven_b}", *SEVEN_B, *overrides])
    return make_plan(cfg, _nodes_layout(nodes, **flags))


def _nodes_layout(nodes, **flags):
    from evenrl.planner.layout import apply_layout_flags

    return apply_layout_flags(make_layout(), ns(nodes=nodes, **flags))


# ------------------------------------------------------------------------------------------ --nodes

@pytest.mark.parametrize("text, nnodes, per_node, labels", [
    ("8xH100-80,8xA10-24", 2, 8, ["8xH100-80", "8xA10-24"]),
    ("2*8xh100-80, 8xL4-24", 3, 8, ["16xH100-80", "8xL4-24"]),
    ("4xMI300X-192@520/3200", 1, 4, ["4xMI300X-192"]),
    ("2xcpu-8,2xcpu-2.5", 2, 2, ["2xcpu-8", "2xcpu-2.5"]),
])
def test_nodes_are_parsed_in_rank_order(text, nnodes, per_node, labels):
    n = parse_nodes(text)
    assert (n.nnodes, n.per_node, len(n.devices)) == (nnodes, per_node, nnodes * per_node)
    assert [g.label for g in device_groups(n.devices)] == labels
    if "@" in text:
        assert (n.devices[0].tflops, n.devices[0].gbps) == (520.0, 3200.0)


@pytest.mark.parametrize("text, match", [
    ("8xH100", "--nodes: got '8xH100'; need NODE"),
    ("H100-80", "need NODE"),
    ("8xH100-0", "memory of one device in GiB"),
    ("8xH100-80,4xA10-24", "every node needs the same number of devices"),
    ("2xcpu-8,2xH100-80", "one kind of device"),
    ("8xMI300X-192@0/1", "@TFLOPS/GBPS as two numbers"),
    ("0xH100-80", "1..100000 nodes of 1..1024 devices"),
    ("", "--nodes: got ''; need NODE"),  # was ignored: the plan ran on this machine instead
    ("100000*1024xH100-80", "need at most 100000 nodes and 131072 ranks"),  # checked before 102 M records are built
    ("9" * 5000 + "*8xH100-80", "1..100000 nodes of 1..1024 devices"),  # from the text: no int() of 5000 digits
    ("99999*1024xH100-80,99999*1024xH100-80", "131072 ranks"),
])
def test_bad_nodes_are_one_line(text, match, capsys):
    with pytest.raises(UsageError, match=match):
        parse_nodes(text)
    assert cli_main(["plan", EXAMPLE, "--nodes", text]) == 2
    err = capsys.readouterr().err
    assert match.split(";")[0] in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("weights", ["1e308,1e308", "1,nan", "1,inf", "0,1", "1e-9,1", ",".join(["1"] * 131_073)])
def test_capacity_weights_out_of_range_are_one_line_before_any_arithmetic(weights, capsys):
    assert cli_main(["plan", EXAMPLE, "--nproc-per-node", "2", f"--capacity-weights={weights}"]) == 2
    err = capsys.readouterr().err
    assert "--capacity-weights" in err and err.count("\n") == 1 and "Traceback" not in err and len(err) < 300
    with pytest.raises(UsageError, match="relative speeds in"):
        load_config(EXAMPLE, ["parallel.capacity_weights=[1.0e+308, 1.0e+308]"])


def test_an_unknown_gpu_model_in_nodes_is_a_warning(seven_b):
    found = {f.rule: f for f in plan_7b(seven_b, nodes="8xFOO-80").findings}
    assert "GPU model FOO" in found["unknown-gpu-model"].message and "8xFOO-80@TFLOPS/GBPS" in found[
        "unknown-gpu-model"].fix
    assert "unknown-gpu-model" not in {f.rule for f in plan_7b(seven_b, nodes="8xFOO-80@500/3000").findings}
    assert "unknown-gpu-model" not in {f.rule for f in plan_7b(seven_b).findings}


def test_lora_settings_without_a_rank_are_a_warning(seven_b):
    found = {f.rule: f for f in plan_7b(seven_b, ["model.lora.alpha=32", "model.lora.target_modules=[q_proj]"]
                                        ).findings}
    assert found["lora-off"].message.startswith("model.lora.alpha, model.lora.target_modules set, but model.lora."
                                                "rank is 0")
    assert "lora-off" not in {f.rule for f in plan_7b(seven_b).findings}


def test_nodes_replace_the_shape_flags_and_keep_the_rest(capsys):
    assert cli_main(["plan", EXAMPLE, "--nodes", "8xH100-80", "--nproc-per-node", "4"]) == 2
    assert "--nodes describes every node's devices; drop --nproc-per-node" in capsys.readouterr().err
    lay = _nodes_layout("8xH100-80,8xA10-24", rollout_devices=8, capacity_weights=(1.0,) * 8)
    assert (lay.world, lay.training_ranks, lay.device, lay.device_memory_gib, lay.source) == (16, 8, "cuda", 24.0,
                                                                                              "--nodes")
    assert [g.label for g in lay.training_groups()] == ["8xH100-80"] and lay.rollout_groups()[0].ranks[0] == 8
    assert "24-80 GiB" in lay.describe()
    d = lay.to_dict()["devices"]
    assert d[1] == {"ranks": list(range(8, 16)), "kind": "cuda", "model": "A10", "memory_gib": 24.0, "threads": 0,
                    "role": "rollout"}


def test_from_a_peers_config_on_described_nodes(tmp_path):
    from test_foreign import LOGIC_RL

    t, cfg, plan = run(tmp_path, "verl", LOGIC_RL, nodes="2xH100-80,2xA10-24")
    assert t.layout.world == 4 and t.layout.devices[3] == A10 and plan.layout.source == "--nodes"
    assert [g.group.label for g in plan.groups] == ["2xH100-80", "2xA10-24"]


# ------------------------------------------------------------------------------------------ memory per group

def test_two_nodes_80_and_24_gib_with_a_7b_model(seven_b, capsys):
    """The per-group memory table, the error naming the 24 GiB group with its fix, and --fit fitting both."""
    p = plan_7b(seven_b)
    h100, a10 = p.groups
    assert (h100.group.label, h100.token_cap, h100.fits) == ("8xH100-80", 9216, True)
    assert (a10.group.label, a10.lowered, a10.fits, a10.token_cap) == ("8xA10-24", True, False, 1536)
    over = [f for f in p.findings if f.rule == "memory-over"]
    assert len(over) == 1 and over[0].level == "error"
    assert "8xA10-24 (ranks 8-15)" in over[0].message and "even at 1,536 tokens (1 sample)" in over[0].message
    assert "parallel.cpu_offload=full (state on the host)" in over[0].fix and "(fits)" in over[0].fix
    text = render(p)
    assert "devices    ranks 0-7 H100-80 (cuda), token cap 9,216; ranks 8-15 A10-24 (cuda), token cap 1,536" in text
    assert "8xH100-80 (0-7)  80.0 GiB      9,216" in text and "DOES NOT FIT" in text
    assert "below: 8xA10-24, the group with the least memory" in text

    args = ["plan", EXAMPLE, f"model.path={seven_b}", *SEVEN_B, "--nodes", "8xH100-80,8xA10-24"]
    assert cli_main(args) == 1
    capsys.readouterr()
    assert cli_main(args + ["--fit", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    # tensor parallelism before offload (planner.fit's order): pairs of consecutive ranks, inside each group
    assert d["fit"]["changes"] == [{"key": "parallel.tensor_parallel_size", "from": 1, "to": 2}]
    fitted = d["fit"]["plan"]["ranks"]["device_groups"]
    assert [g["fits"] for g in fitted] == [True, True] and fitted[1]["lowered"]
    assert (fitted[0]["token_cap"], fitted[1]["token_cap"]) == (9216, 1536)
    assert d["layout"]["devices"][0]["model"] == "H100"
    fixes = [f["settings"] for f in d["ranks"]["device_groups"][1]["fixes"]]
    assert fixes[0] == {"parallel.tensor_parallel_size": 2} and {"parallel.cpu_offload": "full"} in fixes


def test_a_smaller_device_gets_fewer_rows_in_as_many_micro_steps(seven_b):
    p = plan_7b(seven_b, ["parallel.cpu_offload=full"])
    caps = p.token_caps
    assert caps == [9216] * 8 + [1536] * 8
    assert len({r.micro_steps for r in p.ranks}) == 1
    assert p.ranks[8].samples < p.ranks[0].samples
    note = [f for f in p.findings if f.rule == "token-cap-lowered"]
    assert note and "8xA10-24 (ranks 8-15) with 24.0 GiB runs at most" in note[0].message
    assert not any(f.rule == "imbalance" for f in p.findings)  # uneven on purpose


def test_one_kind_of_device_plans_as_before(seven_b):
    cfg = load_config(EXAMPLE, [f"model.path={seven_b}", *SEVEN_B])
    flags = make_plan(cfg, make_layout(2, 8, device="cuda", device_memory_gib=80))
    nodes = make_plan(cfg, _nodes_layout("2*8xH100-80"))
    assert len(nodes.groups) == 1 and nodes.token_caps is None
    assert nodes.memory.total_gib == flags.memory.total_gib and nodes.ranks == flags.ranks
    assert [f.rule for f in nodes.findings] == [f.rule for f in flags.findings]


def test_mixed_speeds_point_at_auto_and_auto_starts_from_the_datasheets(seven_b):
    p = plan_7b(seven_b, ["parallel.cpu_offload=full"])
    f = {f.rule: f for f in p.findings}["mixed-speeds"]
    assert "8xH100-80 (ranks 0-7) computes ~7.9x as fast as 8xA10-24 (ranks 8-15) in bfloat16" in f.message
    assert f.fix.startswith("parallel.capacity_weights=auto")
    auto = plan_7b(seven_b, ["parallel.cpu_offload=full", "parallel.capacity_weights=auto"])
    assert auto.weights == [1.0] * 8 + [0.13] * 8 and "mixed-speeds" not in {f.rule for f in auto.findings}
    assert auto.ranks[0].samples > p.ranks[0].samples  # the fast ranks take more
    assert datasheet_weights([H100, H100], "bfloat16") is None  # alike: equal
    assert datasheet_weights([H100, Device("cuda", "B300", 180.0)], "bfloat16") is None  # unknown: equal


def test_overlap_uses_each_sides_own_devices(seven_b):
    """Engines on the H100s and training on the A10s, and the reverse: generation is faster on the H100s."""
    big_gen = plan_7b(seven_b, ["rollout.max_staleness=1", "parallel.cpu_offload=full"], nodes="8xA10-24,8xH100-80",
                      rollout_devices=8)
    small_gen = plan_7b(seven_b, ["rollout.max_staleness=1", "parallel.cpu_offload=full"],
                        rollout_devices=8)
    a, b = big_gen.overlap.at, small_gen.overlap.at
    assert a.generation_s < b.generation_s and a.training_s > b.training_s
    assert b.generation_s / a.generation_s == pytest.approx(3350 / 600, rel=0.05)  # decode reads: bandwidth
    assert "each side at its own devices' rates" in " ".join(render(big_gen).split())
    same = plan_7b(seven_b, ["rollout.max_staleness=1", "parallel.cpu_offload=full"], nodes="2*8xH100-80",
                   rollout_devices=8)
    assert same.overlap.at.generation_s == pytest.approx(a.generation_s)


# ------------------------------------------------------------------------------------------ what train gathers

def test_the_probe_and_the_gathered_layout():
    from evenrl.distributed.ops import gather_devices, probe_device

    me = probe_device(torch.device("cpu"), 3)
    assert (me.kind, me.model, me.threads) == ("cpu", "cpu", torch.get_num_threads())
    assert me.memory_gib == pytest.approx(cpu_share(host_memory_gib(), 3))
    assert gather_devices(torch.device("cpu"), 1) == (probe_device(torch.device("cpu"), 1),)  # one process
    small = Device("cpu", "cpu", 0.5, 1)
    lay = make_layout(1, 3, device="cpu", device_memory_gib=me.memory_gib).with_devices((me, me, small))
    assert (lay.nnodes, lay.nproc_per_node, lay.device_memory_gib) == (1, 3, 0.5)
    assert [g.ranks for g in lay.training_groups()] == [(0, 1), (2,)]
    assert make_layout(1, 8).with_devices((me,)).world == 1  # one process where the machine has more devices
    assert model_of("NVIDIA A100-SXM4-80GB") == "A100" and model_of("NVIDIA A10") == "A10"
    assert model_of("NVIDIA L40S") == "L40S" and model_of("NVIDIA GeForce RTX 4090") == "GeForce_RTX_4090"


def test_host_memory_reads_a_lower_cgroup_limit(tmp_path):
    mem = tmp_path / "meminfo"
    mem.write_text("MemTotal:       16777216 kB\n")
    limit = tmp_path / "memory.max"
    limit.write_text(f"{4 * 1024**3}\n")
    assert host_memory_gib(str(mem), str(limit)) == 4.0
    limit.write_text("max\n")
    assert host_memory_gib(str(mem), str(limit)) == 16.0
