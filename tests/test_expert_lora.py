"""model.lora.experts: LoRA on a mixture's fused experts (evenrl.models.expert_lora; docs/moe.md, docs/lora.md).

What is compared, and how closely:
  * in this process, Qwen3-MoE and gpt-oss (its experts are [E, in, out], the others' [E, out, in]; the other four
    families measured alike, not run here): the adapters
    change the model; disabled, it is the base bit for bit (the KL reference); saved in PEFT's format and loaded by
    peft (`PeftModel`, its target_parameters) the same logits (<= 1e-6; measured 0.0: peft folds the update with the
    same baddbmm), peft's merge_and_unload within 1e-5; what reaches an hf engine, the adapters pushed into another
    adapted copy, the same logits (<= 1e-6; measured 0.0), the merged weights into a plain base within 1e-5 (the
    experts' folded as the forward folds them, the attention's merged by peft: W + BA in another order).
  * `evenrl train`, 2 steps (engine router replay, the load-balancing loss, a KL reference): 1 process against
    EP = 2 on 2 processes, replicated and FSDP2, the final adapters within 1e-5 and moved, identical rewards and
    expert load; the 1-process run's final/ loads in peft, final/merged/ too.
  * the plan: the experts' adapters counted by hand (divided by EP as the experts are) and their folded weights;
    experts on a dense model an error finding; dropout refused in one line.
EP splitting the adapters with the experts (logits bit for bit, gradients within 1e-8, generation on the gathered
experts, the merged push) is tests/test_expert_parallel.py's test_a_model_with_experts_split_over_two_ranks_...
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from e2e import evenrl_many, max_diff, metrics
from evenrl.config import load_config
from evenrl.demo import write_addition_data
from evenrl.models.loading import load_policy
from evenrl.testing import make_tiny_model

X = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [12, 11, 10, 9, 8, 7, 6, 5]])


def _adapted(path: str, seed: int):
    """The model at `path` with LoRA rank 4 on its attention and its experts, B drawn non-zero."""
    from evenrl.config import RunConfig
    from evenrl.models.lora import add_adapters

    model, _ = load_policy(path)
    torch.manual_seed(seed)
    add_adapters(model, RunConfig().model.lora.model_copy(update={"rank": 4, "alpha": 8.0, "experts": True}))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])  # experts [E, out, in]; [E, in, out]
@torch.no_grad()
def test_adapters_on_the_experts_load_in_peft_and_reach_engines(tmp_path, arch):
    from peft import PeftModel

    from evenrl.engines.hf import HFEngine
    from evenrl.engines.payload import make_payload, merged_weights
    from evenrl.models.lora import adapter_config, adapters_disabled, is_adapter, save_adapter

    path = make_tiny_model(str(tmp_path / arch), arch=arch, seed=1)
    model, base = _adapted(path, seed=0), load_policy(path)[0]
    ours, plain = model(X).logits, base(X).logits
    assert float((ours - plain).abs().max()) > 1e-2  # the adapters matter
    experts = [n for n, _ in model.named_parameters() if ".experts.adapters.lora_" in n]
    assert len(experts) == 4 * sum(1 for n, _ in model.named_modules() if n.endswith("mlp.experts"))
    assert all(p.requires_grad == is_adapter(n) for n, p in model.named_parameters())
    with adapters_disabled(model):
        assert torch.equal(model(X).logits, plain)

    save_adapter(adapter_config(model), ((n, p) for n, p in model.state_dict().items() if is_adapter(n)), tmp_path)
    assert adapter_config(model).target_parameters == ["experts.gate_up_proj", "experts.down_proj"]
    peft_model = PeftModel.from_pretrained(load_policy(path)[0], str(tmp_path)).eval()
    assert float((peft_model(X).logits - ours).abs().max()) <= 1e-6
    assert float((peft_model.merge_and_unload()(X).logits - ours).abs().max()) <= 1e-5

    cfg = load_config(None, ["model.lora.rank=4", "model.lora.experts=true"])
    copy = _adapted(path, seed=1)  # other adapters, overwritten by the push (a reserved hf rollout rank's copy)
    HFEngine(copy, eos_token_ids={1}, pad_token_id=0).update_weights(make_payload(cfg, model)())
    assert float((copy(X).logits - ours).abs().max()) <= 1e-6
    # the merged push (engines that cannot load adapters): the experts folded as their forward folds them
    HFEngine(base, eos_token_ids={1}, pad_token_id=0).update_weights(merged_weights(model, dtype=torch.float32))
    assert float((base(X).logits - ours).abs().max()) <= 1e-5  # the attention's merged by peft: W + BA, not Wx + BAx


# ------------------------------------------------------------------------------------------ real runs

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """1 process, EP = 2 on 2 processes replicated, EP = 2 under FSDP2: a tiny Qwen3-MoE, LoRA rank 4 on its
    attention and experts, engine router replay, the load-balancing loss at 0.01, a KL reference (the adapters off),
    2 mini-batches a step, 2 steps."""
    root = tmp_path_factory.mktemp("expert_lora")
    model = make_tiny_model(str(root / "model"), arch="qwen3_moe", seed=3)
    write_addition_data(root / "addition.jsonl")
    cfg = root / "cfg.yaml"
    cfg.write_text(f"""
model: {{path: {model}, lora: {{rank: 4, experts: true}}}}
data: {{path: {root / 'addition.jsonl'}, prompts_per_step: 4, max_prompt_tokens: 16}}
rollout: {{samples_per_prompt: 3, max_new_tokens: 4, router_replay: engine}}
rewards: {{functions: [{{name: exact_match}}, {{name: 'toy_rewards:digit_fraction', weight: 0.5}}]}}
algo: {{advantage: grpo, minibatches_per_step: 2, router_aux_loss_coef: 0.01, kl_coef: 0.01}}
train: {{steps: 2, lr: 1.0e-2, token_cap_per_micro_batch: 24}}
log: {{progress: false, tensorboard: false}}
""")
    ep2 = ["--nproc-per-node", 2, "parallel.expert_parallel_size=2"]
    evenrl_many({"one": ["train", cfg, f"log.run_dir={root / 'one'}", "log.save_merged=true"],
                 "ep2": ["train", cfg, f"log.run_dir={root / 'ep2'}", *ep2],
                 "ep2_fsdp": ["train", cfg, f"log.run_dir={root / 'ep2_fsdp'}", *ep2, "parallel.sharding=fsdp"]})
    return root


def _adapter(run: Path) -> dict:
    return load_file(str(run / "final" / "adapter_model.safetensors"))


@pytest.mark.slow
def test_expert_parallel_runs_train_the_one_process_adapters(runs):
    """EP = 2 splits the experts' adapters with the experts (each rank 4 of 8 experts' pairs, their gradients
    complete after the backward exchange); FSDP2 shards them in the experts' unit over the ranks holding the same
    experts. After 2 steps both are the 1-process adapters within 1e-5 (measured 3.3e-6, the experts' adapters'
    the largest: AdamW turning the reduction's rounding into a step), the experts' adapters moved, the same rewards,
    expert load and load-balancing loss, and the engine's routes the trainer's own."""
    one = _adapter(runs / "one")
    experts = [k for k in one if ".mlp.experts." in k]
    assert len(experts) == 8 and max(float(one[k].abs().max()) for k in experts if "lora_B" in k) > 1e-3
    for name in ("ep2", "ep2_fsdp"):
        assert max_diff(_adapter(runs / name), one) < 1e-5, name
        got, want = metrics(runs / name), metrics(runs / "one")
        assert [m["reward/mean"] for m in got] == [m["reward/mean"] for m in want], name
        assert [m["moe/load_max_over_mean"] for m in got] == [m["moe/load_max_over_mean"] for m in want], name
        assert all(abs(a["moe/aux_loss"] - b["moe/aux_loss"]) < 1e-5 for a, b in zip(got, want)), name
        assert all(m["moe/routes_differ_any_layer"] == 0.0 and m["kl"] >= 0 for m in got), name


@pytest.mark.slow
@torch.no_grad()
def test_the_final_adapter_is_peft_s_and_merges(runs):
    """final/ is PEFT's files (adapter_config.json names the experts as target_parameters) and loads onto the base in
    peft, every tensor found; final/merged/ (peft's merge_and_unload of it) gives its logits within 1e-5."""
    import json
    import warnings

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    final = runs / "one" / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # peft warns of adapter tensors it did not find
        adapted = PeftModel.from_pretrained(load_policy(config["base_model_name_or_path"])[0], str(final)).eval()
    merged = AutoModelForCausalLM.from_pretrained(final / "merged", local_files_only=True)
    base = load_policy(config["base_model_name_or_path"])[0]
    assert float((adapted(X).logits - base(X).logits).abs().max()) > 1e-4
    assert float((merged(X).logits - adapted(X).logits).abs().max()) <= 1e-5


# ------------------------------------------------------------------------------------------ the plan

QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
                 "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                 "tie_word_embeddings": False}


def test_the_plan_counts_the_experts_adapters_by_hand():
    """Qwen3-30B-A3B, LoRA rank 16 on attention and experts, 8 GPUs: 629 M expert adapter parameters (rank x (in +
    out) for gate_up 2048 -> 1536 and down 768 -> 2048, 128 experts, 48 layers), each rank holding 1/8 of them with
    EP 8 (replicated: 16 bytes each, weights, gradients, AdamW); the update holds every MoE layer's folded experts
    (16 of them in bf16) without activation checkpointing, one layer's with it; a push sends all the adapters."""
    from evenrl.planner.adapters import adapter_params, expert_adapter_params
    from evenrl.planner.dims import dims_from_config
    from evenrl.planner.layout import make_layout
    from evenrl.planner.memory import GIB, estimate_memory
    from evenrl.planner.timing import push_bytes

    d = dims_from_config(QWEN3_30B_A3B)
    Ae = 48 * 128 * 16 * ((2048 + 2 * 768) + (768 + 2048))
    assert expert_adapter_params(d, 16) == Ae == 629_145_600
    A = adapter_params(d, 16, [], experts=True)
    assert A == adapter_params(d, 16, []) + Ae
    base = ["model.dtype=bfloat16", "model.lora.rank=16", "data.max_prompt_tokens=64", "rollout.max_new_tokens=64",
            "parallel.expert_parallel_size=8"]
    lay = make_layout(1, 8, device="cuda", device_memory_gib=80)
    attn = estimate_memory(load_config(None, base), lay, d).breakdown
    lora = estimate_memory(load_config(None, [*base, "model.lora.experts=true"]), lay, d).breakdown
    here = Ae / 8
    assert lora["optimizer"] - attn["optimizer"] == pytest.approx(8 * here / GIB)
    assert lora["gradients"] - attn["gradients"] == pytest.approx(4 * here / GIB)
    assert lora["parameters"] - attn["parameters"] == pytest.approx(4 * here / GIB)
    folded = 2 * 16 * 3 * 2048 * 768  # one MoE layer's 16 local experts in bf16
    assert lora["activations"] - attn["activations"] == pytest.approx(48 * folded / GIB)
    ckpt = [*base, "model.gradient_checkpointing=true"]
    assert (estimate_memory(load_config(None, [*ckpt, "model.lora.experts=true"]), lay, d).breakdown["activations"]
            - estimate_memory(load_config(None, ckpt), lay, d).breakdown["activations"]) == pytest.approx(folded / GIB)
    cfg = load_config(None, [*base, "model.lora.experts=true"])
    assert push_bytes(cfg, d) == 4 * A


def test_experts_take_no_dropout_in_one_line():
    from evenrl.errors import UsageError

    with pytest.raises(UsageError) as e:
        load_config(None, ["model.lora.rank=8", "model.lora.experts=true", "model.lora.dropout=0.05"])
    said = str(e.value)
    assert "\n" not in said and "model.lora" in said and "no dropout" in said and "model.lora.dropout=0" in said
