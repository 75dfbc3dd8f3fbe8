"""Ulysses sequence parallelism (evenrl.distributed.sequence + evenrl.models.split_forward) against the unsplit
computation: one spawn of 2 gloo processes (an SP group of 2) runs every case, each rank also computing the
single-process reference on its own copy of the model.

Compared: the per-token log-probs and entropies of a packed micro-batch of rows of different lengths (a multi-turn
loss mask's worth of prompt tokens in the middle of the packed row, rows cut across the two slices), and the
parameter gradients of a loss built from them, summed over the group (what the trainer's gradient all-reduce does).
Gradients are compared directly (no optimizer step), so AdamW's eps cannot amplify float noise here; the end-to-end
runs below compare trained models within 1e-5 after AdamW steps whose gradients stand well above eps (lr 1e-3 on
the shared config, as tests/test_train.py's layout test does).
Cases: GQA with KV heads divisible by the group, KV heads repeated (one KV head over 2 ranks), Llama, activation
checkpointing, LoRA adapters (peft), the critic's value head; and the size-1 group (a checkpointed model's packed
rows) against the padded forward on one process.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from e2e import free_port, spawn
from evenrl.core.batch import Batch, Ragged
from evenrl.distributed import collectives as dist
from evenrl.distributed.sequence import SequenceGroup, sequence_parallel
from evenrl.models.forward import response_logits, response_logprobs
from test_dist import ENV_KEYS



def tiny(arch: str = "qwen2", kv_heads: int = 2, *, seed: int = 0, value_head: bool = False):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    kw = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=kv_heads, max_position_embeddings=256, tie_word_embeddings=False)
    cfg = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}[arch](**kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if value_head:  # a critic: the output layer gives one number per position
        model.lm_head = torch.nn.Linear(32, 1, bias=True)
    return model


def micro_batch(seed: int = 1) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths, resp = [23, 9, 31, 4], [10, 3, 17, 1]
    rows = [torch.randint(1, 40, (n,), generator=g) for n in lengths]
    return Batch({"tokens": Ragged.of(rows, torch.long), "response_len": torch.tensor(resp)})


def loss_of(outputs, mask):
    w = torch.linspace(-1.0, 1.5, outputs.shape[1])[None, :, None]
    return (outputs * w * mask[..., None]).sum()


def run_case(name: str, sp: SequenceGroup) -> dict:
    arch = name if name in ("llama", "qwen3") else "qwen2"
    model = tiny(arch, kv_heads=1 if name == "repeat_kv" else 2, value_head=name == "critic")
    if name == "lora":
        from peft import LoraConfig, inject_adapter_in_model

        model = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                   init_lora_weights=False), model)
    reference = copy.deepcopy(model)
    if name == "checkpointing":
        model.gradient_checkpointing_enable()
    sequence_parallel(model, sp)
    batch = micro_batch()
    out = {}
    for label, m in (("split", model), ("reference", reference)):
        m.train()
        if name == "critic":
            outputs, targets, mask = response_logits(m, batch, 0)
        else:
            outputs, targets, mask = response_logprobs(m, batch, 0, entropy=True, entropy_grad=True)
        loss_of(outputs, mask).backward()
        grads = {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}
        if label == "split":  # the trainer sums gradients over ranks
            for g in grads.values():
                dist.all_reduce_sum(g)
        out[label] = {"outputs": (outputs * mask[..., None]).detach(), "targets": targets[mask], "grads": grads}
    return out


CASES = ["gqa", "repeat_kv", "llama", "checkpointing", "lora", "critic"]


def _worker(rank: int, world: int, port: int, path: str) -> None:
    torch.set_num_threads(1)
    for k in ENV_KEYS:
        os.environ.pop(k, None)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init(timeout=60, sequence_parallel=world)
    sp = dist.sequence_group()
    result = {name: run_case(name, sp) for name in CASES}
    dist.shutdown()
    torch.save(result, f"{path}.{rank}")
    os._exit(0)  # saved; Python's finalization of torch's modules would cost each rank ~0.5 s of CPU, spawn waits


def assert_same(got: dict, want: dict, what: str, tol: float = 1e-6) -> None:
    assert torch.equal(got["targets"], want["targets"]), f"{what}: targets differ"
    d = float((got["outputs"] - want["outputs"]).abs().max())
    assert d <= tol, f"{what}: per-token outputs differ by {d}"
    assert got["grads"].keys() == want["grads"].keys(), f"{what}: different parameters got gradients"
    for k, g in want["grads"].items():
        d = float((got["grads"][k] - g).abs().max())
        assert d <= tol * max(1.0, float(g.abs().max())), f"{what}: gradient of {k} differs by {d}"


@pytest.mark.slow
def test_sequence_parallel_equals_the_unsplit_forward(tmp_path):
    path = str(tmp_path / "out")
    spawn(_worker, args=(2, free_port(), path), nprocs=2)
    per_rank = [torch.load(f"{path}.{r}", weights_only=True) for r in range(2)]
    for r, res in enumerate(per_rank):
        for name in CASES:
            assert_same(res[name]["split"], res[name]["reference"], f"rank {r}, {name}")


def test_packed_rows_of_a_group_of_one_equal_the_padded_forward():
    """The packed path (a group of one: how a Qwen2, a Qwen3 with its q/k norms, or any checkpointed model trains,
    parallelize.split_sequences) vs the model's own padded forward."""
    for name in ("gqa", "qwen3", "checkpointing"):
        res = run_case(name, SequenceGroup(None, 1, 0))
        assert_same(res["split"], res["reference"], name)


@pytest.mark.slow
def test_sequence_parallel_run_resumes_a_one_process_checkpoint(shared_runs, tmp_path):
    """The shared config's 1-process run (shared_runs.one) checkpointed at step 2; its steps 3-4 then run on an SP
    group of 2 with FSDP2 (--resume at another layout): the same rewards and the same model within 1e-5."""
    from e2e import copy_checkpoint, evenrl, final_params, max_diff, metrics

    run = copy_checkpoint(shared_runs.one, 2, tmp_path / "sp")
    evenrl("train", *shared_runs.args, f"log.run_dir={run}", "--resume", "--nproc-per-node", 2,
           "parallel.sequence_parallel_size=2", "parallel.sharding=fsdp")
    one, split = metrics(shared_runs.one), metrics(run)
    assert [r["step"] for r in split] == [r["step"] for r in one]
    assert [r.get("reward/mean") for r in split] == [r.get("reward/mean") for r in one]
    assert [r.get("eval/reward") for r in split] == [r.get("eval/reward") for r in one]
    for x, y in zip(one[-2:], split[-2:]):  # the statistics are counted once per group, not once per rank
        assert abs(x["policy/loss"] - y["policy/loss"]) <= 1e-6 and x["samples"] == y["samples"]
    assert max_diff(final_params(shared_runs.one), final_params(run)) <= 1e-5


@pytest.mark.large_world
def test_two_sequence_parallel_groups_train_the_one_process_model(assets, tmp_path):
    """DP 2 x SP 2 on 4 processes with activation checkpointing against 1 process (the assets' config, 2 steps of 7
    prompts x 3 samples in 2 mini-batches): the same rewards and the same model within 1e-5.

    And train.reproducibility=bitwise with SP 2 under FSDP2: one SP group (2 processes) and two (4) are one run, the
    same bits (weights, every step's metrics and weights/hash: each group's gradients summed in fixed point over the
    data and sp ranks, FSDP2's reduce-scatter in fixed point). Negative control: SP 2 on 2 and on 4 processes under
    rounding differ. Not claimed: SP 2's bits equal one process's (an SP rank projects its part of the sequence, a
    matrix product of other shape; measured 5.3e-7 apart after 3 steps)."""
    from e2e import BITWISE, assert_same_run, evenrl_many, final_params, max_diff, metrics

    sp, fsdp = ["parallel.sequence_parallel_size=2", "model.gradient_checkpointing=true"], "parallel.sharding=fsdp"
    runs = {"dp2sp2": ["--nproc-per-node", 4, *sp], "dp2sp2_bitwise": ["--nproc-per-node", 4, *sp, fsdp, BITWISE],
            "sp2_bitwise": ["--nproc-per-node", 2, *sp, fsdp, BITWISE], "sp2": ["--nproc-per-node", 2, *sp],
            "one": []}
    evenrl_many({name: ["train", assets["cfg"], f"log.run_dir={tmp_path / name}", *more]
                 for name, more in runs.items()})
    one, split = tmp_path / "one", tmp_path / "dp2sp2"
    assert [r.get("reward/mean") for r in metrics(split)] == [r.get("reward/mean") for r in metrics(one)]
    assert max_diff(final_params(one), final_params(split)) <= 1e-5
    assert_same_run(tmp_path / "sp2_bitwise", tmp_path / "dp2sp2_bitwise")
    assert max_diff(final_params(tmp_path / "sp2"), final_params(split)) > 0.0
