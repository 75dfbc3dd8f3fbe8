"""`evenrl plan --from` on real peer files, taken unchanged from the peers' repositories (tests/peer_corpus,
MANIFEST.tsv: source repository, path and commit of each): every file plans without a traceback in under a
second, every key of it is accounted for (mapped, read, not applicable, no evenrl equivalent, or unknown, never
dropped), and for a dozen of them the mapped values and the peer's findings are the ones read off by hand from
the file and the peer's own code (defaults, check arithmetic)."""

import argparse
from pathlib import Path

import pytest

from evenrl.config import flatten, load_config
from evenrl.planner.cli import write_config
from evenrl.planner.peers import read_foreign, translate
from evenrl.planner.peers.tables import STATUSES, table
from evenrl.planner.plan import make_plan

CORPUS = Path(__file__).parent / "peer_corpus"
FILES = [line.split("\t") for line in (CORPUS / "MANIFEST.tsv").read_text().splitlines()[1:]]


def ns(**kw):
    base = dict(nnodes=None, nproc_per_node=None, rollout_devices=None, device=None, device_memory_gib=None,
                capacity_weights=None, json=False, fit=False, peer_version=None, nodes=None)
    return argparse.Namespace(**{**base, **kw})


def plan_file(name, framework, **kw):
    loaded = read_foreign(framework, str(CORPUS / name), [])
    t, cfg = translate(framework, loaded, ns(**kw))
    return loaded, t, cfg, make_plan(cfg, t.layout)


def test_the_corpus_is_real_and_large_enough():
    assert len(FILES) >= 40
    assert {f[1] for f in FILES} == {"verl", "easyr1", "openrlhf", "trl"}
    for name, _, repo, path, commit in FILES:
        assert (CORPUS / name).is_file() and len(commit) == 40 and "/" in repo and path, name
        assert (CORPUS / name).stat().st_size < 16000  # small files only


@pytest.mark.parametrize("name,framework", [(f[0], f[1]) for f in FILES], ids=[f[0][:48] for f in FILES])
def test_every_file_plans_and_every_key_is_accounted_for(name, framework, tmp_path):
    loaded, t, cfg, plan = plan_file(name, framework)
    keys = {k["key"] for k in t.keys}
    assert all(k["status"] in STATUSES and (k["evenrl"] if k["status"] == "mapped" else k["why"]) for k in t.keys)
    user = set(flatten(loaded.data)) | set(loaded.unresolved)
    spelled = {k.replace("-", "_") for k in user}
    assert spelled <= {k.replace("-", "_") for k in keys}, spelled - keys  # none dropped
    assert len(t.keys) == len(keys)  # each key once
    if plan.runnable:  # --write-config's file is what `evenrl train` validates, paths as the file gave them
        out = tmp_path / "evenrl.yaml"
        write_config(str(out), cfg, plan, t.paths, str(CORPUS / name))
        written = load_config(str(out), [])
        assert written.model_copy(update={"model": cfg.model.model_copy(update={"path": cfg.model.path}),
                                          "data": cfg.data.model_copy(update={"path": cfg.data.path})}) == cfg
        assert written.model.path == (cfg.model.path or t.paths.get("model.path", ""))


def one(t, status):
    return {k["key"]: k for k in t.keys if k["status"] == status}


def test_logic_rl_grpo_script_under_its_own_fork():
    """Logic-RL main_grpo.sh: its verl fork (grad_offload), 64 prompts x 16 on 4 GPUs, KL 0.001 as k3 in the
    loss, entropy 0.001 by the fork's default, everything offloaded; `$@ 2>&1 | tee` leaves no argument behind."""
    _, t, cfg, plan = plan_file("logic-rl__main_grpo.sh", "verl")
    assert t.version == "logic-rl" and t.layout.world == 4
    assert (cfg.data.prompts_per_step, cfg.rollout.samples_per_prompt, cfg.rollout.max_new_tokens) == (64, 16, 2048)
    assert (cfg.algo.kl_coef, cfg.algo.kl_in, cfg.algo.kl_estimator) == (0.001, "loss", "k3")
    assert cfg.algo.entropy_coef == 0.001 and cfg.train.lr == 3e-7 and cfg.parallel.cpu_offload == "full"
    # ppo_micro_batch_size 16 over 4 GPUs = 4 per GPU; 64 x 16 = 1024 samples; 64 % 4 == 0: the fork passes
    assert cfg.train.token_cap_per_micro_batch == 4 * (400 + 2048) and t.checks == []
    assert any("$@" in n for n in t.notes) and plan.runnable


def test_openrlhf_dotted_reinforce_baseline_keeps_kl_estimator_and_lengths():
    """The issue's case: --algo.advantage.estimator reinforce_baseline, KL 1e-5 as a k2 loss term, 64,000 new
    tokens, ring attention 2 and vLLM TP 2, icepop correction; flags built in bash arrays."""
    _, t, cfg, _ = plan_file("openrlhf__examples__scripts__train_reinforce_baseline_hybrid_engine.sh", "openrlhf")
    assert t.version == "0.11"
    assert cfg.algo.advantage == "reinforce_pp_baseline" and cfg.critic.path == ""
    assert cfg.algo.reinforce_pp_baseline_whiten == "token"  # OpenRLHF whitens over the batch's response tokens
    assert (cfg.algo.kl_coef, cfg.algo.kl_in, cfg.algo.kl_estimator) == (1e-5, "loss", "k2")
    assert cfg.rollout.max_new_tokens == 64000 and cfg.data.max_prompt_tokens == 74240 - 64000
    assert (cfg.data.prompts_per_step, cfg.rollout.samples_per_prompt, cfg.train.lr) == (128, 8, 5e-7)
    assert cfg.parallel.sequence_parallel_size == 2 and cfg.rollout.engine == "vllm"
    assert cfg.rollout.tensor_parallel_size == 2  # vLLM TP 2: one engine over 2 devices (an engine group)
    assert cfg.rollout.memory_fraction == 0.7  # --vllm.gpu_memory_utilization
    assert (cfg.algo.importance_correction, cfg.algo.importance_mode) == ("all", "mask")
    assert any("ring attention" in n for n in t.notes)
    # colocated: 4 actor GPUs == 2 engines x TP 2, so OpenRLHF's colocation assert passes; no reserved devices
    assert t.layout.rollout_devices == 0 and t.checks == []


def test_openrlhf_slurm_flags_inside_srun_bash_c():
    """train_ppo_ray_slurm.sh: the flags sit in `srun ... bash -c "... ray job submit -- python3 -m ..."`;
    GAE with the reward model's critic, KL 0.01 in the reward (no --algo.kl.use_loss), 4 engines x TP 2 on their
    own 8 GPUs beside 4 actor GPUs."""
    _, t, cfg, _ = plan_file("openrlhf__examples__scripts__train_ppo_ray_slurm.sh", "openrlhf")
    assert cfg.algo.advantage == "gae" and (cfg.algo.kl_coef, cfg.algo.kl_in) == (0.01, "reward")
    assert (cfg.data.prompts_per_step, cfg.train.lr, cfg.critic.lr) == (1024, 5e-7, 9e-6)
    assert (t.layout.training_ranks, t.layout.rollout_devices) == (4, 8)
    assert cfg.parallel.cpu_offload == "full"  # --ds.adam_offload -> FSDP2's offload (with a note)


def test_easyr1_dapo_script_layered_on_the_bundled_base():
    _, t, cfg, _ = plan_file("easyr1__examples__qwen3_14b_dapo17k_dapo.sh", "easyr1")
    assert any("bundled" in n for n in t.notes)
    origin = {k["key"]: k["from"] for k in t.keys}
    assert origin["worker.actor.ulysses_size"] == "file" and origin["worker.actor.optim.lr"] == "base"
    assert origin["data.max_prompt_length"] == "file"  # the script's value over the base config's
    assert (cfg.data.prompts_per_step, cfg.rollout.samples_per_prompt, cfg.rollout.max_new_tokens) == (512, 16, 20480)
    assert cfg.algo.clip_ratio_c == 10.0 and (cfg.algo.clip_low, cfg.algo.clip_high) == (0.2, 0.28)
    assert cfg.parallel.sequence_parallel_size == 8 and cfg.rollout.engine == "vllm"  # EasyR1 samples with vLLM
    assert cfg.rollout.tensor_parallel_size == 4
    assert cfg.algo.filter_groups and cfg.rewards.overlong_buffer == 4096 and cfg.algo.kl_coef == 0
    assert cfg.algo.minibatches_per_step == 512 // 32 and cfg.train.weight_decay == 0.1


def test_easyr1_lora_and_loss_types():
    _, _, cfg, _ = plan_file("easyr1__examples__qwen3_4b_math_grpo_lora.sh", "easyr1")
    assert (cfg.model.lora.rank, cfg.model.lora.alpha) == (64, 64.0)  # not full fine-tuning
    _, t, cfg, _ = plan_file("easyr1__examples__qwen2_5_vl_7b_geo3k_gspo.sh", "easyr1")
    assert cfg.algo.policy_loss == "gspo" and any("gspo_token" in n for n in t.notes)
    _, _, cfg, _ = plan_file("easyr1__examples__qwen2_5_vl_7b_geo3k_cispo.sh", "easyr1")
    assert cfg.algo.policy_loss == "cispo" and cfg.algo.clip_ratio_c == 0  # EasyR1's dual clip is PPO-clip's


def test_verl_cispo_and_grpo_examples():
    _, t, cfg, _ = plan_file("verl__examples__cispo_trainer__run_cispo_qwen2_5_0_5b_gsm8k.sh", "verl")
    assert (cfg.algo.policy_loss, cfg.algo.clip_low, cfg.algo.clip_high) == ("cispo", 10.0, 0.2)
    _, t, cfg, _ = plan_file("verl__examples__grpo_trainer__run_qwen2-7b.sh", "verl")
    assert t.version == "0.8" and t.layout.world == 8
    assert (cfg.data.prompts_per_step, cfg.rollout.samples_per_prompt) == (1024, 5)
    assert (cfg.algo.kl_coef, cfg.algo.kl_estimator, cfg.algo.entropy_coef) == (0.001, "k3", 0.0)
    assert cfg.algo.clip_ratio_c == 3.0  # verl's default dual clip, not silently dropped
    assert (cfg.rollout.engine, cfg.rollout.memory_fraction) == ("vllm", 0.6) and cfg.train.weight_decay == 0.01
    assert cfg.rollout.tensor_parallel_size == 2


def test_verl_megatron_parallelism_is_named_not_dropped():
    """Megatron TP 2 x PP 2 on 8 GPUs: the actor's TP becomes parallel.tensor_parallel_size=2 (with a note on the
    row-wise split), the reference's is read as the policy's, PP (which evenrl has not) becomes FSDP2 sharding of
    every layer over all the ranks, with a note; the plan lays the 8 ranks out as 4 data-parallel TP groups of 2
    (verl's dp: 8 / (2 x 2) = 2)."""
    _, t, cfg, plan = plan_file("verl__examples__grpo_trainer__run_qwen2-7b_math_megatron.sh", "verl")
    mapped, none, na = one(t, "mapped"), one(t, "no_equivalent"), one(t, "not_applicable")
    tp, pp = (f"actor_rollout_ref.actor.megatron.{k}_model_parallel_size" for k in ("tensor", "pipeline"))
    assert cfg.parallel.tensor_parallel_size == 2 and mapped[tp]["evenrl"] == ["parallel.tensor_parallel_size=2"]
    note = next(n for n in t.notes if n.startswith(tp))
    assert "by rows" in note and "column-wise on gathered inputs" in note
    assert cfg.parallel.sharding == "fsdp" and mapped[pp]["evenrl"] == ["parallel.sharding=fsdp"]
    assert "no pipeline parallelism" in next(n for n in t.notes if n.startswith(pp))
    assert "split as the policy" in na["actor_rollout_ref.ref.megatron.tensor_model_parallel_size"]["why"]
    assert "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size" in none
    assert (plan.tensor_parallel, plan.dp_size) == (2, 4)
    assert not [f for f in plan.findings if f.rule.startswith("tensor-parallel-") and f.level == "error"], \
        [f.rule for f in plan.findings]


def test_trainer_tensor_parallel_keys_of_each_peer():
    """OpenRLHF's ds_tensor_parallel_size (DeepSpeed AutoTP) is parallel.tensor_parallel_size with a note on the
    row-wise split; verl's FSDP actor has no TP key in the versions read (0.8's ppo_trainer.yaml), so an FSDP file's
    megatron TP is unused; the engines' TP keys are rollout.tensor_parallel_size (one vLLM engine over that many
    devices), and the plan places those engines without an error."""
    _, t, cfg, plan = plan_file("openrlhf__examples__scripts__train_ppo_ray_hybrid_engine.sh", "openrlhf")
    assert not any("tensor_parallel" in k for k in table("verl")["map"] if "fsdp_config" in k)
    assert cfg.rollout.tensor_parallel_size == 2 and not any("vllm_tensor_parallel_size" in n for n in t.notes)
    assert not [f.rule for f in plan.findings if f.rule.startswith("tensor-parallel") and f.level == "error"]
    loaded = read_foreign("openrlhf", str(CORPUS / "openrlhf__examples__scripts__train_ppo_ray_hybrid_engine.sh"),
                          ["ds_tensor_parallel_size=2"])
    t, cfg = translate("openrlhf", loaded, ns())
    assert cfg.parallel.tensor_parallel_size == 2
    assert any(n.startswith("ds_tensor_parallel_size=2") and "AutoTP" in n for n in t.notes)


def test_open_r1_recipe_is_trl_0_18_in_server_mode():
    _, t, cfg, _ = plan_file("open-r1__recipes__Qwen2.5-1.5B-Instruct__grpo__config_demo.yaml", "trl",
                             nproc_per_node=8)
    assert t.version == "0.18" and cfg.rollout.engine == "vllm"
    assert (t.layout.training_ranks, t.layout.rollout_devices) == (7, 1)  # 0.18's vllm_mode default: server
    assert cfg.rollout.samples_per_prompt == 16 and cfg.train.lr == 2e-5
    assert cfg.algo.std_eps == 1e-4 and cfg.model.dtype == "bfloat16"  # TRL's epsilon; the recipe's bf16: true
    assert "system_prompt" in one(t, "no_equivalent")


# Each enumeration as the peer's own code lists it (verl core_algos.py registries, rollout_corr_helper.py options
# and kl_penalty; EasyR1 core_algos.py; TRL GRPOConfig's help and grpo_trainer.py; OpenRLHF train_ppo_ray.py's
# choices), written down from reading that code: the tables must hold every one.
PEER_ENUMERATIONS = {
    ("verl", "actor_rollout_ref.actor.policy_loss.loss_mode"):
        "vanilla gspo sapo gpg clip_cov kl_cov geo_mean cispo bypass_mode",
    ("verl", "actor_rollout_ref.actor.loss_agg_mode"):
        "token-mean seq-mean-token-sum seq-mean-token-mean seq-mean-token-sum-norm",
    ("verl", "actor_rollout_ref.actor.kl_loss_type"):
        "kl k1 abs mse k2 low_var_kl k3 full kl+ k1+ abs+ low_var_kl+ k3+",
    ("verl", "algorithm.kl_penalty"): "kl k1 abs mse k2 low_var_kl k3 full",
    ("verl", "algorithm.adv_estimator"): "gae grpo reinforce_plus_plus reinforce_plus_plus_baseline remax rloo opo "
                                         "grpo_passk gpg rloo_vectorized grpo_vectorized optimal_token_baseline "
                                         "tir_optimal_token_baseline",
    ("verl", "algorithm.rollout_correction.rollout_is"): "token sequence",
    ("verl", "algorithm.rollout_correction.rollout_rs"): "token_k1 token_k2 token_k3 seq_sum_k1 seq_sum_k2 seq_sum_k3 "
                                                         "seq_mean_k1 seq_mean_k2 seq_mean_k3 seq_max_k2 seq_max_k3",
    ("easyr1", "worker.actor.loss_type"): "default gspo gspo_token cispo sapo",
    ("easyr1", "worker.actor.loss_avg_mode"): "token seq",
    ("easyr1", "algorithm.kl_penalty"): "kl abs mse low_var_kl full",
    ("easyr1", "algorithm.adv_estimator"): "gae grpo grpo_passk reinforce_plus_plus remax rloo",
    ("trl", "loss_type"): "grpo dapo bnpo dr_grpo cispo sapo luspo vespo",
    ("trl", "importance_sampling_level"): "token sequence",
    ("trl", "vllm_importance_sampling_mode"): "token_truncate token_mask sequence_truncate sequence_mask",
    ("openrlhf", "policy_loss_type"): "ppo gspo",
    ("openrlhf", "kl_estimator"): "k1 k2 k3",
    ("openrlhf", "advantage_estimator"): "gae reinforce rloo reinforce_baseline group_norm dr_grpo",
    ("openrlhf", "vllm_is_correction_type"): "tis icepop seq-mask-tis",
}


def test_the_tables_hold_every_value_the_peers_code_has():
    for (peer, key), values in PEER_ENUMERATIONS.items():
        spec = table(peer)["map"][key]
        known = set(spec.get("values", {})) | set(spec.get("notes", {}))
        assert set(values.split()) <= known, (peer, key, set(values.split()) - known)


def test_every_enumerated_peer_value_is_mapped_or_noted():
    """Each value the tables list for the peers' loss modes, aggregations, KL types, estimators and correction
    modes gives an evenrl setting or a note naming the key and the value; never silence."""
    files = {"verl": {}, "easyr1": {}, "openrlhf": {}, "trl": {}}
    for peer in files:
        for key, spec in table(peer)["map"].items():
            for value in list(spec.get("values", {})) + list(spec.get("notes", {})):
                data = {key: value}
                for cond in ("when",):
                    if cond in spec:
                        data[spec[cond]] = True
                nested = {}
                for k, v in data.items():
                    node = nested
                    *path, last = k.split(".") if peer in ("verl", "easyr1") else [k]
                    for part in path:
                        node = node.setdefault(part, {})
                    node[last] = v
                t, cfg = translate(peer, nested, ns(nnodes=1, nproc_per_node=8))
                to = spec["to"]
                mapped = to in t.settings and t.source.get(to) == key
                noted = any(key in n and str(value) in n for n in t.notes)
                assert mapped or noted, (peer, key, value, t.notes)


def test_verl_gspo_example_keeps_its_tiny_clip_and_aggregation():
    """verl's GSPO example: loss_mode=gspo with the paper's clip 3e-4/4e-4 and seq-mean-token-mean, KL off, the
    overlong buffer off (its +reward_model.reward_kwargs keys are the reward manager's, added with +)."""
    _, t, cfg, _ = plan_file("verl__examples__gspo_trainer__test_gspo_3b_math.sh", "verl")
    assert (cfg.algo.policy_loss, cfg.algo.clip_low, cfg.algo.clip_high) == ("gspo", 0.0003, 0.0004)
    assert cfg.algo.loss_aggregation == "seq-mean-token-mean" and cfg.algo.kl_coef == 0
    assert cfg.rollout.samples_per_prompt == 16 and cfg.rewards.overlong_buffer == 0
    assert not one(t, "unknown")  # the + keys are named as added, not as typos


def test_verl_rollout_correction_with_two_rejection_criteria():
    """rollout_rs="token_k1,seq_max_k2" with thresholds "0.6_1.6,2.5" in bypass mode with loss_type=ppo_clip: both
    criteria chained; token_k1's "0.6_1.6" bounds pi_rollout / pi = 1/w, so evenrl keeps 1/1.6 <= w <= 1/0.6; the
    ratio is taken against the engine (old_policy=engine) and, as in verl's bypass PPO-clip, no weight is applied
    (rollout_is=token is verl's metric only)."""
    _, t, cfg, _ = plan_file("verl__examples__rollout_correction__run_with_rollout_corr_multi_rs.sh", "verl")
    a = cfg.algo
    assert (a.importance_correction, a.importance_mode, a.old_policy, a.policy_loss) == ("all", "none", "engine", "ppo")
    assert [(r.criterion, r.low, r.high) for r in a.rejection] == [("token_k1", 1 / 1.6, 1 / 0.6),
                                                                   ("seq_max_k2", 0.0, 2.5)]
    assert any("metrics only" in n for n in t.notes)
    assert {"algorithm.rollout_correction.rollout_rs", "algorithm.rollout_correction.rollout_rs_threshold",
            "algorithm.rollout_correction.bypass_mode"} <= set(one(t, "mapped"))
    # no layout stated: verl's 1 x 8 GPUs; ppo_mini_batch_size 32 x rollout.n 1 (verl's default) // 8 = 4 per GPU,
    # which micro-batches of 8 do not divide: verl's worker stops there
    assert [c.message for c in t.checks] == [
        "normalized ppo_mini_batch_size 4 should be divisible by ppo_micro_batch_size_per_gpu 8"]


def test_open_r1_code_recipe_generation_batch_by_layout():
    """config_demo_code: 16 per device x gradient_accumulation_steps 4 x the training processes must divide by
    num_generations 14. On 8 GPUs (one for the vLLM server): 16 x 7 x 4 = 448 = 32 x 14, it passes; on 4 GPUs:
    16 x 3 x 4 = 192, 192 % 14 = 10, TRL's config check stops it."""
    name = "open-r1__recipes__Qwen2.5-1.5B-Instruct__grpo__config_demo_code.yaml"
    _, t8, cfg8, _ = plan_file(name, "trl", nproc_per_node=8)
    assert t8.checks == [] and (cfg8.data.prompts_per_step, cfg8.rollout.samples_per_prompt) == (32, 14)
    _, t4, _, _ = plan_file(name, "trl", nproc_per_node=4)
    assert [c.message for c in t4.checks] == [
        "generation_batch_size (192) must be divisible by num_generations (14)."]


def test_verl_sapo_script_branches_and_pattern_substitution():
    """A Slurm script that picks its config by if/else on its own variables and builds the critic's keys with
    ${VAR//actor/critic}: the fsdp branch is taken and said so; SAPO with its tau_pos 1 / tau_neg 1.05, aggregated
    by seq-mean-token-mean as verl's SAPO loss does whatever loss_agg_mode says."""
    _, t, cfg, _ = plan_file("verl__examples__sapo_trainer__run_qwen30b_sapo.sh", "verl")
    assert any("passed over the branch of `if fsdp == megatron`" in n for n in t.notes)
    assert (cfg.algo.policy_loss, cfg.algo.sapo_tau_pos, cfg.algo.sapo_tau_neg) == ("sapo", 1.0, 1.05)
    assert cfg.algo.loss_aggregation == "seq-mean-token-mean" and cfg.algo.clip_ratio_c == 0
    assert any("loss_mode=sapo" in n and "seq-mean-token-mean" in n for n in t.notes)
    assert cfg.parallel.sequence_parallel_size == 4 and cfg.rollout.samples_per_prompt == 16
    assert "trainer.n_gpus_per_node" in {k["key"] for k in t.keys if "unresolved" in k["why"]}  # $SLURM_GPUS_PER_NODE
