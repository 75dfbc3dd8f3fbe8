"""Tiny random models for tests, benchmarks and the demo, written to a directory like any local model.

    from evenrl.testing import make_tiny_model
    path = make_tiny_model("/tmp/tiny", arch="qwen2", seed=0)      # config.json, safetensors, tokenizer

Same arguments, identical weights; nothing is downloaded.
"""

from __future__ import annotations

import os
import string

import torch

from evenrl.errors import bad

# Printable ASCII plus newline: enough for arithmetic, countdown and short word prompts.
DEFAULT_VOCAB = string.digits + "+-*/=()<>.,:;!?'\"_%&#@$[]{}|\\^~`" + " \n" + string.ascii_letters

PAD, EOS, BOS, UNK = "<pad>", "<|endoftext|>", "<bos>", "<unk>"
SPECIAL_TOKENS = [PAD, EOS, BOS, UNK]

# Plain text roles so the template only needs characters the tiny vocab already has.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# The split regex of transformers' Qwen2 pre-tokenizer; see make_tiny_model.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def make_tiny_model(
    out_dir: str,
    *,
    arch: str = "qwen2",
    vocab: str = DEFAULT_VOCAB,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    seed: int = 0,
    chat_template: bool = False,
    max_positions: int = 512,
) -> str:
    """Write a random tiny causal LM with a character-level tokenizer to `out_dir`; return the path.

    Token ids: 0 <pad>, 1 <|endoftext|> (EOS), 2 <bos>, 3 <unk>, then one id per byte of the
    characters in `vocab` (one per character for ASCII). Characters outside `vocab` are dropped
    when encoding. The tokenizer adds no special tokens when encoding; `chat_template=True` adds a
    plain-text "user: ...\nassistant: " template. Same arguments → identical weights.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

    if arch not in ("qwen2", "llama"):
        raise bad("arch", arch, "one of qwen2, llama")
    chars = list(dict.fromkeys(vocab))  # keep order, drop duplicates
    if not chars:
        raise bad("vocab", vocab, "a non-empty string of characters")
    if hidden % heads:
        raise bad("hidden", hidden, f"a multiple of heads ({heads})")

    token_to_id = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    byte_char = _bytes_to_unicode()
    for c in chars:
        for b in c.encode("utf-8"):
            token_to_id.setdefault(byte_char[b], len(token_to_id))
    # Byte-level BPE without merges = one token per byte. It is built exactly like transformers'
    # Qwen2Tokenizer builds its pipeline, because AutoTokenizer swaps that class in for any qwen2
    # checkpoint; both load paths then tokenize identically (a char-level WordLevel tokenizer would
    # lose its spaces under Qwen2Tokenizer).
    tok = Tokenizer(models.BPE(vocab=token_to_id, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, bos_token=BOS, unk_token=UNK,
    )
    if chat_template:
        fast.chat_template = TINY_CHAT_TEMPLATE

    common = dict(
        vocab_size=len(token_to_id),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2 if heads % 2 == 0 else heads,  # GQA when it divides, as in real Qwen2/Llama
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=token_to_id[PAD],
        eos_token_id=token_to_id[EOS],
        bos_token_id=token_to_id[BOS],
    )
    config = Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)
    # A private RNG stream so building a model never shifts the caller's torch RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    os.makedirs(out_dir, exist_ok=True)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # tests and the demo call this often; the bar is noise
    try:
        model.save_pretrained(out_dir)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    fast.save_pretrained(out_dir)
    return os.fspath(out_dir)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
