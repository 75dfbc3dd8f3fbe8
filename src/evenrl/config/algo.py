"""The `algo` and `critic` sections: advantage estimators, policy losses and their clips, aggregation, KL, rollout
correction (docs/algorithms.md), and the value model of algo.advantage=gae. Pure Python."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from evenrl.config.section import MAX_COUNT, MAX_TOKENS, Section

REJECTION_CRITERIA = Literal["token_k1", "seq_sum_k1", "seq_mean_k1", "token_k2", "seq_sum_k2", "seq_mean_k2",
                             "seq_max_k2", "token_k3", "seq_sum_k3", "seq_mean_k3", "seq_max_k3"]


class RejectionCriterion(Section):
    criterion: REJECTION_CRITERIA = Field(
        description="What is bounded, of d = log pi_target - log pi_engine per token: k1 the weight exp(s) (s = d "
                    "per token, its sum or its mean over the sequence: token_k1, seq_sum_k1, seq_mean_k1), k2 d^2/2 "
                    "and k3 exp(d) - 1 - d per token, their sum, mean or max over the sequence (token_*, seq_sum_*, "
                    "seq_mean_*, seq_max_*). A seq_* criterion keeps or rejects the whole sequence.")
    low: float = Field(0.0, ge=0.0, le=1.0, description="k1: the smallest weight kept (at most 1); k2, k3: 0.")
    high: float = Field(gt=0.0, description="k1: the largest weight kept (at least 1); k2, k3: the largest "
                                            "divergence kept. Any finite value, as verl takes any positive "
                                            "rollout_rs_threshold.")

    @model_validator(mode="after")
    def _bounds_of_the_kind(self):
        k1 = self.criterion.endswith("k1")
        if k1 and self.high < 1.0:
            raise PydanticCustomError("rejection_high", "{name}: high {high} < 1 would reject samples the engine "
                                      "sampled exactly (weight 1); need low <= 1 <= high",
                                      {"name": self.criterion, "high": self.high})
        if not k1 and self.low:
            raise PydanticCustomError("rejection_low", "{name} bounds a divergence from above only: low must be 0",
                                      {"name": self.criterion})
        return self


class AlgoConfig(Section):
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "reinforce_pp", "gae"] = Field(
        "grpo", description="Advantage estimator. Over each prompt's group of samples: grpo, dr_grpo, rloo, "
                            "reinforce_pp_baseline. Per token, whitened over the whole step's response tokens on "
                            "all ranks: reinforce_pp (REINFORCE++: discounted returns of the outcome reward, with "
                            "kl_in=reward the per-token KL folded in; works with samples_per_prompt=1) and gae "
                            "(PPO with a learned critic, section critic).")
    gamma: float = Field(1.0, ge=0.0, le=1.0,
                         description="Discount per response token of reinforce_pp returns and gae (verl/OpenRLHF "
                                     "gamma); 1: every token gets the outcome reward.")
    lam: float = Field(1.0, ge=0.0, le=1.0, description="gae: the lambda of generalised advantage estimation "
                                                         "(verl lam, OpenRLHF lambd).")
    filter_groups: bool = Field(
        False, description="Dynamic sampling (DAPO): drop prompt groups whose rewards are all equal (they have no "
                           "group advantage) and sample more prompts, in rounds, until data.prompts_per_step groups "
                           "are kept. Needs samples_per_prompt >= 2.")
    max_generation_rounds: int = Field(
        4, ge=1, le=1000, description="filter_groups: most sampling rounds per step (the first included); when they "
                                      "run out the step trains on the groups it kept and says so.")
    std_scale: Literal["group", "batch", "none"] = Field(
        "group", description="GRPO: divide centred rewards by the group std, the batch std, or nothing.")
    std_eps: float = Field(
        1e-6, gt=0.0, le=1.0, description="grpo (std_scale group or batch) and reinforce_pp_baseline (whiten sample): "
                                          "added to the std before dividing (verl epsilon 1e-6, TRL 1e-4). A group "
                                          "whose rewards are all equal gets advantage exactly 0 whatever it is.")
    reinforce_pp_baseline_whiten: Literal["sample", "token"] = Field(
        "sample", description="reinforce_pp_baseline: scale the group-centred rewards by their std over completions "
                              "('sample', + std_eps) or whiten them over every response token of the step, each "
                              "completion's value repeated on its tokens ('token': verl's and OpenRLHF's masked "
                              "whitening, mean and variance weighted by length, 1e-8 inside the root; an all-equal "
                              "group then gets a small non-zero advantage, as there).")
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                              "seq-mean-token-sum-norm", "token-sum-norm"] = Field(
        "token-mean", description="How per-token losses become one number, normalised by global counts: token-mean "
                                  "(sum / tokens), seq-mean-token-mean (mean over sequences of each one's token "
                                  "mean), seq-mean-token-sum (mean over sequences of token sums), "
                                  "seq-mean-token-sum-norm (that divided by the constant loss_norm_tokens: Dr. "
                                  "GRPO's normaliser, TRL loss_type=dr_grpo), token-sum-norm (the sum over all "
                                  "tokens divided by loss_norm_tokens, no mean over sequences: what verl computes "
                                  "for its seq-mean-token-sum-norm).")
    loss_norm_tokens: int | None = Field(
        None, ge=1, le=MAX_TOKENS,
        description="seq-mean-token-sum-norm and token-sum-norm: the constant the token sums are divided by; "
                    "empty: the response cap (rollout.max_new_tokens; with rollout.env rollout.max_trajectory_tokens), "
                    "as Dr. GRPO and TRL (max_completion_length) do.")
    minibatches_per_step: int = Field(
        1, ge=1, le=MAX_COUNT, description="Optimizer steps per rollout: the step's samples are split into this many.")
    epochs_per_step: int = Field(1, ge=1, le=1000, description="Passes over the step's samples (PPO epochs).")
    policy_loss: Literal["ppo", "gspo", "cispo", "sapo", "gpg", "geo_mean", "clip_cov", "kl_cov"] = Field(
        "ppo", description="Policy-gradient surrogate per token (docs/algorithms.md): ppo (PPO-clip on the token "
                           "ratio, clip_low/clip_high; dual clip with clip_ratio_c), gspo (PPO-clip on the sequence "
                           "ratio exp(mean token log-ratio), GSPO; verl loss_mode=gspo, TRL "
                           "importance_sampling_level=sequence; the paper's clip_low 3e-4, clip_high 4e-4 and "
                           "loss_aggregation=seq-mean-token-mean), cispo (the ratio clipped to [1 - clip_low, 1 + "
                           "clip_high] and detached, times the log-prob, CISPO; verl loss_mode=cispo with clip_low 10 "
                           "(no lower bound), TRL loss_type=cispo with clip_high = epsilon_high - 1), sapo (SAPO's "
                           "soft gate, sapo_tau_pos/sapo_tau_neg), gpg (-A log-prob: GPG, REINFORCE), geo_mean "
                           "(GMPO: the geometric mean of the sequence's token ratios, each clipped in log space to "
                           "[-clip_low, clip_high]; with seq-mean-token-mean), clip_cov and kl_cov (PPO-clip with "
                           "the highest advantage x log-prob covariance tokens of the mini-batch detached, or the "
                           "unclipped ratio with a KL penalty on them: clip_cov_*, kl_cov_*).")
    clip_low: float = Field(0.2, ge=0.0, le=1000.0,
                            description="Ratio clip below 1 (1 - clip_low); at most 1 except with cispo (>= 1: no "
                                        "lower bound on the weight); geo_mean: the log-ratio's lower bound -clip_low.")
    clip_high: float = Field(0.2, ge=0.0, le=10.0, description="Ratio clip above 1 (1 + clip_high); 0.28 = DAPO clip-higher.")
    clip_ratio_c: float = Field(
        0.0, ge=0.0, le=1000.0,
        description="Dual-clip PPO (policy_loss=ppo): the loss of a negative-advantage token is at most -clip_ratio_c "
                    "x A, so a ratio past clip_ratio_c pushes no further (arXiv:1912.09729); 0: off; > 1 when on. "
                    "verl applies 3.0 by default; the share of tokens held by it is policy/dual_clip_fraction.")
    sapo_tau_pos: float = Field(1.0, gt=0.0, le=1000.0, description="sapo: the gate's temperature on tokens with a "
                                                                     "positive advantage (verl tau_pos).")
    sapo_tau_neg: float = Field(1.05, gt=0.0, le=1000.0, description="sapo: the gate's temperature on the others "
                                                                      "(verl tau_neg).")
    clip_cov_fraction: float = Field(0.0002, gt=0.0, le=1.0,
                                     description="clip_cov: the share of the mini-batch's tokens whose gradient is "
                                                 "dropped (at least one; verl clip_cov_ratio).")
    clip_cov_low: float = Field(1.0, ge=-1e6, le=1e6, description="clip_cov: only tokens whose covariance is above "
                                                                  "this are candidates (verl clip_cov_lb).")
    clip_cov_high: float = Field(5.0, ge=-1e6, le=1e6, description="clip_cov: ... and below this (verl clip_cov_ub).")
    kl_cov_fraction: float = Field(0.0002, gt=0.0, le=1.0,
                                   description="kl_cov: the share of the mini-batch's tokens, those of largest "
                                               "covariance, that get the KL penalty (at least one; verl kl_cov_ratio).")
    kl_cov_coef: float = Field(0.1, ge=0.0, le=1000.0, description="kl_cov: weight of |log-ratio| on those tokens "
                                                                   "(verl ppo_kl_coef).")
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of the KL to the frozen reference model; 0 loads no reference.")
    kl_estimator: Literal["k1", "k2", "k3", "abs", "k1+", "k3+"] = Field(
        "k3", description="Per-token KL estimator (Schulman's, d = log pi_ref - log pi): k1 (-d; verl kl), k2 (d^2/2; "
                          "verl mse), k3 (exp(d) - d - 1 >= 0, low variance; verl low_var_kl), abs (|d|), and the "
                          "straight-through k1+ and k3+ (the value of k1 / k3 with the gradient of k2; verl k1+, "
                          "low_var_kl+).")
    kl_in: Literal["loss", "reward"] = Field("loss", description="Apply KL as a loss term or as a reward penalty.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus weight (0: off).")
    importance_correction: Literal["stale", "all", "none"] = Field(
        "stale", description="Which samples get importance weights pi_old / pi_engine on the policy-gradient term, "
                             "pi_old the trainer's policy at the start of the step and pi_engine the engine's "
                             "log-probs of the sampled tokens (AReaL's decoupled PPO, verl's rollout correction, TRL's "
                             "vLLM importance sampling); how: importance_level, importance_mode, importance_cap, "
                             "importance_floor. 'stale': only samples from an older policy (rollout.max_staleness >= "
                             "1); 'all': every sample, which also corrects engine/trainer mismatch (e.g. vLLM in "
                             "bf16); 'none': off.")
    old_policy: Literal["trainer", "engine"] = Field(
        "trainer", description="The ratio's denominator pi_old: the trainer's log-probs at the start of the step "
                               "(trainer; decoupled: importance weights correct pi_old to the engine), or the "
                               "engine's log-probs of the sampled tokens (engine: verl's rollout_correction.bypass_mode; "
                               "no pass of its own for pi_old, the ratio itself carries the correction, and "
                               "importance weights and rejection, when on, compare the current policy with the "
                               "engine: with gpg it is verl's bypass loss_type=reinforce).")
    importance_level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="importance_correction: one weight per token (token), or per sequence on all its tokens: "
                             "the product of its token weights (sequence) or their geometric mean (geometric); "
                             "docs/algorithms.md has the peers' names.")
    importance_mode: Literal["truncate", "mask", "none"] = Field(
        "truncate", description="importance_correction: a weight outside [importance_floor, importance_cap] is "
                                "clamped into it (truncate: TIS) or set to 0, rejecting the token or sequence (mask: "
                                "masked importance sampling, TRL *_mask, OpenRLHF icepop); a rejected token still "
                                "counts in the loss denominators. none: no weight, only rejection acts (verl rollout_rs "
                                "without rollout_is). Shares per step: policy/is_clipped_fraction, "
                                "policy/is_masked_fraction (tokens), policy/is_clipped_seq_fraction, "
                                "policy/is_masked_seq_fraction (sequences).")
    importance_normalize: bool = Field(
        False, description="importance_correction: divide the weights by their mean over the whole step on all ranks "
                           "(over tokens at importance_level=token, over sequences otherwise; after truncation or "
                           "masking, before rejection): verl's rollout_is_batch_normalize. The mean "
                           "(policy/is_batch_mean) needs pi_old before the step's first update: with one mini-batch "
                           "and one epoch the trainer computes it in a pass of its own. Not with old_policy=engine.")
    rejection: list[RejectionCriterion] = Field(
        default_factory=list,
        description="importance_correction: rejection criteria, all of which a token must pass or its policy-gradient "
                    "term is 0 (it still counts in the loss denominators): verl's rollout_rs, chained; e.g. "
                    "[{criterion: token_k1, low: 0.5, high: 2}, {criterion: seq_max_k2, high: 2.5}]. Shares per "
                    "step: policy/rejected_fraction, policy/rejected_seq_fraction.")
    router_aux_loss_coef: float = Field(
        0.0, ge=0.0, le=1000.0,
        description="A mixture of experts' load-balancing loss (transformers' router_aux_loss_coef: Switch "
                    "Transformer's, every MoE layer's tokens pooled), added with this weight; 0: off, as verl, slime "
                    "and prime-rl run RL. It is the whole mini-batch's: expert counts and tokens summed over all ranks "
                    "before each update (a forward without gradient first when nothing recorded them), so it is the "
                    "same on any layout (docs/moe.md). Not for a sigmoid router (DeepSeek-V3), balanced by its "
                    "correction biases, which stay as the checkpoint has them.")
    turn_discount: float = Field(
        1.0, ge=0.0, le=1.0,
        description="With rollout.env: a trajectory's reward is the sum over its turns t = 0, 1, ... of "
                    "turn_discount^t x the reward of the environment's answer to turn t, so an outcome reached in "
                    "fewer turns is worth more; 1: the plain sum.")
    importance_cap: float = Field(
        2.0, ge=1.0, le=1000.0, description="Upper threshold of the importance weight (verl/AReaL cap, TRL "
                                         "vllm_importance_sampling_clip_max, OpenRLHF's upper threshold).")
    importance_floor: float = Field(
        0.0, ge=0.0, le=1.0, description="Lower threshold of the importance weight (TRL "
                                         "vllm_importance_sampling_clip_min, OpenRLHF's lower threshold; verl's "
                                         "rollout_rs bounds are algo.rejection's); 0: none. At most 1, so an "
                                         "uncorrected sample (weight exactly 1) is never touched.")

    @field_validator("importance_normalize")
    @classmethod
    def _normalize_needs_pi_old(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("old_policy") == "engine":
            raise PydanticCustomError("importance_normalize", "false with old_policy=engine: the weights then follow "
                                      "the current policy, whose mean over the step is not known before its updates")
        return value

    @field_validator("clip_low")
    @classmethod
    def _clip_low_for_loss(cls, value: float, info: ValidationInfo) -> float:
        loss = info.data.get("policy_loss", "ppo")
        if value > 1.0 and loss != "cispo":
            raise PydanticCustomError("clip_low", "with policy_loss={loss} the ratio's lower clip 1 - clip_low must "
                                      "not be negative: at most 1 (above 1 only with policy_loss=cispo)",
                                      {"loss": loss})
        return value

    @field_validator("clip_ratio_c")
    @classmethod
    def _dual_clip_for_loss(cls, value: float, info: ValidationInfo) -> float:
        loss = info.data.get("policy_loss", "ppo")
        if value and loss != "ppo":
            raise PydanticCustomError("clip_ratio_c", "dual clip is PPO's: 0 with policy_loss={loss}", {"loss": loss})
        if value and value <= 1.0:
            raise PydanticCustomError("clip_ratio_c", "0 (off) or a bound > 1 (verl's default 3.0)")
        return value


class CriticConfig(Section):
    path: str = Field("", description="algo.advantage=gae: local Hugging Face directory (or hub id, as model.path) "
                                      "of the value model's body; empty: the policy's (model.path) weights. Its LM "
                                      "head is replaced by "
                                      "a scalar value head.")
    lr: float = Field(1e-5, gt=0.0, le=1.0, description="AdamW learning rate of the critic.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up of the critic's learning rate, in optimizer "
                                                   "steps.")
    value_clip: float = Field(0.5, ge=0.0, description="Value-loss clipping: a new value counts at most this far "
                                                       "from the value at sampling time (verl cliprange_value).")
