"""The carried samples of a checkpoint (rollout.partial: evenrl.rollout.carry's packed in-flight and waiting samples),
checked when a resumed run loads them, before it uses or rewrites anything: a damaged one would otherwise stop the
run with a traceback at unpacking (lengths that do not add up), in a re-prefill after the run directory was
rewritten (a token id past the vocabulary, a dataset row that does not exist), or train on NaN log-probs and stop
with a non-finite loss naming the damaged checkpoint as the last good one.

Checked for every field a partial rollout carries: the packed tensors' kinds and shapes; each sample's key, its
row in the dataset, its tokens (ids in the vocabulary), log-probs (finite) and policy versions (before the
checkpoint's step); whether it is done or in flight as the rules say; and its talk: a multi-turn trajectory's turn
loop (evenrl.rollout.talk: one loss-mask entry per token) or an agent's transcript (evenrl.agents.replay: its
calls' tokens adding up to the sample's, their prompts in the vocabulary). `problem` says what is wrong in one line
(None: sound); evenrl.train.checkpoint.last_good finds the newest checkpoint whose carried samples are sound.
"""

from __future__ import annotations

import math
import torch

from evenrl.core.carry import CarryRules, carry_rules
from evenrl.rollout.carry import META
from evenrl.rollout.talk import decode

_TENSORS = {"meta": torch.long, "lengths": torch.long, "tokens": torch.int32, "logprobs": torch.float32,
            "versions": torch.int32}
_TALK = {"talk": torch.uint8, "talk_lengths": torch.long}


def problem(carry, cfg, *, step: int, vocab: int, rows: int, eos: set[int]) -> str | None:
    """What is wrong with a checkpoint's carried samples (its "carry" entry), in one line; None when they are
    sound for a run of `cfg` at checkpoint `step`, whose model has `vocab` token ids, whose data `rows` prompts and
    whose end-of-sequence ids are `eos`."""
    if not isinstance(carry, dict):
        return f"carry is a {type(carry).__name__}; expected the carried samples evenrl train saves"
    rules, keys = carry_rules(cfg), set()
    kind = "agent" if cfg.rollout.agent else "env" if cfg.rollout.env else None
    for name, what in (("live", "in-flight"), ("pool", "waiting")):
        packed = carry.get(name)
        why = _shape_problem(packed, kind)
        if why:
            return f"carry.{name}: {why}"
        lengths = packed["lengths"].tolist()
        parts = {k: torch.split(packed[k], lengths) for k in ("tokens", "logprobs", "versions")}
        talks = (torch.split(packed["talk"], packed["talk_lengths"].tolist()) if kind else [None] * len(lengths))
        for i, meta in enumerate(packed["meta"].tolist()):
            birth, position, sample = meta[:3]
            where = f"{what} sample (step {birth}, prompt {position}, sample {sample})"
            why = (_meta_problem(meta, cfg, step, rows, keys)
                   or _token_problem(parts["tokens"][i], parts["logprobs"][i], parts["versions"][i], step, vocab)
                   or _talk_problem(talks[i], kind, len(parts["tokens"][i]), name, vocab))
            if why is None and kind is None:
                why = _single_turn_problem(parts["tokens"][i], bool(meta[6]), name, rules, eos)
            if why:
                return f"{where}: {why}"
    return None


def vocab_of(model) -> int:
    """The token ids `model` can sample: its (text) config's vocabulary size, the rows of its output layer."""
    return int(model.config.get_text_config().vocab_size)


def _shape_problem(packed, kind: str | None) -> str | None:
    if not isinstance(packed, dict):
        return f"is a {type(packed).__name__}; expected packed samples"
    wanted = {**_TENSORS, **(_TALK if kind and packed.get("meta") is not None and len(packed["meta"]) else {})}
    for key, dtype in wanted.items():
        t = packed.get(key)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            got = "missing" if t is None else f"a {getattr(t, 'dtype', type(t).__name__)}"
            return f"{key} is {got}; expected {dtype} as evenrl train packs it"
    if kind is None and "talk" in packed:
        return "holds multi-turn or agent trajectories; this run has neither rollout.env nor rollout.agent"
    meta, lengths = packed["meta"], packed["lengths"]
    n = len(meta)
    if meta.dim() != 2 or meta.shape[1] != len(META):
        return f"meta has shape {tuple(meta.shape)}; expected (samples, {len(META)})"
    if lengths.shape != (n,) or (lengths < 0).any():
        return f"lengths has shape {tuple(lengths.shape)} for {n} samples, or a negative length"
    total = int(lengths.sum())
    for key in ("tokens", "logprobs", "versions"):
        if packed[key].shape != (total,):
            return f"the lengths add up to {total:,} tokens but {key} holds {tuple(packed[key].shape)}"
    if "talk" in packed and n:
        talk, talk_lengths = packed["talk"], packed["talk_lengths"]
        if talk_lengths.shape != (n,) or (talk_lengths < 0).any() or talk.shape != (int(talk_lengths.sum()),):
            return "talk_lengths do not add up to the talk bytes it holds"
    return None


def _meta_problem(meta: list[int], cfg, step: int, rows: int, keys: set) -> str | None:
    birth, position, sample, row_id, gen, home, ended = meta
    if not 1 <= birth <= step:
        return f"drawn at step {birth}, which is not in 1..{step} (the checkpoint's step)"
    if position < 0 or not 0 <= sample < cfg.rollout.samples_per_prompt:
        return f"position {position}, sample {sample}: expected a position >= 0 and a sample in " \
               f"0..{cfg.rollout.samples_per_prompt - 1} (rollout.samples_per_prompt)"
    if not 0 <= row_id < rows:
        return f"its prompt is row {row_id} of the dataset, which has {rows:,} (data.path changed?)"
    if gen < 0 or home < 0 or ended not in (0, 1):
        return f"its generator {gen}, home rank {home} or end mark {ended} is out of range"
    if (birth, position, sample) in keys:
        return "carried twice"
    keys.add((birth, position, sample))
    return None


def _token_problem(tokens, logprobs, versions, step: int, vocab: int) -> str | None:
    if len(tokens) and not (0 <= int(tokens.min()) and int(tokens.max()) < vocab):
        bad = next(t for t in tokens.tolist() if not 0 <= t < vocab)
        return f"token id {bad} is not in the model's vocabulary (0..{vocab - 1})"
    if not bool(torch.isfinite(logprobs).all()):
        return f"{int((~torch.isfinite(logprobs)).sum())} of its {len(logprobs)} log-probs are not finite"
    if len(versions) and not (0 <= int(versions.min()) and int(versions.max()) < step):
        return f"a token sampled by policy version {int(versions.max())}, not before the checkpoint's step {step}"
    return None


def _single_turn_problem(tokens, ended: bool, name: str, rules: CarryRules, eos: set[int]) -> str | None:
    n = len(tokens)
    if ended and (not n or (eos and int(tokens[-1]) not in eos)):
        return "marked as ended, but its last token is not end-of-sequence (lengths shifted?)"
    if name == "live" and (ended or n >= rules.max_new):
        return (f"in flight with {n} tokens{', ended' if ended else ''}: it cannot continue under "
                f"rollout.max_new_tokens={rules.max_new} (lowered since the checkpoint?)")
    return None


def _talk_problem(raw, kind: str | None, n: int, name: str, vocab: int) -> str | None:
    """A trajectory's talk (multi-turn: its turn loop; agent: its transcript) against its `n` tokens."""
    if kind is None:
        return None
    try:
        talk = decode(bytes(raw.tolist()))
    except (UnicodeDecodeError, ValueError, TypeError) as e:
        return f"its talk cannot be read ({type(e).__name__})"
    if not isinstance(talk, dict):
        return "it has no talk (the state of its trajectory)"
    complete = talk.get("complete")
    if not isinstance(complete, bool) or complete != (name == "pool"):
        return f"its talk says complete={complete!r}, yet it is {'in flight' if name == 'live' else 'waiting'}"
    return _agent_talk(talk, n, vocab) if kind == "agent" else _env_talk(talk, n)


def _env_talk(talk: dict, n: int) -> str | None:
    mask = talk.get("mask")
    if not isinstance(mask, str) or len(mask) != n or set(mask) - {"0", "1"}:
        return f"its talk's loss mask has {len(mask) if isinstance(mask, str) else 'no'} entries for {n} tokens"
    if not isinstance(talk.get("messages"), list) or not isinstance(talk.get("history"), str):
        return "its talk has no messages or history"
    for key in ("reply", "turns", "tool_calls", "tool_errors"):
        if type(talk.get(key)) is not int or talk[key] < 0:
            return f"its talk's {key} is {talk.get(key)!r:.30}; expected a count"
    if talk["reply"] > n or not _finite(talk.get("reward")):
        return f"its talk's reply ({talk['reply']} tokens) or reward ({talk.get('reward')!r:.30}) is out of range"
    return None


def _agent_talk(talk: dict, n: int, vocab: int) -> str | None:
    calls = talk.get("calls")
    if not isinstance(calls, list):
        return "its transcript has no calls"
    total = 0
    for k, call in enumerate(calls, 1):
        if not (isinstance(call, list) and len(call) == 5 and isinstance(call[0], list)
                and all(type(x) is int for x in (call[1], call[2])) and 0 <= call[2] <= call[1]):
            return f"its transcript's call {k} is not [prompt ids, budget, tokens, eos, complete]"
        if not all(type(i) is int and 0 <= i < vocab for i in call[0]):
            return f"its transcript's call {k} has a prompt token id outside the vocabulary (0..{vocab - 1})"
        total += call[2]
    if total != n:
        return f"its transcript's calls hold {total} tokens, the sample {n}"
    if talk["complete"] and not (_finite(talk.get("reward")) and isinstance(talk.get("tool_calls"), list)
                                 and len(talk["tool_calls"]) == len(calls)):
        return "its transcript is complete but its reward or tool calls are missing"
    return None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

