"""Qwen3-VL and Qwen3-VL-MoE (docs/vision.md, docs/moe.md): tiny random models made on the spot, EasyR1's Qwen3-VL-30B-A3B
geometry workload planned from its published config.json (tests/fixtures/qwen3-vl-30b-a3b, no weights).

In this process: both tiny models' hf sampler against the training forward (log-probs within 1e-5 in fp32; the
MoE's recorded routes replayed as the trainer's own), both models' packed training forward with images (each row's
M-RoPE positions, the DeepStack features, placeholders sampled in responses) against the model's own padded forward
(log-probs, entropies and every gradient), replay of its own routes bit for bit, LoRA on its attention, the
planner's dimensions of both towers against the tiny models' own parameter counts. Real processes (gloo): the MoE
with engine replay and the load-balancing loss on 1 process and on 3 under FSDP2 with activation checkpointing, on
data that mixes image and text prompts (a sharded forward without images runs a blank image): final weights within
1e-5 after 2 steps, the weights moved.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from e2e import evenrl_many, final_params, max_diff, metrics, requests
from evenrl.core.batch import Batch, Ragged
from evenrl.distributed.sequence import SequenceGroup, sequence_parallel
from evenrl.engines import HFEngine, SamplingParams
from evenrl.models import routing
from evenrl.models.forward import response_logprobs
from evenrl.models.loading import load_policy
from evenrl.models.vision import encode_vision_prompt, image_inputs, load_image_processor
from evenrl.testing import make_tiny_model, write_geometry_data
from evenrl.train import moe
from evenrl.train.update import compute_logprobs

TOL = 1e-5
FIXTURE = Path(__file__).parent / "fixtures" / "qwen3-vl-30b-a3b"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_vl")
    return {arch: make_tiny_model(str(root / arch), arch=arch, chat_template=True)
            for arch in ("qwen3_vl", "qwen3_vl_moe")}


def _png(w: int, h: int, seed: int = 0) -> bytes:
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def trainer_model(path: str, arch: str):
    """(the model as evenrl trains it, its tokenizer): its rows packed with their images (parallelize.split_sequences)."""
    model, tok = load_policy(path)
    sequence_parallel(model, SequenceGroup(None, 1, 0))
    return model, tok


def rows_batch(rows, dim: int, sampled=None) -> Batch:
    """A micro-batch of (prompt ids, response ids, ImageInputs or None) rows with the image columns (and, with the
    `sampled` completions of a mixture of experts, their log-probs and routes)."""
    cols = {"tokens": Ragged.of([torch.tensor(p + r) for p, r, _ in rows], torch.long),
            "response_len": torch.tensor([len(r) for _, r, _ in rows]),
            "pixel_values": Ragged.of([x.pixel_values if x else torch.zeros(0, dim) for *_, x in rows], torch.float32),
            "image_grid_thw": Ragged.of([x.grid if x else torch.zeros(0, 3, dtype=torch.long) for *_, x in rows],
                                        torch.long)}
    if sampled is not None:
        cols["routes"] = Ragged.of([c.routes for c in sampled], torch.uint8)
        cols["engine_logp"] = Ragged.of([torch.tensor(c.logprobs) for c in sampled], torch.float32)
    return Batch(cols)


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_vl_moe"])
def test_the_sampler_and_the_trainer_agree(paths, arch):
    """16-pixel patches: a 56x56 image is 4 image tokens, 224x168 is 35 (10 x 14 patches merged 2 x 2), 1,536 values
    per patch. The hf sampler (images in its prefill, the model's own forward) and the training forward (the MoE's
    packed one, replaying the routes the sampler recorded) give the sampled tokens' log-probs within 1e-5 in fp32;
    the replayed routes are the trainer's own choice (no token routed elsewhere)."""
    model, tok = trainer_model(paths[arch], arch)
    processor = load_image_processor(paths[arch], min_pixels=None, max_pixels=None)
    ids = encode_vision_prompt(tok, processor, model.config, "<image>and <image>: x=", [(56, 56), (224, 168)], False)
    inputs = image_inputs(processor, [_png(56, 56), _png(224, 168, 1)])
    assert ids.count(model.config.image_token_id) == 4 + 35 and inputs.grid.tolist() == [[1, 4, 4], [1, 10, 14]]
    assert inputs.pixel_values.shape == (16 + 140, 1536)
    text = tok("7+1=")["input_ids"]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, samples_per_prompt=2, seed=3)
    moe_model = arch == "qwen3_vl_moe"
    engine = HFEngine(model, eos_token_ids=set(), pad_token_id=tok.pad_token_id, record_routes=moe_model)
    done = engine.generate(requests([ids, text], [0, 1], 1, images=[inputs, None]), params)
    rows = [(ids if p == 0 else text, c.token_ids, inputs if p == 0 else None) for p, cs in enumerate(done) for c in cs]
    sampled = [c for cs in done for c in cs]
    batch = rows_batch(rows, 1536, sampled if moe_model else None)
    micro = [[0, 3], [1, 2]]
    trainer = compute_logprobs(model, batch, micro, temperature=1.0, pad_token_id=tok.pad_token_id)
    assert max(float((lp - torch.tensor(c.logprobs)).abs().max()) for c, lp in zip(sampled, trainer)) <= TOL
    if moe_model:
        assert all(c.routes.shape[0] == len(p) + len(r) - 1 for (p, r, _), c in zip(rows, sampled))
        stats = moe.probe(model, batch, micro, temperature=1.0, pad_token_id=tok.pad_token_id)
        assert stats["moe/routes_differ_any_layer"] == 0.0


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_vl_moe"])
def test_the_packed_forward_with_images_is_the_models_own(paths, arch):
    """Qwen3-VL's and Qwen3-VL-MoE's packed forward (how evenrl trains them) on rows with one and two images, a text
    row and image placeholders sampled in responses, against the model's own left-padded forward: log-probs and
    entropies, and every parameter's gradient (the tower, its DeepStack mergers and the routers included), within
    1e-5. Replaying the routes the MoE recorded gives its outputs and gradients bit for bit (the router family's rule
    is the router's own); replaying other experts moves them (replay reaches the experts)."""
    path, moe_model = paths[arch], arch == "qwen3_vl_moe"
    reference, tok = load_policy(path)
    model, _ = trainer_model(path, arch)
    processor = load_image_processor(path, min_pixels=None, max_pixels=None)
    cfg, image = model.config, model.config.image_token_id
    one = encode_vision_prompt(tok, processor, cfg, "<image>x=", [(56, 56)], False)
    two = encode_vision_prompt(tok, processor, cfg, "two <image> and <image>: y=", [(112, 112), (224, 168)], False)
    a, b = image_inputs(processor, [_png(56, 56)]), image_inputs(processor, [_png(112, 112, 1), _png(224, 168, 2)])
    rows = [(one, [5, 9, image, 11, 12], a), (tok("7+1=")["input_ids"], [image, 3, 8], None),
            (two, [20, 31, 9, 40, 7, 33, 12], b), (one, [9, 10], a)]
    batch = rows_batch(rows, 1536)
    out_ref, _, mask = response_logprobs(reference, batch, 0, entropy=True)
    with routing.options(model, record=True) if moe_model else contextlib.nullcontext():
        out, _, _ = response_logprobs(model, batch, 0, entropy=True)
    assert float((out - out_ref).detach()[mask].abs().max()) <= TOL
    weight = torch.linspace(-1.0, 1.5, out.shape[1])[None, :, None] * mask[..., None]
    (out_ref * weight).sum().backward()
    (out * weight).sum().backward()
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()) if q.grad is not None]
    assert len(grads) == sum(p.requires_grad for p in reference.parameters())
    assert max(float((g - h).abs().max()) for g, h in grads) <= TOL
    deepstack = reference.model.visual.deepstack_merger_list[0].linear_fc2.weight.grad
    assert float(deepstack.abs().max()) > 1e-6  # the DeepStack features reach the loss
    if not moe_model:
        return
    recorded = routing.routing(model).plan.rows
    assert recorded.lengths.tolist() == [len(p) + len(r) - 1 for p, r, _ in rows]
    again, _ = trainer_model(path, "qwen3_vl_moe")
    replayed, _, _ = response_logprobs(again, Batch({**batch, "routes": recorded}), 0, entropy=True)
    (replayed * weight).sum().backward()
    assert torch.equal(replayed[mask], out[mask])
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(again.parameters(), model.parameters()))
    other = Ragged(((recorded.values.long() + 1) % 8).to(torch.uint8), recorded.lengths)
    with torch.no_grad():
        moved, _, _ = response_logprobs(again, Batch({**batch, "routes": other}), 0, entropy=True)
    assert float((moved - replayed.detach())[mask].abs().max()) > 1e-3


@pytest.mark.parametrize("experts", [False, True])
def test_lora(paths, experts):
    """model.lora on Qwen3-VL-MoE: adapters on the text attention (neither the tower nor the router), and with
    model.lora.experts on its fused experts too (models.expert_lora), the only trainable parameters; through the
    packed forward with images they get the padded forward's gradients (1e-5)."""
    from evenrl.config.schema import LoraConfig
    from evenrl.models.lora import add_adapters, default_targets

    path = paths["qwen3_vl_moe"]
    reference, tok = load_policy(path)
    model, _ = trainer_model(path, "qwen3_vl_moe")
    assert default_targets(model) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    for m in (reference, model):
        torch.manual_seed(0)
        add_adapters(m, LoraConfig(rank=4, experts=experts))
        for name, p in m.named_parameters():  # B starts at 0: move it, so that A gets a gradient too
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(name)))
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    attention = [n for n in trained if "self_attn" in n]
    assert len(attention) == 16 and all("lora_" in n and "visual" not in n for n in trained)
    assert len(trained) == 16 + (8 if experts else 0)  # A and B of gate_up_proj and down_proj in 2 MoE layers
    processor = load_image_processor(path, min_pixels=None, max_pixels=None)
    ids = encode_vision_prompt(tok, processor, model.config, "<image>x=", [(112, 112)], False)
    batch = rows_batch([(ids, [5, 9, 11], image_inputs(processor, [_png(112, 112)])),
                        (tok("7+1=")["input_ids"], [8, 12], None)], 1536)
    for m in (reference, model):
        out, _, mask = response_logprobs(m, batch, 0)
        out[..., 0][mask].sum().backward()
    diffs = [float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), reference.parameters())
             if p.requires_grad]
    assert len(diffs) == len(trained) and max(diffs) <= TOL
    assert min(float(p.grad.abs().max()) for p in model.parameters() if p.requires_grad) > 0


# ------------------------------------------------------------------------------------ the planner

@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_vl_moe"])
def test_planner_dims_are_the_models_parameters(paths, arch):
    """The planner's count of each tiny model's parameters from its config.json alone (the tower's learned
    positions, biases and DeepStack mergers; the text model's q/k norms and experts) is the model's own."""
    from evenrl.planner.dims import read_model_dims

    dims = read_model_dims(paths[arch])
    model, _ = load_policy(paths[arch])
    tower = sum(p.numel() for p in model.model.visual.parameters())
    assert dims.vision.params == tower and dims.vision.deepstack == 2 and dims.vision.patch == 16
    assert dims.params == sum(p.numel() for p in model.parameters()) - tower
    assert (dims.experts, dims.top_k, dims.moe_layers) == ((8, 2, 2) if arch == "qwen3_vl_moe" else (0, 0, 0))


def test_easyr1_qwen3_vl_30b_a3b_geometry_plan(tmp_path):
    """EasyR1's geometry example with Qwen3-VL-30B-A3B (its published config.json) on 8 x 80 GB: 30.5 B text
    parameters (3.35 B active), a 0.54 B tower whose patch costs 0.15 of a token's active compute (0.014 of a whole
    MoE layer's), 32 x 32 pixels per image token; its vLLM engine is refused in one line (never run), and with the
    hf engine replaying its routes the plan counts the tower and the route records."""
    from test_foreign import ns

    from evenrl.config import with_settings
    from evenrl.models.vision_config import vision_token_weight
    from evenrl.planner.dims import read_model_dims
    from evenrl.planner.peers import read_foreign, translate
    from evenrl.planner.plan import make_plan

    dims = read_model_dims(str(FIXTURE))
    assert round(dims.params / 1e9, 1) == 30.5 and round(dims.active_params / 1e9, 2) == 3.35
    assert round(dims.vision.params / 1e9, 2) == 0.54 and dims.vision.image_tokens(1024 * 1024) == 1024
    assert round(vision_token_weight(dims.layers, dims.active_layer_params, dims.vision), 2) == 0.15
    assert round(vision_token_weight(dims.layers, dims.layer_params, dims.vision), 3) == 0.014
    example = Path(__file__).resolve().parents[1] / "examples" / "easyr1_geo3k.yaml"
    data = read_foreign("easyr1", str(example), [f"worker.actor.model.model_path={FIXTURE}",
                                                 "trainer.n_gpus_per_node=8", "worker.rollout.tensor_parallel_size=1"])
    t, cfg = translate("easyr1", data, ns(device_memory_gib=80))
    refused = [f for f in make_plan(cfg, t.layout).findings if f.rule == "vllm-vision-moe"]
    assert len(refused) == 1 and refused[0].level == "error" and refused[0].fix == "rollout.engine=hf"
    hf = with_settings(cfg, {"rollout.engine": "hf", "rollout.router_replay": "engine", "data.prompts_per_step": 64})
    plan = make_plan(hf, t.layout)
    assert not [f for f in plan.findings if f.rule in ("vllm-vision-moe", "router-unknown", "packed-attention")]
    assert plan.vision_tokens == round(2048 * 4 * 0.1506) and plan.memory.breakdown["route records"] > 0
    assert plan.memory.breakdown["vision activations"] > 0 and plan.memory.params == 31_070_754_032


# ------------------------------------------------------------------------------------ real processes

@pytest.fixture(scope="module")
def vlm_runs(paths, tmp_path_factory):
    """EasyR1's geometry workload (test_vision's Geometry3K-shaped rows, every other one without its image) on the
    tiny Qwen3-VL-MoE with engine replay and the load-balancing loss, 2 steps of 4 mini-batches (a prompt's 2
    samples each): 1 process, and 3 under FSDP2 with activation checkpointing. 2 samples per mini-batch on 3 ranks:
    a rank runs a zero-weight filler forward in each mini-batch, which holds no image and so runs the blank one
    (every rank gathers and reduces the tower); a text prompt's mini-batch gives the tower no gradient on one
    process and only the blank image's zeros under FSDP2, which update.minibatch_update drops (AdamW would move
    the tower by its momentum: 1 vs 3 processes 2.1e-3 apart before, bitwise on a tiny Qwen2-VL)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("qwen3_vl_moe_runs")
    data = write_geometry_data(str(root / "geo3k.parquet"))
    rows = pq.read_table(data).to_pylist()
    for row in rows[1::2]:
        row.update(images=[], problem=row["problem"].replace("<image>", ""))
    pq.write_table(pa.Table.from_pylist(rows), data)
    cfg = root / "geo.yaml"
    cfg.write_text(f"""
model: {{path: {paths['qwen3_vl_moe']}}}
data: {{path: {data}, prompt_field: problem, image_key: images, prompts_per_step: 4, max_prompt_tokens: 80}}
rollout: {{samples_per_prompt: 2, max_new_tokens: 4, router_replay: engine}}
rewards: {{functions: [{{name: math}}, {{name: 'toy_rewards:digit_fraction', weight: 0.5}}]}}
algo: {{minibatches_per_step: 4, router_aux_loss_coef: 0.01}}
train: {{steps: 2, lr: 1.0e-3, token_cap_per_micro_batch: 200}}
log: {{progress: false, tensorboard: false}}
""")
    runs = {"one": [], "fsdp3": ["--nproc-per-node", "3", "parallel.sharding=fsdp",
                                 "model.gradient_checkpointing=true"]}
    evenrl_many({name: ["train", cfg, f"log.run_dir={root / name}", *more] for name, more in runs.items()})
    return {name: root / name for name in runs}


@pytest.mark.slow
def test_qwen3_vl_moe_on_one_and_three_processes(paths, vlm_runs):
    """Final weights within 1e-5 of the 1-process run after 2 steps (and moved from the model's start), identical
    rewards and expert loads, the load-balancing loss within 1e-6, the engine's routes the trainer's own."""
    from safetensors.torch import load_file

    one, three = (final_params(vlm_runs[n]) for n in ("one", "fsdp3"))
    start = load_file(str(Path(paths["qwen3_vl_moe"]) / "model.safetensors"))
    assert max_diff(start, one) > 1e-5 and max_diff(one, three) <= TOL
    a, b = metrics(vlm_runs["one"]), metrics(vlm_runs["fsdp3"])
    assert [r["reward/mean"] for r in a] == [r["reward/mean"] for r in b] and max(r["reward/mean"] for r in a) > 0
    assert [r["moe/load_max_over_mean"] for r in a] == [r["moe/load_max_over_mean"] for r in b]
    assert all(abs(x["moe/aux_loss"] - y["moe/aux_loss"]) < 1e-6 for x, y in zip(a, b))
    assert all(r["moe/routes_differ_any_layer"] == 0.0 and r["rollout/logprob_mismatch"] < 1e-6 for r in a + b)
    assert all(r["samples"] == 8 and len(r["load/rank_tokens"]) == 3 for r in b)  # a filler in each mini-batch
