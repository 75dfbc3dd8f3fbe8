"""Mixtures of experts (docs/moe.md): every router family evenrl knows, routed, recorded and replayed through the one
seam (evenrl.models.routing), the load-balancing loss against transformers' own, and the whole step on 1, 2 and 3
processes (one family: the others are covered by the single-process equivalences here).

Single process: each family's packed training forward against the model's own padded forward; replaying a
forward's own routes changes nothing, bit for bit; activation checkpointing's recompute replays what the forward
replayed; the hf engine's routes of every sampled token are the trainer's in fp32; a bf16 engine routes some tokens
elsewhere than an fp32 trainer, and replaying its routes lowers the log-prob mismatch; the load-balancing loss over
two micro-batches with global counts is transformers' load_balancing_loss_func on the whole batch, value and
gradient. Processes: one family's runs with the load-balancing loss on, in every replay mode, replicated on 3
ranks, sharded on 2, sequence-parallel on 2 with activation checkpointing: the 1-process model within 1e-5.
"""

from __future__ import annotations

import copy
import sys
from types import SimpleNamespace

import pytest
import torch

from e2e import BITWISE, assert_same_run, evenrl_many, final_params, max_diff, metrics, requests
from evenrl.config import RunConfig
from evenrl.core.batch import Batch, Ragged
from evenrl.core.moe import balance_loss, route_dtype
from evenrl.demo import write_addition_data
from evenrl.distributed.sequence import SequenceGroup, sequence_parallel
from evenrl.engines.base import SamplingParams
from evenrl.engines.hf import HFEngine, generate
from evenrl.errors import UsageError
from evenrl.models import routing
from evenrl.models.forward import response_logprobs
from evenrl.models.loading import load_policy, set_autocast
from evenrl.testing import MOE_ARCHS, make_tiny_model
from evenrl.train import moe
from evenrl.train.update import compute_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def moe_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {arch: make_tiny_model(str(root / arch), arch=arch, seed=3) for arch in MOE_ARCHS}


def packed(path):
    """(a model whose training forwards pack their rows, as evenrl trains a mixture of experts; its tokenizer)."""
    model, tok = load_policy(path)
    sequence_parallel(model, SequenceGroup(None, 1, 0))
    return model, tok


def rows_batch(seed: int = 1) -> Batch:
    """Four rows of different lengths; the longest is past gpt-oss's 8-token sliding window."""
    g = torch.Generator().manual_seed(seed)
    lengths, resp = [14, 9, 21, 5], [5, 3, 9, 2]
    return Batch({"tokens": Ragged.of([torch.randint(4, 60, (n,), generator=g) for n in lengths], torch.long),
                  "response_len": torch.tensor(resp)})


def weighted(outputs, mask):
    w = torch.linspace(-1.0, 1.5, outputs.shape[1])[None, :, None]
    return (outputs * w * mask[..., None]).sum()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_packed_forward_is_the_models_own_and_replay_changes_nothing(moe_paths, arch):
    """Each family through the packed forward (every MoE forward in training) against the model's own left-padded
    masked forward: log-probs, entropies and every gradient within 1e-5 (measured <= 2.4e-6). Recording its routes
    and replaying them gives the same outputs bit for bit (the family's weight rule is the router's own); replaying
    other experts changes them (so replay reaches the experts)."""
    reference, _ = load_policy(moe_paths[arch])
    model, _ = packed(moe_paths[arch])
    batch = rows_batch()
    out_ref, _, mask = response_logprobs(reference, batch, 0, entropy=True)
    with routing.options(model, record=True):
        out, _, _ = response_logprobs(model, batch, 0, entropy=True)
    recorded = routing.routing(model).plan.rows
    assert float((out - out_ref).detach()[mask].abs().max()) < 1e-5
    weighted(out_ref, mask).backward()
    weighted(out, mask).backward()
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()) if q.grad is not None]
    assert len(grads) == sum(p.requires_grad for p in reference.parameters())  # the routers' weights too
    assert max(float((a - b).abs().max()) for a, b in grads) < 1e-5

    state = routing.routing(model)
    assert recorded.values.dtype == torch.uint8 and recorded.values.shape[1:] == (state.layers, 2)
    assert recorded.lengths.tolist() == [n - 1 for n in batch["tokens"].lengths.tolist()]
    with torch.no_grad():
        replayed, _, _ = response_logprobs(model, Batch({**{k: batch[k] for k in batch.keys()}, "routes": recorded}),
                                           0, entropy=True)
        other = Ragged((recorded.values.long() + 1) % state.experts, recorded.lengths)
        moved, _, _ = response_logprobs(model, Batch({**{k: batch[k] for k in batch.keys()},
                                                      "routes": Ragged(other.values.to(torch.uint8), other.lengths)}),
                                        0, entropy=True)
    assert torch.equal(replayed[mask], out.detach()[mask])
    assert float((moved - replayed)[mask].abs().max()) > 1e-3
    # and with gradients: a second copy replaying the routes the first chose live gets every gradient bit for bit
    again, _ = packed(moe_paths[arch])
    out_again, _, _ = response_logprobs(again, Batch({**{k: batch[k] for k in batch.keys()}, "routes": recorded}),
                                        0, entropy=True)
    weighted(out_again, mask).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(again.parameters(), model.parameters())
               if q.grad is not None)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_activation_checkpointing_recomputes_the_replayed_routes(moe_paths, arch):
    """The routers run again in the backward of a checkpointed model; the plan is kept by router module, so the
    recompute replays what the forward replayed: gradients equal the uncheckpointed ones (1e-6) while replaying
    routes the routers would not choose (which move the outputs, see above)."""
    plain, _ = packed(moe_paths[arch])
    ckpt, _ = packed(moe_paths[arch])
    ckpt.gradient_checkpointing_enable()
    plain.train(), ckpt.train()
    batch = rows_batch(2)
    with routing.options(plain, record=True), torch.no_grad():
        response_logprobs(plain, batch, 0)
    rec = routing.routing(plain).plan.rows
    state = routing.routing(plain)
    batch["routes"] = Ragged(((rec.values.long() + 3) % state.experts).to(torch.uint8), rec.lengths)
    for m in (plain, ckpt):
        out, _, mask = response_logprobs(m, batch, 0, entropy=True)
        weighted(out, mask).backward()
    diffs = [float((p.grad - q.grad).abs().max()) for p, q in zip(plain.parameters(), ckpt.parameters())]
    assert max(diffs) < 1e-6


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_the_hf_engine_records_every_tokens_routes(moe_paths, arch):
    """rollout.router_replay=engine: each completion carries the experts every token but its last went to (the
    prompt's from the prefill, each sampled token's when it was fed; rows finishing early at various EOS tokens,
    dropped from the batch on the way). Replayed by the trainer in fp32 on the same weights they are its own
    choice (no token differs) and its log-probs are the engine's (< 1e-5); a sample's routes are the same when its
    prompt is generated alone."""
    model, tok = packed(moe_paths[arch])
    prompts = [tok(f"{i}+{3 * i + 1}=")["input_ids"] for i in range(6)]
    eos = set(range(10, 30))  # many stop tokens: rows end after 1..12 tokens
    params = SamplingParams(max_new_tokens=12, samples_per_prompt=3, seed=5)
    res = generate(model, requests(prompts, list(range(6)), 1), params, eos_token_ids=eos,
                   pad_token_id=tok.pad_token_id, record_routes=True)
    rows = [(p, c) for p, r in zip(prompts, res) for c in r]
    assert len({len(c.token_ids) for _, c in rows}) >= 4  # rows of many lengths: the batch shrank on the way
    assert all(c.routes.shape[0] == len(p) + len(c.token_ids) - 1 for p, c in rows)
    batch = Batch({"tokens": Ragged.of([torch.tensor(p + c.token_ids) for p, c in rows], torch.long),
                   "response_len": torch.tensor([len(c.token_ids) for _, c in rows]),
                   "engine_logp": Ragged.of([torch.tensor(c.logprobs) for _, c in rows], torch.float32),
                   "routes": Ragged.of([c.routes for _, c in rows], torch.uint8)})
    stats = moe.probe(model, batch, [list(range(len(batch)))], temperature=1.0, pad_token_id=tok.pad_token_id)
    assert stats["moe/routes_differ_any_layer"] == 0.0
    replayed = compute_logprobs(model, batch, [list(range(len(batch)))], temperature=1.0,
                                pad_token_id=tok.pad_token_id)
    assert max(float((t - torch.tensor(c.logprobs)).abs().max()) for t, (_, c) in zip(replayed, rows)) < 1e-5
    alone = generate(model, requests(prompts[2:3], [2], 1), params, eos_token_ids=eos, pad_token_id=tok.pad_token_id,
                     record_routes=True)[0]
    assert all(torch.equal(a.routes, b.routes) for a, b in zip(alone, res[2]))


def test_a_bf16_engine_routes_differently_and_replay_lowers_the_mismatch(moe_paths):
    """A bf16 engine (a copy of the weights under bf16 autocast, as a reserved rollout rank would hold them)
    against the fp32 trainer: some tokens' top-2 experts differ (measured 0.3 % and 1.7 % of tokens in the two
    layers, 2.0 % in either), and replaying the engine's routes lowers the engine-trainer log-prob mismatch, mean
    6.5e-4 -> 5.9e-4 and worst 0.016 -> 0.0039 (the rest is bf16 arithmetic, which replay cannot remove)."""
    trainer, tok = packed(moe_paths["qwen3_moe"])
    engine_model = copy.deepcopy(trainer)
    set_autocast(engine_model, torch.bfloat16)
    engine = HFEngine(engine_model, eos_token_ids={tok.eos_token_id}, pad_token_id=tok.pad_token_id,
                      record_routes=True)
    prompts = [tok(f"{i}+{3 * i + 1}=")["input_ids"] for i in range(16)]
    res = engine.generate(requests(prompts, list(range(16)), 1),
                          SamplingParams(max_new_tokens=16, samples_per_prompt=4, seed=2))
    rows = [c for r in res for c in r]
    batch = Batch({"tokens": Ragged.of([torch.tensor(p + c.token_ids) for p, r in zip(prompts, res) for c in r],
                                       torch.long),
                   "response_len": torch.tensor([len(c.token_ids) for c in rows]),
                   "engine_logp": Ragged.of([torch.tensor(c.logprobs) for c in rows], torch.float32),
                   "routes": Ragged.of([c.routes for c in rows], torch.uint8)})
    micro = [list(range(i, min(i + 16, len(batch)))) for i in range(0, len(batch), 16)]
    live = moe.probe(trainer, batch, micro, temperature=1.0, pad_token_id=tok.pad_token_id)
    assert live["moe/routes_differ_any_layer"] > 0.005 and min(live["moe/routes_differ"]) > 0
    assert live["moe/routes_differ_any_layer"] >= max(live["moe/routes_differ"])
    with routing.options(trainer, replay=False):
        own = compute_logprobs(trainer, batch, micro, temperature=1.0, pad_token_id=tok.pad_token_id)
    replayed = compute_logprobs(trainer, batch, micro, temperature=1.0, pad_token_id=tok.pad_token_id)
    gap = {name: torch.cat([(t - torch.tensor(c.logprobs)).abs() for t, c in zip(lp, rows)])
           for name, lp in (("own", own), ("replayed", replayed))}
    assert abs(float(gap["own"].mean()) - live["moe/logprob_mismatch_without_replay"]) < 1e-7
    assert float(gap["replayed"].mean()) < float(gap["own"].mean())
    assert float(gap["replayed"].max()) < float(gap["own"].max())


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_balance_loss_is_transformers_over_the_whole_batch(moe_paths, arch):
    """algo.router_aux_loss_coef's loss, built as the trainer builds it: two micro-batches (as two ranks would run
    them), the expert counts of both summed first, each forward adding its own tokens' share. The sum is
    transformers' load_balancing_loss_func on the whole batch's router logits (every token but each row's last,
    whose output predicts nothing), value and gradient within 1e-6; one micro-batch's own loss is not."""
    reference, _ = load_policy(moe_paths[arch])
    model, _ = packed(moe_paths[arch])
    state = routing.routing(model)
    batch = rows_batch(4)
    seqs = torch.split(batch["tokens"].values, batch["tokens"].lengths.tolist())
    logits = [reference(input_ids=s[None, :-1], output_router_logits=True).router_logits for s in seqs]
    layers = tuple(torch.cat([per_row[i] for per_row in logits]) for i in range(state.layers))
    hf_loss = sys.modules[type(reference).__module__].load_balancing_loss_func(layers, state.experts, state.top_k)
    hf_loss.backward()

    with routing.options(model, record=True), torch.no_grad():
        response_logprobs(model, batch, 0)
    recorded = routing.routing(model).plan.rows
    per_row = torch.split(recorded.values, recorded.lengths.tolist())

    def counted(rows):  # (top-k assignments per expert, tokens x layers) of these rows
        ids = torch.cat([per_row[r] for r in rows])
        return torch.bincount(ids.flatten().long(), minlength=state.experts).double(), float(ids[..., 0].numel())

    counts, routed = counted(range(len(batch)))
    total, alone = 0.0, 0.0
    for rows in ([0, 2], [1, 3]):
        with routing.options(model, balance=True):
            response_logprobs(model, batch.select(rows), 0)
        prob_sums = sum(state.plan.prob_sums.values())
        share = balance_loss(prob_sums, counts, routed, state.experts)
        share.backward()
        total += float(share)
        alone += float(balance_loss(prob_sums.detach(), *counted(rows), state.experts)) / 2  # each rank's own mean
    assert abs(total - float(hf_loss)) < 1e-6
    assert abs(alone - float(hf_loss)) > 1e-4
    diffs = [float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), reference.parameters())
             if q.grad is not None]
    assert len(diffs) > 0 and max(diffs) < 1e-6
    router = next(m for m in reference.modules() if type(m).__name__ in routing.FAMILIES)
    assert float(router.weight.grad.abs().max()) > 1e-4  # the loss moves the routers


def test_route_dtype_and_refusals(moe_paths):
    """Routes travel in the smallest integer dtype (uint8 up to 256 experts, DeepSeek-V3's count); what cannot be
    honoured by the model is refused in one line naming the setting: replay on a dense model; the load-balancing loss
    on a sigmoid router (DeepSeek-V3's, aux-loss-free). (Engine replay beside vLLM or an agent is a row of
    config.compatibility: tests/test_compatibility.py.)"""
    assert [route_dtype(e) for e in (8, 256, 257, 384, 1 << 15, 1 << 16)] == \
        [torch.uint8, torch.uint8, torch.int16, torch.int16, torch.int16, torch.int32]
    deepseek, _ = load_policy(moe_paths["deepseek_v3"])
    with pytest.raises(UsageError, match="algo.router_aux_loss_coef: got 0.01, but DeepseekV3ForCausalLM's router is "
                                         "aux-loss-free"):
        moe.check(RunConfig.model_validate({"algo": {"router_aux_loss_coef": 0.01}}), deepseek)
    moe.check(RunConfig.model_validate({"rollout": {"router_replay": "engine"}}), deepseek)
    dense, _ = load_policy(make_tiny_model(str(moe_paths["qwen3_moe"]) + "-dense", arch="qwen2"))
    with pytest.raises(UsageError, match="rollout.router_replay: got 'trainer', but model.path is not a mixture"):
        moe.check(RunConfig.model_validate({"rollout": {"router_replay": "trainer"}}), dense)


def test_vllm_routes_become_the_moe_layers_routes(moe_paths):
    """vLLM returns a sample's routes per computed token for every decoder layer, dense ones too
    (enable_return_routed_experts; GPU builds only, never run here): evenrl keeps the first prompt + tokens - 1 rows
    and its MoE layers' columns, found by decoder-layer index (DeepSeek-V3's layer 0 is dense), in the routes'
    dtype, and stops on routes that do not cover the sample."""
    import numpy as np

    from evenrl.engines.vllm_engine import VLLMEngine

    deepseek, _ = load_policy(moe_paths["deepseek_v3"])
    qwen, _ = load_policy(moe_paths["qwen3_moe"])
    assert routing.decoder_layers(deepseek) == [1] and routing.decoder_layers(qwen) == [0, 1]
    engine = SimpleNamespace(routes=(routing.decoder_layers(deepseek), routing.routing(deepseek).dtype))
    vllm_rows = np.arange(7 * 2 * 2, dtype=np.uint16).reshape(7, 2, 2) % 8  # 7 tokens, 2 decoder layers, top 2
    got = VLLMEngine._routes(engine, 5, vllm_rows)
    assert got.dtype == torch.uint8 and torch.equal(got, torch.as_tensor(vllm_rows[:5, 1:].astype("int64")).byte())
    with pytest.raises(RuntimeError, match="vLLM returned routes for 7 tokens of a sample's 9"):
        VLLMEngine._routes(engine, 9, vllm_rows)


# ------------------------------------------------------------------------------------------ real processes

@pytest.fixture(scope="module")
def layout_runs(moe_paths, tmp_path_factory):
    """One config (a tiny Qwen3-MoE, the load-balancing loss at 0.01, 2 mini-batches so that old log-probs are
    computed) on five layouts and replay modes, two runs at a time. Replay of fp32 engine routes routes as the
    trainer would (no token differs), so engine and trainer replay are one model; off recomputes each mini-batch's
    routes at its own weights, a different (equally exact) model, compared with its own 1-process run."""
    root = tmp_path_factory.mktemp("moe-runs")
    data = root / "addition.jsonl"
    write_addition_data(data)
    cfg = root / "cfg.yaml"
    cfg.write_text(f"""
model: {{path: {moe_paths['qwen3_moe']}}}
data: {{path: {data}, prompts_per_step: 4, max_prompt_tokens: 16}}
rollout: {{samples_per_prompt: 3, max_new_tokens: 4}}
rewards: {{functions: [{{name: exact_match}}, {{name: 'toy_rewards:digit_fraction', weight: 0.5}}]}}
algo: {{advantage: grpo, minibatches_per_step: 2, router_aux_loss_coef: 0.01}}
train: {{steps: 2, lr: 1.0e-3, token_cap_per_micro_batch: 24}}
log: {{progress: false, tensorboard: false}}
""")
    chat = make_tiny_model(str(root / "gpt_oss_chat"), arch="gpt_oss", chat_template="tools", seed=3)
    runs = {
        "three": ["--nproc-per-node", 3, "rollout.router_replay=trainer"],
        "bitwise_three": ["--nproc-per-node", 3, "rollout.router_replay=engine", BITWISE],
        "sp": ["--nproc-per-node", 2, "parallel.sequence_parallel_size=2", "model.gradient_checkpointing=true",
               "rollout.router_replay=trainer"],
        "fsdp": ["--nproc-per-node", 2, "parallel.sharding=fsdp"],
        "one": ["rollout.router_replay=engine"],
        "one_off": [],
        "bitwise_one": ["rollout.router_replay=engine", BITWISE],
        # one update per step: the routes every forward replays are those the model chooses (see the test)
        "one_mb1": ["rollout.router_replay=engine", "algo.minibatches_per_step=1"],
        "one_off_mb1": ["algo.minibatches_per_step=1"],
        # DeepSeek-V3's sigmoid router, aux-loss-free; gpt-oss's trajectories (turns re-prefilled, sinks, windows)
        # with LoRA on its attention
        "deepseek": [f"model.path={moe_paths['deepseek_v3']}", "algo.router_aux_loss_coef=0",
                     "rollout.router_replay=engine"],
        "multiturn": [f"model.path={chat}", "rollout.env=feedback", "rollout.max_turns=3",
                      "rollout.max_trajectory_tokens=64", "data.max_prompt_tokens=32", "model.lora.rank=4",
                      "rollout.router_replay=engine", "train.token_cap_per_micro_batch=512", "rewards.timeout_s=60"],
        # an agent's calls over the endpoint: chained calls, rewritten histories (split samples), rows without calls
        "agent": [f"model.path={chat}", "rollout.agent=toy_agents:mixed_or_silent", "rollout.max_new_tokens=6",
                  "rollout.max_trajectory_tokens=128", "data.max_prompt_tokens=48", "rollout.router_replay=engine",
                  "train.token_cap_per_micro_batch=512", "rollout.agent_timeout_s=60"],
    }
    evenrl_many({name: ["train", cfg, f"log.run_dir={root / name}", *more] for name, more in runs.items()})
    return root


@pytest.mark.slow
def test_moe_runs_are_the_same_on_any_layout(layout_runs, moe_paths):
    """Final weights within 1e-5 of the 1-process run after 2 steps, identical rewards, the same load-balancing
    loss: 3 replicated ranks (router_replay=trainer), 2 sequence-parallel ranks with activation checkpointing
    (trainer: each rank records its slice's routes, gathered to whole rows, and replays its slice), 2 FSDP2 ranks
    (off, each mini-batch's counts from a recording pass) against its own 1-process run.
    The weights moved, and the engine's fp32 routes are the trainer's own choice (no token differs)."""
    from safetensors.torch import load_file

    root = layout_runs
    for name, ref in (("three", "one"), ("sp", "one"), ("fsdp", "one_off")):
        assert max_diff(final_params(root / name), final_params(root / ref)) < 1e-5, name
        got, want = metrics(root / name), metrics(root / ref)
        assert [m["reward/mean"] for m in got] == [m["reward/mean"] for m in want], name
        assert all(abs(a["moe/aux_loss"] - b["moe/aux_loss"]) < 1e-5 for a, b in zip(got, want)), name
        assert [a["moe/load_max_over_mean"] for a in got] == [b["moe/load_max_over_mean"] for b in want], name
    start = load_file(f"{moe_paths['qwen3_moe']}/model.safetensors")
    assert max_diff(final_params(root / "one"), start) > 1e-3
    for m in metrics(root / "one"):
        assert m["moe/routes_differ_any_layer"] == 0.0 and m["moe/logprob_mismatch_without_replay"] < 1e-5
        assert 1.0 <= m["moe/load_max_over_mean_worst"] <= 8.0 and 1.5 < m["moe/aux_loss"] < 3.0


@pytest.mark.slow
def test_under_bitwise_the_same_bits_on_one_and_three_processes(layout_runs):
    """train.reproducibility=bitwise with the load-balancing loss and engine replay: weights and every metric the
    same bits on 1 and 3 processes, the loss's mean and the replay probe's log-prob mismatch added in sample order
    (their fp64 sums over ranks followed the layout), expert loads and routing counts exact integers. Negative
    control: the rounding runs differ."""
    one = layout_runs / "bitwise_one"
    assert_same_run(one, layout_runs / "bitwise_three")
    rows = [r for r in metrics(one) if r["step"] > 0]
    assert all(r["moe/aux_loss"] > 0 and "moe/logprob_mismatch_without_replay" in r for r in rows)
    assert max_diff(final_params(layout_runs / "one"), final_params(layout_runs / "three")) > 0.0


@pytest.mark.slow
def test_replay_is_the_models_own_routing_while_the_routes_agree(layout_runs):
    """Replaying the engine's routes is the model's own forward when they are the routes it would choose: with one
    update per step every forward of the step runs at the weights the engine sampled with, and the run with
    router_replay=engine equals the run with replay off bit for bit (metrics and final weights). With two
    mini-batches the second replays routes sampled before the first moved the weights: `moe/update_routes_differ*`
    counts the replayed tokens that its own routing would now send elsewhere (> 0: the two runs part there, by
    design: R3 trains the routes the engine used), and 0.0 where the update replays routes it recorded at its own
    weights (off, the load-balancing loss's counting pass)."""
    root = layout_runs
    assert final_params(root / "one_mb1").keys() == final_params(root / "one_off_mb1").keys()
    assert max_diff(final_params(root / "one_mb1"), final_params(root / "one_off_mb1")) == 0.0
    on, off = metrics(root / "one_mb1"), metrics(root / "one_off_mb1")
    shared = ("policy/loss", "grad_norm", "reward/mean", "moe/aux_loss", "moe/load_max_over_mean")
    assert [[m[k] for k in shared] for m in on] == [[m[k] for k in shared] for m in off]
    assert all(m["moe/update_routes_differ_any_layer"] == 0.0 for m in on + off)
    assert max(m["moe/update_routes_differ_any_layer"] for m in metrics(root / "one")) > 0.0
    assert all(m["moe/update_routes_differ_any_layer"] == 0.0 for m in metrics(root / "one_off"))
    assert max_diff(final_params(root / "one"), final_params(root / "one_off")) > 1e-6


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_packed_attention_keeps_a_sliding_window(kind):
    """The packed attention (every MoE forward, sequence parallelism, checkpointing) implements sliding windows as
    transformers' masks do (Mistral whenever set; Qwen2 with use_sliding_window past max_window_layers): log-probs
    within 1e-5 of the model's own forward on rows 2-3 windows long, where the window moves them by > 1e-3."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    def built(window):
        kw = dict(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, sliding_window=window)
        cfg = MistralConfig(**kw) if kind == "mistral" else \
            Qwen2Config(**kw, use_sliding_window=window is not None, max_window_layers=0)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg)

    reference, unwindowed = built(6), built(None)  # the same weights, with and without the window
    model = copy.deepcopy(reference)
    sequence_parallel(model, SequenceGroup(None, 1, 0))
    batch = rows_batch(5)
    want, _, mask = response_logprobs(reference, batch, 0)
    got, _, _ = response_logprobs(model, batch, 0)
    full, _, _ = response_logprobs(unwindowed, batch, 0)
    assert float((got - want).detach()[mask].abs().max()) < 1e-5
    assert float((full - want).detach()[mask].abs().max()) > 1e-3


@pytest.mark.slow
def test_replay_runs_on_deepseek_and_on_trajectories(layout_runs, moe_paths):
    """DeepSeek-V3 (sigmoid router): its weights move while its correction biases stay as the checkpoint has them (a
    buffer: no optimizer sees it); the engine's fp32 routes are the trainer's own choice. gpt-oss trajectories of up
    to 3 turns with LoRA adapters on its attention: each trajectory's routes (its last call's, which re-prefilled the
    whole history) line up with its tokens, so replaying them leaves the trainer's log-probs on the engine's
    (< 1e-5, no token routed differently). The same for an agent's samples (toy_agents:mixed_or_silent): each holds
    its last endpoint call's routes, a sample split off by a rewritten history its own, a trajectory whose agent
    made no call its prompt's (measured: 1.1e-7 and 1.4e-7 mean, as without replay, 0 tokens routed differently)."""
    from safetensors.torch import load_file

    root = layout_runs
    start, final = load_file(f"{moe_paths['deepseek_v3']}/model.safetensors"), final_params(root / "deepseek")
    biases = [k for k in start if k.endswith("e_score_correction_bias")]
    assert biases and all(torch.equal(start[k], final[k]) for k in biases)
    assert float(start[biases[0]].abs().max()) > 0.01
    assert max(float((start[k] - final[k]).abs().max()) for k in start if k not in biases) > 1e-3
    for run in ("deepseek", "multiturn", "agent"):
        for m in metrics(root / run):
            assert m["moe/routes_differ_any_layer"] == 0.0, run
            assert m["rollout/logprob_mismatch"] < 1e-5 and m["moe/logprob_mismatch_without_replay"] < 1e-5, run
    assert max(m["rollout/turns_mean"] for m in metrics(root / "multiturn")) > 1.5
    agent = metrics(root / "agent")
    assert sum(m["agent/split_samples"] for m in agent) > 0 and sum(m["agent/chained_calls"] for m in agent) > 0
    assert all(m["reward/failures"] > 0 for m in agent)  # the rows whose agent made no call

