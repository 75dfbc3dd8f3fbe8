"""Supervised warm start on the same data core, schedule and launcher as `evenrl train`.

    evenrl sft examples/demo.yaml sft.steps=300                 # one process
    evenrl sft examples/demo.yaml --nproc-per-node 2            # two local processes

Each row's target is its answer followed by EOS, after the (templated) prompt; the loss is the token-mean
negative log-likelihood of the target tokens over the whole step, exact on any number of ranks.
Writes the tuned model to `log.run_dir/final` (a Hugging Face directory; with model.lora the adapter in PEFT's
format, and with log.save_merged the merged model in final/merged/) and metrics to `log.run_dir`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from evenrl.config import RunConfig, config_to_yaml
from evenrl.core.batch import Batch, Ragged
from evenrl.core.model_plan import plan_of
from evenrl.distributed import collectives as dist
from evenrl.distributed.exact import ElementwiseAdamW
from evenrl.models.forward import response_logprobs
from evenrl.train.data import PromptSampler, load_data
from evenrl.train.optimizer import make_adamw
from evenrl.train.reduction import reduction_of
from evenrl.train import determinism, rundir
from evenrl.train.checkpoint import save_final
from evenrl.config.compatibility import SFT_RULES
from evenrl.planner.compatibility import check_run
from evenrl.train.runlog import RunLog
from evenrl.train.trackers import Trackers, check_reachable
from evenrl.train.trainer import trainable_model
from evenrl.train.update import minibatch_denominators, minibatch_update


def sft(cfg: RunConfig, *, overwrite: bool = False) -> Path:
    rundir.check(cfg.log.run_dir, resume=False, overwrite=overwrite)
    check_run(cfg, rollout_devices=0, rules=SFT_RULES)  # as the launcher did: no row of them is about the device
    check_reachable(cfg)  # a tracker's server, before anything loads
    determinism.environment(cfg)
    mesh = dist.from_config(cfg, rollout=False)
    determinism.settle(cfg, mesh.device)  # bitwise: one CPU thread, deterministic kernels
    if dist.is_main():
        rundir.prepare(cfg.log.run_dir, overwrite=overwrite)
    dist.barrier()
    torch.manual_seed(cfg.train.seed)
    model, tokenizer = trainable_model(cfg, cfg.model.path, mesh)  # the whole model, or with model.lora its adapters
    rows, prompt_tokens, _ = load_data(cfg, tokenizer)
    eos = tokenizer.eos_token_id
    targets = [tokenizer.encode(str(r["answer"]), add_special_tokens=False) + ([eos] if eos is not None else [])
               for r in rows]
    sampler = PromptSampler(len(rows), cfg.data.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    kind = ElementwiseAdamW if cfg.train.reproducibility == "bitwise" else torch.optim.AdamW
    # bf16 weights: their Kahan-compensated AdamW (evenrl.train.optimizer, which refuses it under bitwise)
    opt = make_adamw(params, cfg, cfg.sft.lr) if cfg.model.weights_dtype == "bfloat16" else \
        kind(params, lr=cfg.sft.lr, weight_decay=cfg.train.weight_decay)
    run_dir = Path(cfg.log.run_dir)
    log = RunLog(str(run_dir), enabled=dist.is_main(), trackers=Trackers(cfg, run_dir) if dist.is_main() else None,
                 progress_total=cfg.sft.steps, progress=cfg.log.progress, shown={"sft/nll": "nll"})
    log.write_text("config.yaml", config_to_yaml(cfg))

    def loss_fn(outputs, tgt, mask, mb):
        nll = -outputs[..., 0]
        return nll, {"sft/nll": ((nll.detach() * mask).sum(), mask.sum())}

    for step in range(1, cfg.sft.steps + 1):
        ids = sampler.next_prompts(cfg.sft.rows_per_step)
        seqs = [prompt_tokens[i] + targets[i] for i in ids]
        # sequence parallelism: a group of S ranks trains its rows together, each a slice of every micro-batch
        group, groups = dist.data_parallel()
        # the model's reduction cuts the micro-batches: under bitwise the same on any layout (train.reduction)
        schedule = reduction_of(model).schedule([len(s) for s in seqs], world=groups,
                                                token_cap=cfg.train.token_cap_per_micro_batch * mesh.sp,
                                                min_rows=cfg.train.min_rows_per_micro_batch,
                                                packed=plan_of(model).sequence is not None)
        mine = schedule.rank_rows(group)
        batch = Batch({
            "tokens": Ragged.of([torch.tensor(seqs[i], dtype=torch.long) for i in mine], torch.long),
            "response_len": torch.tensor([len(targets[ids[i]]) for i in mine], dtype=torch.long),
            "sample_index": torch.tensor(mine, dtype=torch.long),
        })
        pos = {row: j for j, row in enumerate(mine)}
        micro = [[pos[r] for r in m.rows] for m in schedule.minibatches[0].per_rank[group]]
        denom = minibatch_denominators([len(targets[i]) for i in ids], schedule.minibatches[0].rows)
        stats = minibatch_update(model, opt, None, batch, micro, denom, loss_fn=loss_fn, stat_names=["sft/nll"],
                                 forward=functools.partial(response_logprobs, pad_token_id=tokenizer.pad_token_id),
                                 aggregation="token-mean", max_grad_norm=cfg.train.max_grad_norm,
                                 pad_token_id=tokenizer.pad_token_id, reduction=reduction_of(model))
        log.metrics(step, stats)
    save_final(model, tokenizer, run_dir / "final", merged=cfg.log.save_merged)
    log.close()
    dist.barrier()
    dist.shutdown()  # the process group ends here, not in the interpreter's exit (evenrl.train.loop.train says why)
    return run_dir

