"""The compatibility table (evenrl.config.compatibility): every row is refused at both ends, the plan (an error
finding, same rule and words) and the run (planner.compatibility.check_run, the check every rank and evenrl sft make
before anything loads: one line); every pair of the table's settings is planned, and what the pair is refused for
that neither setting alone is, is a row of the table; `evenrl train` on 2 processes and `evenrl sft` show the
wiring (one line, exit 2, nothing written). Plans and checks only: nothing loads."""

import json

import pytest

from evenrl.config import load_config, with_settings
from evenrl.config.compatibility import ROWS, SETTINGS, holds, problems, stated
from evenrl.errors import UsageError
from evenrl.planner.compatibility import check_run, facts
from evenrl.planner.dims import dims_from_config
from evenrl.planner.layout import make_layout
from evenrl.planner.plan import make_plan

TEXT = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 128, "max_position_embeddings": 4096}
MODELS = {"text": TEXT, "vision": {"model_type": "qwen2_vl", "text_config": {**TEXT, "model_type": "qwen2_vl_text"},
                                   "tie_word_embeddings": False,
                                   "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64}},
          "moe": {**TEXT, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32},
          "vision-moe": {"model_type": "qwen3_vl_moe", "tie_word_embeddings": False,
                         "text_config": {**TEXT, "model_type": "qwen3_vl_moe_text", "num_experts": 8,
                                         "num_experts_per_tok": 2, "moe_intermediate_size": 32},
                         "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64,
                                           "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}}}
BASE = {"data.prompts_per_step": 4, "rollout.samples_per_prompt": 2, "data.max_prompt_tokens": 64,
        "rollout.max_new_tokens": 64, "train.token_cap_per_micro_batch": 1024}
# How the sweep switches each setting on: config settings, and the model ("model") and device ("device") it needs
# beside them. 8 GPUs: room for every parallel size here, and 4 reserved rollout devices leave 4 trainers.
EXAMPLES = {
    "partial": {"rollout.partial": True},
    "bitwise": {"train.reproducibility": "bitwise"},
    "tp": {"parallel.tensor_parallel_size": 2},
    "sp": {"parallel.sequence_parallel_size": 2},
    "ep": {"parallel.expert_parallel_size": 2, "model": "moe"},
    "ep-tp": {"parallel.expert_parallel_size": 2, "parallel.tensor_parallel_size": 2, "model": "moe"},
    "ep-beside": {"parallel.expert_parallel_size": 2, "parallel.sharding": "fsdp", "model": "moe"},
    "lora-experts": {"model.lora.rank": 8, "model.lora.experts": True, "model": "moe"},
    "offload": {"parallel.cpu_offload": "full", "parallel.sharding": "fsdp"},
    "replicated": {"parallel.sharding": "replicated"},
    "engine-tp": {"rollout.engine": "vllm", "rollout.tensor_parallel_size": 2},
    "hf": {"rollout.engine": "hf"},
    "vllm": {"rollout.engine": "vllm"},
    "vllm-cpu": {"rollout.engine": "vllm", "device": "cpu"},
    "cpu": {"device": "cpu"},
    "reserved": {"parallel.rollout_devices": 4},
    "split-reserved": {"rollout.tensor_parallel_size": 2, "parallel.rollout_devices": 4},
    "split-other": {"rollout.tensor_parallel_size": 2},
    "lockstep-vllm": {"rollout.engine": "vllm", "rollout.tensor_parallel_size": 2},
    "lockstep-hf": {"parallel.tensor_parallel_size": 2},
    "stale": {"rollout.max_staleness": 1},
    "colocated": {},
    "agent": {"rollout.agent": "toy_agents:two_tools"},
    "partial-agent": {"rollout.partial": True, "rollout.agent": "toy_agents:two_tools"},
    "env": {"rollout.env": "calculator"},
    "fsdp-colocated": {"parallel.sharding": "fsdp"},
    "reward-models": {"rewards.functions": [{"model": "/no/such/rm"}]},
    "sandbox-all": {"rewards.sandbox": "all"},
    "replay-engine": {"rollout.router_replay": "engine", "model": "moe"},
    "filter-groups": {"algo.filter_groups": True, "algo.max_generation_rounds": 1},
    "single-sample": {"rollout.samples_per_prompt": 1},
    "rounds": {"algo.filter_groups": True},
    "gae": {"algo.advantage": "gae"},
    "vision": {"model": "vision"},
    "moe": {"model": "moe"},
    "moe-whole": {"model": "moe"},
    "bf16-weights": {"model.dtype": "bfloat16", "model.weights_dtype": "bfloat16"},
    "vision-moe": {"model": "vision-moe"},
}
# What a pair may be refused for, beyond what its settings are refused for alone, without being a row: (rule, one of
# the pair) -> why. Sizes that do not divide, memory and the model directories' missing files are refused for one
# setting alone here, or for none (subtracted).
_NEEDS_MOE = ("its example's mixture of experts is replaced by the vision-language model: one setting's need "
              "(planner.moe)")
NOT_ROWS = {("expert-parallel", "vision"): _NEEDS_MOE, ("router-replay-dense", "vision"): _NEEDS_MOE,
            ("router-aux-dense", "vision"): _NEEDS_MOE, ("lora-experts", "vision"): _NEEDS_MOE,
            ("vllm-vision", "vision"): "vLLM's Qwen2-VL code imports torchvision, which this machine may lack "
                                       "(planner.vision): the installation's, not the settings'"}
NOT_ROWS[("vllm-vision", "vision-moe")] = NOT_ROWS[("vllm-vision", "vision")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """config.json-only model directories: the plan and the run read a model's kind from its config.json."""
    root = tmp_path_factory.mktemp("models")
    for name, hf in MODELS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(hf))
    return {name: str(root / name) for name in MODELS}


def combine(*names):
    """The examples of `names` merged in that order: a later one wins a key (hf after vllm: only hf holds)."""
    merged = {}
    for n in names:
        merged.update(EXAMPLES[n])
    return merged


DEFAULT = load_config(None, [])


class Case:
    """A config, layout and the table's facts (as the plan and the run derive them) for merged examples."""

    def __init__(self, models, merged: dict):
        self.device = merged.get("device", "cuda")
        kind = merged.get("model", "text")
        settings = {**BASE, "model.path": models[kind],
                    **{k: v for k, v in merged.items() if k not in ("model", "device")}}
        self.cfg = with_settings(DEFAULT, settings)
        self.layout = make_layout(nproc_per_node=8, device=self.device, device_memory_gib=80)
        self.rollout_devices = self.cfg.parallel.rollout_devices
        self.facts = facts(dims_from_config(MODELS[kind]), self.device, self.rollout_devices)

    def holds(self, *names) -> bool:
        return all(SETTINGS[n].on(self.cfg, self.facts) for n in names)

    def plan(self):
        p = make_plan(self.cfg, self.layout)
        assert facts(p.dims, self.device, p.layout.rollout_devices) == self.facts  # the plan's own facts
        return p


def pair_case(models, a: str, b: str):
    """A Case with both settings holding, or None where neither order of their examples has both (or the config
    itself refuses them together, in its own one line: LoRA with bf16 weights)."""
    return next((case for case in (_case(models, combine(*order)) for order in ((a, b), (b, a)))
                 if case is not None and case.holds(a, b)), None)


def _case(models, merged: dict):
    from pydantic import ValidationError

    try:
        return Case(models, merged)
    except ValidationError:
        return None


def errors(p) -> set[str]:
    return {f.rule for f in p.findings if f.level == "error"}


def test_every_setting_has_an_example_and_every_row_names_settings():
    assert set(EXAMPLES) == set(SETTINGS)
    for row in ROWS:
        assert row.a in SETTINGS and row.b in SETTINGS and row.a != row.b and row.why and row.fix, row
    # the line a check deeper in the run raises without a config (vLLM's routes, FSDP2's offload): the first row's
    first = next(r for r in ROWS if r.rule == "offload-cpu")
    assert stated("offload-cpu") == (f"{SETTINGS[first.a].text} with {SETTINGS[first.b].text}: {first.why}; fix: "
                                     f"{first.fix}") and "\n" not in stated("router-replay-engine")


@pytest.mark.parametrize("row", ROWS, ids=[f"{r.rule}:{r.a}+{r.b}" for r in ROWS])
def test_each_row_is_refused_by_the_plan_and_by_the_run(models, row):
    """The plan's error finding is the table's words with the config's values; the run's check (model.path's
    config.json, this rank's device, the reserved rollout ranks) refuses it in that one line."""
    case = pair_case(models, row.a, row.b)
    assert case is not None, f"{row.a} and {row.b} cannot both be switched on"
    p = case.plan()
    want = next(x for x in problems(case.cfg, case.facts) if x.rule == row.rule)
    finding = next(f for f in p.findings if f.rule == row.rule)
    assert (finding.level, finding.message, finding.fix) == ("error", want.message, want.fix)
    assert finding.message.startswith(SETTINGS[row.a].shown.format(c=case.cfg, f=case.facts) + " with ")
    with pytest.raises(UsageError) as e:
        check_run(case.cfg, device=case.device, rollout_devices=case.rollout_devices, rules=[row.rule])
    assert str(e.value) == f"{finding.message}; fix: {finding.fix}" and "\n" not in str(e.value)


def test_every_pair_is_refused_by_the_table_or_runs(models):
    """Every pair of the table's settings, planned: the table's findings are the rows that hold (no other pair is
    refused by it), and an error the pair has that neither setting has alone is one of them."""
    singles = {n: errors(Case(models, combine(n)).plan()) for n in SETTINGS}
    names, planned, refused, skipped = list(SETTINGS), 0, set(), []
    table_rules = {r.rule for r in ROWS}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            case = pair_case(models, a, b)
            if case is None:
                skipped.append((a, b))
                continue
            p = case.plan()
            planned += 1
            holding = [r for r in ROWS if holds(r, case.cfg, case.facts)]
            expected = {r.rule for r in holding}
            got = errors(p)
            assert got & table_rules == expected, (a, b, got & table_rules, expected)
            extra = {r for r in got - singles[a] - singles[b] - expected if (r, a) not in NOT_ROWS
                     and (r, b) not in NOT_ROWS}
            assert not extra, f"{a} with {b} is refused for {extra}, which is no row of the table"
            refused |= {(r.a, r.b) for r in holding}
    assert planned > 300 and {(r.a, r.b) for r in ROWS} <= refused
    assert ("hf", "vllm") in skipped and len(skipped) < 40, skipped


def test_train_on_two_processes_stops_on_a_row_in_one_line(assets, tmp_path, capsys):
    """`evenrl train` on 2 processes: the launcher's plan names the row (its rule, the table's words), exit 2,
    nothing written, no worker started."""
    from e2e import evenrl_here

    settings = ["train.reproducibility=bitwise", "rollout.engine=vllm"]
    code, _, err = evenrl_here(capsys, "train", assets["cfg"], *settings, "--nproc-per-node", 2,
                               f"log.run_dir={tmp_path}/r")
    line = next(x.line() for x in problems(load_config(str(assets["cfg"]), settings), facts(None, "cpu", 0))
                if x.rule == "bitwise-vllm-cpu")
    assert code == 2 and err.strip() == f"evenrl train: error: plan bitwise-vllm-cpu: {line}", err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("nproc", [1, 2])
def test_sft_refuses_a_row_before_anything_loads(assets, models, tmp_path, capsys, nproc):
    """`evenrl sft` makes no plan: its own check (the table's rows about the model's split, compatibility.SFT_RULES, on
    model.path's config.json), by the launcher for 2 processes and by the one process itself, stops it in the
    table's words before the mesh is joined: one line, exit 2, nothing written."""
    from e2e import evenrl_here

    code, _, err = evenrl_here(capsys, "sft", assets["cfg"], f"model.path={models['vision']}",
                               "parallel.sequence_parallel_size=2", "--nproc-per-node", nproc,
                               f"log.run_dir={tmp_path}/r")
    assert code == 2 and err.strip() == (
        "evenrl sft: error: parallel.sequence_parallel_size=2 with a vision-language model (qwen2_vl_text): not "
        "supported yet: its image tokens would need splitting with the text; fix: parallel.sequence_parallel_size=1"
    ), err
    assert not (tmp_path / "r").exists()
