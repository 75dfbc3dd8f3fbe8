"""Launching: two simulated nodes on loopback, and an elastic restart that resumes from the checkpoint."""

import json

import pytest

from e2e import ENV, Job, evenrl, fault_env, final_params, free_port, max_diff


@pytest.mark.slow
def test_two_nodes_on_loopback_give_the_one_process_model(shared_runs, tmp_path):
    """The shared config on 2 nodes x 1 process ends with the parameters of shared_runs.one (tests/conftest.py)."""
    two = tmp_path / "two"
    port = free_port()
    nodes = [Job("train", *shared_runs.args, f"log.run_dir={two}", "--nnodes", "2", "--node-rank", r,
                 "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port, timeout_s=300)
             for r in (0, 1)]
    try:
        outs = [n.wait(check=False) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    assert [o.returncode for o in outs] == [0, 0], "\n".join(o.stdout[-2000:] + o.stderr[-2000:] for o in outs)
    assert "2 nodes" in (two / "plan.txt").read_text() or "2 ranks" in (two / "plan.txt").read_text()
    assert max_diff(final_params(shared_runs.one), final_params(two)) <= 1e-5


@pytest.mark.slow
def test_elastic_restart_resumes_and_matches(shared_runs, tmp_path):
    """The shared config on 2 processes, killed at the start of step 3 and restarted by the elastic agent from the
    step-2 checkpoint, ends with the parameters of shared_runs.one (tests/conftest.py)."""
    restarted = tmp_path / "restarted"
    proc = evenrl("train", *shared_runs.args, f"log.run_dir={restarted}", "--nproc-per-node", "2",
                  "--max-restarts", "1", env=fault_env(crash_at_step=3))
    assert proc.returncode == 0
    assert "resumed from" in proc.stdout and "step-000002" in proc.stdout  # the crash happened and was recovered
    steps = [json.loads(x)["step"] for x in (restarted / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]  # the eval before step 1 (row 0) once, every step once
    assert max_diff(final_params(shared_runs.one), final_params(restarted)) <= 1e-5


def test_the_fork_server_imports_without_asking_for_a_device():
    """The launcher's workers are forked from a server that imported evenrl.train.preload: had that import asked
    CUDA anything (is_available, device_count, an initialisation), no forked worker could use a GPU. Checked here,
    where there is none, by counting the calls torch.cuda would have made."""
    import subprocess
    import sys

    spy = """
import torch, torch.cuda
asked = []
for name in ("is_available", "device_count", "_lazy_init", "init", "current_device", "get_device_properties",
             "get_device_capability", "mem_get_info"):
    setattr(torch.cuda, name, lambda *a, _n=name, **k: asked.append(_n))
import evenrl.train.preload
assert "evenrl.train.loop" in sys.modules, "the preload did not import the loop"
print(asked)
"""
    out = subprocess.run([sys.executable, "-c", "import sys\n" + spy], env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]
