"""What every rollout engine shares: the sampling settings, a request (one prompt's samples to make), a completion
(and a trajectory: a completion of many turns), the keyed random stream of a sample and the `Engine` interface the
trainer and the weight sync call.

A sample's randomness is keyed by (train.seed, step, prompt position, sample index[, turn]): `row_seed` names its
stream, so which rank or engine replica makes a sample does not change it. A multi-turn trajectory's later turns
(turn >= 1, evenrl.rollout.trajectories) draw from streams of their own; turn 0 is the single-turn stream.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Protocol

import torch

from evenrl.config import RunConfig
from evenrl.errors import bad

if TYPE_CHECKING:
    from evenrl.models.vision import ImageInputs


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    samples_per_prompt: int = 1
    seed: int = 0

    def __post_init__(self):
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise bad("max_new_tokens", self.max_new_tokens, "an integer >= 1")
        if not (isinstance(self.samples_per_prompt, int) and self.samples_per_prompt >= 1):
            raise bad("samples_per_prompt", self.samples_per_prompt, "an integer >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise bad("temperature", self.temperature, "a number >= 0 (0 means greedy)")
        if not (0 < self.top_p <= 1):
            raise bad("top_p", self.top_p, "a number in (0, 1]")


@dataclass(frozen=True)
class Request:
    """One prompt's samples for Engine.generate, each drawn from its stream row_seed(seed, step, key, sample, turn):
    what a sample is follows from these fields alone, not from the call, rank or batch it is made in. Engines and
    every caller share it: the step's rollout (rollout.generate, train.rollout_rank), carried samples (rollout.carry),
    the turn loops (rollout.trajectories, agents.rollout), judges (train.reward_models)."""

    prompt: list[int]  # token ids; a continued sample's are its prompt's then its tokens so far (prefilled again)
    key: int  # names the prompt's streams: a position that does not depend on the layout (not its dataset row)
    step: int  # the step whose streams it draws from (a carried sample's: the step that started it)
    samples: range | None = None  # which sample indices (streams) of the prompt; None: all of samples_per_prompt
    turn: int = 0  # the turn of the multi-turn trajectories it continues (0: the single-turn stream)
    first_token: int = 0  # tokens its streams have drawn already: its next draw is that position's (partial rollouts)
    max_tokens: int | None = None  # most new tokens in this call (<= max_new_tokens); None: max_new_tokens
    images: ImageInputs | None = None  # a vision-language model's prompt images (placeholders expanded in `prompt`)

    def sample_range(self, params: SamplingParams) -> range:
        """Its sample indices, checked against the call's samples_per_prompt."""
        n = params.samples_per_prompt
        r = range(n) if self.samples is None else self.samples
        if not (r.step == 1 and 0 <= r.start and len(r) >= 1 and r.stop <= n):
            raise bad("samples", self.samples, f"a range of 1 or more of the {n} samples per prompt")
        return r

    def cap(self, params: SamplingParams) -> int:
        """Its most new tokens in this call, checked against the call's max_new_tokens."""
        cap = params.max_new_tokens if self.max_tokens is None else self.max_tokens
        if not 1 <= cap <= params.max_new_tokens or self.first_token < 0:
            raise bad("max_tokens", cap, f"1..max_new_tokens ({params.max_new_tokens}), first_token >= 0")
        return cap


@dataclass
class Completion:
    prompt_key: int
    sample_index: int
    token_ids: list[int]  # generated tokens only; ends with the EOS token when finished
    logprobs: list[float]  # one per token in token_ids
    finished: bool  # stopped at EOS (False: hit max_new_tokens)
    # rollout.router_replay=engine: the experts each token of prompt + token_ids but the last went to, as ids
    # [tokens - 1, MoE layers, top-k] in the smallest integer dtype (evenrl.models.routing)
    routes: torch.Tensor | None = None


@dataclass
class Trajectory(Completion):
    """A Completion whose token_ids hold every token after the prompt (sampled and environment turns); logprobs
    hold the engine's log-prob of each sampled token and 0 for environment tokens. What both trajectory loops
    return, rollout.env's (evenrl.rollout.trajectories) and rollout.agent's (evenrl.agents.rollout), so it lives
    below both."""

    loss_mask: list[bool] = field(default_factory=list)
    reward: float = 0.0  # the turns' rewards, discounted by algo.turn_discount
    failed: bool = False  # an environment step failed (rewards.on_failure decides what that costs)
    error: str | None = None  # how, in one line
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    cut_calls: int = 0  # replies cut at rollout.max_new_tokens inside a tool call (envs.toolcalls.ends_inside_call)
    # rollout.agent (evenrl.agents.rollout): the sample's own prompt (None: the dataset prompt's tokens), the samples a
    # trajectory was split into after its first (calls that did not extend it), which of them this is, and on the
    # first how many splits there were
    prompt_ids: list[int] | None = None
    splits: list[Trajectory] = field(default_factory=list)
    segment: int = 0
    history_breaks: int = 0


def row_seed(seed: int, step: int, key: int, sample_index: int, turn: int = 0) -> int:
    """64-bit seed of one (prompt, sample, turn) stream; stable across processes and Python versions. Turn 0 is the
    stream a single-turn sample has always had."""
    parts = (seed, step, key, sample_index) + ((turn,) if turn else ())
    return keyed_seed("evenrl-rollout", *parts)


def keyed_seed(domain: str, *parts: int) -> int:
    """64-bit seed named by a domain and integers (blake2b): the same on every process, rank and run."""
    text = "/".join([domain, *(str(int(p)) for p in parts)]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def sampling_params(cfg: RunConfig) -> SamplingParams:
    """A step's sampling settings from the run's config."""
    r = cfg.rollout
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                          samples_per_prompt=r.samples_per_prompt, seed=cfg.train.seed)


class Engine(Protocol):
    name: str
    # True when update_weights must be fed after each optimizer step (the engine holds its own copy of the weights).
    needs_weights: bool
    # The mesh dimension whose ranks call it with the same requests and step in lockstep (the hf engine on a
    # tensor-parallel model: "tp"), so what they do between calls must agree too; None: each rank's calls are its own.
    lockstep: str | None

    def generate(self, requests: list[Request], params: SamplingParams) -> list[list[Completion]]:
        """[request][sample] completions, in the order of each request's samples: token ids, finished (stopped at
        EOS), the engine's own log-prob of each sampled token under softmax(logits / temperature) and, where the
        engine records them, the routes of a mixture of experts. A (step, key, sample, turn) must be unique within
        a call: equal streams give equal samples."""

    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
        """Load the trainer's weights, given as buckets of (Hugging Face name, whole tensor)."""

    def sleep(self) -> None:
        """Free what the engine holds between rollouts (vLLM on GPU: its KV cache and weights); no-op elsewhere."""

    def wake(self) -> None:
        """Undo sleep before the next weight push and rollout."""
