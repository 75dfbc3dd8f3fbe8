"""The training forward: the packed path (the model's own forward over rows back to back) and the shared-prefix
path against the model's own masked forward, which path a model takes, and the loss denominators."""

from __future__ import annotations

import pytest
import torch

from e2e import with_random_adapters
from evenrl.config import load_config
from evenrl.distributed.sequence import SequenceGroup, sequence_parallel
from evenrl.models import forward as U
from evenrl.core.model_plan import plan_of
from evenrl.distributed.mesh import Mesh
from evenrl.train.parallelize import split_sequences
from evenrl.train.update import minibatch_denominators
from evenrl.core.batch import Batch, Ragged
from evenrl.models.loading import load_policy
from evenrl.testing import make_tiny_model


def _batch(prompt_lens: list[int], samples: int, max_resp: int, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    rows, resp = [], []
    for p in prompt_lens:
        prompt = torch.randint(3, 90, (p,), generator=g)
        for _ in range(samples):
            n = int(torch.randint(1, max_resp + 1, (), generator=g))
            rows.append(torch.cat([prompt, torch.randint(3, 90, (n,), generator=g)]))
            resp.append(n)
    return Batch({"tokens": Ragged(torch.cat(rows), torch.tensor([len(r) for r in rows])),
                  "response_len": torch.tensor(resp)})


def _logp_and_grads(model, batch, shared: bool, monkeypatch):
    monkeypatch.setattr(U, "_MIN_SAVED_PER_ROW", 0 if shared else 10**9)
    model.zero_grad(set_to_none=True)
    logits, targets, mask = U.response_logits(model, batch, pad_token_id=0)
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    (logp * mask * torch.linspace(0.5, 1.5, logp.shape[1])).sum().backward()
    return (logp * mask).detach(), mask, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_shared_prefix_forward_matches_plain(tmp_path, monkeypatch, arch):
    model, _ = load_policy(make_tiny_model(str(tmp_path / arch), arch=arch, seed=1))
    model.train()
    batch = _batch([9, 14, 9, 2], samples=3, max_resp=7)  # two groups with equal prompt length, one of 2 tokens
    assert U._shared_prefixes(model, batch) is not None
    plain, mask, g_plain = _logp_and_grads(model, batch, False, monkeypatch)
    shared, mask2, g_shared = _logp_and_grads(model, batch, True, monkeypatch)
    assert torch.equal(mask, mask2)
    assert float((plain - shared).abs().max()) < 1e-5
    scale = max(float(g.abs().max()) for g in g_plain.values())
    assert max(float((g_plain[k] - g_shared[k]).abs().max()) for k in g_plain) < 1e-5 * scale


def packed(model):
    """`model` with the packed path of one rank (what evenrl.train.parallelize.split_sequences gives it)."""
    sequence_parallel(model, SequenceGroup(None, 1, 0))
    return model


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "qwen2+lora"])
def test_the_packed_forward_matches_the_models_masked_one(tmp_path, monkeypatch, arch):
    """Also with LoRA adapters in the projections: both paths are the model's own modules, adapters included."""
    model, _ = load_policy(make_tiny_model(str(tmp_path / arch), arch=arch.split("+")[0], seed=2))
    if arch.endswith("+lora"):
        with_random_adapters(model)
    model.train()
    batch = _batch([9, 3, 14, 1], samples=2, max_resp=7, seed=3)  # unequal prompts and responses
    plain, mask, g_plain = _logp_and_grads(model, batch, False, monkeypatch)
    used = []
    monkeypatch.setattr(U, "split_forward", lambda *a, f=U.split_forward: used.append(1) or f(*a))
    fast, mask2, g_fast = _logp_and_grads(packed(model), batch, False, monkeypatch)
    assert used and torch.equal(mask, mask2)
    assert float((plain - fast).abs().max()) < 1e-5
    scale = max(float(g.abs().max()) for g in g_plain.values())
    assert max(float((g_plain[k] - g_fast[k]).abs().max()) for k in g_plain) < 1e-5 * scale


def test_packed_forward_with_biases_and_one_token_rows(tmp_path, monkeypatch):
    """Llama with biases everywhere (attention_bias, mlp_bias) and rows whose prompt is their only token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=90, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).train()
    batch = _batch([1, 5, 1], samples=2, max_resp=6, seed=4)
    plain, mask, g_plain = _logp_and_grads(model, batch, False, monkeypatch)
    fast, mask2, g_fast = _logp_and_grads(packed(model), batch, False, monkeypatch)
    assert torch.equal(mask, mask2)
    assert float((plain - fast).abs().max()) < 1e-5
    assert max(float((g_plain[k] - g_fast[k]).abs().max()) for k in g_plain) < 1e-5


def test_families_through_the_attention_interface_train_packed_others_masked(tmp_path, monkeypatch):
    """Every model whose attention goes through transformers' interface with rotary positions packs (a Mistral with
    sliding-window attention too: the window applied within each row, its masked forward's log-probs and gradients);
    GPT-2 (learned absolute positions) and Gemma 2 (attention softcap) keep the model's own masked forward."""
    from transformers import (Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel, MistralConfig,
                              MistralForCausalLM)

    cfg = load_config(None, [])
    for arch in ("qwen2", "llama", "qwen3", "qwen2_vl"):
        model, _ = load_policy(make_tiny_model(str(tmp_path / arch), arch=arch, seed=1))
        split_sequences(model, cfg, Mesh())
        assert plan_of(model).sequence.size == 1, arch
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=90, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, sliding_window=8)).train()
    batch = _batch([9, 3, 14, 1], samples=2, max_resp=7, seed=3)  # rows of up to 21 tokens: the window cuts in
    plain, _, g_plain = _logp_and_grads(model, batch, False, monkeypatch)
    split_sequences(model, cfg, Mesh())
    assert plan_of(model).sequence.size == 1
    fast, _, g_fast = _logp_and_grads(model, batch, False, monkeypatch)
    assert float((plain - fast).abs().max()) < 1e-5
    assert max(float((g_plain[k] - g_fast[k]).abs().max()) for k in g_plain) < 1e-5
    small = dict(vocab_size=90, num_hidden_layers=1, num_attention_heads=4)
    for model in (GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=90)),
                  Gemma2ForCausalLM(Gemma2Config(hidden_size=32, intermediate_size=48, num_key_value_heads=2,
                                                 head_dim=8, **small))):
        split_sequences(model, cfg, Mesh())
        assert plan_of(model).sequence is None, type(model).__name__


def test_shared_prefix_only_when_it_saves_enough(tmp_path):
    model, _ = load_policy(make_tiny_model(str(tmp_path / "m"), seed=1))
    assert U._shared_prefixes(model, _batch([40, 30], samples=8, max_resp=5)) is not None
    assert U._shared_prefixes(model, _batch([40, 30], samples=1, max_resp=5)) is None   # nothing repeats
    assert U._shared_prefixes(model, _batch([3, 3], samples=8, max_resp=5)) is None     # too short to pay
    assert U._shared_prefixes(model, _batch([40, 1], samples=8, max_resp=5)) is None    # a one-token prompt


def test_minibatch_denominators_count_every_row():
    d = minibatch_denominators(torch.tensor([3, 5, 7, 11, 0]), (0, 2, 3, 4))
    assert (d.tokens, d.seqs) == (21.0, 3.0)  # a row with no response token is no sequence (as in aggregation)
    assert minibatch_denominators(torch.tensor([3]), ()).seqs == 0.0


def _force_path(monkeypatch, model, path: str) -> None:
    monkeypatch.setattr(U, "_MIN_SAVED_PER_ROW", 0 if path == "shared" else 10**9)
    if path == "packed":
        packed(model)


@pytest.mark.parametrize("path", ["shared", "packed", "model"])
def test_fused_log_probs_equal_the_logits_path_on_every_forward(tmp_path, monkeypatch, path):
    """response_logprobs (the output layer computes log-probs and entropies chunk by chunk) against response_logits
    followed by core.losses on the full logits: values and gradients of a loss with an entropy bonus, per path."""
    from evenrl.core.losses import entropy_from_logits, token_logprobs

    model, _ = load_policy(make_tiny_model(str(tmp_path / "m"), arch="qwen2", seed=4))
    model.train()
    batch = _batch([9, 14, 9, 2], samples=3, max_resp=7, seed=5)
    _force_path(monkeypatch, model, path)
    used = []
    name = "split_forward" if path == "packed" else f"_response_logits_{path}"
    monkeypatch.setattr(U, name, lambda *a, f=getattr(U, name): used.append(path) or f(*a))
    weights = torch.linspace(0.5, 1.5, 7)

    def loss_and_grads(fused: bool):
        model.zero_grad(set_to_none=True)
        if fused:
            out, _, mask = U.response_logprobs(model, batch, 0, temperature=0.8, entropy=True, entropy_grad=True)
            logp, ent = out[..., 0], out[..., 1]
        else:
            logits, targets, mask = U.response_logits(model, batch, 0)
            logp, ent = token_logprobs(logits, targets, 0.8), entropy_from_logits(logits, 0.8)
        w = weights[-logp.shape[1]:]
        ((logp * mask * w).sum() + 0.1 * (ent * mask * w).sum()).backward()
        return (logp * mask).detach(), (ent * mask).detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    lp, ent, grads = loss_and_grads(False)
    lp2, ent2, grads2 = loss_and_grads(True)
    assert used == [path, path]
    assert float((lp - lp2).abs().max()) <= 1e-6 * float(lp.abs().max())
    assert float((ent - ent2).abs().max()) <= 1e-6 * float(ent.abs().max())
    for name, g in grads.items():
        assert float((g - grads2[name]).norm() / g.norm()) <= 1e-6, name


def test_layouts_differ_by_rounding_alone_which_adam_amplifies_where_a_gradient_cancels(tmp_path):
    """Why 1 and 3 processes end a run up to ~1e-5 apart in a few weights (tests/e2e.py close_weights): the same
    mini-batch's gradient summed over 1 or 3 ranks' micro-batches differs by float rounding alone (measured 2.4e-7 of
    the largest entry), and one SGD step from either is the same to the weights' own rounding (1.9e-9); AdamW's
    step lr x g / (sqrt(v) + eps) is g / |g| on a first step, which turns the rounding of an entry that nearly
    cancels (|g| ~1e-7, 2e-6 of the largest) into a different step (2.0e-6 at lr 1e-3 here; 1.15e-5 in
    tests/test_agents_runs.py's run); every weight it moves apart by more than 1e-7 is such an entry."""
    model, _ = load_policy(make_tiny_model(str(tmp_path / "m"), arch="qwen2", seed=0))
    model.train()
    batch = _batch([9, 14, 9, 2, 5, 20, 3], samples=3, max_resp=7, seed=5)
    n = len(batch)
    adv = torch.linspace(-1, 1, n)

    def gradient(micro: list[list[int]]) -> list[torch.Tensor]:  # an entropy bonus, as the agents' runs have
        model.zero_grad(set_to_none=True)
        for rows in micro:
            out, _, mask = U.response_logprobs(model, batch.select(rows), 0, entropy=True, entropy_grad=True)
            (-(adv[rows][:, None] * out[..., 0] * mask).sum() / 100 - 0.1 * (out[..., 1] * mask).sum() / 100).backward()
        return [p.grad.clone() for p in model.parameters()]

    def stepped(grads: list[torch.Tensor], optimizer) -> torch.Tensor:
        params = [p.detach().clone().requires_grad_() for p in model.parameters()]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer(params, lr=1e-3).step()
        return torch.cat([p.detach().flatten().double() for p in params])

    one, three = gradient([list(range(n))]), gradient([list(range(0, 7)), list(range(7, 14)), list(range(14, n))])
    g1, g3 = (torch.cat([g.flatten().double() for g in gs]) for gs in (one, three))
    assert (g1 - g3).abs().max() <= 1e-6 * g1.abs().max()
    sgd = (stepped(one, torch.optim.SGD) - stepped(three, torch.optim.SGD)).abs()
    adam = (stepped(one, torch.optim.AdamW) - stepped(three, torch.optim.AdamW)).abs()
    assert sgd.max() <= 1e-8
    assert adam.max() > 10 * max(float(sgd.max()), 1e-9) and adam.max() <= 1e-4
    assert g1.abs()[adam > 1e-7].max() <= 1e-5 * g1.abs().max()  # only where the gradient nearly cancels
