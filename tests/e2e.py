"""Shared helpers of the end-to-end tests: run the evenrl CLI in a subprocess (one, or several side by side) or in
this process, read a run's metrics, compare final models."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
TIMEOUT_S = 600


class Saved:
    """The least a checkpoint saves and restores (evenrl.train.checkpoint.Checkpointed): trained models by name with
    their optimizers, a small dict of state and the step; no weight sync."""

    def __init__(self, models: dict, extra: dict | None = None, step: int = 0):
        self.models, self.extra, self.step, self.sync = models, dict(extra or {}), step, None

    def trained(self) -> dict:
        return self.models

    def state_dict(self) -> dict:
        return {**self.extra, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.extra = {k: v for k, v in state.items() if k != "step" and not k.endswith("param_groups")}
        self.step = state["step"]


def fault_env(*, crash_at_step: int = 0, signal_at_step: str = "", rollout_stalls_at_step: int = 0,
              tracker_fails_at_step: int = 0, small_rank: tuple[int, float] | None = None,
              slow_rank: tuple[int, float] | None = None) -> dict:
    """ENV with a fault injected into the evenrl processes it starts (tests/faults/sitecustomize.py): a training rank
    that dies at the start of a step (first attempt only), a signal sent at the start of a step, a reserved rollout
    rank that hangs, experiment trackers that raise from a step on, a rank whose device has less memory (rank,
    GiB), or one that computes slower (rank, factor)."""
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(TESTS / "faults"), ENV["PYTHONPATH"]])}
    if crash_at_step:
        env["EVENRL_FAULT_CRASH_AT_STEP"] = str(crash_at_step)
    if signal_at_step:  # "N:INT:self" or "N:TERM:parent" (tests/faults/sitecustomize.py)
        env["EVENRL_FAULT_SIGNAL_AT_STEP"] = signal_at_step
    if rollout_stalls_at_step:
        env["EVENRL_FAULT_ROLLOUT_STALLS_AT_STEP"] = str(rollout_stalls_at_step)
    if tracker_fails_at_step:
        env["EVENRL_FAULT_TRACKER_FAILS_AT_STEP"] = str(tracker_fails_at_step)
    if small_rank:
        env["EVENRL_FAULT_DEVICE_MEMORY_GIB"] = f"{small_rank[0]}:{small_rank[1]!r}"
    if slow_rank:
        env["EVENRL_FAULT_SLOW_RANK"] = f"{slow_rank[0]}:{slow_rank[1]!r}"
    return env


@contextlib.contextmanager
def loaded_cpu(busy: int):
    """This process, and every process it starts meanwhile, pinned to one CPU with `busy` processes spinning on the
    same CPU: a machine loaded busy + 1 times over for the code under test, and not the machine's other CPUs.
    Yields the CPU's number."""
    cpu = max(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    spin = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n    pass\n"
    # each spinner in a session of its own: where the kernel groups a session's processes for the scheduler
    # (autogroup), spinners sharing this process's session would together weigh as one against code under test
    # that starts sessions of its own (the reward workers do), which would then see a machine loaded 2 times over
    spinners = [subprocess.Popen([sys.executable, "-c", spin], start_new_session=True) for _ in range(busy)]
    os.sched_setaffinity(0, {cpu})
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, before)
        for p in spinners:
            p.kill()
            p.wait()


class Job:
    """`python -m evenrl.cli ARGS` started now, waited for later. Output goes to files, not pipes, so a job nobody
    reads yet never blocks on a full pipe. It runs in a process group of its own, so that killing it (a timeout,
    an interrupted test) reaches everything it started. Forked from a server that has imported evenrl where its
    environment allows (tests/warm_start.py), else started as a new Python."""

    def __init__(self, *args, env=None, timeout_s: float = TIMEOUT_S):
        import warm_start

        self.args = [sys.executable, "-m", "evenrl.cli", *map(str, args)]
        self.timeout_s = timeout_s
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.started = time.monotonic()
        env = env or ENV
        if warm_start.can_fork(env):
            self.proc = warm_start.start(self.args[3:], env, self._out, self._err)
        else:
            self.proc = subprocess.Popen(self.args, stdout=self._out, stderr=self._err, text=True, env=env,
                                         start_new_session=True)

    def done(self) -> bool:
        if self.proc.poll() is None and time.monotonic() - self.started > self.timeout_s:
            self.kill()  # wait() then reports the kill as a failure with the output so far
        return self.proc.poll() is not None

    def wait(self, check=True) -> subprocess.CompletedProcess:
        try:
            self.proc.wait(timeout=max(1.0, self.timeout_s - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.kill()
        except BaseException:  # e.g. pytest-timeout or Ctrl-C while waiting: leave no process behind
            self.kill()
            raise
        outs = []
        for f in (self._out, self._err):
            f.seek(0)
            outs.append(f.read())
            f.close()
        proc = subprocess.CompletedProcess(self.args, self.proc.returncode, *outs)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(self.args[3:])}: exit {proc.returncode}\n"
                                 f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
        return proc

    def kill(self) -> None:
        """SIGTERM first: torchrun's agent then stops the workers it started (in sessions of their own); SIGKILL to
        whatever of the group is left after 15 s."""
        if self.proc.poll() is not None:
            return
        for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, None)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace)
                return
            except subprocess.TimeoutExpired:
                pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what the fork server of `spawn` imports once: what every in-test rank imports (torch's distributed code,
# transformers' common model classes, evenrl's collectives and model loading)
SPAWN_PRELOAD = ["torch", "torch.distributed.tensor", "transformers", "transformers.models.qwen2.modeling_qwen2",
                 "transformers.models.qwen3_moe.modeling_qwen3_moe", "evenrl.distributed.collectives",
                 "evenrl.models.loading"]


def spawn(fn, args: tuple, nprocs: int) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs), each process forked from multiprocessing's fork server (started
    on the first call in this test process, with SPAWN_PRELOAD imported) instead of started as a new Python that
    imports torch and transformers again (~7 s of a core each; the suite starts ~40). What differs from spawn: the
    processes start from the server's environment and modules, taken when it started (the tests that call this set
    their ranks' variables inside `fn`). No test of this process may start evenrl's launcher in-process after it
    (the launcher's own fork server would be this one)."""
    import multiprocessing

    import torch.multiprocessing as tmp

    multiprocessing.set_forkserver_preload(SPAWN_PRELOAD)  # read when the server starts: the first call
    tmp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def evenrl(*args, env=None, check=True) -> subprocess.CompletedProcess:
    """Run `evenrl ARGS` in a subprocess and wait; by default a non-zero exit fails the test with its output."""
    return Job(*args, env=env).wait(check=check)


def evenrl_many(runs: dict[str, list], parallel: int = 2) -> dict[str, subprocess.CompletedProcess]:
    """Run several `evenrl` commands, at most `parallel` at a time, in the given order; all must exit 0.
    On a 2-core machine a 1-process run leaves a core idle, so two side by side finish sooner than one after the
    other; the numbers do not depend on it (every process is single-threaded and seeded)."""
    pending, running, done = list(runs.items()), {}, {}
    try:
        while pending or running:
            while pending and len(running) < parallel:
                name, args = pending.pop(0)
                running[name] = Job(*args)
            for name in [n for n, job in running.items() if job.done()]:
                done[name] = running.pop(name).wait()
            time.sleep(0.05)
    finally:
        for job in running.values():
            job.kill()
    return {name: done[name] for name in runs}


def evenrl_here(capsys, *args) -> tuple[int, str, str]:
    """`evenrl ARGS` in this process: (exit code, stdout, stderr). Python warnings, which pytest would swallow,
    are counted as stderr lines, under the filters a fresh `python` process starts with. The mesh is left as found:
    a run that stops after joining (a bad setting found once the model is loaded) leaves its answer cached, which
    the process's exit would drop, and a later test in this process would get it."""
    from evenrl.cli import main
    from evenrl.distributed import mesh

    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("default")
        for quiet in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", quiet)
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse's own exits, as `raise SystemExit(main())` would give
            code = e.code if isinstance(e.code, int) else 1
        finally:
            mesh.shutdown()
    out, err = capsys.readouterr()
    err += "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)
    return code, out, err


def shared_args(assets: dict) -> list:
    """The shared config (tests/conftest.py's shared_runs): `evenrl train *shared_args(assets) log.run_dir=...` is
    the assets' config for 4 steps, a checkpoint every 2 steps, a greedy eval of 11 prompts before the first and
    after the last step."""
    return [assets["cfg"], "train.steps=4", "checkpoint.every_steps=2", f"eval.path={assets['data']}",
            "eval.max_prompts=11"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final" / "model.safetensors"))


def copy_checkpoint(run_dir: Path, step: int, to: Path) -> Path:
    """A new run directory `to` holding `run_dir`'s checkpoint of `step` (as its latest) and metrics, so that
    `evenrl train ... log.run_dir=TO --resume` continues that run from `step` (at another layout, say) without
    running its first steps again; its metrics rows after `step` are dropped on resume."""
    name = f"step-{step:06d}"
    shutil.copytree(Path(run_dir) / "checkpoints" / name, to / "checkpoints" / name)
    (to / "checkpoints" / "latest").write_text(name + "\n")
    shutil.copy(Path(run_dir) / "metrics.jsonl", to / "metrics.jsonl")
    return to


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def close_weights(a: dict, b: dict, *, within: float = 1e-5, outliers: int = 8, outliers_within: float = 1e-4
                  ) -> str:
    """'' when the weights of two runs on different layouts agree: every entry within `within` except at most
    `outliers` entries, those within `outliers_within`; else what is past that. What it trades for what: AdamW's
    step lr x g / (sqrt(v) + eps) turns the float rounding by which layouts' gradients differ (~1e-7 of the largest
    entry) into a different step where an entry nearly cancels (tests/test_update.py::test_layouts_differ_by_
    rounding_alone_which_adam_amplifies_where_a_gradient_cancels): a handful of entries of ~1e-5 at lr 1e-3, and
    no more than a tenth of lr; the rest stay within 1e-5."""
    assert a.keys() == b.keys()
    d = torch.cat([(a[k].double() - b[k].double()).abs().flatten() for k in a])
    far = int((d > within).sum())
    if far <= outliers and d.max() <= outliers_within:
        return ""
    return f"{far} of {d.numel()} entries differ by more than {within:g} (max {float(d.max()):.3g})"


def same_on_n_processes(assets: dict, tmp_path: Path, args: list, n: int, keys: tuple) -> tuple[list, list]:
    """The assets' config with `args` trained on 1 and on n processes: the final models within 1e-5 (and moved from
    the start, else the test is weak) and the metrics `keys` of every step equal; -> (1-process, n-process) rows of
    the steps, for the caller's checks that the objective bit."""
    runs = {name: ["train", assets["cfg"], *args, f"log.run_dir={tmp_path / name}", *more]
            for name, more in (("many", ["--nproc-per-node", str(n)]), ("one", []))}
    evenrl_many(runs)
    one, many = tmp_path / "one", tmp_path / "many"
    assert max_diff(final_params(one), final_params(many)) <= 1e-5
    start = load_file(str(Path(assets["model"]) / "model.safetensors"))
    assert max_diff(final_params(one), start) > 1e-5, "training did not move the policy: weak test"
    m1, mn = [r for r in metrics(one) if r["step"] > 0], [r for r in metrics(many) if r["step"] > 0]
    assert len(m1) == len(mn) > 0
    for a, b in zip(m1, mn):
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    return m1, mn


def with_random_adapters(model, rank: int = 4):
    """`model` with LoRA adapters of `rank` on its default targets, their B matrices random (peft starts them at 0,
    which would make the adapters invisible)."""
    from evenrl.config import RunConfig
    from evenrl.models.lora import add_adapters

    add_adapters(model, RunConfig().model.lora.model_copy(update={"rank": rank}))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.3)
    return model


def requests(prompts: list, keys: list, step=0, *, sample_ranges=None, **fields) -> list:
    """Engine requests (evenrl.engines.base.Request) of `prompts` with `keys`, at `step` (or one per prompt):
    `sample_ranges` their (first sample, count), `fields` Request's other fields, each one value or one per prompt."""
    from evenrl.engines.base import Request

    n = len(prompts)
    at = lambda v, i: v[i] if isinstance(v, list) else v  # noqa: E731
    ranges = [None] * n if sample_ranges is None else [range(a, a + c) for a, c in sample_ranges]
    return [Request(prompts[i], keys[i], at(step, i), ranges[i],
                    **{f: at(v, i) for f, v in fields.items() if v is not None}) for i in range(n)]


def engine_gap(engine, model, prompts: list, params, pad_token_id: int) -> float:
    """Largest |engine log-prob - trainer log-prob| over the tokens `engine` samples for `prompts` (keys 0..n-1,
    step 1), the trainer's from `model`'s forward on the same tokens."""
    from evenrl.core.batch import Batch
    from evenrl.train.update import compute_logprobs

    res = engine.generate(requests(prompts, list(range(len(prompts))), 1), params)
    rows = [(p, c) for p, r in zip(prompts, res) for c in r]
    batch = Batch({"tokens": [torch.tensor(p + c.token_ids) for p, c in rows],
                   "response_len": torch.tensor([len(c.token_ids) for _, c in rows])})
    trainer = compute_logprobs(model, batch, [[i] for i in range(len(rows))], temperature=params.temperature,
                               pad_token_id=pad_token_id)
    return max(float((t - torch.tensor(c.logprobs)).abs().max()) for t, (_, c) in zip(trainer, rows))


# train.reproducibility=bitwise: runs compared bit for bit (tests/test_bitwise_runs.py and the roles' own files)
BITWISE = "train.reproducibility=bitwise"
# what describes the machine or the layout, not the run: wall times, throughput, who ran what, memory
LAYOUT_KEYS = ("time/", "perf/", "load/", "memory/", "devices")


def run_log(run: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(LAYOUT_KEYS)} for row in metrics(run)]


def weights(run: Path) -> dict:
    final = run / "final"
    return load_file(str(final / ("model.safetensors" if (final / "model.safetensors").exists()
                                  else "adapter_model.safetensors")))


def assert_same_run(a: Path, b: Path) -> None:
    assert max_diff(weights(a), weights(b)) == 0.0, (a.name, b.name)
    la, lb = run_log(a), run_log(b)
    assert len(la) == len(lb) and la == lb, next(
        {k: (x.get(k), y.get(k)) for k in x.keys() | y.keys() if x.get(k) != y.get(k)} for x, y in zip(la, lb)
        if x != y)
