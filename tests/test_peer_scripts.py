"""Launch scripts read as text (evenrl.planner.peers.script), never run: variables and defaults, arrays, branches,
wrappers, and what a script leaves to its caller; then `--from` on them, the TRL version rules, and
`--write-config`, whose file `evenrl train` reads as it is."""

import argparse
import subprocess

import pytest
import yaml

from evenrl.cli import main as cli_main
from evenrl.config import load_config
from evenrl.errors import UsageError
from evenrl.planner.peers import read_foreign, translate
from evenrl.planner.peers.script import read_script


def ns(**kw):
    base = dict(nnodes=None, nproc_per_node=None, rollout_devices=None, device=None, device_memory_gib=None,
                capacity_weights=None, json=False, fit=False, peer_version=None, nodes=None)
    return argparse.Namespace(**{**base, **kw})


VERL = r"""#!/bin/bash
set -x
export VLLM_ATTENTION_BACKEND=XFORMERS
N=${N:-4}   # GPUs
MODE=${1:-grpo}
BATCH=$((16 * 2))
if [ "$MODE" = "gae" ]; then
    ADV=gae
elif [[ "$MODE" == "grpo" ]]; then
    ADV=grpo
else
    ADV=rloo
fi
LOGGER="['console','wandb']"
cat > /tmp/never_written.yaml <<EOF
python3 -m verl.trainer.main_ppo data.train_batch_size=999
EOF
for i in 1 2; do
  python3 -m verl.trainer.main_ppo data.train_batch_size=7
done
CUDA_VISIBLE_DEVICES=0,1,2,3 python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=$ADV \
    data.train_batch_size=${BATCH} \
    'data.train_files=/no/such/train.parquet' \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
    trainer.logger="$LOGGER" \
    trainer.default_local_dir=$CKPT_DIR/run \
    trainer.n_gpus_per_node=$N "$@" 2>&1 | tee log.txt
"""


def test_script_variables_defaults_branches_and_wrappers():
    launch = read_script(VERL)
    assert launch.program == "python3 -m verl.trainer.main_ppo"  # not the heredoc's, not the loop's
    assert "algorithm.adv_estimator=grpo" in launch.args  # ${1:-grpo} selects the elif branch
    assert "data.train_batch_size=32" in launch.args  # $((16 * 2))
    assert "trainer.n_gpus_per_node=4" in launch.args and "trainer.logger=['console','wandb']" in launch.args
    assert "data.train_files=/no/such/train.parquet" in launch.args
    assert "trainer.default_local_dir=$CKPT_DIR/run" in launch.args and launch.unresolved == {"CKPT_DIR"}
    assert launch.args[-1] == "trainer.n_gpus_per_node=4"  # "$@" expands to nothing; 2>&1 | tee dropped
    notes = " ".join(launch.notes)
    assert "passed over the branch of `if grpo = gae`" in notes and "took the branch of `elif grpo == grpo`" in notes
    assert "$@" in notes and "$CKPT_DIR" in notes


def test_arrays_srun_bash_c_and_ray_job_submit():
    """${ARGS[*]} inside bash -c "...": one word, the whole array (with [@] bash would pass only the first element
    in the command string, the rest as $0, $1, ...)."""
    script = """#SBATCH --nodes=2
#SBATCH --gres=gpu:8
ARGS=(
   --actor.num_nodes 2   # the actors
   --actor.num_gpus_per_node 8
)
srun --overlap -N 1 bash -c "ray job submit --address=http://x:8265 -- python3 -m openrlhf.cli.train_ppo_ray \\
    ${ARGS[*]} --rollout.batch_size 64 --algo.kl.estimator k3"
"""
    launch = read_script(script)
    assert launch.program == "python3 -m openrlhf.cli.train_ppo_ray"
    assert launch.args == ["--actor.num_nodes", "2", "--actor.num_gpus_per_node", "8", "--rollout.batch_size",
                           "64", "--algo.kl.estimator", "k3"]
    assert launch.gpus_per_node == 8


def test_accelerate_launch_layout_and_trl_config(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"num_generations": 4, "per_device_train_batch_size": 4, "use_vllm": True,
                                      "learning_rate": 3e-6}))
    script = tmp_path / "run.sh"
    script.write_text(f"ACCELERATE_LOG_LEVEL=info accelerate launch --config_file zero3.yaml --num_processes=7 "
                      f"src/open_r1/grpo.py --config {recipe} --num_generations 7\n")
    loaded = read_foreign("trl", str(script), [])
    assert loaded.data["num_generations"] == 7 and loaded.data["learning_rate"] == 3e-6  # the flag wins
    t, cfg = translate("trl", loaded, ns())
    assert t.layout.training_ranks == 7 and any("num_processes=7" in n for n in t.notes)
    assert t.version == "1.x" and cfg.parallel.rollout_devices == 0  # TRL >= 1.0 colocates vLLM by default
    assert any("vllm_mode is not set" in n for n in t.notes)
    old, _ = translate("trl", read_foreign("trl", str(script), []), ns(peer_version="0.18"))
    assert (old.layout.training_ranks, old.layout.rollout_devices) == (7, 1)  # 0.18: a vLLM server GPU


def test_trl_eval_batch_check_per_version(tmp_path):
    f = tmp_path / "grpo.yaml"
    f.write_text(yaml.safe_dump({"num_generations": 8, "per_device_train_batch_size": 8, "eval_strategy": "steps",
                                 "per_device_eval_batch_size": 3, "num_processes": 2}))
    t, _ = translate("trl", read_foreign("trl", str(f), []), ns())
    assert "The global eval batch size (3 * 2) must be divisible by the number of generations used for evaluation " \
        "(8)." in [c.message for c in t.checks]
    t, _ = translate("trl", read_foreign("trl", str(f), []), ns(peer_version="0.18"))
    assert any(c.message.startswith("The global eval batch size (2 x 3) must be evenly divisible") for c in t.checks)


@pytest.mark.parametrize("content,match", [
    ({"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "num_processes": 8},
     "accelerate config.*--nproc-per-node 8"),
    ({"dataset_name": "x", "packing": True, "max_seq_length": 4096, "learning_rate": 1e-5}, "SFT config"),
])
def test_accelerate_and_sft_configs_are_refused(tmp_path, content, match):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(content))
    with pytest.raises(UsageError, match=match):
        translate("trl", read_foreign("trl", str(f), []), ns())


def test_unknown_keys_and_peer_version_are_one_line(tmp_path, capsys):
    f = tmp_path / "v.yaml"
    f.write_text(yaml.safe_dump({"data": {"train_batch_size": 16, "max_promt_length": 10},
                                 "actor_rollout_ref": {"rollout": {"n": 4},
                                                       "actor": {"ppo_mini_batch_size": 16,
                                                                 "ppo_micro_batch_size_per_gpu": 1}}}))
    t, _ = translate("verl", read_foreign("verl", str(f), []), ns(nproc_per_node=4))
    unknown = [k for k in t.keys if k["status"] == "unknown"]
    assert [k["key"] for k in unknown] == ["data.max_promt_length"] and "typo" in unknown[0]["why"]
    assert cli_main(["plan", "--from", "verl", str(f), "--peer-version", "9.9"]) == 2
    assert "--peer-version 9.9: not a verl version" in capsys.readouterr().err


def test_write_config_is_what_train_reads(tmp_path, capsys):
    script = tmp_path / "run.sh"
    script.write_text(VERL.replace("actor_rollout_ref.rollout.n=5", "actor_rollout_ref.rollout.n=5 "
                                   "actor_rollout_ref.model.path=/no/such/model"))
    out = tmp_path / "evenrl.yaml"
    code = cli_main(["plan", "--from", "verl", str(script), "--write-config", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and out.is_file()
    cfg = load_config(str(out), [])  # what `evenrl train` validates first
    assert cfg.model.path == "/no/such/model" and cfg.data.path == "/no/such/train.parquet"
    assert (cfg.data.prompts_per_step, cfg.rollout.samples_per_prompt, cfg.algo.advantage) == (32, 5, "grpo")
    assert f"wrote {out}; not on this machine: model.path=/no/such/model, data.path=/no/such/train.parquet" in text
    assert cli_main(["plan", "examples/plan_512x8.yaml", "--write-config", str(out)]) == 2  # only with --from


def test_json_lists_every_key(tmp_path, capsys):
    script = tmp_path / "run.sh"
    script.write_text(VERL)
    assert cli_main(["plan", "--from", "verl", str(script), "--json"]) == 0
    import json
    doc = json.loads(capsys.readouterr().out)
    statuses = {k["key"]: k["status"] for k in doc["keys"]}
    assert statuses["data.train_batch_size"] == "mapped" and statuses["trainer.logger"] == "not_applicable"
    assert statuses["trainer.default_local_dir"] == "no_equivalent"  # unresolved: $CKPT_DIR
    assert doc["peer_version"] == "0.8"


def test_verl_micro_batch_spellings_are_checked_as_current_verl_does(tmp_path):
    f = tmp_path / "v.yaml"
    base = {"data": {"train_batch_size": 16}, "actor_rollout_ref": {
        "actor": {"ppo_mini_batch_size": 16, "use_kl_loss": True},
        "rollout": {"n": 4}}}
    f.write_text(yaml.safe_dump(base))
    t, _ = translate("verl", read_foreign("verl", str(f), []), ns(nproc_per_node=4))
    msgs = [c.message for c in t.checks]
    assert any(m.startswith("[actor] Please set at least one of") for m in msgs)
    assert any(m.startswith("[actor_rollout_ref.rollout] Please set at least one of") for m in msgs)
    assert any(m.startswith("[actor_rollout_ref.ref] Please set at least one of") for m in msgs)  # KL needs ref
    old, _ = translate("verl", read_foreign("verl", str(f), []), ns(nproc_per_node=4, peer_version="logic-rl"))
    assert not any("Please set at least one of" in c.message for c in old.checks)  # the fork had defaults


def test_openrlhf_micro_batch_defaults_follow_the_version(tmp_path):
    """--micro_train_batch_size defaults to 4 in OpenRLHF 0.7 and to 1 since 0.10 (train_ppo_ray.py): the same
    flags pass DeepSpeed's batch check in one and fail it in the other."""
    f = tmp_path / "args.txt"
    f.write_text("--actor_num_gpus_per_node 4 --train_batch_size 8 --rollout_batch_size 8 --n_samples_per_prompt 2\n")
    new, _ = translate("openrlhf", read_foreign("openrlhf", str(f), []), ns())
    assert not any("train_batch_size is not equal" in c.message for c in new.checks)  # 8 = 1 x 2 x 4
    old, _ = translate("openrlhf", read_foreign("openrlhf", str(f), []), ns(peer_version="0.7"))
    assert any("Gradient accumulation steps: 0" in c.message for c in old.checks)  # 8 // (4 x 4) = 0


# ------------------------------------------------------------------------------------ hostile scripts

TRAINER = "python3 -m verl.trainer.main_ppo"


def plan_from(tmp_path, capsys, text: str, *more) -> tuple[int, str, str]:
    script = tmp_path / "run.sh"
    script.write_text(text)
    code = cli_main(["plan", "--from", "verl", str(script), *more])
    out, err = capsys.readouterr()
    return code, out, err


def refused_in_one_line(code: int, err: str, needle: str) -> None:
    assert code == 2 and "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and needle in lines[0], err


HOSTILE = [
    # 64 doublings would hold 2**64 characters
    ("doubling", "A=x\n" + "A=$A$A\n" * 64 + f"{TRAINER} a=$A\n", "longer than"),
    # 3,000 levels of defaults inside defaults
    ("nested-default", f"{TRAINER} a=" + "${A:-" * 3000 + "x" + "}" * 3000 + "\n", "nested deeper than"),
    # a pattern that a backtracking matcher tries in every way on every start: refused by the work bound
    ("quadratic-replace", "A=" + "a" * 20_000 + f"\n{TRAINER} a=${{A//a*a*a*b/x}}\n", "more work than"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text, needle", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_expansion_past_its_bounds_is_one_line(tmp_path, capsys, text, needle):
    refused_in_one_line(*plan_from(tmp_path, capsys, text)[::2], needle)


@pytest.mark.timeout(60)
def test_wrappers_and_globs_that_once_hung_are_read(tmp_path):
    """What recursed or backtracked without bound now reads as bash would: 3,000 wrapper words before the trainer,
    a 30-star pattern (55 s in a backtracking matcher), ${A%%*b} on 200,000 characters (past 60 s)."""
    launch = read_script("nohup env " * 1500 + f"{TRAINER} a=1\n")
    assert launch.program == TRAINER and launch.args == ["a=1"]
    launch = read_script("A=" + "a" * 40 + f"\n{TRAINER} a=${{A//" + "*a" * 30 + "b/x} b=${A//a*a/x}\n")
    assert launch.args == ["a=" + "a" * 40, "b=x"]  # no match: unchanged; a match: the longest, replaced
    launch = read_script("A=" + "a" * 200_000 + f"b\n{TRAINER} a=${{A%%*b}}\n")
    assert launch.args == ["a="]
    launch = read_script("A=" + "a" * 2000 + f"b\n{TRAINER} b=${{A%a*}} c=${{A#*a}} d=${{A##*a}} e=${{A%%a*}}\n")
    assert launch.args == ["b=" + "a" * 1999, "c=" + "a" * 1999 + "b", "d=b", "e="]


def test_edits_match_bash(tmp_path):
    """${v/pat/rep}, ${v//pat/rep}, ${v#pat}, ${v##pat}, ${v%pat}, ${v%%pat} and $((...)): bash 5's results."""
    launch = read_script("P=/models/Qwen2.5-7B-Instruct.tar.gz\n"
                         f"{TRAINER} a=${{P##*/}} b=${{P#*/}} c=${{P%.*}} d=${{P%%.*}} e=${{P//[.]/_}} "
                         "f=${P/Q?en/X} g=${P//e/E} h=${P/#\\/models/M}\n")
    assert launch.args == ["a=Qwen2.5-7B-Instruct.tar.gz", "b=models/Qwen2.5-7B-Instruct.tar.gz",
                           "c=/models/Qwen2.5-7B-Instruct.tar", "d=/models/Qwen2", "e=/models/Qwen2_5-7B-Instruct_tar_gz",
                           "f=/models/X2.5-7B-Instruct.tar.gz", "g=/modEls/QwEn2.5-7B-Instruct.tar.gz",
                           "h=M/Qwen2.5-7B-Instruct.tar.gz"]
    launch = read_script(f"{TRAINER} a=$((-7/2)) b=$((-7%2)) c=$((7%-2)) d=$((9223372036854775807+1))\n")
    assert launch.args == ["a=-3", "b=-1", "c=1", "d=-9223372036854775808"]  # 64-bit, truncating, as bash


@pytest.mark.timeout(60)
def test_a_fifo_is_not_read(tmp_path, capsys):
    import os
    fifo = tmp_path / "run.sh"
    os.mkfifo(fifo)
    code = cli_main(["plan", "--from", "verl", str(fifo)])
    refused_in_one_line(code, capsys.readouterr().err, "not a regular file")


def test_write_config_never_writes_over_the_script(tmp_path, capsys):
    script = tmp_path / "run.sh"
    script.write_text(VERL)
    link = tmp_path / "link.yaml"
    link.symlink_to(script)
    for target in (script, link):
        code = cli_main(["plan", "--from", "verl", str(script), "--write-config", str(target)])
        refused_in_one_line(code, capsys.readouterr().err, "is the file being read")
        assert script.read_text() == VERL


# ------------------------------------------------------------------------------------ words as bash splits them

AS_BASH = r"""ARGS=(optim.lr=3e-6 "data.train_batch_size=16" "a b=c d")
M="<p>"
V="x|y 'q'"
E=""
python3 -m verl.trainer.main_ppo "${ARGS[@]}" "pre${ARGS[@]}post" model.path=$M actor.lr=1e-6 k=$V \
    "m=$M" first=$ARGS e=$E "q=$E" $E ${ARGS[*]} "$@" 2>&1 | tee log.txt > /dev/null
"""


def test_words_are_what_bash_passes(tmp_path):
    """"${A[@]}" is one word per element (the text around it joins the first and the last), an unquoted value
    splits at blanks only and its <, >, |, quotes are data (M="<p>" then model.path=$M swallows nothing), $A of an
    array is its first element; the script's own 2>&1 | tee ... > /dev/null are dropped. Checked against bash
    itself, running the script with python3 replaced by a function that prints its arguments."""
    launch = read_script(AS_BASH)
    stub = "python3() { shift 2; printf '%s\\0' \"$@\" > args.bin; }\n"
    subprocess.run(["bash", "-c", stub + AS_BASH], cwd=tmp_path, check=True, timeout=30)
    bash = (tmp_path / "args.bin").read_bytes().decode().split("\0")[:-1]
    assert launch.args == bash
    assert bash[:3] == ["optim.lr=3e-6", "data.train_batch_size=16", "a b=c d"]  # not one word
    assert "model.path=<p>" in bash and "actor.lr=1e-6" in bash  # the learning rate is not swallowed


def test_a_script_without_the_trainer_is_one_line(tmp_path, capsys):
    """A script that runs commands but not the peer's trainer is bad input (exit 2, one line naming what was looked
    for), never a plan from the peer's defaults; another peer's trainer is named with the --from that reads it."""
    cleanup = "pkill -9 ray\nray stop --force\nsleep 3\n"
    code, _, err = plan_from(tmp_path, capsys, cleanup + "python3 tools/convert.py --tp 4\n")
    refused_in_one_line(code, err, "no verl trainer command in the script (looked for python3 -m "
                                   "verl.trainer.main_ppo")
    assert "it runs python3 tools/convert.py)" in err
    script = tmp_path / "slime.sh"
    script.write_text(cleanup + "ray job submit --address=http://127.0.0.1:8265 -- python3 train.py "
                                "--actor-num-nodes 1 --rollout-batch-size 32\n")
    code = cli_main(["plan", "--from", "openrlhf", str(script)])
    refused_in_one_line(code, capsys.readouterr().err, "runs `python3 train.py`, slime's trainer, not OpenRLHF's "
                                                       "(python3 -m openrlhf.cli.train_ppo_ray); read it with "
                                                       "--from slime")


def test_an_array_from_a_sourced_file_is_no_words():
    """slime's scripts `source models/X.sh` for MODEL_ARGS: not read here, so ${MODEL_ARGS[@]} gives no words (as
    an unset array in bash), never a '$MODEL_ARGS' value for the flag before it; the notes name both."""
    launch = read_script('source "$DIR/models/glm4-9B.sh"\npython3 train.py --rollout-num-gpus 4 ${MODEL_ARGS[@]} '
                         "--lr 1e-6\n")
    assert launch.args == ["--rollout-num-gpus", "4", "--lr", "1e-6"]
    notes = " ".join(launch.notes)
    assert "is not read: the variables it sets are not known here" in notes and "$MODEL_ARGS" in notes
    assert "a file it sources" in notes
