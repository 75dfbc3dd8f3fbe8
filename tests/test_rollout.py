import numpy as np
import pytest
import torch

from e2e import requests, with_random_adapters
from evenrl.errors import UsageError
from evenrl.models.loading import load_policy
from evenrl.testing import make_tiny_model
from evenrl.train.data import encode_prompt
from evenrl.engines.base import Request
from evenrl.engines.hf import Completion, SamplingParams, generate, greedy, row_seed, sample_from_logits, uniforms
from evenrl.models.decoder import LeanDecoder

PAD = 0


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return load_policy(make_tiny_model(str(tmp_path_factory.mktemp("tiny")), seed=3))


@pytest.fixture(scope="module")
def abc(policy):
    _, tok = policy
    # Different lengths, so batching them needs real left padding.
    return [encode_prompt(tok, t, False) for t in ("7+8=", "countdown 3 5 7 to 15:", "12*3=")]


def run(model, prompts, keys, params, *, step=0, eos=frozenset(), sample_ranges=None, **kw):
    return generate(model, requests(prompts, keys, step, sample_ranges=sample_ranges), params, eos_token_ids=set(eos),
                    pad_token_id=PAD, **kw)


def by_key(results):
    return {(c.prompt_key, c.sample_index): c for r in results for c in r}


def full_logits(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    return model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(completion)]


def test_batching_does_not_change_samples(policy, abc):
    model, _ = policy
    A, B, C = abc
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, samples_per_prompt=4, seed=5)
    together = by_key(run(model, [A, B, C], [10, 11, 12], params, step=3))
    alone = by_key(run(model, [C], [12], params, step=3))
    reversed_ = by_key(run(model, [B, A], [11, 10], params, step=3))
    one_by_one = by_key(run(model, [A, B, C], [10, 11, 12], params, step=3, max_batch_prompts=1))
    # a rank's part of prompts split over ranks (train.rollout_shares): the same samples
    parts = run(model, [A, C], [10, 12], params, step=3, sample_ranges=[(1, 2), (3, 1)])
    assert [[c.sample_index for c in r] for r in parts] == [[1, 2], [3]]
    for other in (alone, reversed_, one_by_one, by_key(parts)):
        for k, c in other.items():
            assert c.token_ids == together[k].token_ids, k
            np.testing.assert_allclose(c.logprobs, together[k].logprobs, atol=1e-5)
    # The test has teeth: samples of one prompt differ, and another step gives other samples.
    assert len({tuple(together[(10, s)].token_ids) for s in range(4)}) > 1
    later = by_key(run(model, [A], [10], params, step=4))
    assert later[(10, 0)].token_ids != together[(10, 0)].token_ids


def test_shape_and_keys(policy, abc):
    model, _ = policy
    res = run(model, abc, [7, 8, 9], SamplingParams(max_new_tokens=3, samples_per_prompt=2))
    assert [[(c.prompt_key, c.sample_index) for c in r] for r in res] == [[(7, 0), (7, 1)], [(8, 0), (8, 1)], [(9, 0), (9, 1)]]
    assert all(isinstance(c, Completion) and len(c.token_ids) == len(c.logprobs) == 3 for r in res for c in r)
    assert run(model, [], [], SamplingParams(max_new_tokens=3)) == []


def test_eos_stops_rows_without_disturbing_others(policy, abc):
    model, tok = policy
    eos = {1} | set(encode_prompt(tok, "0123456789", False))  # ~11% of the vocab: rows end at varied steps
    params = SamplingParams(max_new_tokens=16, samples_per_prompt=6, seed=1)
    stopped = run(model, abc, [0, 1, 2], params, eos=eos)
    free = run(model, abc, [0, 1, 2], params)
    flags = [c.finished for r in stopped for c in r]
    assert any(flags) and not all(flags)
    assert len({len(c.token_ids) for r in stopped for c in r}) > 2
    for rs, rf in zip(stopped, free):
        for s, f in zip(rs, rf):
            n = len(s.token_ids)
            if s.finished:
                assert s.token_ids[-1] in eos and not eos & set(s.token_ids[:-1])
            else:
                assert n == 16 and not eos & set(s.token_ids)
            # Dropping finished rows from the batch must not change the rows that keep going.
            assert s.token_ids == f.token_ids[:n]
            np.testing.assert_allclose(s.logprobs, f.logprobs[:n], atol=1e-5)


def test_temperature_zero_is_argmax(policy, abc):
    model, _ = policy
    res = greedy(model, abc, max_new_tokens=8, eos_token_ids=set(), pad_token_id=PAD)
    for prompt, c in zip(abc, res):
        ids = list(prompt)
        for _ in range(8):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert c.token_ids == ids[len(prompt) :]
    assert len({tuple(c.token_ids) for c in res}) > 1


def test_tiny_top_p_is_greedy(policy, abc):
    model, _ = policy
    g = run(model, abc, [0, 1, 2], SamplingParams(max_new_tokens=8, temperature=0.0))
    p = run(model, abc, [0, 1, 2], SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1e-6, samples_per_prompt=3))
    for rg, rp in zip(g, p):
        assert all(c.token_ids == rg[0].token_ids for c in rp)
    # A wide nucleus at temperature 1 does sample something else.
    w = run(model, abc, [0, 1, 2], SamplingParams(max_new_tokens=8, samples_per_prompt=3))
    assert any(c.token_ids != rg[0].token_ids for rg, rw in zip(g, w) for c in rw)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_logprobs_and_tokens_match_uncached_forward(policy, abc, temperature, top_p):
    model, _ = policy
    params = SamplingParams(max_new_tokens=10, temperature=temperature, top_p=top_p, samples_per_prompt=3, seed=9)
    res = run(model, abc, [4, 5, 6], params, step=2)
    worst = 0.0
    for prompt, r in zip(abc, res):
        for c in r:
            logits = full_logits(model, prompt, c.token_ids)
            ref = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
            # Re-sample from the no-cache, no-padding logits with the same uniforms: same tokens.
            seed = np.array([row_seed(9, 2, c.prompt_key, c.sample_index)], dtype=np.uint64)
            for t, want in enumerate(c.token_ids):
                u = torch.from_numpy(uniforms(seed, t))
                got, _ = sample_from_logits(logits[t : t + 1], u, temperature, top_p)
                assert int(got) == want
    assert worst < 1e-4


def test_llama_matches_uncached_forward(tmp_path):
    model, tok = load_policy(make_tiny_model(str(tmp_path), arch="llama", seed=2))
    prompts = [encode_prompt(tok, t, False) for t in ("1+1=", "a longer prompt: 9-4=")]
    res = run(model, prompts, [0, 1], SamplingParams(max_new_tokens=6, samples_per_prompt=2, seed=4))
    for prompt, r in zip(prompts, res):
        for c in r:
            logits = full_logits(model, prompt, c.token_ids)
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            assert (ref - torch.tensor(c.logprobs)).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen2+lora"])
def test_lean_decoder_gives_the_forward_decoders_samples(tmp_path, arch):
    """The pre-allocated-cache decoder against the model's own forward: left padding, GQA, finished rows dropped
    mid-generation (the eos set is ~11% of the vocab), top-p; same tokens, log-probs equal to float rounding. With
    LoRA adapters (model.lora) the lean decoder applies each adapter merged into its base weight."""
    model, tok = load_policy(make_tiny_model(str(tmp_path), arch=arch.split("+")[0], seed=5))
    if arch.endswith("+lora"):
        with_random_adapters(model)
    assert LeanDecoder.supports(model) and model.config.num_key_value_heads < model.config.num_attention_heads
    prompts = [encode_prompt(tok, t, False) for t in ("7+8=", "countdown 3 5 7 to 15:", "12*3=", "x")]
    eos = {1} | set(encode_prompt(tok, "0123456789", False))
    params = SamplingParams(max_new_tokens=14, temperature=0.9, top_p=0.95, samples_per_prompt=5, seed=3)
    hf = run(model, prompts, [0, 1, 2, 3], params, eos=eos, decoder="forward")
    lean = run(model, prompts, [0, 1, 2, 3], params, eos=eos, decoder="lean")
    flags = [c.finished for r in lean for c in r]
    assert any(flags) and not all(flags)
    for rh, rl in zip(hf, lean):
        for h, c in zip(rh, rl):
            assert (h.token_ids, h.finished) == (c.token_ids, c.finished)
            np.testing.assert_allclose(c.logprobs, h.logprobs, atol=1e-5)


def test_lean_decoder_with_biases_matches_the_forward_decoder():
    """Llama with attention and MLP biases: the projections that add a bias before the residual (o_proj, down_proj).
    Short prompts, so the steps cross from the short-row softmax (fewer than _SHORT_ROWS keys) to torch.softmax."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                          max_position_embeddings=64)
        model = LlamaForCausalLM(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.3)  # initialised to zero: give them something to do
    assert LeanDecoder.supports(model)
    params = SamplingParams(max_new_tokens=20, samples_per_prompt=3, seed=2)
    prompts = [[5, 6, 7, 8], [9, 10]]
    hf = run(model, prompts, [0, 1], params, eos={4}, decoder="forward")
    lean = run(model, prompts, [0, 1], params, eos={4}, decoder="lean")
    for rh, rl in zip(hf, lean):
        for h, c in zip(rh, rl):
            assert (h.token_ids, h.finished) == (c.token_ids, c.finished)
            np.testing.assert_allclose(c.logprobs, h.logprobs, atol=1e-5)


def test_lean_decoder_pieces_are_the_models_arithmetic(policy):
    """The decoding step's rewrites of the model's ops give the same numbers: rotary tables + one flip for
    apply_rotary_pos_emb, F.rms_norm for the RMSNorm modules."""
    import sys

    from evenrl.models.decoder import _norm, rope_rotate

    model, _ = policy
    inner = model.model
    dec = LeanDecoder(model, 40)
    x = torch.randn(3, 5, 4, dec.head_dim)  # [B, T, heads, D]
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11], [30, 31, 32, 33, 34]])
    cos, sin = inner.rotary_emb(x, pos)
    rope = sys.modules[type(inner.layers[0].self_attn).__module__].apply_rotary_pos_emb
    want, _ = rope(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    cs = dec.rope[pos]
    assert torch.equal(rope_rotate(x, cs[:, :, None, 0], cs[:, :, None, 1]), want.transpose(1, 2))
    norm = inner.layers[0].input_layernorm
    h = torch.randn(7, norm.weight.shape[0]) * 3
    assert torch.equal(_norm(norm)(h), norm(h))


def test_lean_decoder_leaves_dynamic_rope_to_the_forward():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                      rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert not LeanDecoder.supports(LlamaForCausalLM(cfg))


def test_sampling_in_chunks_gives_the_same_samples(monkeypatch):
    from evenrl.engines import hf as rollout

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 7, generator=g) * 2
    u = torch.rand(50, dtype=torch.float64, generator=g)
    for temperature, top_p in [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)]:
        whole = sample_from_logits(logits, u, temperature, top_p)
        monkeypatch.setattr(rollout, "_SAMPLE_CHUNK_ELEMS", 7 * 8)  # 8 rows per chunk: 7 chunks, the last short
        chunked = sample_from_logits(logits, u, temperature, top_p)
        monkeypatch.undo()
        assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


def test_other_architectures_use_the_models_forward():
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=64)).eval()
    assert not LeanDecoder.supports(model)
    params = SamplingParams(max_new_tokens=4, samples_per_prompt=2)
    auto = run(model, [[5, 6, 7], [8]], [0, 1], params)
    assert [c.token_ids for r in auto for c in r] == [c.token_ids for r in run(model, [[5, 6, 7], [8]], [0, 1], params,
                                                                                decoder="forward") for c in r]
    with pytest.raises(UsageError, match="decoder"):
        run(model, [[5]], [0], params, decoder="lean")


def test_sampler_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]])
    n = 20000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # stratified: frequencies are exact to 1/n
    for temperature, top_p in [(1.0, 1.0), (0.5, 1.0), (1.0, 0.8)]:
        toks, lps = sample_from_logits(logits.expand(n, -1), u, temperature, top_p)
        probs = torch.softmax(logits[0] / temperature, -1)
        if top_p < 1:
            probs[2:] = 0  # p = .64, .24, .09, ... -> nucleus {0, 1} holds 0.88 >= 0.8
            probs /= probs.sum()
        freq = torch.bincount(toks, minlength=5).double() / n
        assert torch.allclose(freq, probs.double(), atol=2e-4), (temperature, top_p, freq)
        np.testing.assert_allclose(lps, torch.log_softmax(logits[0] / temperature, -1)[toks], atol=1e-6)
    assert not (toks == 4).any()


def test_uniforms_are_keyed_and_uniform():
    seeds = np.array([row_seed(0, 0, k, 0) for k in range(5000)], dtype=np.uint64)
    u0, u1 = uniforms(seeds, 0), uniforms(seeds, 1)
    assert ((u0 >= 0) & (u0 < 1)).all() and abs(u0.mean() - 0.5) < 0.02 and abs(u1.mean() - 0.5) < 0.02
    assert abs(np.corrcoef(u0, u1)[0, 1]) < 0.05
    assert row_seed(0, 0, 1, 0) != row_seed(0, 0, 0, 1) != row_seed(0, 1, 0, 0) != row_seed(1, 0, 0, 0)
    np.testing.assert_array_equal(uniforms(seeds[7:8], 3), uniforms(seeds, 3)[7:8])


def test_bad_inputs(policy, abc):
    model, _ = policy
    for kw in (dict(max_new_tokens=0), dict(max_new_tokens=4, temperature=-1.0), dict(max_new_tokens=4, top_p=0.0),
               dict(max_new_tokens=4, samples_per_prompt=0)):
        with pytest.raises(UsageError):
            SamplingParams(**kw)
    p = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="unique"):
        run(model, abc[:2], [1, 1], p)
    with pytest.raises(ValueError, match="no tokens"):
        run(model, [[]], [0], p)
    for samples in (range(2), range(-1, 0), range(0), range(0, 1, 2)):  # past samples_per_prompt=1, or not a run
        with pytest.raises(UsageError, match="samples"):
            generate(model, [Request(abc[0], 0, 0, samples)], p, eos_token_ids=set(), pad_token_id=PAD)
    with pytest.raises(UsageError, match="max_tokens"):
        generate(model, [Request(abc[0], 0, 0, max_tokens=3)], p, eos_token_ids=set(), pad_token_id=PAD)


def test_restores_training_mode(policy, abc):
    model, _ = policy
    model.train()
    try:
        run(model, abc[:1], [0], SamplingParams(max_new_tokens=2))
        assert model.training
    finally:
        model.eval()


def test_an_engines_fused_weights_are_kept_while_the_weights_are_unchanged(abc, tmp_path):
    """HFEngine keeps LeanDecoder's fused weights from one call to the next (a step makes one call per prompt batch
    under bitwise, one per turn with environments): the same samples as a call that fuses anew, the same fused
    tensors while nothing changed, new ones after an optimizer step, a weight push or an adapter switched off, and
    none after sleep() (the rollout's end)."""
    from evenrl.engines.hf import HFEngine
    from evenrl.models.lora import adapters_disabled

    model, _ = load_policy(make_tiny_model(str(tmp_path / "m"), seed=5))
    with_random_adapters(model)
    engine = HFEngine(model, eos_token_ids=set(), pad_token_id=PAD, decoder="lean")
    params = SamplingParams(max_new_tokens=6, temperature=1.0)

    def call():
        got = engine.generate(requests(abc, [0, 1, 2]), params)
        fresh = run(model, abc, [0, 1, 2], params, decoder="lean")  # no cache: fused anew
        assert [[c.token_ids for c in r] for r in got] == [[c.token_ids for c in r] for r in fresh]
        assert [[c.logprobs for c in r] for r in got] == [[c.logprobs for c in r] for r in fresh]
        return engine.fused["fused"][0][0][1]  # the first layer's fused q|k|v weight

    first = call()
    assert call() is first  # unchanged weights: kept
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(input_ids=torch.tensor([abc[0]])).logits.sum().backward()
    opt.step()  # the adapters move in place
    stepped = call()
    assert stepped is not first and not torch.equal(stepped, first)
    with torch.no_grad():
        engine.update_weights([[("model.layers.0.self_attn.q_proj.base_layer.weight",
                                 model.model.layers[0].self_attn.q_proj.base_layer.weight * 0.5)]])
    pushed = call()
    assert pushed is not stepped and not torch.equal(pushed, stepped)
    with adapters_disabled(model):
        off = call()
    assert off is not pushed and not torch.equal(off, pushed)
    engine.sleep()
    assert engine.fused == {}
