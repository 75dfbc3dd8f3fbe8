"""Reward models and LLM judges as rewards.functions entries: the scores against a naive loop, the judge's keyed
samples and its parser failures, one-line errors for bad entries, the plan's memory and findings, the peers' reward
settings, and the same rewards on 1 and 3 processes (replicated and FSDP2)."""

from __future__ import annotations

import json

import pytest
import torch

from e2e import evenrl_here, evenrl_many, final_params, max_diff, metrics
from evenrl.config import RunConfig, with_settings
from evenrl.config.rewards import JudgeSpec
from evenrl.engines import HFEngine
from evenrl.models.loading import load_policy, load_reward_model
from evenrl.planner.layout import make_layout
from evenrl.planner.dims import dims_from_config
from evenrl.planner.memory import GIB, estimate_memory
from evenrl.rewards.judge import fill_template, first_number, last_number, resolve_parser, yes_no
from evenrl.testing import make_tiny_reward_model
from evenrl.train.reward_models import (Judge, RewardModel, add_model_rewards, judge_outputs, reward_model_input,
                                        reward_model_scores)

TEMPLATE = "Rate {question}{completion} (answer {answer}) from 0 to 9: "


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    return make_tiny_reward_model(str(tmp_path_factory.mktemp("rm") / "rm"), seed=3)


def _rm(path) -> RewardModel:
    model, tok = load_reward_model(path, "rm")
    return RewardModel("model:rm", 1.0, model, tok, 512, torch.device("cpu"))


def _judge(model_path, parser="last_number", temperature=1.0) -> Judge:
    model, tok = load_policy(model_path)
    spec = JudgeSpec(template=TEMPLATE, parser=parser, max_new_tokens=6, temperature=temperature)
    engine = HFEngine(model, eos_token_ids={tok.eos_token_id}, pad_token_id=tok.pad_token_id)
    return Judge("judge:model", 1.0, spec, engine, model, tok, resolve_parser(parser), 7, 512, torch.device("cpu"))


PROMPTS = ["3+5=", "1+1=", "9+9=", "2+7=", "4+0="]
COMPLETIONS = ["8", "2 and more text here", "", "9!", "four"]


def test_reward_model_scores_match_a_naive_loop_whatever_the_token_cap(rm_path):
    """Each (prompt, completion) scored alone by the model's own forward, one per call, vs the packed
    micro-batches of any token cap (right-padded rows: a row's score sees only its own tokens)."""
    rm = _rm(rm_path)
    naive = []
    with torch.no_grad():
        for p, c in zip(PROMPTS, COMPLETIONS):
            ids = reward_model_input(rm.tokenizer, p, c)
            naive.append(float(rm.model(input_ids=torch.tensor([ids])).logits[0, 0]))
    assert max(naive) - min(naive) > 0.1, "the tiny reward model scores everything alike: weak test"
    for cap in (1, 24, 10_000):
        got, errors = reward_model_scores(rm, PROMPTS, COMPLETIONS, keys=[4, 0, 3, 1, 2], token_cap=cap)
        assert errors == [None] * 5
        assert got == pytest.approx(naive, abs=1e-6)
    rm.positions = 8  # longer inputs fail their reward instead of being cut
    got, errors = reward_model_scores(rm, PROMPTS, COMPLETIONS, keys=list(range(5)), token_cap=64)
    assert got[1] is None and "takes 8" in errors[1] and got[0] == pytest.approx(naive[0], abs=1e-6)


def test_reward_model_reads_the_conversation_through_its_chat_template(tmp_path):
    path = make_tiny_reward_model(str(tmp_path / "rm"), chat_template=True)
    _, tok = load_reward_model(path, "rm")
    assert tok.decode(reward_model_input(tok, "3+5=", "8")) == "user: 3+5=\nassistant: 8\n"


def test_judge_samples_are_keyed_like_the_policys(assets):
    """Temperature 1: a sample's verdict depends on (step, key), not on the batch it is judged in nor its order."""
    judge = _judge(assets["model"])
    rows = [{"prompt": p, "answer": "x"} for p in PROMPTS]
    out, errors = judge_outputs(judge, rows, COMPLETIONS, keys=[10, 11, 12, 13, 14], step=3)
    assert errors == [None] * 5 and len(set(out)) > 1
    alone, _ = judge_outputs(judge, rows[3:4], COMPLETIONS[3:4], keys=[13], step=3)
    reversed_, _ = judge_outputs(judge, rows[::-1], COMPLETIONS[::-1], keys=[14, 13, 12, 11, 10], step=3)
    assert alone == out[3:4] and reversed_ == out[::-1]
    later, _ = judge_outputs(judge, rows, COMPLETIONS, keys=[10, 11, 12, 13, 14], step=4)
    assert later != out


def test_reward_model_rows_split_by_the_meshs_weights_when_they_are_measured(rm_path):
    """parallel.capacity_weights=auto (measured at run time): a reward model's rows are split by the mesh's
    configured weights (none here: equal), so its scores are those of a run without weights. The config's "auto"
    once reached the partition as the weights themselves (ValueError: could not convert string to float)."""
    from evenrl.config import load_config

    rm = _rm(rm_path)
    rows = [{"prompt": p, "answer": "x"} for p in PROMPTS]

    def scored(cfg):
        stats = {"failed": [False] * 5, "failures": 0, "by_reward": {},
                 **{k: 0 for k in ("raised", "bad_value", "timeout", "memory", "cpu")}}
        return add_model_rewards([rm], cfg, COMPLETIONS, rows, list(range(5)), 1, [0.0] * 5, stats)[0]

    plain = scored(RunConfig())
    assert scored(load_config(None, ["parallel.capacity_weights=auto"])) == plain and len(set(plain)) > 1


def test_a_judge_output_that_does_not_parse_is_a_failed_reward(assets):
    """The tiny random judge writes no yes/no: every sample's reward call fails (kind raised, counted, flagged for
    rewards.on_failure); the function rewards' scores and failures are kept."""
    cfg = RunConfig()
    judge = _judge(assets["model"], parser="yes_no", temperature=0.0)
    rows = [{"prompt": p, "answer": "x"} for p in PROMPTS]
    stats = {"failed": [False, True, False, False, False], "failures": 1, "by_reward": {"exact_match": {}},
             **{k: 0 for k in ("raised", "bad_value", "timeout", "memory", "cpu")}}
    stats["raised"] = 1
    scores, out = add_model_rewards([judge], cfg, COMPLETIONS, rows, list(range(5)), 1, [1.0, 0, 0, 0, 0], stats)
    assert out["failed"] == [True] * 5 and out["failures"] == out["raised"] == 6
    assert scores == [1.0, 0, 0, 0, 0] and out["by_reward"]["judge:model"]["first_error"].startswith("ValueError")


def test_judge_prompt_and_parsers():
    assert fill_template("Q {question} A {completion} R {answer}", "x {answer}", "{question} 7", None) == \
        "Q x {answer} A {question} 7 R "
    assert last_number("3 then 7.5", {}) == 7.5 and first_number("8/10", {}) == 8.0
    assert yes_no("No. Well, yes", {}) == 0.0
    for parse, text in ((last_number, "none"), (yes_no, "maybe")):
        with pytest.raises(ValueError):
            parse(text, {})


@pytest.mark.parametrize("entry, needle", [
    ("[{name: exact_match, model: /x}]", "rewards.functions.0: got"),
    ("[{weight: 2}]", "none of them"),
    ("[{judge: {template: 'no placeholder'}}]", "rewards.functions.0.judge.template"),
    ("[{judge: {template: '{completion}', parser: bogus}}]", "judge-parser"),
    ("[{model: /nonexistent/rm}]", "/nonexistent/rm"),
])
def test_bad_reward_entries_are_one_line_and_exit_2(assets, tmp_path, capsys, entry, needle):
    code, _, err = evenrl_here(capsys, "train", assets["cfg"], f"log.run_dir={tmp_path / 'r'}",
                               f"rewards.functions={entry}")
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_plan_refuses_a_causal_lm_as_reward_model(assets, capsys):
    code, out, _ = evenrl_here(capsys, "plan", assets["cfg"], f"rewards.functions=[{{model: {assets['model']}}}]")
    assert code == 1 and "reward-model-files" in out and "ForSequenceClassification" in out


def _config_dir(d, config):
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


RM_7B = {"model_type": "qwen2", "architectures": ["Qwen2ForSequenceClassification"], "hidden_size": 3584,
         "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
         "vocab_size": 152064, "tie_word_embeddings": False, "max_position_embeddings": 32768}


def test_memory_of_a_reward_model_by_phase(tmp_path):
    """A 7B reward model beside a 7B policy on 8 GPUs: in bf16, 2 bytes per parameter (no LM head), sharded 1/8
    under fsdp, in host memory outside the reward phase when replicated; the reward phase appears only with one."""
    path = _config_dir(tmp_path / "rm", RM_7B)
    d = dims_from_config(RM_7B)
    rm_params = d.params - d.vocab * d.hidden
    base = RunConfig.model_validate({"model": {"dtype": "bfloat16"},
                                     "rewards": {"functions": [{"model": path}]}})
    lay = make_layout(1, 8, device="cuda", device_memory_gib=80)
    fsdp = estimate_memory(with_settings(base, {"parallel.sharding": "fsdp"}), lay, d)
    assert fsdp.breakdown["reward models"] * GIB == pytest.approx(2 * rm_params / 8)
    assert "reward" in fsdp.phases and fsdp.phases["reward"] > sum(fsdp.breakdown[k] for k in ("parameters",))
    rep = estimate_memory(base, lay, d)
    assert rep.breakdown["reward models"] == 0 and rep.breakdown["reward models in use"] * GIB == \
        pytest.approx(2 * rm_params)
    assert "reward" not in estimate_memory(RunConfig(), lay, d).phases


def test_plan_note_says_where_the_scorers_run(assets, rm_path, capsys):
    entries = f"[{{model: {rm_path}}}, {{judge: {{template: '{{completion}}'}}}}]"
    code, out, _ = evenrl_here(capsys, "plan", assets["cfg"], f"rewards.functions={entries}", "--nproc-per-node",
                               "3", "parallel.sharding=fsdp")
    assert code == 0, out
    note = out[out.index("reward-models:"):]
    assert "sharded over the 3 training ranks" in note and "reward model rm" in note and "judge model" in note
    assert "\n             reward " in out  # the reward phase's row of the memory table


def test_peer_reward_models_become_entries(tmp_path, rm_path):
    from test_foreign import run

    t, cfg, _ = run(tmp_path, "trl", {"reward_funcs": [rm_path, "accuracy_reward", "org/hub-rm"],
                                      "reward_weights": [1.0, 0.5, 2.0]})
    assert [s.model_dump() for s in cfg.rewards.functions] == [{"name": "math", "weight": 0.5},
                                                               {"model": rm_path, "weight": 1.0}]
    assert any("org/hub-rm" in n for n in t.notes)
    t, cfg, _ = run(tmp_path, "openrlhf", f"--reward_pretrain {rm_path} --remote_rm_url http://h:5000")
    assert cfg.rewards.functions[0].model == rm_path and any("remote_rm_url" in n for n in t.notes)
    t, cfg, _ = run(tmp_path, "verl", {"reward_model": {"enable": True, "model": {"path": rm_path}}})
    assert [s.model for s in cfg.rewards.functions] == [rm_path]


@pytest.mark.slow
def test_same_rewards_and_model_on_one_and_three_processes(assets, rm_path, tmp_path):
    """A reward model (weight 0.5) and a judge on the policy's base (temperature 1, keyed samples, weight 0.1)
    beside exact_match, rewards.on_failure=mask (the random judge seldom writes a number: those samples leave
    learning), 3 steps: 1 process, 3 processes, and 3 processes with FSDP2.

    Replicated, the rewards are the same bits on 1 and 3 processes (the reward model's micro-batches are cut from
    the whole step before they are dealt to ranks). Sharded, FSDP2's gathered weights make the reward model's
    matmuls round differently (measured 3e-9 on reward/mean at step 3): within 1e-6. The final weights within 1e-5
    (measured 1.8e-6 on 3 processes, 2.1e-6 sharded): the update's own float rounding, as for function rewards."""
    judge = "{judge: {template: 'Rate {question}{completion} 0-9: ', max_new_tokens: 4, temperature: 1.0}, weight: 0.1}"
    args = [assets["cfg"], "train.steps=3", "rewards.on_failure=mask", "eval.path=''",
            f"rewards.functions=[{{name: exact_match}}, {{model: {rm_path}, weight: 0.5}}, {judge}]"]
    runs = {"three": ["--nproc-per-node", "3"], "fsdp": ["--nproc-per-node", "3", "parallel.sharding=fsdp"],
            "one": []}
    evenrl_many({name: ["train", *args, f"log.run_dir={tmp_path / name}", *more] for name, more in runs.items()})
    rows = {name: [r for r in metrics(tmp_path / name) if r["step"] > 0] for name in runs}
    one = rows["one"]
    assert all(0 < r["reward/masked_samples"] == r["reward/failures"] < r["samples"] for r in one)
    for k in ("reward/mean", "reward/std", "reward/masked_samples"):
        assert [r[k] for r in rows["three"]] == [r[k] for r in one], k
        assert [r[k] for r in rows["fsdp"]] == pytest.approx([r[k] for r in one], abs=1e-6), k
    want = final_params(tmp_path / "one")
    for name in ("three", "fsdp"):
        assert max_diff(want, final_params(tmp_path / name)) <= 1e-5, name
    assert max_diff(want, _start(assets)) > 1e-5, "training did not move the model: weak test"


def _start(assets) -> dict:
    from pathlib import Path

    from safetensors.torch import load_file

    return load_file(str(Path(assets["model"]) / "model.safetensors"))
