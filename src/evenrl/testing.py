"""Tiny random models for tests, benchmarks and the demo, written to a directory like any local model.

    from evenrl.testing import make_tiny_model, make_tiny_reward_model
    path = make_tiny_model("/tmp/tiny", arch="qwen2", seed=0)      # config.json, safetensors, tokenizer
    path = make_tiny_model("/tmp/vl", arch="qwen2_vl", seed=0)     # + a vision tower and preprocessor_config.json
    path = make_tiny_model("/tmp/vlm", arch="qwen3_vl_moe")         # Qwen3-VL's tower around a Qwen3-VL-MoE text model
    path = make_tiny_model("/tmp/moe", arch="qwen3_moe", seed=0)   # a mixture of experts (MOE_ARCHS), 8 experts, top 2
    rm = make_tiny_reward_model("/tmp/tiny-rm", seed=0)            # the same, with a one-label score head

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
# Qwen2-VL's vision tokens, named as in its tokenizer: an image is <|vision_start|> <|image_pad|> x n <|vision_end|>.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# Mixtures of experts, one per router family evenrl knows (evenrl.models.routing): softmax top-k (Qwen3-MoE, OLMoE),
# with a gated shared expert (Qwen2-MoE), renormalised (Mixtral), sigmoid with correction biases and a shared expert
# (DeepSeek-V3), top-k then softmax with biased experts, attention sinks and sliding windows (gpt-oss).
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss")
# Pixel bounds of the tiny image processor: 56x56 (4 image tokens) up to 224x224 (64 image tokens).
TINY_MIN_PIXELS, TINY_MAX_PIXELS = 56 * 56, 224 * 224

# Plain text roles so the template only needs characters the tiny vocab already has.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# The same for a vision-language model: content is text or a list of parts, an image part renders as Qwen2-VL's does.
TINY_VL_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# The split regex of transformers' Qwen2 pre-tokenizer; see make_tiny_model.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# What a tool-calling demo needs with the tiny vocabulary (chat_template="tools"): the tools' names and parameters in a
# system line (the template's tools= rendering), Hermes tool calls and tool responses, and the EOS token after each
# assistant turn, so the rendered history is what the model sampled (evenrl.envs.template's prefix check holds).
# The tool-call tags are single tokens, as in Qwen's vocabulary, and so are the JSON around a calculator call's
# arguments, as a real BPE vocabulary's merges make them: a call is ~18 tokens instead of ~64 characters.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", '{"name": "',
               '", "arguments": {"', '": "', '"}}', "calculator", "expression"]
TINY_TOOL_CHAT_TEMPLATE = (
    "{% if tools %}system: tools: {% for t in tools %}{{ t.function.name }}("
    "{{ t.function.parameters.properties | join(',') }}){% if not loop.last %} {% endif %}{% endfor %}"
    "{{ '\\n' }}{% endif %}"  # an expression: the renderer's trim_blocks drops a newline right after a block tag
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>\n"
    "{% elif m.role == 'assistant' %}assistant: {{ m.content }}" + EOS + "\n"
    "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
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
    chat_template: bool | str = False,
    max_positions: int = 512,
    vision_width: int = 32,
    experts: int = 8,
    top_k: int = 2,
) -> str:
    """Write a random tiny causal LM with a character-level tokenizer to `out_dir`; return the path.

    Token ids: 0 <pad>, 1 <|endoftext|> (EOS), 2 <bos>, 3 <unk>, then one id per byte of the
    characters in `vocab` (one per character for ASCII). Characters outside `vocab` are dropped
    when encoding. The tokenizer adds no special tokens when encoding; `chat_template=True` adds a
    plain-text "user: ...\nassistant: " template; `chat_template="tools"` the tool-calling one
    (TINY_TOOL_CHAT_TEMPLATE), with one token each for TOOL_TOKENS. Same arguments → identical weights.

    arch "qwen2_vl" / "qwen2_5_vl": the same language model inside a Qwen2-VL / Qwen2.5-VL (the 2.5 tower has
    RMSNorm, a gated MLP and windowed attention) with a 2-block vision tower `vision_width` wide, the four vision tokens
    (ids 4-7: <|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|>) and Qwen2-VL's image processor
    (preprocessor_config.json, patch 14, merge 2: one image token per 28x28 pixels, bounded to
    TINY_MIN_PIXELS..TINY_MAX_PIXELS); its chat template renders image parts as Qwen2-VL's does.

    arch "qwen3_vl" / "qwen3_vl_moe": Qwen3-VL's tower (LayerNorm, a plain MLP, learned position embeddings, 16-pixel
    patches: one image token per 32x32 pixels) with DeepStack features from both its blocks (added to the first two
    decoder layers' outputs) and interleaved M-RoPE, around a Qwen3-VL text model (q/k norms) or a Qwen3-VL-MoE one
    (`experts` experts, `top_k` per token, always renormalised); the image processor is Qwen2-VL's with Qwen3-VL's
    patch size and normalisation, as Qwen3-VL's preprocessor_config.json names it.

    arch in MOE_ARCHS: a mixture of experts of that family with `experts` routed experts of width hidden / 2, `top_k`
    of them per token, in transformers' fused layout (3-D gate_up_proj / down_proj). DeepSeek-V3 keeps layer 0 dense
    (first_k_dense_replace 1, as the real model keeps its first three) and gets random correction biases (its
    checkpoint's e_score_correction_bias, which training must leave as they are); gpt-oss alternates sliding-window
    (8 tokens) and full attention, with sinks.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    if arch not in ("qwen2", "qwen3", "llama", *VISION_ARCHS, *MOE_ARCHS):
        raise bad("arch", arch, f"one of qwen2, qwen3, llama, {', '.join(VISION_ARCHS + MOE_ARCHS)}")
    if not 1 <= top_k <= experts:
        raise bad("top_k", top_k, f"an integer in 1..experts ({experts})")
    chars = list(dict.fromkeys(vocab))  # keep order, drop duplicates
    if not chars:
        raise bad("vocab", vocab, "a non-empty string of characters")
    if hidden % heads:
        raise bad("hidden", hidden, f"a multiple of heads ({heads})")
    if chat_template not in (False, True, "tools"):
        raise bad("chat_template", chat_template, "false, true (plain) or 'tools'")
    vision = arch in VISION_ARCHS
    fast, token_to_id = _tokenizer(chars, VISION_TOKENS if vision else [],
                                   TOOL_TOKENS if chat_template == "tools" else [])
    if chat_template:
        fast.chat_template = (TINY_TOOL_CHAT_TEMPLATE if chat_template == "tools" else
                              TINY_VL_CHAT_TEMPLATE if vision else TINY_CHAT_TEMPLATE)

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
    if vision:
        config = _vision_config(arch, common, token_to_id, vision_width, experts, top_k)
    elif arch in MOE_ARCHS:
        config = _moe_config(arch, common, experts, top_k)
    else:
        config = (Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common) if arch == "llama" else
                  Qwen3Config(**common, head_dim=hidden // heads))  # Qwen3: RMSNorms over each head's q and k
    # A private RNG stream so building a model never shifts the caller's torch RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if vision:
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for m in model.modules():  # DeepSeek-V3's routers: biases a trained checkpoint has, ~ the scores' spread
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(0.05 * torch.randn(m.e_score_correction_bias.shape))
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
    if vision:
        # the PIL image processor: the torchvision one is the default where torchvision is installed (it is not here)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        # Qwen3-VL's preprocessor_config.json: Qwen2-VL's processor with 16-pixel patches, normalised to [-1, 1]
        qwen3 = {"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3} if arch.startswith("qwen3") else {}
        processor = Qwen2VLImageProcessorPil(min_pixels=TINY_MIN_PIXELS, max_pixels=TINY_MAX_PIXELS, **qwen3)
        processor.save_pretrained(out_dir)
    return os.fspath(out_dir)


# Image sizes (width, height) of write_geometry_data: 4, 16 and 48 image tokens with the tiny image processor.
GEOMETRY_SIZES = ((56, 56), (112, 112), (224, 168))


def write_geometry_data(path: str, rows: int = 24, *, sizes=GEOMETRY_SIZES, seed: int = 0) -> str:
    """Geometry3K-shaped prompts for the tiny vision-language models, as EasyR1 reads them: a parquet file with a
    "problem" column ("<image>" then a one-digit equation), an "images" column holding one image each as Hugging
    Face datasets stores an Image ({"bytes": PNG, "path": None}), and a numeric "answer". Row i's image has size
    sizes[i % len(sizes)] (random pixels from `seed`), so a step mixes small and large images. Returns `path`."""
    import io
    import random

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = random.Random(seed)
    pixels = np.random.default_rng(seed)
    records = []
    for i in range(rows):
        w, h = sizes[i % len(sizes)]
        buf = io.BytesIO()
        Image.fromarray(pixels.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
        a, x = rng.randint(1, 4), rng.randint(0, 5)
        records.append({"problem": f"<image>x+{a}={a + x}, x=", "images": [{"bytes": buf.getvalue(), "path": None}],
                        "answer": str(x)})
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def _tokenizer(chars: list[str], extra_special: list[str], added: list[str]):
    """(tokenizer, token -> id): the special tokens, then `extra_special`, then one token per byte of `chars`, then
    `added` (plain tokens matched whole, kept when decoding)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    token_to_id = {t: i for i, t in enumerate(SPECIAL_TOKENS + extra_special)}
    byte_char = _bytes_to_unicode()
    for c in chars:
        for b in c.encode("utf-8"):
            token_to_id.setdefault(byte_char[b], len(token_to_id))
    for t in added:
        token_to_id[t] = len(token_to_id)
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
        **({"additional_special_tokens": extra_special} if extra_special else {}),
    )
    if added:
        fast.add_tokens(added)  # matched whole before the byte-level split; kept when decoding
    return fast, token_to_id


def _vision_config(arch: str, text: dict, token_to_id: dict[str, int], width: int, experts: int, top_k: int):
    """A Qwen2-VL / Qwen2.5-VL / Qwen3-VL(-MoE) config around the tiny text model: M-RoPE sections for its head size,
    a 2-block vision tower `width` wide whose merger outputs the text model's width."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig, Qwen3VLMoeConfig

    half = text["hidden_size"] // text["num_attention_heads"] // 2  # rotary pairs per head: time, height, width
    t = half // 4
    sections = [t, (half - t) // 2, half - t - (half - t) // 2]
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections}
    if arch.startswith("qwen3"):
        # interleaved (t h w t h w ...): height and width take every third pair up to 3 x their section
        rope = {**rope, "mrope_section": [half - 2 * (half // 4), half // 4, half // 4], "mrope_interleaved": True}
    text_config = {**text, "rope_parameters": rope}
    if arch == "qwen2_vl":
        vision_config = dict(depth=2, embed_dim=width, hidden_size=text["hidden_size"], num_heads=2, mlp_ratio=2)
        cls = Qwen2VLConfig
    elif arch == "qwen2_5_vl":
        vision_config = dict(depth=2, hidden_size=width, intermediate_size=2 * width, num_heads=2,
                             out_hidden_size=text["hidden_size"], window_size=56, fullatt_block_indexes=[1])
        cls = Qwen2_5_VLConfig
    else:  # Qwen3-VL: DeepStack features from both blocks, a learned 8 x 8 position grid resampled to each image
        vision_config = dict(depth=2, hidden_size=width, intermediate_size=2 * width, num_heads=2,
                             out_hidden_size=text["hidden_size"], patch_size=16, num_position_embeddings=64,
                             deepstack_visual_indexes=[0, 1])
        text_config["head_dim"] = text["hidden_size"] // text["num_attention_heads"]
        if arch == "qwen3_vl_moe":
            text_config.update(moe_intermediate_size=text["hidden_size"] // 2, num_experts=experts,
                               num_experts_per_tok=top_k)
        cls = Qwen3VLMoeConfig if arch == "qwen3_vl_moe" else Qwen3VLConfig
    ids = {f"{name}_token_id": token_to_id[tok] for name, tok in
           zip(("vision_start", "vision_end", "image", "video"), VISION_TOKENS)}
    return cls(text_config=text_config, vision_config=vision_config, tie_word_embeddings=True, **ids)


def _moe_config(arch: str, text: dict, experts: int, top_k: int):
    """A mixture-of-experts config of family `arch` around the tiny text model's dimensions."""
    from transformers import AutoConfig

    hidden, heads = text["hidden_size"], text["num_attention_heads"]
    head = hidden // heads
    rope = {"rope_type": "default", "rope_theta": 10000.0}  # DeepSeek-V3 and gpt-oss default to YaRN
    width = dict(moe_intermediate_size=hidden // 2, num_experts=experts)
    family = {
        "qwen3_moe": dict(width, norm_topk_prob=True),
        "qwen2_moe": dict(width, shared_expert_intermediate_size=hidden),
        "olmoe": dict(intermediate_size=hidden // 2, num_experts=experts),
        "mixtral": dict(intermediate_size=hidden // 2, num_local_experts=experts),
        "deepseek_v3": dict(moe_intermediate_size=hidden // 2, n_routed_experts=experts, n_shared_experts=1,
                            n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None,
                            kv_lora_rank=hidden // 2, qk_nope_head_dim=head // 2, qk_rope_head_dim=head // 2,
                            v_head_dim=head, num_key_value_heads=heads, rope_parameters=rope),
        "gpt_oss": dict(intermediate_size=hidden // 2, num_local_experts=experts, head_dim=head, sliding_window=8,
                        rope_parameters=rope),
    }[arch]
    return AutoConfig.for_model(arch, **{**text, "num_experts_per_tok": top_k, **family})


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


def make_tiny_reward_model(out_dir: str, *, seed: int = 0, **kwargs) -> str:
    """Write a random tiny reward model to `out_dir`: the body of `make_tiny_model(out_dir, seed=seed, **kwargs)`
    under a sequence-classification head with one label (`AutoModelForSequenceClassification`), its score weights
    drawn N(0, 1/hidden) from `seed` so that scores spread over about +-1; the same tokenizer. Returns the path."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    make_tiny_model(out_dir, seed=seed, **kwargs)
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # "score.weight newly initialized", "lm_head unused": both intended here
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForSequenceClassification.from_pretrained(out_dir, num_labels=1, local_files_only=True)
        hidden = model.config.hidden_size
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed + 1)
            model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=g) / hidden**0.5)
        model.save_pretrained(out_dir)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    return os.fspath(out_dir)
