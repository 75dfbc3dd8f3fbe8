"""Cluster layout: flags, torchrun/Slurm environment (evenrl.distributed.env, shared with collectives.init and the
launcher), local detection (nvidia-smi faked), validation, and the launcher's worker check."""

import argparse
import os
import re
import subprocess

import pytest

from evenrl.distributed.env import LaunchEnv, first_host, read_env, tasks_per_node
from evenrl.errors import UsageError
from evenrl.planner.layout import (Layout, add_layout_args, detect_local, host_memory_gib, layout_from_args,
                                   layout_from_env, local_gpus, make_layout)
from evenrl.train import launch


def parse(*argv):
    p = argparse.ArgumentParser()
    add_layout_args(p)
    return p.parse_args(list(argv))


def fake_smi(stdout="81920\n81920\n40960\n", rc=0):
    def run(cmd, **kw):
        assert cmd[0] == "nvidia-smi" and kw["timeout"] <= 5
        return subprocess.CompletedProcess(cmd, rc, stdout=stdout, stderr="")
    return run


def no_smi(cmd, **kw):
    raise FileNotFoundError(cmd[0])


def test_counts():
    lay = make_layout(2, 4, device="cuda", device_memory_gib=80, rollout_devices=1)
    assert (lay.world, lay.training_ranks) == (8, 7)
    assert "2 nodes x 4 cuda" in lay.describe() and "7 training, 1 reserved for rollout" in lay.describe()
    d = lay.to_dict()
    assert d["world"] == 8 and d["training_ranks"] == 7 and d["capacity_weights"] is None


def test_capacity_weights_shown_as_runs():
    lay = make_layout(1, 4, capacity_weights=[1, 1, 2, 2])
    assert "capacity weights 1x2,2x2" in lay.describe()


@pytest.mark.parametrize("kwargs, field", [
    (dict(nnodes=0), "--nnodes"),
    (dict(nproc_per_node=-1), "--nproc-per-node"),
    (dict(nproc_per_node=2000), "--nproc-per-node"),
    (dict(nnodes=1000, nproc_per_node=1000), "ranks"),
    (dict(device="tpu"), "--device"),
    (dict(device_memory_gib=-1), "--device-memory-gib"),
    (dict(rollout_devices=-1), "--rollout-devices"),
    (dict(capacity_weights=[1, 0]), "--capacity-weights"),
    (dict(capacity_weights=[]), "--capacity-weights"),
])
def test_make_layout_refuses(kwargs, field):
    with pytest.raises(UsageError, match=field):
        make_layout(**kwargs)


def test_rollout_devices_beyond_world_is_a_finding_not_an_error():
    assert make_layout(1, 4, rollout_devices=4).training_ranks == 0


TORCHRUN_8 = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "RANK": "5", "LOCAL_RANK": "1", "GROUP_RANK": "1",
              "MASTER_ADDR": "h0", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "2"}


@pytest.mark.parametrize("env, expect", [
    ({}, dict(source=None, rank=0, world=1, local_rank=0, local_world=1, node_rank=0, nnodes=1, master_addr=None,
              master_port=None, restart_count=0, launched=False)),
    (TORCHRUN_8,
     dict(source="torchrun", rank=5, local_rank=1, node_rank=1, world=8, local_world=4, nnodes=2,
          master_addr="h0", master_port=29500, restart_count=2, launched=True)),
    # torchrun inside a Slurm allocation: torchrun's variables win
    ({**TORCHRUN_8, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "7", "SLURM_NNODES": "1"},
     dict(source="torchrun", rank=5, world=8, master_addr="h0")),
    ({"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8(x2)",
      "SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[03-04]"},
     dict(source="slurm", rank=9, local_rank=1, node_rank=1, world=16, local_world=8, nnodes=2,
          master_addr="gpu03", master_port=15007, launched=True)),  # the port init listens on: 15000 + job id
    ({"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_NTASKS": "4", "MASTER_ADDR": "x"},
     dict(source="slurm", world=4, local_world=2, master_addr="x", launched=False)),  # salloc shell: no task
    # collectives.init's Slurm case: SLURM_PROCID without SLURM_NNODES; this node's entry of the list
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
      "SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_JOB_ID": "100"},
     dict(source="slurm", rank=4, world=5, local_rank=0, local_world=1, node_rank=2, nnodes=3, master_addr="gpu07",
          master_port=15100, launched=True)),
])
def test_read_env(env, expect):
    d = read_env(env)
    assert {k: getattr(d, k) for k in expect} == expect


def test_read_env_plain_process_is_the_default():
    assert read_env({"PATH": "/bin"}) == LaunchEnv() and read_env({"WORLD_SIZE": "4"}) == LaunchEnv()


@pytest.mark.parametrize("env, expect", [
    # torchrun without LOCAL_RANK/GROUP_RANK/MASTER_*: derived from RANK (ranks are numbered node by node),
    # torchrun's default address and port
    ({"RANK": "6", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"},
     dict(local_rank=2, node_rank=1, nnodes=2, master_addr="127.0.0.1", master_port=29500, launched=True)),
    # WORLD_SIZE with LOCAL_WORLD_SIZE but no RANK: a layout to plan for, not a rank to join
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, dict(source="torchrun", rank=0, nnodes=2, launched=False)),
    ({"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "", "LOCAL_WORLD_SIZE": ""},  # "" counts as unset
     dict(master_addr="127.0.0.1", local_world=4)),
    # the step's counts, list and node list before the job's (srun -n3 in a larger allocation)
    ({"SLURM_PROCID": "2", "SLURM_JOB_ID": "20001", "SLURM_NNODES": "4", "SLURM_NTASKS": "32",
      "SLURM_TASKS_PER_NODE": "8(x4)", "SLURM_JOB_NODELIST": "a[1-4]", "SLURM_STEP_NUM_TASKS": "3",
      "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_STEP_NODELIST": "a[3-4]",
      "SLURM_NODEID": "1"},
     dict(world=3, nnodes=2, local_world=1, master_addr="a3", master_port=15001, launched=True)),
    # SLURM_NTASKS_PER_NODE is the last list read; no node list: this host
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "4"},
     dict(local_world=4, nnodes=2, master_addr="127.0.0.1", master_port=15000)),
    # no list: tasks spread over the nodes; SLURM_NODELIST is the last node list read
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_NNODES": "2", "SLURM_NODELIST": "n[5-6]"},
     dict(local_world=4, master_addr="n5")),
    # no task count (a batch script without --ntasks): the world is the list's sum, else one task per node,
    # and the process is not one of several launched ranks
    ({"SLURM_PROCID": "0", "SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "4(x2)"},
     dict(world=8, local_world=4, launched=False)),
    ({"SLURM_PROCID": "0", "SLURM_JOB_ID": "7", "SLURM_NNODES": "2"}, dict(world=2, local_world=1, launched=False)),
    ({"SLURM_JOB_ID": "7", "SLURM_NNODES": "1", "SLURM_RESTART_COUNT": "3"}, dict(restart_count=3)),
    # MASTER_ADDR/MASTER_PORT set by the user win over the node list and the job's port
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_JOB_ID": "100",
      "MASTER_ADDR": "head", "MASTER_PORT": "9"}, dict(master_addr="head", master_port=9)),
])
def test_read_env_unified_rules(env, expect):
    d = read_env(env)
    assert {k: getattr(d, k) for k in expect} == expect


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "x", "RANK": "0"}, "WORLD_SIZE='x' is not an integer"),
    ({"WORLD_SIZE": "4", "RANK": "-1"}, "RANK='-1' is negative"),
    ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE='0' must be at least 1"),
    ({"WORLD_SIZE": "4", "RANK": "4"}, "RANK='4' is not below the world size 4"),
    ({"WORLD_SIZE": "4", "RANK": "0", "MASTER_PORT": "70000"}, "MASTER_PORT='70000' is not a port"),
    ({"SLURM_PROCID": "x", "SLURM_NTASKS": "2"}, "SLURM_PROCID='x' is not an integer"),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "2"}, "SLURM_PROCID='2' is not below the world size 2"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2(x"},
     "SLURM_TASKS_PER_NODE='2(x' is not a Slurm tasks-per-node list"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[03"},
     "SLURM_JOB_NODELIST='gpu[03' is not a Slurm node list"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID='abc' is not an integer"),
])
def test_read_env_bad_value_is_one_line(env, message):
    with pytest.raises(UsageError, match="^environment: " + re.escape(message)) as e:
        read_env(env)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("nodelist, host", [
    ("gpu[03-05,9],cpu1", "gpu03"), ("node7", "node7"), ("a1,a2", "a1"), ("", ""), ("n[10]", "n10"),
    (" n[7-8] ", "n7"), ("rack[1-2]-n[07-08],x", "rack1-n07"), ("gpu[03-04]-ib", "gpu03-ib")])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["gpu[03", "gpu[]", "]a", "a[1]]"])
def test_first_host_refuses_unreadable(nodelist):
    with pytest.raises(ValueError, match="node list"):
        first_host(nodelist)


@pytest.mark.parametrize("spec, counts", [("8", [8]), ("2(x3),1", [2, 2, 2, 1]), (" 4(x2) , 3", [4, 4, 3])])
def test_tasks_per_node(spec, counts):
    assert tasks_per_node(spec) == counts


@pytest.mark.parametrize("spec", ["", "x", "2(x0)", "0", "2(3)"])
def test_tasks_per_node_refuses(spec):
    with pytest.raises(ValueError, match="tasks-per-node"):
        tasks_per_node(spec)


@pytest.mark.parametrize("visible, run, expect", [
    (None, fake_smi(), [80.0, 80.0, 40.0]),
    ("2", fake_smi(), [40.0]),
    ("0,1", fake_smi(), [80.0, 80.0]),
    ("", fake_smi(), []),
    ("-1", fake_smi(), []),
    (None, no_smi, []),
    ("0,1", no_smi, [0.0, 0.0]),  # listed devices, memory unknown
    (None, fake_smi(rc=9), []),
    ("GPU-uuid-a", fake_smi(), [80.0]),
])
def test_local_gpus(visible, run, expect):
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert local_gpus(env, run) == expect


def test_detect_local_gpu_and_cpu():
    lay = detect_local({}, fake_smi())
    assert (lay.device, lay.nproc_per_node, lay.device_memory_gib, lay.source) == ("cuda", 3, 40.0, "local")
    cpu = detect_local({}, no_smi)
    assert (cpu.device, cpu.world) == ("cpu", 1) and cpu.device_memory_gib >= 0


def test_host_memory(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       16777216 kB\nMemFree: 1 kB\n")
    no_limit = str(tmp_path / "no-cgroup")  # this machine's container limit would count otherwise
    assert host_memory_gib(str(f), no_limit) == 16.0
    assert host_memory_gib(str(tmp_path / "missing"), no_limit) == 0.0


def test_layout_from_env_torchrun_and_slurm_gpus():
    lay = layout_from_env({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "RANK": "0"}, fake_smi("81920\n" * 8))
    assert (lay.nnodes, lay.nproc_per_node, lay.device, lay.source) == (2, 8, "cuda", "torchrun")
    # one Slurm task per node that will run torchrun over the node's GPUs
    slurm = {"SLURM_JOB_ID": "1", "SLURM_NNODES": "4", "SLURM_NTASKS": "4", "SLURM_GPUS_ON_NODE": "8"}
    lay = layout_from_env(slurm, fake_smi("81920\n" * 8))
    assert (lay.nnodes, lay.nproc_per_node, lay.source) == (4, 8, "slurm")
    # an srun task whose step says 4 tasks on each of 2 nodes (no SLURM_NNODES needed)
    task = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}
    lay = layout_from_env(task, no_smi)
    assert (lay.nnodes, lay.nproc_per_node, lay.device, lay.source) == (2, 4, "cpu", "slurm")
    assert layout_from_env({"PATH": "/bin"}, no_smi) is None


@pytest.mark.parametrize("argv, env, expect", [
    (["--nnodes", "2", "--nproc-per-node", "4"], {"GPUS": "yes"},
     dict(nnodes=2, nproc_per_node=4, device="cuda", device_memory_gib=40.0, source="flags")),
    (["--num-nodes", "3", "--num-gpus", "2"], {}, dict(nnodes=3, nproc_per_node=2)),
    (["--nproc-per-node", "4", "--device", "cpu"], {}, dict(nnodes=1, nproc_per_node=4, device="cpu")),
    (["--nproc-per-node", "4", "--rollout-devices", "1", "--capacity-weights", "1,1,2"], {},
     dict(rollout_devices=1, capacity_weights=(1.0, 1.0, 2.0))),
    ([], {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "RANK": "0"}, dict(nproc_per_node=4, source="torchrun")),
    (["--device-memory-gib", "24"], {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0"},
     dict(nproc_per_node=2, device_memory_gib=24.0)),
    ([], {}, dict(source="local")),
])
def test_layout_from_args(argv, env, expect):
    run = fake_smi() if env.pop("GPUS", None) else no_smi  # a machine with GPUs of 80, 80 and 40 GiB
    lay = layout_from_args(parse(*argv), env, run)
    assert isinstance(lay, Layout)
    assert {k: getattr(lay, k) for k in expect} == expect


@pytest.mark.parametrize("argv", [["--nnodes", "0"], ["--nnodes", "x"], ["--nproc-per-node", "1.5"],
                                  ["--capacity-weights", "1,-2"], ["--capacity-weights", "a"],
                                  ["--device-memory-gib", "0"], ["--device", "tpu"], ["--rollout-devices", "-1"]])
def test_bad_flags_exit(argv):
    with pytest.raises(SystemExit):  # argparse; `evenrl plan` turns these into a one-line UsageError
        parse(*argv)


def test_shape_flags_take_device_and_memory_from_this_machine():
    """--nproc-per-node alone used to mean 'cuda, memory unknown' even on a CPU machine."""
    host = detect_local({}, no_smi)  # no GPU: one CPU process with the host's memory (less the reserve)
    lay = layout_from_args(parse("--nproc-per-node", "4"), {}, no_smi)
    assert (lay.device, lay.nproc_per_node, lay.source) == ("cpu", 4, "flags")
    assert lay.device_memory_gib == pytest.approx(host.device_memory_gib / 4)
    assert "memory unknown" not in lay.describe() or host.device_memory_gib == 0
    # with GPUs: cuda, the smallest GPU's memory; --device/--device-memory-gib still override
    assert layout_from_args(parse("--nproc-per-node", "4"), {}, fake_smi()).device_memory_gib == 40.0
    told = layout_from_args(parse("--nproc-per-node", "4", "--device", "cuda", "--device-memory-gib", "24"), {},
                            lambda *a, **k: pytest.fail("nvidia-smi run although the flags say everything"))
    assert (told.device, told.device_memory_gib) == ("cuda", 24.0)
    cpu = layout_from_args(parse("--nproc-per-node", "2", "--device", "cpu"), {}, fake_smi())
    assert (cpu.device, cpu.device_memory_gib) == ("cpu", pytest.approx(host.device_memory_gib / 2))
    assert layout_from_args(parse("--nproc-per-node", "2", "--device", "cuda"), {}, no_smi).device_memory_gib == 0


@pytest.mark.parametrize("kwargs, text", [
    (dict(nnodes=2, nproc_per_node=4, device="cuda", device_memory_gib=80),
     "2 nodes x 4 cuda, 80 GiB each = 8 training ranks"),
    (dict(device_memory_gib=3.5), "1 node x 1 cpu, 3.5 GiB = 1 training rank  [flags]"),
    (dict(nproc_per_node=4, rollout_devices=4), "= 4 ranks: 0 training, 4 reserved for rollout"),
])
def test_describe(kwargs, text):
    assert text in make_layout(**kwargs).describe()


# ------------------------------------------------------------------------------------------ the launcher's use

TORCHRUN = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "2"}
SRUN = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_NTASKS": "16", "SLURM_PROCID": "9",
        "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[03-04]", "MASTER_ADDR": "gpu03"}


def _old_is_worker(env):
    """Reference for the launcher's check: a torchrun rank, or one of several Slurm tasks."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return True
    return "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1


def _set_env(monkeypatch, env):
    for key in list(os.environ):
        if key.startswith(("SLURM_", "TORCHELASTIC_")) or key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK",
                                                                     "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("env, worker", [
    ({}, False),
    (TORCHRUN, True),
    ({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_WORLD_SIZE": "1"}, True),  # torchrun --nproc-per-node 1
    (SRUN, True),
    ({**SRUN, "SLURM_NTASKS": "1", "SLURM_NNODES": "1", "SLURM_PROCID": "0"}, False),  # salloc -n1 shell
    ({"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_PROCID": "0"}, False),  # sbatch -N2 script, no --ntasks
    ({**SRUN, **TORCHRUN}, True),  # torchrun inside a Slurm allocation
    ({"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_NTASKS": "16"}, False),  # salloc -N2 -n16 shell: no task
], ids=["none", "torchrun", "torchrun-1", "srun-16", "slurm-1-task", "sbatch-script", "torchrun-in-slurm",
        "salloc-shell"])
def test_launcher_is_worker(env, worker, monkeypatch):
    _set_env(monkeypatch, env)
    assert launch._is_worker() is worker
    assert _old_is_worker(env) is worker


def test_launcher_bad_environment_is_one_line(monkeypatch):
    _set_env(monkeypatch, {"WORLD_SIZE": "four", "RANK": "0"})
    with pytest.raises(UsageError, match="WORLD_SIZE='four' is not an integer"):
        launch._is_worker()
