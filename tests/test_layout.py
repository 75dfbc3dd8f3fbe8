"""Cluster layout: flags, torchrun/Slurm environment, local detection (nvidia-smi faked), validation, and the
launcher's worker check built on read_dist_env."""

import argparse
import os
import subprocess

import pytest

from evenrl.train import launch
from evenrl.errors import UsageError
from evenrl.planner.layout import Layout, add_layout_args, detect_local, first_host, host_memory_gib, layout_from_args, layout_from_env, local_gpus, make_layout, read_dist_env


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


@pytest.mark.parametrize("env, expect", [
    ({}, None),
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "RANK": "5", "LOCAL_RANK": "1", "GROUP_RANK": "1",
      "MASTER_ADDR": "h0", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "2"},
     dict(source="torchrun", rank=5, local_rank=1, node_rank=1, world_size=8, local_world_size=4, nnodes=2,
          master_addr="h0", master_port=29500, restart_count=2)),
    ({"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8(x2)",
      "SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[03-04]"},
     dict(source="slurm", rank=9, local_rank=1, node_rank=1, world_size=16, local_world_size=8, nnodes=2,
          master_addr="gpu03", master_port=None)),
    ({"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_NTASKS": "4", "MASTER_ADDR": "x"},
     dict(source="slurm", world_size=4, local_world_size=2, master_addr="x")),
])
def test_read_dist_env(env, expect):
    d = read_dist_env(env)
    if expect is None:
        assert d is None
    else:
        assert {k: getattr(d, k) for k in expect} == expect


def test_read_dist_env_bad_value_is_one_line():
    with pytest.raises(UsageError, match="WORLD_SIZE='x' is not an integer"):
        read_dist_env({"WORLD_SIZE": "x", "RANK": "0"})


@pytest.mark.parametrize("nodelist, host", [
    ("gpu[03-05,9],cpu1", "gpu03"), ("node7", "node7"), ("a1,a2", "a1"), ("", ""), ("n[10]", "n10")])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


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
    assert host_memory_gib(str(f)) == 16.0
    assert host_memory_gib(str(tmp_path / "missing")) == 0.0


def test_layout_from_env_torchrun_and_slurm_gpus():
    lay = layout_from_env({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "RANK": "0"}, fake_smi("81920\n" * 8))
    assert (lay.nnodes, lay.nproc_per_node, lay.device, lay.source) == (2, 8, "cuda", "torchrun")
    # one Slurm task per node that will run torchrun over the node's GPUs
    slurm = {"SLURM_JOB_ID": "1", "SLURM_NNODES": "4", "SLURM_NTASKS": "4", "SLURM_GPUS_ON_NODE": "8"}
    lay = layout_from_env(slurm, fake_smi("81920\n" * 8))
    assert (lay.nnodes, lay.nproc_per_node, lay.source) == (4, 8, "slurm")


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
    """evenrl.launch's check before it used read_dist_env, kept as the reference for its behaviour."""
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
], ids=["none", "torchrun", "torchrun-1", "srun-16", "slurm-1-task", "sbatch-script", "torchrun-in-slurm"])
def test_launcher_is_worker(env, worker, monkeypatch):
    _set_env(monkeypatch, env)
    assert launch._is_worker() is worker
    assert _old_is_worker(env) is worker


def test_launcher_bad_environment_is_one_line(monkeypatch):
    _set_env(monkeypatch, {"WORLD_SIZE": "four", "RANK": "0"})
    with pytest.raises(UsageError, match="WORLD_SIZE='four' is not an integer"):
        launch._is_worker()
