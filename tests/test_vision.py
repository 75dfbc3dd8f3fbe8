"""Vision-language RL (Qwen2-VL, Qwen2.5-VL) on tiny random models made on the spot: EasyR1's geometry workload.

In this process: loading and prompt encoding, the image column's layouts and every bad image as one line (train and
plan), the schedule with the vision encoder's work, the sampler's log-probs against the training forward, the
planner (memory, findings, EasyR1's geometry config), Geometry3K answers. Real processes (gloo, `vl_runs`): the same
model on 1 and 3 processes replicated and sharded (activation checkpointing on), a frozen vision tower bit-unchanged
(bf16, a reserved rollout rank), resume 3 -> 2 processes, a vision-language model on text under FSDP (every forward
runs the tower, so the ranks' collectives meet).
vLLM is not tested with images: its Qwen2-VL code needs torchvision, which this CPU set-up cannot install (the
engine and the plan refuse it here, tested below).
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from e2e import (BITWISE, assert_same_run, copy_checkpoint, evenrl, evenrl_here, evenrl_many, final_params, max_diff,
                 metrics, requests)
from evenrl.config import RunConfig
from evenrl.core.batch import Batch, Ragged
from evenrl.core.schedule import make_schedule
from evenrl.demo import write_addition_data
from evenrl.distributed.sequence import SequenceGroup, sequence_parallel
from evenrl.engines import HFEngine, SamplingParams
from evenrl.errors import UsageError
from evenrl.models.loading import load_policy
from evenrl.models.vision import encode_vision_prompt, image_inputs, load_image_processor
from evenrl.testing import make_tiny_model, write_geometry_data
from evenrl.data.prompts import load_prompts
from evenrl.train.data import load_data, take_images
from evenrl.train.update import compute_logprobs

TOL = 1e-5


@pytest.fixture(scope="session")
def vl(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    model = make_tiny_model(str(root / "qwen2_vl"), arch="qwen2_vl", chat_template=True)
    data = write_geometry_data(str(root / "geo3k.parquet"))
    cfg = root / "geo.yaml"
    cfg.write_text(f"""
model: {{path: {model}}}
data: {{path: {data}, prompt_field: problem, image_key: images, prompts_per_step: 6, max_prompt_tokens: 80}}
rollout: {{samples_per_prompt: 3, max_new_tokens: 4}}
rewards: {{functions: [{{name: math}}, {{name: 'toy_rewards:digit_fraction', weight: 0.5}}]}}
algo: {{minibatches_per_step: 2}}
train: {{steps: 2, lr: 1.0e-3, token_cap_per_micro_batch: 200}}
log: {{progress: false, tensorboard: false}}
""")
    return {"root": root, "model": model, "data": data, "cfg": cfg}


def _png(w: int, h: int, seed: int = 0) -> bytes:
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


# ------------------------------------------------------------------------------------ models, prompts, data

@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_tiny_vl_models_load_with_their_processor_and_sample_what_the_trainer_scores(arch, tmp_path):
    """The image tokens of a prompt are its grid / merge^2; the hf sampler's log-probs of the tokens it drew equal
    the training forward's on the same rows (images in the Batch columns, packed with each row's M-RoPE positions, as
    parallelize.split_sequences has it train) at fp32 level, for both towers."""
    path = make_tiny_model(str(tmp_path / arch), arch=arch)
    model, tok = load_policy(path)
    sequence_parallel(model, SequenceGroup(None, 1, 0))
    processor = load_image_processor(path, min_pixels=None, max_pixels=None)
    assert type(processor).__name__ == "Qwen2VLImageProcessorPil"
    images = [_png(56, 56), _png(224, 168, 1)]
    ids = encode_vision_prompt(tok, processor, model.config, "<image>and <image>: x=", [(56, 56), (224, 168)], False)
    assert ids.count(model.config.image_token_id) == 4 + 48
    inputs = image_inputs(processor, images)
    assert inputs.grid.tolist() == [[1, 4, 4], [1, 12, 16]] and inputs.pixel_values.shape == (16 + 192, 1176)
    text_ids = tok("7+1=")["input_ids"]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, samples_per_prompt=2, seed=3)
    engine = HFEngine(model, eos_token_ids=set(), pad_token_id=tok.pad_token_id)
    done = engine.generate(requests([ids, text_ids], [0, 1], 1, images=[inputs, None]), params)
    rows = [(ids if p == 0 else text_ids, c, inputs if p == 0 else None) for p, cs in enumerate(done) for c in cs]
    batch = Batch({"tokens": Ragged.of([torch.tensor(p + c.token_ids) for p, c, _ in rows], torch.long),
                   "response_len": torch.tensor([len(c.token_ids) for _, c, _ in rows]),
                   "pixel_values": Ragged.of([x.pixel_values if x else torch.zeros(0, 1176) for *_, x in rows],
                                             torch.float32),
                   "image_grid_thw": Ragged.of([x.grid if x else torch.zeros(0, 3, dtype=torch.long)
                                                for *_, x in rows], torch.long)})
    trainer = compute_logprobs(model, batch, [[0, 3], [1, 2]], temperature=1.0, pad_token_id=tok.pad_token_id)
    for (_, c, _), lp in zip(rows, trainer):
        assert torch.allclose(lp, torch.tensor(c.logprobs), atol=2e-5), (lp, c.logprobs)
    alone = engine.generate(requests([ids], [0], 1, images=[inputs]), params)  # a sample is its key's, batch or not
    assert [c.token_ids for c in alone[0]] == [c.token_ids for c in done[0]]


def test_image_column_layouts_and_chat_messages(tmp_path):
    """EasyR1's layout ({bytes, path} dicts in parquet; file paths relative to a jsonl) and chat messages whose
    image parts carry their image or take the image column's, in prompt order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png(56, 56))
    pq.write_table(pa.Table.from_pylist([{"problem": "<image>x=", "answer": "1",
                                          "images": [{"bytes": _png(56, 56), "path": None}]}]), tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_text(json.dumps({"problem": "two <image> and <image>", "answer": "2",
                                                  "images": ["img/a.png", {"bytes": None, "path": "img/a.png"}]}) + "\n")
    msgs = [{"role": "user", "content": [{"type": "image", "image": "img/a.png"}, {"type": "text", "text": "x="},
                                          {"type": "image"}]}]
    (tmp_path / "m.jsonl").write_text(json.dumps({"prompt": msgs, "answer": "3", "pics": ["img/a.png"]}) + "\n")
    rows = load_prompts(str(tmp_path / "d.parquet"), prompt_field="problem", image_key="images")
    assert isinstance(rows[0]["images"][0], bytes)
    rows = load_prompts(str(tmp_path / "d.jsonl"), prompt_field="problem", image_key="images")
    assert rows[0]["images"] == [str(tmp_path / "img" / "a.png")] * 2
    rows = load_prompts(str(tmp_path / "m.jsonl"), image_key="pics")
    assert rows[0]["images"] == [str(tmp_path / "img" / "a.png")] * 2 and rows[0]["prompt"][0]["content"][0] == \
        {"type": "image"}
    with pytest.raises(UsageError, match="m.jsonl line 1: the prompt has 1 image slot"):  # nothing fills the bare part
        load_prompts(str(tmp_path / "m.jsonl"))
    with pytest.raises(UsageError, match="d.jsonl line 1: 2 images, more than data.max_images_per_prompt=1"):
        load_prompts(str(tmp_path / "d.jsonl"), prompt_field="problem", image_key="images", max_images=1)
    model = make_tiny_model(str(tmp_path / "vl"), arch="qwen2_vl", chat_template=True)
    m, tok = load_policy(model)
    cfg = RunConfig.model_validate({"model": {"path": model}, "data": {"path": str(tmp_path / "d.jsonl"),
                                   "prompt_field": "problem", "image_key": "images", "max_prompt_tokens": 64}})
    rows, tokens, _ = load_data(cfg, tok, vision=(load_image_processor(model, min_pixels=None, max_pixels=None),
                                                  m.config))
    assert tokens[0].count(m.config.image_token_id) == 8 and len(take_images(rows)[0]) == 2 and "images" not in rows[0]
    bigger = cfg.model_copy(update={"data": cfg.data.model_copy(update={"min_pixels": 112 * 112})})
    _, tokens, _ = load_data(bigger, tok, vision=(load_image_processor(model, min_pixels=112 * 112,
                                                                       max_pixels=None), m.config))
    assert tokens[0].count(m.config.image_token_id) == 32  # data.min_pixels scales 56x56 up to 112x112


# ------------------------------------------------------------------------------------ bad images: one line

def _header_png(w: int, h: int) -> bytes:
    """A PNG that declares w x h pixels (its header alone): what a 20,000 x 20,000 image looks like to a reader."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


BAD_IMAGES = [
    ("truncated", lambda d: (d / "x.png").write_bytes(_png(112, 112)[:2000]) and "x.png", "is truncated or corrupt"),
    ("not-an-image", lambda d: (d / "x.png").write_bytes(b"hello") and "x.png", "is not an image"),
    ("missing", lambda d: "nope.png", "nope.png (data.image_key) does not exist"),
    ("20000x20000", lambda d: (d / "x.png").write_bytes(_header_png(20_000, 20_000)) and "x.png",
     "(data.image_key) is 400,000,000 pixels, over evenrl's limit of 89,478,485"),  # Pillow's refusal
    ("10000x10000", lambda d: (d / "x.png").write_bytes(_header_png(10_000, 10_000)) and "x.png",
     "(data.image_key) is 100,000,000 pixels, over evenrl's limit of 89,478,485"),
    ("wrong-type", lambda d: 7, "an image (data.image_key) is int"),
]


@pytest.mark.parametrize("make, needle", [b[1:] for b in BAD_IMAGES], ids=[b[0] for b in BAD_IMAGES])
def test_bad_images_are_one_line_exit_2_nothing_written(vl, tmp_path, capsys, make, needle):
    (tmp_path / "ok.png").write_bytes(_png(56, 56))
    bad = make(tmp_path)
    data = tmp_path / "geo.jsonl"
    data.write_text("".join(json.dumps({"problem": "<image>x=", "answer": "1", "images": [img]}) + "\n"
                            for img in ["ok.png", bad]))
    run = tmp_path / "run"
    code, out, err = evenrl_here(capsys, "train", vl["cfg"], f"data.path={data}", f"log.run_dir={run}")
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "geo.jsonl line 2" in lines[0] and needle in lines[0] and len(lines[0]) < 200, lines[0]
    assert not run.exists()
    code, out, _ = evenrl_here(capsys, "plan", vl["cfg"], f"data.path={data}")
    assert code == 1 and needle in out.replace("\n" + " " * 10, " "), out
    assert "image" in out.split("fix:")[1] and "prompt_field" not in out.split("fix:")[1]  # the image's fix


def test_image_settings_the_run_cannot_take(vl, capsys):
    """On a text model, pixel bounds the wrong way round, vLLM without torchvision, a critic: plan errors."""
    text = make_tiny_model(str(vl["root"] / "text"), hidden=16, layers=1, heads=2)
    code, out, _ = evenrl_here(capsys, "plan", vl["cfg"], f"model.path={text}")
    assert code == 1 and "vision-settings: data.image_key=images but model.path holds a text model" in out
    code, out, _ = evenrl_here(capsys, "plan", vl["cfg"], "data.min_pixels=5000", "data.max_pixels=4000",
                               "rollout.engine=vllm", "algo.advantage=gae")
    assert code == 1 and all(f"ERROR   {r}" in out for r in ("pixel-bounds", "vllm-vision", "critic-vision")), out
    from evenrl.engines.vllm_engine import require_vision

    with pytest.raises(UsageError, match="torchvision, which is not installed here"):  # the engine's own refusal
        require_vision()


# ------------------------------------------------------------------------------------ the schedule's balance

def test_large_images_are_spread_by_their_vision_tokens():
    """A Geometry3K-like step: 8 prompts x 3 samples, 2 prompts with a large image (256 image tokens, 1,024
    patches at 0.23 tokens of compute each), the rest small. Per-rank tokens (text + image + vision encoder) on 3
    ranks are within 3% with the encoder's term, and an equal-count split of the same step is far off
    (benchmarks/vision.py times both, and the schedule without the encoder's term)."""
    big = {1, 6}
    lengths, vision = [], []
    for p in range(8):
        image = 256 if p in big else 4
        for s in range(3):
            lengths.append(20 + image + 5 + 3 * s)
            vision.append(round(image * 4 * 0.23))
    cost = [a + b for a, b in zip(lengths, vision)]
    groups = [i // 3 for i in range(24)]
    sch = make_schedule(lengths, world=3, token_cap=10_000, groups=groups, extra=vision)
    loads = [sum(cost[i] for m in micros for i in m.rows) for micros in sch.minibatches[0].per_rank]
    assert max(loads) / (sum(cost) / 3) < 1.03, loads
    assert sch.rank_loads() == [sum(len(m.rows) * max(lengths[i] for i in m.rows) + sum(vision[i] for i in m.rows)
                                    for m in micros if m.rows) for micros in sch.minibatches[0].per_rank]
    equal = [sum(cost[r * 8:(r + 1) * 8]) for r in range(3)]
    assert max(equal) / (sum(cost) / 3) > 1.3, equal
    capped = make_schedule(lengths, world=1, token_cap=600, extra=vision)
    assert all(m.tokens <= 600 or len(m.rows) == 1 for m in capped.minibatches[0].per_rank[0])


# ------------------------------------------------------------------------------------ planner, peers, rewards

QWEN25_VL_7B = {"model_type": "qwen2_5_vl", "hidden_size": 3584, "intermediate_size": 18944,
                "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                                  "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                                  "temporal_patch_size": 2}}


def test_plan_of_easyr1_geometry_counts_the_vision_encoder(tmp_path):
    """EasyR1's geometry config (examples/easyr1_geo3k.yaml) on 6 GPUs with a local Qwen2.5-VL-7B config: its
    settings mapped, its 512-on-6 failure named, the encoder's ~0.68 B parameters and its activations in the
    estimate, less optimizer state when it is frozen."""
    from test_foreign import config_only_model, ns

    from evenrl.planner.peers import read_foreign, translate
    from evenrl.planner.plan import make_plan

    model = config_only_model(tmp_path / "qwen25vl", QWEN25_VL_7B)
    (model / "preprocessor_config.json").write_text(json.dumps({"max_pixels": 12845056, "min_pixels": 3136}))
    example = Path(__file__).resolve().parents[1] / "examples" / "easyr1_geo3k.yaml"
    data = read_foreign("easyr1", str(example), [f"worker.actor.model.model_path={model}", "trainer.n_gpus_per_node=6",
                                                 "worker.rollout.limit_images=1"])
    t, cfg = translate("easyr1", data, ns(device_memory_gib=80))
    assert "only support equal chunk. Got size of DataProto 512 and chunk 6." in [c.message for c in t.checks]
    d = cfg.data
    assert (d.image_key, d.min_pixels, d.max_pixels, d.max_images_per_prompt) == ("images", 262144, 4194304, 1)
    assert any("tensor_parallel_size=2" in n for n in t.notes)
    plan = make_plan(cfg, t.layout)
    assert 670e6 < plan.dims.vision.params < 680e6 and plan.vision_tokens == round(2048 * 4 * 0.0966)
    mem = plan.memory
    assert mem.breakdown["vision activations"] > 0 and mem.params > 8.2e9
    frozen = make_plan(cfg.model_copy(update={"model": cfg.model.model_copy(update={"freeze_vision_tower": True})}),
                       t.layout).memory
    assert frozen.host_gib < mem.host_gib  # EasyR1's offload: the state lives on the host


@pytest.mark.parametrize("completion, gold, score", [
    ("<think>..</think> \\boxed{B}", "B", 1.0), ("\\boxed{(B) 12}", "B", 1.0), ("\\boxed{B: 12}", "(B)", 1.0),
    ("\\boxed{C}", "B", 0.0), ("\\boxed{12}", "B", 0.0), ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", 1.0),
    ("\\boxed{40/3}", "\\frac{40}{3}", 1.0), ("\\boxed{60^\\circ}", "60", 1.0), ("\\boxed{3.46}", "2\\sqrt{3}", 0.0),
])
def test_math_reward_scores_geometry3k_answers(completion, gold, score):
    from evenrl.rewards.math import math_reward

    assert math_reward(completion, {"answer": gold}) == score


# ------------------------------------------------------------------------------------ real processes

@pytest.fixture(scope="session")
def vl_runs(vl, tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_runs")
    text = root / "add.jsonl"
    write_addition_data(text)
    base = ["train", vl["cfg"], f"eval.path={vl['data']}", "eval.max_prompts=6"]
    on_text = ["train", vl["cfg"], f"data.path={text}", "data.prompt_field=prompt", "data.image_key=''",
               "data.max_prompt_tokens=16", "train.steps=1", "rewards.functions=[{name: exact_match}, "
               "{name: 'toy_rewards:digit_fraction', weight: 0.5}]"]
    runs = {"three": [*base, "--nproc-per-node", "3"], "bitwise_three": [*base, BITWISE, "--nproc-per-node", "3"],
            "fsdp3": [*base, "--nproc-per-node", "3", "parallel.sharding=fsdp", "model.gradient_checkpointing=true",
                      "checkpoint.every_steps=1"],  # its step-1 checkpoint: the resume test's start
            "frozen_reserved": ["train", vl["cfg"], "--nproc-per-node", "3", "--rollout-devices", "1",
                                "model.freeze_vision_tower=true", "model.dtype=bfloat16"],
            "text_fsdp2": [*on_text, "--nproc-per-node", "2", "parallel.sharding=fsdp"],
            "one": base, "bitwise_one": [*base, BITWISE], "text_one": on_text}
    done = evenrl_many({name: [*args, f"log.run_dir={root / name}"] for name, args in runs.items()})
    return {name: root / name for name in runs} | {"stdout": {n: p.stdout for n, p in done.items()}}


@pytest.mark.slow
def test_geometry_on_one_and_three_processes_replicated_and_sharded(vl_runs):
    """Same rewards and evaluation, final weights within 1e-5: 1 process, 3 replicated, 3 FSDP2 with activation
    checkpointing (the vision blocks are FSDP units and checkpointed layers too)."""
    one = metrics(vl_runs["one"])
    assert one[1]["reward/mean"] > 0 and "load/rank_vision_tokens" in one[1]
    for name in ("three", "fsdp3"):
        other = metrics(vl_runs[name])
        assert [r.get("reward/mean") for r in other] == [r.get("reward/mean") for r in one]
        assert [r.get("eval/reward") for r in other] == [r.get("eval/reward") for r in one]
        assert max_diff(final_params(vl_runs["one"]), final_params(vl_runs[name])) <= TOL, name
    assert len(metrics(vl_runs["three"])[1]["load/rank_vision_tokens"]) == 3
    assert (vl_runs["one"] / "final" / "preprocessor_config.json").is_file()


@pytest.mark.slow
def test_geometry_under_bitwise_is_the_same_bits_on_one_and_three_processes(vl_runs):
    """train.reproducibility=bitwise with images: weights, rewards, evaluation and every metric the same bits on 1
    and 3 processes (each rank's images in canonical micro-batches). Negative control: under rounding they differ."""
    assert_same_run(vl_runs["bitwise_one"], vl_runs["bitwise_three"])
    assert "eval/reward" in metrics(vl_runs["bitwise_one"])[0]
    assert max_diff(final_params(vl_runs["one"]), final_params(vl_runs["three"])) > 0.0


@pytest.mark.slow
def test_a_frozen_vision_tower_is_bit_unchanged(vl, vl_runs):
    """model.freeze_vision_tower in bf16 mixed precision, 2 trainers and 1 reserved rollout rank (its hf engine
    samples the images; pushes leave the tower out at both ends): the tower's fp32 weights stay as loaded."""
    start, end = load_file(str(Path(vl["model"]) / "model.safetensors")), final_params(vl_runs["frozen_reserved"])
    tower = [k for k in start if k.startswith("visual.")]
    assert tower and all(torch.equal(start[k], end[k]) for k in tower)
    assert max(float((start[k] - end[k]).abs().max()) for k in start if k not in tower) > 1e-4


@pytest.mark.slow
def test_a_vision_model_on_text_under_fsdp(vl_runs):
    """No image anywhere: every sharded forward runs the tower on a blank image so that the ranks' gathers and
    gradient reductions meet; the model equals the replicated one-process run."""
    assert max_diff(final_params(vl_runs["text_one"]), final_params(vl_runs["text_fsdp2"])) <= TOL


@pytest.mark.slow
def test_resume_with_images_on_3_then_2_processes(vl, vl_runs, tmp_path):
    """Step 1 on 3 FSDP2 processes (vl_runs' fsdp3 run, checkpointed after it), step 2 resumed from that checkpoint
    on 2 replicated processes: the one-process run's rewards and model."""
    run = tmp_path / "run"
    copy_checkpoint(vl_runs["fsdp3"], 1, run)
    evenrl("train", vl["cfg"], f"log.run_dir={run}", "checkpoint.every_steps=1", "--nproc-per-node", "2", "--resume")
    assert max_diff(final_params(vl_runs["one"]), final_params(run)) <= TOL
    assert [r["step"] for r in metrics(run)] == [0, 1, 2]  # fsdp3's evaluation (row 0) and step 1, then step 2
    assert [r["reward/mean"] for r in metrics(run)[1:]] == [r["reward/mean"] for r in metrics(vl_runs["one"])[1:]]


def test_image_placeholders_sampled_in_a_response_are_plain_tokens(vl):
    """A policy can sample <|image_pad|> in its answer (temperature 1, an entropy bonus): the training forward of such
    rows runs (before: a shape mismatch in get_rope_index, the image tokens counted as the prompt's images) and its
    log-probs equal the sampler's, which fed the sampled placeholder back as a plain token."""
    from evenrl.models.forward_decoder import ForwardDecoder

    model, tok = load_policy(vl["model"])
    processor = load_image_processor(vl["model"], min_pixels=None, max_pixels=None)
    image_id = model.config.image_token_id
    ids = encode_vision_prompt(tok, processor, model.config, "<image>x=", [(56, 56)], False)
    inputs = image_inputs(processor, [_png(56, 56)])
    text = tok("7+1=")["input_ids"]
    forced = [[5, image_id, 9, image_id, image_id, 11], [image_id, 3]]  # sampled responses, placeholders forced in
    expected = []
    with torch.no_grad():
        for response in forced:  # the sampler's own path: prefill with the image, then one token at a time
            dec = ForwardDecoder(model)
            logits, shift = dec.prefill_images(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long),
                                               [inputs])
            pos, lps = len(ids) + shift[0], []
            for t in response:
                lps.append(torch.log_softmax(logits.float(), -1)[0, t].item())
                logits, pos = dec.step(torch.tensor([t]), torch.tensor([pos])), pos + 1
            expected.append(lps)
    rows = [(ids, forced[0], inputs), (text, forced[1], None), (ids, forced[1], inputs)]
    batch = Batch({"tokens": Ragged.of([torch.tensor(p + r) for p, r, _ in rows], torch.long),
                   "response_len": torch.tensor([len(r) for _, r, _ in rows]),
                   "pixel_values": Ragged.of([x.pixel_values if x else torch.zeros(0, 1176) for *_, x in rows],
                                             torch.float32),
                   "image_grid_thw": Ragged.of([x.grid if x else torch.zeros(0, 3, dtype=torch.long)
                                                for *_, x in rows], torch.long)})
    trainer = compute_logprobs(model, batch, [[0, 1, 2]], temperature=1.0, pad_token_id=tok.pad_token_id)
    assert torch.allclose(trainer[0], torch.tensor(expected[0]), atol=2e-5), (trainer[0], expected[0])
    assert torch.allclose(trainer[2], torch.tensor(expected[1]), atol=2e-5), (trainer[2], expected[1])
    assert torch.isfinite(trainer[1]).all()
    text_only = Batch({"tokens": Ragged.of([torch.tensor(text + forced[1])], torch.long),  # no image in the batch
                       "response_len": torch.tensor([len(forced[1])]),
                       "pixel_values": Ragged.of([torch.zeros(0, 1176)], torch.float32),
                       "image_grid_thw": Ragged.of([torch.zeros(0, 3, dtype=torch.long)], torch.long)})
    assert torch.allclose(compute_logprobs(model, text_only, [[0]], temperature=1.0, pad_token_id=tok.pad_token_id)[0],
                          trainer[1], atol=2e-5)
    from evenrl.models.forward import response_logprobs  # trains on: the backward runs, every gradient finite

    logp, _, mask = response_logprobs(model, batch, tok.pad_token_id)
    (logp[..., 0] * mask).sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
