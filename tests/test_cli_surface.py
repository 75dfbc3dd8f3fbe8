"""The command-line surface is frozen: adding, renaming or removing a flag or a command means editing this
file too, as a deliberate change (torchtitan's test_no_new_cli_options). Every flag is one more thing to
document, test and keep; prefer a config field with a description."""

import subprocess
import sys

import pytest

from evenrl import cli
from evenrl.planner import cli as plan_cli
from evenrl.train import launch

PLAN = {
    "config", "overrides", "-h", "--help", "--json", "--fit", "--from",
    # with --from: the peer version whose keys and checks apply; the equivalent evenrl config written to a file
    "--peer-version", "--write-config",
    # layout (evenrl.planner.layout.add_layout_args)
    "--nnodes", "--num-nodes", "--nproc-per-node", "--num-gpus", "--rollout-devices", "--device",
    "--device-memory-gib", "--capacity-weights",
    # every node's devices, for a cluster of mixed devices the planner cannot see (evenrl.planner.cluster)
    "--nodes",
    # device rates of the step-time estimate of reserved placement (evenrl.planner.timing.add_rate_args)
    "--device-tflops", "--device-gbps", "--link-gbps",
}
TRAIN = {
    "config", "overrides", "-h", "--help", "--nproc-per-node", "--num-gpus", "--nnodes", "--num-nodes",
    "--node-rank", "--master-addr", "--master-port", "--max-restarts", "--resume",
    # a run directory belongs to one run; how long a rank waits for a stopped peer (parallel.collective_timeout_s)
    "--overwrite", "--collective-timeout-s",
}
# train only: the last R processes only generate (parallel.rollout_devices; the planner's flag of the same name)
TRAIN_ONLY = {"--rollout-devices"}
COMMANDS = ["plan", "train", "sft", "report", "demo"]


def options(p):
    return {s for a in p._actions for s in (a.option_strings or [a.dest])}


def test_plan_options_are_frozen():
    assert options(plan_cli.parser()) == PLAN


def test_train_and_sft_options_are_frozen():
    assert options(launch._parser("train")) == TRAIN | TRAIN_ONLY
    assert options(launch._parser("sft")) == TRAIN  # one launcher, one surface (sft generates nothing)


def test_commands_are_frozen():
    assert list(cli.COMMANDS) == COMMANDS


def test_plan_help_exits_0(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--help"])
    assert e.value.code == 0 and "--nproc-per-node" in capsys.readouterr().out


def test_help_and_unknown_command():
    """The real entry point in a fresh interpreter: --help exits 0, an unknown command 2 with one line."""
    ok = subprocess.run([sys.executable, "-m", "evenrl", "--help"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and all(c in ok.stdout for c in COMMANDS) and ok.stderr == ""
    bad = subprocess.run([sys.executable, "-m", "evenrl", "bogus"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1
    assert "unknown command 'bogus'" in bad.stderr and "plan" in bad.stderr and "Traceback" not in bad.stderr


def test_flags_are_spelled_out(capsys):
    """No abbreviations: `--nproc` is not --nproc-per-node (argparse's allow_abbrev would take it, and break the
    day another flag starts the same way)."""
    for argv in (["plan", "x.yaml", "--nproc", "2"], ["train", "x.yaml", "--nproc", "2"], ["train", "x.yaml", "--res"]):
        assert cli.main(argv) == 2
        assert "unrecognized arguments: --" in capsys.readouterr().err


def test_the_program_ends_with_a_thread_pool_alive(tmp_path):
    """cli.run ends the process without the interpreter's finalization, but after what the interpreter's exit does
    first: threading's exit hooks tell a ThreadPoolExecutor's idle workers to stop (vLLM's engine keeps one); joining
    them without those hooks waited forever (a colocated vLLM run's rank 0 hung after its last step)."""
    code = ("import sys, concurrent.futures as f; pool = f.ThreadPoolExecutor(1); pool.submit(int).result(); "
            f"sys.argv = ['evenrl', 'plan', {str(tmp_path / 'missing.yaml')!r}]; from evenrl.cli import run; run()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "missing.yaml" in proc.stderr, proc.stderr
