"""EasyR1: its batch checks (ray_trainer, fsdp_workers) and its config as evenrl settings.

EasyR1 counts rollout_batch_size and global_batch_size in prompts and the micro-batch sizes per device in samples.
Its vision-language runs (the geometry example: Qwen2.5-VL on Geometry3K) map image_key, min/max_pixels,
freeze_vision_tower and rollout.limit_images; rollout.tensor_parallel_size maps onto the vLLM engine's (the tables),
and a note says what a vision-language model cannot split.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from evenrl.models.files import is_vision_config, read_model_config
from evenrl.planner.peers.reader import (
    Check, Source, Translation, check_dataloader, set_critic, set_data, set_dynamic_sampling, set_kl,
    set_lengths, set_lora, set_model, set_overlong, set_parallel, set_steps, trainer_layout)


def translate(src: Source, ns: argparse.Namespace, t: Translation) -> None:
    """EasyR1's config -> t: the checks EasyR1 would fail on t.layout, and the evenrl settings."""
    a = "worker.actor."
    t.layout = trainer_layout(src, ns)
    world = t.layout.world
    rbs, n = src.int("data.rollout_batch_size", 512), src.int("worker.rollout.n", 1)
    gbs = src.int(a + "global_batch_size", 256)
    m_up = src.int(a + "micro_batch_size_per_device_for_update", 4)
    m_exp = src.int(a + "micro_batch_size_per_device_for_experience", 16)
    sp = src.int(a + "ulysses_size", None) or src.int(a + "ulysses_sequence_parallel_size", 1)
    plen, rlen = src.int("data.max_prompt_length", 512), src.int("data.max_response_length", 512)
    adv = src.str("algorithm.adv_estimator", "grpo")
    if rbs % gbs:
        t.checks.append(Check("config", "ValueError",
                              "Rollout batch size must be divisible by actor global batch size.",
                              f"rollout_batch_size {rbs} % global_batch_size {gbs} = {rbs % gbs}"))
    if (rbs * n) % m_exp:
        t.checks.append(Check("config", "ValueError",
                              "Rollout batch size * rollout.n must be divisible by actor micro batch size for "
                              "experience.", f"{rbs} x {n} = {rbs * n}; % micro_batch_size_per_device_for_experience "
                              f"{m_exp} = {rbs * n % m_exp}"))
    if adv in ("grpo", "rloo") and n == 1:
        t.checks.append(Check("config", "ValueError", "GRPO and RLOO algorithm need `config.worker.rollout.n > 1`.",
                              "one sample per prompt has no group baseline", "recent EasyR1"))
    per_dev = (gbs * n if n > 1 else gbs) // max(world // sp, 1)
    if per_dev == 0:
        t.checks.append(Check("worker", "ValueError",
                              "actor global batch size * ulysses size must be larger than num gpus.",
                              f"global_batch_size {gbs} x n {n} // ({world} GPUs // ulysses {sp}) = 0"))
    elif per_dev % m_up:
        t.checks.append(Check("worker", "ValueError",
                              "actor global batch size per device must be divisible by the micro batch size.",
                              f"global_batch_size {gbs} x rollout.n {n} = {gbs * n} samples // {world // sp} GPUs "
                              f"= {per_dev} per GPU; {per_dev} % micro_batch_size_per_device_for_update {m_up} = "
                              f"{per_dev % m_up}"))
    if per_dev and src.bool(a + "fsdp.enable_cpu_offload", False) and per_dev != m_up:
        t.checks.append(Check("worker", "ValueError",
                              "actor cannot use FSDP's CPU offload when gradient accumulation is enabled.",
                              f"{per_dev} samples per GPU != micro_batch_size_per_device_for_update {m_up}"))
    if rbs % world:
        t.checks.append(Check("rollout", "AssertionError",
                              f"only support equal chunk. Got size of DataProto {rbs} and chunk {world}.",
                              f"the {rbs} prompts are split over {world} workers for generation: {rbs} % {world} = "
                              f"{rbs % world} (not checked up front)"))
    check_dataloader(src, t, "data.train_files", rbs, "AssertionError", "")
    t.set("data.prompts_per_step", rbs, "data.rollout_batch_size")
    t.set("rollout.samples_per_prompt", n, "worker.rollout.n")
    set_lengths(t, plen, rlen, "data.max_prompt_length", "data.max_response_length")
    t.set("algo.minibatches_per_step", max(1, rbs // gbs), a + "global_batch_size")
    t.set("train.token_cap_per_micro_batch", m_up * (plen + rlen), a + "micro_batch_size_per_device_for_update")
    if not src.bool("algorithm.disable_kl", False):
        coef = src.float("algorithm.kl_coef", 1e-3)  # first: with two bad keys, the error names this one
        where = "loss" if src.bool("algorithm.use_kl_loss", False) else "reward"
        set_kl(t, coef, where, "algorithm.kl_coef")
    if adv in ("gae", "reinforce_plus_plus"):
        t.set("algo.gamma", src.float("algorithm.gamma", 1.0), "algorithm.gamma")
    if adv == "gae":
        t.set("algo.lam", src.float("algorithm.lam", 1.0), "algorithm.lam")
        c = "worker.critic."
        set_critic(t, path=src.str(c + "model.model_path", ""), policy_path=src.str(a + "model.model_path", ""),
                   lr=src.float(c + "optim.lr", 1e-6), value_clip=src.float(c + "cliprange_value", 0.5),
                   warmup=src.int(c + "optim.lr_warmup_steps", 0, lo=-1) or 0,
                   keys=(c + "model.model_path", c + "optim.lr", c + "cliprange_value", c + "optim.lr_warmup_steps"))
    if src.bool("algorithm.online_filtering", False):
        set_dynamic_sampling(t, None, "algorithm.online_filtering", "algorithm.online_filtering",
                             "algorithm.online_filtering keeps groups whose mean filter_key lies in (filter_low, "
                             "filter_high); evenrl keeps groups whose rewards are not all equal (the same for 0/1 "
                             "rewards)")
    kw = "worker.reward.reward_function_kwargs."
    if src.int(kw + "overlong_buffer_length", 0, lo=0):
        set_overlong(t, src.int(kw + "overlong_buffer_length", 0, lo=0),
                     src.float(kw + "overlong_penalty_factor", 1.0),
                     (kw + "overlong_buffer_length", kw + "overlong_penalty_factor"))
    set_model(t, src.str(a + "model.model_path"), a + "model.model_path")
    # fsdp.enable_cpu_offload is FSDP's own parameter offload (CPUOffload(offload_params=True))
    params = src.bool(a + "offload.offload_params", False) or src.bool(a + "fsdp.enable_cpu_offload", False)
    set_parallel(t, world, params=params, optimizer=src.bool(a + "offload.offload_optimizer", False),
                 shard=src.bool(a + "fsdp.enable_full_shard", True),
                 keys=(a + "offload.offload_params", a + "offload.offload_optimizer"))
    set_data(t, src.str("data.train_files"), "data.train_files", src.str("data.prompt_key", "prompt"),
             src.str("data.answer_key", "answer"), keys=("data.prompt_key", "data.answer_key"))
    set_steps(src, t, "trainer.max_steps", "trainer.total_episodes", 10, rbs)
    m = a + "model.lora."
    set_lora(src, t, rank=m + "rank", alpha=m + "alpha", targets=m + "target_modules", alpha_default=64.0)
    set_vision(src, t)


def set_vision(src: Source, t: Translation) -> None:
    """The image settings of a vision-language run. EasyR1 reads data.image_key (default "images") only when a
    row has that column; here it maps when the model is a vision-language one: a local directory whose config says
    so, or a hub name with "VL" in it (Qwen/Qwen2.5-VL-7B-Instruct)."""
    a, path = "worker.actor.", src.str("worker.actor.model.model_path")
    local = Path(path).expanduser() / "config.json"
    if local.is_file():
        vision = is_vision_config(read_model_config(str(local.parent)))
    else:
        vision = bool(re.search(r"(?i)(^|[-_/])vl([-_/]|$)", path))
    if not vision:
        return
    t.set("data.image_key", src.str("data.image_key", "images"), "data.image_key")
    for key in ("min_pixels", "max_pixels"):
        if src.has(f"data.{key}"):
            t.set(f"data.{key}", src.int(f"data.{key}", None), f"data.{key}")
    t.set("model.freeze_vision_tower", src.bool(a + "model.freeze_vision_tower", False),
          a + "model.freeze_vision_tower")
    limit = src.int("worker.rollout.limit_images", 0, lo=0)
    if limit:
        t.set("data.max_images_per_prompt", limit, "worker.rollout.limit_images")
    tp = src.int("worker.rollout.tensor_parallel_size", 1)
    if tp > 1:  # the tables' note says what runs for a text model; a vision-language one has less
        t.notes.append(f"worker.rollout.tensor_parallel_size={tp} with a vision-language model: evenrl's "
                       "parallel.tensor_parallel_size does not split one yet (its vision tower), so with either "
                       "engine every generating rank holds the whole model in the compute dtype")
    t.notes.append("images: EasyR1 resizes each image to min/max_pixels itself, then its processor rounds it to "
                   "28-pixel multiples; evenrl gives the bounds to the processor (one resize, the same bounds). "
                   "EasyR1 samples with vLLM; evenrl's vLLM engine takes images only where torchvision is "
                   "installed (GPU set-ups), else rollout.engine=hf samples them")
