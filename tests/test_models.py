import json
import os

import pytest
import torch

from evenrl.errors import UsageError
from evenrl.models.loading import load_policy
from evenrl.testing import DEFAULT_VOCAB, make_tiny_model
from evenrl.train.data import encode_prompt
from evenrl.engines.base import Request
from evenrl.engines.hf import SamplingParams, generate


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_round_trip_make_load_generate(tmp_path, arch):
    path = make_tiny_model(str(tmp_path / arch), arch=arch, seed=1)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(path))
    model, tok = load_policy(path)
    assert model.config.model_type == arch and not model.training
    assert model.config._attn_implementation == "sdpa"
    assert (tok.pad_token, tok.eos_token) == ("<pad>", "<|endoftext|>") and tok.pad_token_id != tok.eos_token_id

    # Every default character is one token and decodes back, whitespace included
    # (AutoTokenizer picks Qwen2Tokenizer for qwen2 and a plain backend for llama).
    text = "Use 3, 5, 7 to make 15: (3+5)*7 - 41 = 15\nanswer: 15"
    ids = encode_prompt(tok, text, False)
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert len(encode_prompt(tok, DEFAULT_VOCAB, False)) == len(DEFAULT_VOCAB)

    res = generate(model, [Request(ids, 0, 0)], SamplingParams(max_new_tokens=5, samples_per_prompt=2),
                   eos_token_ids={tok.eos_token_id}, pad_token_id=tok.pad_token_id)
    for c in res[0]:
        assert len(c.token_ids) == 5 or (c.finished and c.token_ids[-1] == tok.eos_token_id)
        assert all(0 <= t < model.config.vocab_size for t in c.token_ids)


def test_same_seed_same_weights(tmp_path):
    a, _ = load_policy(make_tiny_model(str(tmp_path / "a"), seed=7))
    b, _ = load_policy(make_tiny_model(str(tmp_path / "b"), seed=7))
    c, _ = load_policy(make_tiny_model(str(tmp_path / "c"), seed=8))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_make_does_not_touch_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_tiny_model(str(tmp_path))
    assert torch.equal(torch.rand(3), expected)


def test_bad_paths_raise_usage_error(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(UsageError, match="config.json") as e:
        load_policy(missing)
    assert missing in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UsageError, match="config.json"):
        load_policy(str(tmp_path))  # a directory, but no model in it
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(UsageError, match="broken") as e:
        load_policy(str(broken))
    assert "\n" not in str(e.value)


def test_dtype(tmp_path):
    path = make_tiny_model(str(tmp_path))
    model, _ = load_policy(path, dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    with pytest.raises(UsageError, match="dtype"):
        load_policy(path, dtype="float8")


def test_missing_pad_token_becomes_eos(tmp_path):
    path = make_tiny_model(str(tmp_path))
    cfg_path = os.path.join(path, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    del cfg["pad_token"]
    json.dump(cfg, open(cfg_path, "w"))
    model, tok = load_policy(path)
    assert tok.pad_token == tok.eos_token == "<|endoftext|>"
    assert model.config.pad_token_id == tok.eos_token_id


def test_encode_prompt_chat_template(tmp_path):
    _, plain = load_policy(make_tiny_model(str(tmp_path / "plain")))
    _, chat = load_policy(make_tiny_model(str(tmp_path / "chat"), chat_template=True))
    assert chat.decode(encode_prompt(chat, "2+2=", True)) == "user: 2+2=\nassistant: "
    assert chat.decode(encode_prompt(chat, "2+2=", False)) == "2+2="
    # No template: requesting one falls back to the plain text.
    assert encode_prompt(plain, "2+2=", True) == encode_prompt(plain, "2+2=", False)
