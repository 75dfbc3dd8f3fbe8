"""benchmarks/trainer_throughput.py, the update alone at prime-rl's benchmark shapes, rehearsed on CPU: its MFU
formula against prime-rl's published numbers and a hand computation, and a --tiny run of evenrl's update that
counts the fake batch's tokens, moves the weights and reports memory. The GPU numbers are the suite's
(docs/performance.md), never a timed test."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import trainer_throughput as tt  # noqa: E402

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def adapter_params(shape: dict, rank: int) -> int:
    """LoRA's A and B on the seven projections of every block, r x (fan-in + fan-out) each, counted by hand."""
    h, d, i = shape["hidden_size"], shape["head_dim"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    fans = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, i), "up": (h, i), "down": (i, h)}
    return shape["num_hidden_layers"] * sum(rank * sum(fans[p]) for p in PROJECTIONS)


def test_qwen3_0_6b_at_16k_is_the_hand_computed_flops():
    # 28 x (2 x 1024 x 2048 [q, o] + 2 x 1024 x 1024 [k, v] + 3 x 1024 x 3072) + 151936 x 1024 = 595,984,384
    s = tt.SHAPES["qwen3-0.6b"]
    assert tt.mm_params(s) == 595_984_384
    # 6 N + 12 x 28 layers x 16 heads x 64 (hidden / heads, not head_dim 128) x 16384
    assert tt.flop_per_token(s, 16384) == 6 * 595_984_384 + 12 * 28 * 16 * 64 * 16384
    assert tt.peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and tt.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert tt.peak_flops("NVIDIA H200") == 989e12 and tt.peak_flops(None) is None


@pytest.mark.parametrize("key", sorted(tt.PUBLISHED))
def test_the_formula_gives_prime_rls_published_mfu_from_its_published_tokens_per_s(key):
    model, seq, rank = key
    tps, mfu, _ = tt.PUBLISHED[key]
    shape = tt.SHAPES[model]
    fpt = tt.flop_per_token(shape, seq, adapter_params(shape, rank), 0, lora=rank > 0)
    got = fpt * tps / 989e12  # one H100 SXM
    # the table rounds tokens/s to 10 (<= 0.12 % of these) and MFU to 0.1 point
    assert abs(got - mfu) <= 0.0005 + 0.0013 * got, (key, got, mfu)


def run(tmp_path, *extra):
    return tt.main(["--tiny", "--device", "cpu", "--steps", "2", "--json", str(tmp_path / "r.json"), *extra])


def test_a_tiny_full_run_counts_the_fake_batch_and_moves_the_weights(tmp_path):
    r = run(tmp_path, "--peak-tflops", "0.5")
    assert r["tokens_per_step"] == 2 * 64 and r["forward_path"] == "packed"  # 2 micro-batches x 64 tokens
    assert len(r["step_s"]) == 2 and len(r["warmup_s"]) == 1
    assert math.isclose(r["tokens_per_s"], 2 * 128 / sum(r["step_s"]))
    shape = tt.SHAPES["tiny"]  # 2 x (2 x 64 x 64 + 2 x 64 x 32 + 3 x 64 x 128) + 512 x 64, and attention at 64
    mm = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) + 512 * 64
    assert r["flop_per_token"] == 6 * mm + 12 * 2 * 4 * 16 * 64 == tt.flop_per_token(shape, 64)
    assert math.isclose(r["mfu"], r["flop_per_token"] * r["tokens_per_s"] / 0.5e12)
    assert r["trainable_params"] == r["params"] and r["lora_params"] == 0
    assert r["watched_max_change"] > 1e-5 and 0 < r["grad_norm"] < math.inf
    assert 0 < r["memory"]["peak_rss_gib"] < 64 and "resident" in r["memory"]["what"]
    assert (tmp_path / "r.json").exists()


def test_a_tiny_lora_run_on_packed_rows_trains_the_adapters_alone(tmp_path):
    r = run(tmp_path, "--lora-rank", "4", "--rows-per-micro-batch", "3", "--seq-len", "50")
    shape = tt.SHAPES["tiny"]
    assert r["lora_params"] == adapter_params(shape, 4) == r["trainable_params"] < r["params"]
    assert r["tokens_per_step"] == 2 * 50 and r["mfu"] is None  # 17 + 17 + 16 tokens per micro-batch; no CPU peak
    assert "lora_B" in r["watched_param"] and r["watched_max_change"] > 1e-5  # B starts at zero: it moved
    hand = 4 * tt.mm_params(shape) + 6 * adapter_params(shape, 4) + 12 * 2 * 4 * 16 * 50
    assert r["flop_per_token"] == hand


@pytest.mark.parametrize("argv, field", [(["--seq-len", "0"], "--seq-len: 0"),
                                         (["--tiny", "--seq-len", "3", "--rows-per-micro-batch", "2"], "--seq-len: 3"),
                                         (["--peak-tflops", "-1"], "--peak-tflops: -1.0")])
def test_bad_arguments_are_refused_in_one_line(argv, field, capsys):
    with pytest.raises(SystemExit) as e:
        tt.parse(argv)
    assert e.value.code == 2
    assert field in capsys.readouterr().err.strip().splitlines()[-1]
