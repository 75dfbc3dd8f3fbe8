"""The model directory a run reads before anything is loaded, checked without torch or transformers:
config.json, model_type, weights, tokenizer files. (The prompt dataset's readers are evenrl.data.readers.)

The trainer reads through these functions (evenrl.models.loading.load_policy) and `evenrl plan` runs the same
checks (evenrl.planner.rules), so the plan never calls runnable what the trainer refuses. Every problem is a
one-line UsageError that names the file and what is wrong, raised before the trainer writes anything. Pure
Python (json, struct): never imports torch.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import struct
from pathlib import Path

from evenrl.data.readers import JSON_MAX_BYTES, read_json
from evenrl.errors import UsageError, bad

CONFIG_MAX_BYTES = JSON_MAX_BYTES  # config.json, vocab.json and a safetensors header are read whole
TOKENIZER_MAX_BYTES = 512 * 1024**2  # tokenizer.json too, but large vocabularies (Gemma's) run to tens of MB
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# Files a tokenizer's vocabulary lives in (transformers' VOCAB_FILES_NAMES across its tokenizers).
VOCAB_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model",
               "sentencepiece.bpe.model", "sentencepiece.model", "spm.model", "spm_char.model")
VOCAB_SUFFIXES = (".tiktoken", ".spm")
# Bytes per element of safetensors dtypes (sub-byte and unknown ones are not size-checked).
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
                "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
_REDOWNLOAD = "re-download the model or save it again with save_pretrained"
# Vision-language models evenrl trains (evenrl.models.vision): their processor and forward follow Qwen2-VL's
# conventions (image grids, M-RoPE positions, <|image_pad|> placeholders); Qwen3-VL adds DeepStack features and
# interleaved M-RoPE inside the model's own forward, and Qwen3-VL-MoE routes its tokens (evenrl.models.routing).
VISION_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
LEAN_ARCHS = ("Qwen2ForCausalLM", "LlamaForCausalLM")  # the ones models.decoder.LeanDecoder runs


def model_dir(path: str) -> Path:
    """The model directory as a Path; a missing one is a UsageError (hub ids are resolved before: models.hub)."""
    p = Path(path).expanduser()
    if not path or not p.is_dir():
        raise bad("model.path", path, "expected a local directory with config.json (a model saved with "
                                      "save_pretrained), or a hub id (org/name)")
    return p


def no_config_fix(d: Path) -> str:
    """What to point model.path at instead of a directory without config.json."""
    if (d / "adapter_config.json").is_file():
        return ("it holds a LoRA adapter (PEFT's files), not a model: point model.path at a merged model "
                "(log.save_merged=true writes final/merged/) or at the adapter's base")
    return "expected a Hugging Face model directory (written by save_pretrained)"


def read_model_config(path: str) -> dict:
    """config.json of the model directory, checked: a JSON object whose model_type is a causal LM this
    transformers can build (when its table of them can be read)."""
    d = model_dir(path)
    f = d / "config.json"
    if not f.is_file():
        raise UsageError(f"{d}: no config.json; {no_config_fix(d)}")
    cfg = read_json(f, "the model's Hugging Face config")
    if not isinstance(cfg, dict):
        raise UsageError(f"{f}: top level is a {type(cfg).__name__}; expected a JSON object (the model's config)")
    kind = cfg.get("model_type")
    if not isinstance(kind, str) or not kind:
        raise UsageError(f"{f}: no \"model_type\"; expected a Hugging Face config with one, e.g. \"qwen2\" or "
                         "\"llama\"")
    known = causal_lm_types()
    if known is not None and kind not in known and kind not in VISION_TYPES:
        raise UsageError(f"{f}: model_type {kind!r} is not a causal LM that transformers {_version()} can load; "
                         f"use a decoder-only model (e.g. qwen2, llama), a vision-language one of "
                         f"{', '.join(VISION_TYPES)}, or a transformers that knows it")
    if kind in VISION_TYPES and not (d / "preprocessor_config.json").is_file():
        raise UsageError(f"{d}: no preprocessor_config.json; a {kind} model needs its image processor beside it "
                         "(save the processor with save_pretrained)")
    return cfg


def is_vision_config(cfg: dict | None) -> bool:
    """Whether a config.json (dict) is one of the vision-language models evenrl trains."""
    return isinstance(cfg, dict) and cfg.get("model_type") in VISION_TYPES


EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # config.json's routed-expert count


def routed_experts(cfg: dict | None) -> int:
    """A mixture of experts' routed experts per MoE layer from its config.json (a text_config's too); 0 if dense."""
    if not isinstance(cfg, dict):
        return 0
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    return next((text[k] for k in EXPERT_KEYS if isinstance(text.get(k), int) and text[k] > 0), 0)


def check_weights(path: str) -> None:
    """The weights transformers would load exist and, for safetensors, are complete: every tensor the header
    describes lies inside the file and the file ends where the last one does (an empty or truncated download
    fails here, not half-way through loading)."""
    d = model_dir(path)
    if (d / SAFE_WEIGHTS).exists():
        check_safetensors(d / SAFE_WEIGHTS)
        return
    if (d / SAFE_INDEX).exists():
        index = read_json(d / SAFE_INDEX, "a safetensors index ({\"weight_map\": {tensor: file}})")
        shards = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(shards, dict) or not shards or not all(isinstance(v, str) for v in shards.values()):
            raise UsageError(f"{d / SAFE_INDEX}: no \"weight_map\" of tensor names to shard files; {_REDOWNLOAD}")
        for name in sorted(set(shards.values())):
            shard = d / name
            if Path(name).name != name or not shard.is_file():
                raise UsageError(f"{shard}: listed in {SAFE_INDEX} but missing; {_REDOWNLOAD}")
            check_safetensors(shard)
        return
    for name in PICKLE_WEIGHTS:
        if (d / name).is_file():
            if (d / name).stat().st_size == 0:
                raise UsageError(f"{d / name}: empty (0 bytes); {_REDOWNLOAD}")
            return
    raise UsageError(f"{d}: no weights ({SAFE_WEIGHTS}, {SAFE_INDEX} or {PICKLE_WEIGHTS[0]}); {_REDOWNLOAD}")


def weight_names(path: str) -> list[str]:
    """The tensor names of the model's safetensors weights (from the index or the file's header); [] for other
    formats."""
    d = model_dir(path)
    if (d / SAFE_WEIGHTS).exists():
        return [name for name in _header(d / SAFE_WEIGHTS)[0] if name != "__metadata__"]
    if (d / SAFE_INDEX).exists():
        index = read_json(d / SAFE_INDEX, "a safetensors index ({\"weight_map\": {tensor: file}})")
        shards = index.get("weight_map") if isinstance(index, dict) else None
        return list(shards) if isinstance(shards, dict) else []
    return []


def check_safetensors(f: Path) -> None:
    """A safetensors file whose header (8-byte length, then JSON) describes exactly the bytes that follow."""
    header, n, size = _header(f)
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        offsets = t.get("data_offsets") if isinstance(t, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int for x in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise UsageError(f"{f}: tensor {name!r} has no valid data_offsets in the header; {_REDOWNLOAD}")
        dtype = t.get("dtype")
        shape, width = t.get("shape"), _DTYPE_BYTES.get(dtype) if isinstance(dtype, str) else None
        if width and isinstance(shape, list) and all(type(x) is int and x >= 0 for x in shape):
            if _product(shape) * width != offsets[1] - offsets[0]:
                raise UsageError(f"{f}: tensor {name!r} of shape {shape} ({t['dtype']}) does not match its "
                                 f"{offsets[1] - offsets[0]:,} bytes; {_REDOWNLOAD}")
        end = max(end, offsets[1])
    expected = 8 + n + end
    if size != expected:
        what = "truncated" if size < expected else "longer than its tensors"
        raise UsageError(f"{f}: {what}: {size:,} bytes, its header describes {expected:,}; {_REDOWNLOAD}")


def _header(f: Path) -> tuple[dict, int, int]:
    """(a safetensors file's JSON header, its length, the file's size)."""
    try:
        size = f.stat().st_size
        with f.open("rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if n is None or n > min(size - 8, CONFIG_MAX_BYTES):
                what = "empty (0 bytes)" if size == 0 else f"not a safetensors file or truncated ({size:,} bytes)"
                raise UsageError(f"{f}: {what}; {_REDOWNLOAD}")
            header = json.loads(fh.read(n).decode("utf-8"))
    except OSError as e:
        raise UsageError(f"{f}: cannot read ({e.__class__.__name__}); {_REDOWNLOAD}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UsageError(f"{f}: header is not JSON, not a safetensors file; {_REDOWNLOAD}") from None
    if not isinstance(header, dict):
        raise UsageError(f"{f}: header is not a JSON object, not a safetensors file; {_REDOWNLOAD}")
    return header, n, size


def _product(xs: list[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def check_tokenizer_files(path: str) -> None:
    """The directory holds a tokenizer vocabulary (tokenizer.json, vocab.json, tokenizer.model, ...): without one
    transformers quietly builds a tokenizer of a few special tokens. A tokenizer.json must be a JSON object whose
    vocabulary, if it lists one, is not empty."""
    d = model_dir(path)
    names = set(os.listdir(d))
    if not any(n in names for n in VOCAB_FILES) and not any(n.endswith(VOCAB_SUFFIXES) for n in names):
        raise UsageError(f"{d}: no tokenizer files (tokenizer.json, or vocab.json and merges.txt, tokenizer.model, "
                         "vocab.txt); save the tokenizer beside the model (tokenizer.save_pretrained)")
    if "tokenizer.json" not in names and "vocab.json" in names:  # a BPE tokenizer's vocabulary: token -> id
        vocab = read_json(d / "vocab.json", "a tokenizer vocabulary (a JSON object of token: id)")
        if not isinstance(vocab, dict) or not vocab:
            raise UsageError(f"{d / 'vocab.json'}: the vocabulary is empty or not a JSON object; save the tokenizer "
                             "again with save_pretrained")
    if "tokenizer.json" in names:
        f = d / "tokenizer.json"
        tok = read_json(f, "a tokenizers file (tokenizer.save_pretrained writes it)", TOKENIZER_MAX_BYTES)
        model = tok.get("model") if isinstance(tok, dict) else None
        if not isinstance(model, dict):
            raise UsageError(f"{f}: no \"model\" object; expected a tokenizers file (tokenizer.save_pretrained "
                             "writes it)")
        vocab = model.get("vocab")
        if "vocab" in model and not vocab:
            raise UsageError(f"{f}: the vocabulary is empty; save the tokenizer again with save_pretrained")
        added = tok.get("added_tokens") if isinstance(tok.get("added_tokens"), list) else []
        special = {t.get("id") for t in added if isinstance(t, dict) and t.get("special")}
        # BPE, WordPiece, WordLevel map token -> id (Unigram lists pairs: not checked here)
        ids = {v for v in vocab.values() if isinstance(v, int)} if isinstance(vocab, dict) else None
        if ids and ids <= special:
            raise UsageError(f"{f}: the vocabulary holds only the {len(ids)} special tokens; save the tokenizer "
                             "again with save_pretrained")


def check_model_dir(path: str) -> dict:
    """Every check above, in the order the trainer meets the files; returns config.json."""
    cfg = read_model_config(path)
    check_tokenizer_files(path)
    check_weights(path)
    return cfg


@functools.lru_cache(maxsize=1)
def causal_lm_types() -> frozenset[str] | None:
    """The model_types transformers' AutoModelForCausalLM can build, read from its source (importing
    transformers costs seconds and loads torch); None when transformers or that table cannot be found."""
    try:
        spec = importlib.util.find_spec("transformers")
        if spec is None or not spec.submodule_search_locations:
            return None
        src = (Path(spec.submodule_search_locations[0]) / "models" / "auto" / "modeling_auto.py").read_text("utf-8")
        import ast

        start = src.index("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = ")
        end = src.index("\n)\n", start) + 3
        call = ast.parse(src[start:end]).body[0].value
        names = frozenset(k for k, _ in ast.literal_eval(call.args[0]))
        return names or None
    except (OSError, ValueError, SyntaxError, AttributeError, IndexError, TypeError, UnicodeDecodeError):
        return None


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("transformers")
    except Exception:  # metadata missing: only the message loses the number
        return "(unknown version)"


def check_reward_model_dir(path: str, field: str) -> dict:
    """A reward model's directory (a rewards.functions entry's `model`): a config.json whose architecture is a
    sequence classifier with one label (what AutoModelForSequenceClassification saves for a reward model), tokenizer
    files, complete weights; `field` names the entry in the one-line errors. Returns config.json."""
    d = Path(path).expanduser()
    if not path or not d.is_dir():
        raise bad(field, path, "a local directory holding a reward model saved with save_pretrained; evenrl never "
                               "downloads")
    f = d / "config.json"
    cfg = read_json(f, "the reward model's Hugging Face config") if f.is_file() else None
    if not isinstance(cfg, dict):
        raise UsageError(f"{field}: {f} is missing or not a JSON object; expected a Hugging Face model directory")
    arch = cfg.get("architectures") or []
    if not any(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in arch):
        raise UsageError(f"{field}: {f} names architectures {arch}, no *ForSequenceClassification; a reward model "
                         "is a sequence classifier with one label (AutoModelForSequenceClassification, num_labels=1)")
    labels = cfg.get("id2label")
    n = len(labels) if isinstance(labels, dict) else cfg.get("num_labels", 2)  # transformers' default is 2
    if n != 1:
        raise UsageError(f"{field}: {f} has {n} labels; a reward model scores with one (num_labels=1)")
    check_tokenizer_files(str(d))
    check_weights(str(d))
    return cfg
