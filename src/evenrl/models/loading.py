"""Loading policies from local directories.

Nothing here touches the network: a model is a directory written by `save_pretrained`.
"""

from __future__ import annotations

import contextlib
import os

import torch
from safetensors import SafetensorError

from evenrl.core.model_plan import plan_of, record
from evenrl.errors import UsageError, bad, first_line
from evenrl.models.files import check_model_dir, check_reward_model_dir, is_vision_config

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    raise bad("dtype", dtype, f"one of {', '.join(_DTYPES)}")


def load_policy(path: str, *, dtype="float32", device="cpu"):
    """Load `(model, tokenizer)` from a local directory written by `save_pretrained`: a causal LM, or a
    vision-language model of evenrl.models.files.VISION_TYPES (its image processor: evenrl.models.vision).

    The tokenizer always has a pad token afterwards (its EOS when it had none), and
    `model.config.pad_token_id` agrees with it.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a per-load weights bar on every rank is noise in a training log
    path = os.fspath(path)
    torch_dtype = _resolve_dtype(dtype)
    # The torch-free checks `evenrl plan` runs too: config.json and its model_type, tokenizer files, complete
    # weights. What they catch would otherwise surface half-way through transformers as a traceback.
    auto = AutoModelForImageTextToText if is_vision_config(check_model_dir(path)) else AutoModelForCausalLM
    device = torch.device(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as e:
        raise UsageError(f"model path: could not load a tokenizer from {path!r}; {first_line(e)}") from None
    _check_vocabulary(tokenizer, path)
    # sdpa is the fastest exact attention on CPU; flash kernels are GPU-only.
    kwargs = dict(local_files_only=True, dtype=torch_dtype, attn_implementation="sdpa")
    try:
        try:
            model = auto.from_pretrained(path, **kwargs)
        except ValueError as e:  # a model without SDPA attention (gpt-oss: its sinks) says so in one of two ways
            if not any(w in str(e).lower() for w in ("sdpa", "scaled_dot_product_attention")):
                raise
            kwargs["attn_implementation"] = "eager"
            model = auto.from_pretrained(path, **kwargs)
    except torch.OutOfMemoryError:
        raise
    except (OSError, ValueError, TypeError, KeyError, RuntimeError, SafetensorError) as e:
        raise UsageError(f"model path: could not load a causal LM from {path!r}; {first_line(e)}") from None
    model.to(device)
    model.eval()

    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise UsageError(f"model path: tokenizer in {path!r} has neither a pad nor an EOS token; add one to it")
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def load_reward_model(path: str, field: str, *, dtype="float32", device="cpu"):
    """`(model, tokenizer)` of a reward model (a sequence classifier with one label, checked first without torch:
    models.files.check_reward_model_dir), frozen, in eval mode. The tokenizer has a pad token afterwards (its EOS
    when it had none) and the model's config agrees, which the classifier needs to find each row's last token."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = os.fspath(path)
    check_reward_model_dir(path, field)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True,
                                                                   dtype=_resolve_dtype(dtype))
    except torch.OutOfMemoryError:
        raise
    except (OSError, ValueError, TypeError, KeyError, RuntimeError, SafetensorError) as e:
        raise UsageError(f"{field}: could not load a reward model from {path!r}; {first_line(e)}") from None
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise UsageError(f"{field}: the tokenizer in {path!r} has neither a pad nor an EOS token; add one to it")
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    model.to(torch.device(device)).eval().requires_grad_(False)
    return model, tokenizer


def with_value_head(model, seed: int):
    """The model as a value model: its LM head replaced by a scalar head (hidden -> 1, with bias; weights drawn
    N(0, initializer_range) from `seed`, bias 0), as verl's critic (a token-classification head with one label)
    and OpenRLHF's value head are. Every forward path that ends in `lm_head` then returns values [.., 1] where it
    returned logits, so the critic trains through the same micro-batching as the policy."""
    inner = model.lm_head
    hidden = model.config.hidden_size
    head = torch.nn.Linear(hidden, 1, bias=True, dtype=inner.weight.dtype, device=inner.weight.device)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1, hidden, generator=g) * getattr(model.config, "initializer_range", 0.02))
        head.bias.zero_()
    model.lm_head = head
    model.config.tie_word_embeddings = False  # the value head is its own weight, never the embedding's
    return model


def _check_vocabulary(tokenizer, path: str) -> None:
    """A tokenizer with no ordinary tokens (only special ones) is what transformers builds from a directory
    whose vocabulary files are missing or empty: refuse it rather than train on token soup."""
    try:
        ids = set(tokenizer.get_vocab().values())
    except (AttributeError, NotImplementedError, TypeError):  # no vocabulary to list: trust the tokenizer
        return
    ordinary = ids - set(getattr(tokenizer, "all_special_ids", []) or [])
    if not ordinary:
        raise UsageError(f"{path}: the tokenizer has {len(ids)} tokens, none of them ordinary (its vocabulary files "
                         "are missing or empty); save the model's tokenizer beside it (tokenizer.save_pretrained)")


def set_tf32(on: bool) -> None:
    """model.tf32: TF32 for float32 matrix products on CUDA (a process-wide switch; CPU products are unaffected)."""
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def set_autocast(model, dtype: torch.dtype) -> None:
    """Mixed precision for a replicated model: its fp32 parameters stay the master weights and every forward of it
    (response_logits, the sampler) runs under torch.autocast(dtype). FSDP2 models get it from their policy."""
    record(model).autocast = dtype


def autocast(model):
    """The forward-pass precision context of `model` (see set_autocast); a no-op context for fp32 models."""
    dtype = plan_of(model).autocast
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(next(model.parameters()).device.type, dtype=dtype)


def compute_device(model) -> torch.device:
    """Where `model`'s forward computes: its parameters' device, except under FSDP2's CPU offload
    (parallel.cpu_offload=full), where the sharded parameters live on the host between forwards and FSDP2 runs the
    forward on the mesh's accelerator (moving the inputs there itself), so tensors built beside the forward's
    output (targets, masks) must go there too."""
    p = next(model.parameters())
    mesh = getattr(p, "device_mesh", None)  # a DTensor: a sharded parameter
    if mesh is not None and mesh.device_type != p.device.type:
        return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
    return p.device


def is_sharded(model) -> bool:
    """Whether FSDP2 shards the model (its parameters are DTensors, gathered by hooks on the forward)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def forwards_meet(model) -> bool:
    """Whether every forward of the model is a collective over the data ranks (FSDP2 gathers its units, expert
    parallelism exchanges tokens: the model's plan, core.model_plan), so every rank must run as many forwards and
    backwards, a filler where it has no rows."""
    return is_sharded(model) or plan_of(model).expert_parallel > 1


def is_checkpointing(model) -> bool:
    """Whether the model recomputes activations in backward (transformers 5 renamed the flag)."""
    flag = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"
    return bool(getattr(model, flag, False))


def checkpoint_names(model, bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """A bucket of the model's tensors (state-dict names) under the names and layout its checkpoint files use:
    transformers 5 fuses some weights when it loads them (a mixture of experts' per-expert projections into 3-D
    gate_up_proj / down_proj) and save_pretrained splits them back (revert_weight_conversion); an engine that reads
    checkpoint files (vLLM) needs that form. Each fused tensor converts alone, so any bucketing works; a model with
    nothing fused comes back as it is."""
    from transformers.core_model_loading import revert_weight_conversion

    converted = revert_weight_conversion(model, dict(bucket))
    return list(converted.items()) if converted is not None else bucket

