"""`evenrl train`: set-up, the loop over RL steps, checkpoints and the run directory. The step itself is
`evenrl.train.step.rl_step`; a training rank's state is `evenrl.train.trainer.Trainer`; a reserved rollout rank runs
`evenrl.train.rollout_rank.serve` instead.

    evenrl train examples/demo.yaml                          # one process
    evenrl train examples/demo.yaml --nproc-per-node 3       # three local processes (evenrl.train.launch)
    evenrl train examples/demo.yaml --resume                 # continue from the run directory's latest checkpoint
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from evenrl.config import RunConfig, config_to_yaml
from evenrl.distributed import collectives as dist
from evenrl.distributed.mesh import Mesh
from evenrl.errors import Interrupted, NonFinite, RunStopped, UsageError
from evenrl.rollout import carry_check
from evenrl.train import checkpoint, determinism, rundir
from evenrl.train.balance import make_balance
from evenrl.train.evaluate import evaluate
from evenrl.train.metrics import Idle, phase_table
from evenrl.train.plots import plots_for_trackers
from evenrl.train.preflight import preflight
from evenrl.train.rollout_rank import serve
from evenrl.train.runlog import RunLog, read_metrics
from evenrl.train.step import rl_step
from evenrl.train.stopping import Stopping
from evenrl.train.trackers import Trackers, check_reachable
from evenrl.train.trainer import Trainer, build_trainer


def train(cfg: RunConfig, *, resume: bool = False, overwrite: bool = False, restarted: bool = False) -> Path:
    """Run `cfg.train.steps` RL steps (or continue to them from the latest checkpoint). Returns the run dir.
    restarted: this worker was started again by the elastic agent (continue from a checkpoint if there is one)."""
    run_dir = Path(cfg.log.run_dir)
    rundir.check(cfg.log.run_dir, resume=resume, overwrite=overwrite, restarted=restarted)
    # read now: a broken line is one error, not a traceback once the header is half-written; trackers skip these
    earlier = read_metrics(run_dir) if resume or restarted else []
    plan = preflight(cfg)
    check_reachable(cfg)  # a tracker's server, before anything loads
    determinism.environment(cfg)  # before CUDA or vLLM start (bitwise)
    dist.mark("set-up: joining the other ranks")  # each rank's phase: a failure names it (distributed.guard)
    mesh = dist.from_config(cfg)  # the job's mesh, built once: handed to whoever needs a group or a size
    determinism.settle(cfg, mesh.device)
    earlier_ckpt = checkpoint.latest(run_dir / "checkpoints") if resume or restarted else None
    resumed = determinism.check_resumed(checkpoint.read_meta(earlier_ckpt)) if earlier_ckpt is not None else None
    # the same plan on every rank's real device (one gather): per-device token caps, auto's starting weights
    plan = preflight(cfg, plan.layout.with_devices(dist.gather_devices(mesh.device, mesh.info.local_world)),
                     resumed=resumed)
    if dist.is_main():
        rundir.prepare(run_dir, overwrite=overwrite and not restarted)
    dist.barrier()
    found = checkpoint.latest(run_dir / "checkpoints") if resume or restarted else None
    with Stopping(cfg) as stopping:
        try:
            if dist.is_rollout_rank():
                dist.mark("set-up: loading the rollout rank's model and engine")
                try:
                    serve(cfg, mesh, found)
                except Exception:
                    if stopping.signal is None:
                        raise
                    # signalled, it lost its trainers when they stopped and saved: theirs is the run's one line
                    raise Interrupted("", stopping.signal) from None
            else:
                train_here(cfg, mesh, plan, found, stopping, earlier, resume=resume or restarted, restarted=restarted)
        except Interrupted:
            dist.shutdown()  # as after a finished run (below): not left to the interpreter's exit
            raise
    dist.barrier_all()  # a rollout rank waits for the trainers to finish and save before leaving the group
    # Left to the interpreter's exit, the process group's threads can be torn down mid-use: seen once in a full
    # test suite as SIGABRT ("terminate called without an active exception") on a rank that had finished and saved.
    dist.shutdown()
    return run_dir


def train_here(cfg: RunConfig, mesh: Mesh, plan, found: Path | None, stopping: Stopping, earlier: list[dict], *,
               resume: bool, restarted: bool) -> None:
    """A training rank's run: the trainer built and resumed from `found`, the header written, the steps run.
    `earlier`: the run directory's metrics rows before this start (for the trackers)."""
    run_dir = Path(cfg.log.run_dir)
    dist.mark("set-up: loading the model and its engine")
    trainer = build_trainer(cfg, mesh, make_balance(mesh, plan, colocated=not dist.rollout_ranks()))
    dist.mark("set-up: loading the checkpoint" if found else "set-up: first steps")
    trainer.resume(found)
    # once the checkpoint has loaded, before the run writes anything: one that cannot start stops the run here
    trackers = Trackers(cfg, run_dir, earlier) if dist.is_main() else None
    if dist.is_main():
        if found is not None:
            print(f"evenrl: resumed from {found} (step {trainer.step})", flush=True)
        elif restarted:
            print("evenrl: restarted before the first checkpoint; starting over from step 1", flush=True)
        write_run_header(trainer, plan, resumed_from=trainer.step if resume else None)
    try:
        run_steps(trainer, trackers, stopping, first_row=device_row(plan))
    except BaseException:
        if trackers is not None:
            trackers.close(ok=False)
        raise


def run_steps(trainer: Trainer, trackers: Trackers | None, stopping: Stopping, first_row: dict | None = None) -> None:
    """The RL steps after trainer.step up to train.steps, each followed by its metrics (to metrics.jsonl and rank 0's
    `trackers`), samples, evaluation and checkpoint (`stopping` says when; on a signal the run saves and ends with
    Interrupted); then the final model, the trackers' plots and the run's phase breakdown. `first_row`: more
    entries of the first step's metrics row (the devices the run has)."""
    cfg, start = trainer.cfg, trainer.step
    run_dir = Path(cfg.log.run_dir)
    log = RunLog(str(run_dir), enabled=dist.is_main(), trackers=trackers,
                 progress_total=cfg.train.steps, progress=cfg.log.progress, initial_step=start,
                 shown={"reward/mean": "reward", "kl": "kl", "perf/tokens_per_s": "tok/s"})
    phases: dict[str, float] = {}
    idle, cut_warned = Idle(), False
    if stopping.before_start():
        log.close()
        latest = checkpoint.latest(run_dir / "checkpoints")
        raise Interrupted(f"stopped before step {start + 1}; " + (f"the latest checkpoint is {latest}" if latest
                                                                  else "nothing was saved"), stopping.signal,
                          resumable=latest is not None)
    if trainer.eval_prompts.rows and start == 0:
        log.metrics(0, evaluate(trainer, trainer.eval_prompts), advance=False)
    for step in range(start + 1, cfg.train.steps + 1):
        t0 = time.perf_counter()
        try:
            metrics, examples = rl_step(step, trainer)
        except RunStopped as e:  # every rank stops here; nothing of this step is saved
            raise RunStopped(f"step {step}: {e}; last good checkpoint: {_last_good(trainer, e)}") from None
        trainer.step = step
        metrics["time/step"] = time.perf_counter() - t0  # wall time of the whole step, phases and the rest
        first_errors = {k: metrics.pop(k) for k in [k for k in metrics if k.startswith(FIRST_ERROR)]}
        if step == start + 1:
            metrics.update(first_row or {})
        for k, v in metrics.items():
            if k.startswith("time/"):
                phases[k[5:]] = phases.get(k[5:], 0.0) + v
        if dist.is_main():
            idle.see(step, metrics)
            warn_short_sampling(cfg, step, metrics)
            warn_reward_failures(cfg, step, metrics, first_errors)
            cut_warned = cut_warned or warn_cut_calls(cfg, step, metrics)
        if trainer.eval_prompts.rows and (step == cfg.train.steps or
                                          (cfg.eval.every_steps and step % cfg.eval.every_steps == 0)):
            dist.mark(f"step {step} evaluate")
            metrics.update(evaluate(trainer, trainer.eval_prompts))
        log.metrics(step, metrics)
        # the first step's too, so that a short run has samples to look at when a warning points there
        if cfg.log.samples_every_steps and (step % cfg.log.samples_every_steps == 0 or step == start + 1):
            log.samples(step, examples)
        save, stop = stopping.after_step(step)
        if save:
            dist.mark(f"step {step} checkpoint")
            checkpoint.save(run_dir / "checkpoints", trainer, keep=cfg.checkpoint.keep)
            stopping.saved()
        if stop:
            log.close()
            latest = checkpoint.latest(run_dir / "checkpoints")
            raise Interrupted(_stopped_at(step, latest, saved=save), stopping.signal, resumable=latest is not None)
    if trainer.sync is not None:
        trainer.sync.finish()
    dist.mark("final save")
    checkpoint.save_final(trainer.model, trainer.tokenizer, run_dir / "final", trainer.image_processor,
                          merged=cfg.log.save_merged)
    if trackers is not None and trackers.wants_images:
        trackers.images(plots_for_trackers(run_dir))
    log.close()
    if dist.is_main() and phases:
        print(phase_table(phases, cfg.train.steps - start), flush=True)
        idle.summary(cfg.train.steps - start)
    if dist.is_main():
        print(summary(run_dir, read_metrics(run_dir)), flush=True)


def _last_good(trainer: Trainer, e: RunStopped) -> str:
    """The newest checkpoint a stopped run can resume from; after a non-finite loss in a partial run, the newest
    whose carried samples are sound (a damaged one would stop the resumed run again)."""
    root = Path(trainer.cfg.log.run_dir) / "checkpoints"
    last = checkpoint.latest(root)
    if not isinstance(e, NonFinite) or trainer.carry is None or last is None:
        return str(last or "none yet")
    good = checkpoint.last_good(root, trainer.cfg, vocab=carry_check.vocab_of(trainer.model),
                                 rows=len(trainer.prompts.rows), eos=trainer.eos_ids)
    return str(good or "none") + (f" ({last.name}'s carried samples are damaged)" if good != last else "")


def _stopped_at(step: int, latest: Path | None, *, saved: bool) -> str:
    """What an interrupted run kept, for the CLI's one line."""
    if saved:
        return f"stopped after step {step}; saved {latest}"
    if latest is None:
        return f"stopped after step {step}, before its first checkpoint; nothing was saved"
    return (f"stopped after step {step}; the latest checkpoint is {latest} (with rollout.max_staleness >= 1 "
            "checkpoints are written at checkpoint.every_steps only)")


def summary(run_dir: Path, rows: list[dict]) -> str:
    """The run's last lines: its reward at the start and the end (means of 10 steps), the last evaluation, where
    the model is and the command that plots the run."""
    steps = [r for r in rows if r.get("step", 0) > 0 and isinstance(r.get("reward/mean"), (int, float))]
    parts = [f"evenrl: done: {len(steps)} steps in {run_dir}"]
    if steps:
        first, last = [r["reward/mean"] for r in steps[:10]], [r["reward/mean"] for r in steps[-10:]]
        parts.append(f"reward/mean {sum(first) / len(first):.3f} (first {len(first)} steps) -> "
                     f"{sum(last) / len(last):.3f} (last {len(last)})")
    evals = [r for r in rows if isinstance(r.get("eval/reward"), (int, float))]
    if evals:
        parts.append(f"eval/reward {evals[0]['eval/reward']:.3f} (step {evals[0]['step']}) -> "
                     f"{evals[-1]['eval/reward']:.3f} (step {evals[-1]['step']})")
    return "; ".join(parts) + (f"\n  model: {run_dir / 'final'}\n  plots: evenrl report {run_dir}")


FIRST_ERROR = "reward/first_error/"  # sampling.sample's (this rank's): for the warning below, not the metrics


def warn_reward_failures(cfg: RunConfig, step: int, metrics: dict, first_errors: dict) -> None:
    """Each reward entry that failed on more than rewards.warn_failed_share of the step's samples, with its first
    error (rank 0's; another rank's failures are counted but their messages stay there)."""
    samples = max(int(metrics.get("samples", 0)), 1)
    for key, n in metrics.items():
        if key.startswith("reward/failures/") and n / samples > cfg.rewards.warn_failed_share:
            name = key[len("reward/failures/"):]
            first = first_errors.get(FIRST_ERROR + name) or "the failures were on other ranks' samples"
            print(f"evenrl: warning: step {step}: reward {name} failed on {n} of {samples} samples (scored "
                  f"{'as masked' if cfg.rewards.on_failure == 'mask' else '0'}); first error: {first}", flush=True)


def warn_cut_calls(cfg: RunConfig, step: int, metrics: dict) -> bool:
    """Replies that ended at their token limit inside a tool call, which was never made (the environment was not
    called, an agent saw no tool call): warned once a run, with the step's counts (tools/cut_calls has every step's).
    True when it warned."""
    cut = metrics.get("tools/cut_calls", 0)
    if not cut:
        return False
    replies = round(metrics.get("rollout/turns_mean", 0.0) * metrics.get("samples", 0))
    print(f"evenrl: warning: step {step}: {cut} of {replies} replies ended at their token limit inside a tool call "
          f"(<tool_call> without </tool_call>), so those calls were never made; raise rollout.max_new_tokens "
          f"({cfg.rollout.max_new_tokens}) (warned once; tools/cut_calls counts them every step)", flush=True)
    return True


def warn_short_sampling(cfg: RunConfig, step: int, metrics: dict) -> None:
    """Dynamic sampling that ran out of rounds before it had data.prompts_per_step informative groups."""
    if metrics.get("sampling/groups_short", 0) > 0:
        kept = cfg.data.prompts_per_step - metrics["sampling/groups_short"]
        print(f"evenrl: warning: step {step}: dynamic sampling kept {kept} of {cfg.data.prompts_per_step} "
              f"groups ({metrics['samples']} samples) after {metrics['sampling/rounds']} rounds "
              f"(algo.max_generation_rounds); " + ("the step trains on those" if kept else
                                                  "nothing to train on in this step"), flush=True)


def device_row(plan) -> dict:
    """The run's devices by group, for its first metrics row: ranks, device, role and (training) token cap."""
    caps = {r: g.token_cap for g in plan.groups for r in g.group.ranks}
    lay = plan.layout
    return {"devices": [{"ranks": list(g.ranks), "device": g.device.describe(),
                         "role": "rollout" if g.ranks[0] >= lay.training_ranks else "train",
                         "token_cap": caps.get(g.ranks[0])} for g in lay.training_groups() + lay.rollout_groups()]}


def write_run_header(trainer: Trainer, plan, *, resumed_from: int | None) -> None:
    """Print the plan and dump the resolved config and plan into the run directory (rank 0)."""
    from evenrl.planner.render import render

    text = render(plan)
    print(text, flush=True)
    run_dir = Path(trainer.cfg.log.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_to_yaml(trainer.cfg))
    (run_dir / "plan.txt").write_text(text + "\n")
    (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=1))
    if resumed_from is not None:  # continuing (or restarted before the first checkpoint: from 0)
        _truncate_metrics(run_dir, resumed_from)
    if trainer.skipped_prompts:
        print(f"evenrl: skipped {trainer.skipped_prompts} prompts longer than "
              f"data.max_prompt_tokens={trainer.cfg.data.max_prompt_tokens}")


def _truncate_metrics(run_dir: Path, last_step: int) -> None:
    """After a resume, drop metric rows of steps the checkpoint does not contain (they are re-run); from step 0
    (a restart before the first checkpoint) that is every row, the step-0 evaluation included."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    keep = [row for row in read_metrics(run_dir) if row["step"] <= last_step] if last_step > 0 else []
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in keep))  # as RunLog writes them
    os.replace(tmp, path)
