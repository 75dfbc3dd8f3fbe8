"""benchmarks/gpu_suite.py, the one prepared GPU run, checked on CPU: its JSON schema is complete whatever the budget
cuts, every section not run says why, a section that runs reports numbers that could be wrong, and a child killed
at the deadline is recorded as cut with the sections after it skipped. The whole rehearsal (`--tiny --device cpu`,
every section) is a benchmark, not a test: docs/performance.md."""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_suite  # noqa: E402
import gpu_suite_table  # noqa: E402

KEYS = {"name", "group", "status", "reason", "seconds", "estimate_s", "result"}


@pytest.fixture(autouse=True)
def _restored_environment(monkeypatch):
    """main() sets these for its children (CPU only, one thread for --tiny, src/ on the path); the tests after
    these must not inherit them."""
    for key in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "PYTHONPATH"):
        if key in os.environ:
            monkeypatch.setenv(key, os.environ[key])
        else:
            monkeypatch.delenv(key, raising=False)


def load(out: Path) -> dict:
    res = json.loads((out / "gpu_suite.json").read_text())
    assert res["schema"] == gpu_suite.SCHEMA
    assert [s["name"] for s in res["sections"]] == list(gpu_suite.SECTIONS)  # every section, in the order of value
    for s in res["sections"]:
        assert KEYS <= set(s)
        assert s["status"] in ("ran", "skipped", "failed", "cut")
        if s["status"] != "ran":
            assert s["reason"], s  # never silent
    md = (out / "gpu_suite.md").read_text()
    assert all(f"| {name} |" in md for name in gpu_suite.SECTIONS)
    return res


def test_a_budget_too_small_for_anything_skips_every_section_and_says_why(tmp_path):
    assert gpu_suite.main(["--tiny", "--device", "cpu", "--out", str(tmp_path), "--budget-s", "1"]) == 0
    res = load(tmp_path)
    assert res["model"] is None  # nothing fitted, so nothing was built
    assert all(s["status"] == "skipped" and s["reason"].startswith("budget:") for s in res["sections"])
    assert res["wall_s"] < 30


def test_one_cheap_section_runs_and_the_rest_are_not_asked(tmp_path):
    out = tmp_path / "out"
    asked = {"precision", "trace", "adamw", "attention", "moe"}
    assert gpu_suite.main(["--tiny", "--device", "cpu", "--out", str(out), "--budget-s", "300",
                           "--sections", ",".join(sorted(asked))]) == 0
    res = load(out)
    secs = {s["name"]: s for s in res["sections"]}
    assert {n for n, s in secs.items() if s["status"] == "ran"} == asked
    assert all(s["reason"] == "not asked (--sections)" for n, s in secs.items() if n not in asked)
    att = secs["attention"]["result"]
    assert set(att["paths"]) == {"masked", "segments"} and 0 < att["padding_share"] < 1
    for p in att["paths"].values():  # every training-forward path computes the masked path's log-probs (fp32)
        assert p["max_abs_dlogp_vs_masked"] < 1e-5 and p["real_tokens_per_s"] > 0
    moe = secs["moe"]["result"]["backends"]
    assert set(moe) == {"grouped_mm", "eager"} and moe["eager"]["max_abs_dy_vs_first"] < 1e-5
    v = secs["precision"]["result"]["variants"]
    assert set(v) == {"fp32", "fp32-tf32", "bf16-autocast", "bf16-params"}
    assert v["fp32"]["mean_abs_dlogp"] < 1e-5 and v["fp32"]["grad_rel_err"] < 1e-4  # fp32 against float64
    for scheme in ("bf16-autocast", "bf16-params"):  # bf16 is measurably worse, and within its documented bounds
        assert 10 * v["fp32"]["mean_abs_dlogp"] < v[scheme]["mean_abs_dlogp"] < 1e-2
    assert v["fp32-tf32"] == v["fp32"]  # TF32 is a CUDA mode: on CPU the same arithmetic
    opt = secs["adamw"]["result"]["optimizer"]
    assert opt["fused"]["step_ms"] > 0 and opt["foreach"]["step_ms"] > 0
    assert res["model"]["shape_name"] == "tiny"
    trace = secs["trace"]["result"]  # one optimizer step: the first mini-batch of the step's 4 x 4 rows
    assert trace["rows"] == 8 and set(trace["phases"]) == {"update"}
    assert 0 < trace["phases"]["update"]["busy_share"] <= 1 and trace["phases"]["update"]["profiled_s"] > 0
    assert (out / trace["trace"]).stat().st_size > 0 and "aten::" in (out / trace["top_ops"]).read_text()


def test_a_kernels_child_killed_at_the_deadline_is_cut_and_the_rest_skipped(tmp_path):
    class KilledAfterCeiling:  # what the child leaves when the deadline kills it during "schemes"
        def run(self, title, cmd, timeout):
            spec = json.loads(Path(cmd[-1]).read_text())
            assert spec["sections"] == ["ceiling", "schemes", "sampler"] and timeout > 0
            Path(spec["result_file"]).write_text(
                json.dumps({"name": "load", "seconds": 2.0, "result": {"params": 1}}) + "\n"
                + json.dumps({"name": "ceiling", "seconds": 0.5, "result": {"n": 8, "bf16_matmul_tflops": 1.0}}) + "\n")
            return 124, "", 9.0

    ctx = SimpleNamespace(work=tmp_path, out=tmp_path, model=tmp_path, data=tmp_path, device="cpu",
                          budget=gpu_suite.Budget(60, tiny=True), log=KilledAfterCeiling(), info={},
                          args=SimpleNamespace(prompts=4, samples=4, new_tokens=16, token_cap=4096, tiny=True))
    got = gpu_suite.run_kernels(ctx, ["ceiling", "schemes", "sampler"])
    assert got["ceiling"]["status"] == "ran" and got["ceiling"]["load_s"] == 2.0
    assert got["schemes"]["status"] == "cut" and "deadline" in got["schemes"]["reason"]
    assert got["sampler"]["status"] == "skipped" and "schemes" in got["sampler"]["reason"]


def test_trainer_throughput_runs_each_arm_apart_and_only_where_it_fits(tmp_path):
    class Children:  # each arm's process, 10 s of the budget: the 0.6B one writes its result, the 4B LoRA one fails
        def __init__(self, budget):
            self.calls, self.budget = [], budget

        def run(self, title, cmd, timeout):
            self.calls.append((cmd, timeout))
            self.budget.end -= 10
            if "--lora-rank" in cmd:
                return 1, "loading\nRuntimeError: out of memory", 3.0
            out = Path(cmd[cmd.index("--json") + 1])
            out.write_text(json.dumps({"model": "tiny", "lora_rank": 0, "micro_batches": 2, "seq_len": 64,
                                       "tokens_per_s": 2.0e4, "mfu": 0.2, "step_s": [1.0, 1.1], "forward_path": "packed",
                                       "memory": {"peak_reserved_gib": 12.0, "peak_allocated_gib": 11.0},
                                       "prime_rl": {"tokens_per_s": 11900, "mfu": 0.111, "peak_gib": 12.5,
                                                    "where": "prime-rl BENCHMARKS.md"}}))
            return 0, "", 2.0

    def ctx(seconds):
        budget = gpu_suite.Budget(seconds, tiny=True)
        return SimpleNamespace(work=tmp_path, device="cpu", budget=budget, log=Children(budget),
                               args=SimpleNamespace(tiny=True))

    roomy = ctx(60)
    got = gpu_suite.run_throughput(roomy, "trainer-throughput")
    arms = got["result"]["arms"]
    assert got["status"] == "ran" and list(arms) == ["qwen3-0.6b-16k", "qwen3-4b-lora-16k"]
    assert arms["qwen3-0.6b-16k"]["status"] == "ran" and arms["qwen3-0.6b-16k"]["result"]["tokens_per_s"] == 2e4
    assert arms["qwen3-4b-lora-16k"]["status"] == "failed" and "out of memory" in arms["qwen3-4b-lora-16k"]["reason"]
    cmd, timeout = roomy.log.calls[0]  # --tiny: the tiny shape at 64 tokens for 16 K
    assert "--tiny" in cmd and "qwen3-0.6b" not in cmd and cmd[cmd.index("--seq-len") + 1] == "64"
    assert cmd[cmd.index("--device") + 1] == "cpu" and cmd[cmd.index("--steps") + 1] == "2" and timeout <= 3 * 20 + 30
    assert roomy.log.calls[1][0][roomy.log.calls[1][0].index("--lora-rank") + 1] == "16"
    md = "\n".join(gpu_suite_table._throughput({"trainer-throughput": {"status": "ran", "result": got["result"]}}))
    assert ("| qwen3-0.6b-16k | tiny, 2 x 64 tokens | 20,000 | 20.0% | 12.0 (11.0) | 1.00 / 1.10 | packed | 11,900 | "
            "11.1% | 12.5 |") in md
    assert "| qwen3-4b-lora-16k | failed: exit 1: RuntimeError: out of memory |" in md

    tight = ctx(30)  # 25 s to use: the first 64 K arm (~20 s) fits, then 15 s are left for the second
    got = gpu_suite.run_throughput(tight, "trainer-throughput-64k")
    arms = got["result"]["arms"]
    assert arms["qwen3-0.6b-64k"]["status"] == "ran" and len(tight.log.calls) == 1
    assert tight.log.calls[0][0][tight.log.calls[0][0].index("--seq-len") + 1] == "256"
    assert arms["qwen3-4b-lora-64k"]["status"] == "skipped" and arms["qwen3-4b-lora-64k"]["reason"].startswith("budget:")


@pytest.mark.parametrize("argv, field", [(["--sections", "step-fp32,nope"], "--sections: unknown nope"),
                                         (["--budget-s", "0"], "--budget-s: 0.0")])
def test_bad_arguments_are_refused_in_one_line(argv, field, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_suite.parse(argv)
    assert e.value.code == 2
    assert field in capsys.readouterr().err.strip().splitlines()[-1]
