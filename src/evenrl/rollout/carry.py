"""Partial rollouts (rollout.partial): samples carried across steps, cut at a token budget and continued under the
next step's policy. The rules (how many tokens a sample gets, when it is done, carried or dropped) are
evenrl.core.carry's; this module holds the samples and moves them.

Each step, where samples are generated (a training rank when colocated, each reserved rollout rank otherwise):
  the step's new prompts (this rank's share, rollout_shares) and the in-flight samples this rank continues, one
  engine call: a new sample draws its first round, a carried one is re-prefilled (prompt + its tokens so far) and
  draws its next round from the token position where it stopped (engines.base.Request's first_token), every token
  recording the policy version that sampled it and its log-prob. Samples that are done go to the training rank that
  trains them (their home: the rank that generated them colocated, the share's trainer with reserved rollout
  ranks); the others stay for the next step.
On the training ranks: the done samples each holds wait there (`pool`) until every sample of their group is done.
One all-gather of the pool's group keys per step decides, the same on every rank, which groups are complete (they
are trained this step, numbered in (step drawn, position) order, so the step's batch does not depend on where a
sample waited) and which were dropped (rollout.at_max_carry=drop).
Nothing here depends on timing: what a sample holds after step t follows from its key, the budget and the weights
of each step. A checkpoint holds every in-flight and waiting sample with its tokens (`state_dict`, gathered to
trainer 0; with reserved rollout ranks trainer 0 keeps a copy of theirs, sent with every step's samples), so a
resumed run continues them exactly.
With rollout.env a sample is a trajectory: its step runs its turns within the budget (evenrl.rollout.trajectories.
Turns.advance) and its turn loop's state (`talk`, evenrl.rollout.talk) travels and is checkpointed with its tokens.
With rollout.agent a sample is an agent's trajectory (evenrl.agents.rollout.Agents.advance): its step runs the agent
with its calls replayed (evenrl.agents.replay), `talk` holds its transcript and the tokens its calls' sampled ids;
once done it becomes the rows of its samples (`to_batch`). Either loop is the run's TrajectorySource
(evenrl.rollout.source), whose `advance` runs a step of its carried samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from evenrl.agents.rollout import Agents
from evenrl.core.batch import Batch, Ragged
from evenrl.core.canonical import unit_batches
from evenrl.core.carry import CarryRules, carry_rules, oldest_token_age, outcome, round_tokens, step_budget
from evenrl.core.offpolicy import tokens_by_age, version_runs
from evenrl.core.schedule import rollout_shares
from evenrl.core.staleness import policy_version
from evenrl.distributed import collectives as dist
from evenrl.engines.base import Request, Trajectory, sampling_params
from evenrl.errors import RunStopped
from evenrl.rollout.source import TrajectorySource
from evenrl.rollout.talk import decode, encode, trajectory
from evenrl.rollout.trajectories import trajectory_columns


@dataclass
class Carried:
    """One sample of partial rollouts, from its first round to its training."""

    birth: int      # the step that drew its prompt
    position: int   # its prompt's position in that step: with birth, its group
    sample: int     # its index in the group
    row_id: int     # its prompt's dataset row
    gen: int        # the generating rank (colocated) or rollout replica that continues it
    home: int       # the training rank it waits on once done
    # 12 bytes a token (int32, float32, int32), what evenrl plan's estimate of carried samples counts
    tokens: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))
    logprobs: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float32))  # the engine's
    versions: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))  # each token's policy
    ended: bool = False  # its last token is EOS
    # rollout.env: the turn loop's state (evenrl.rollout.talk): messages, rendered history, the environment's
    # pickle, the reply it was cut in, turns, rewards, the loss mask; None for a single-turn sample
    talk: dict | None = None

    @property
    def key(self) -> tuple[int, int, int]:
        return self.birth, self.position, self.sample

    @property
    def group(self) -> tuple[int, int]:
        return self.birth, self.position

    def sampled_versions(self) -> list[int]:
        """The versions of the tokens the policy sampled (a trajectory's environment tokens left out)."""
        if self.talk is None or "mask" not in self.talk:  # a single-turn sample, or an agent's calls' tokens
            return self.versions.tolist()
        return [v for v, m in zip(self.versions.tolist(), self.talk["mask"]) if m == "1"]


META = ("birth", "position", "sample", "row_id", "gen", "home", "ended")


def pack(records: list[Carried]) -> dict:
    """Samples as a few flat tensors (what travels and what a checkpoint holds; torch.load(weights_only=True) reads
    it): pickling three tensors per sample made a step's hand-over from a rollout rank ~80 ms on this CPU."""
    return {"meta": torch.tensor([[int(getattr(r, k)) for k in META] for r in records],
                                 dtype=torch.long).reshape(len(records), len(META)),
            "lengths": torch.tensor([len(r.tokens) for r in records], dtype=torch.long),
            **talks(records),
            **{name: torch.cat([getattr(r, name) for r in records]) if records else empty
               for name, empty in (("tokens", torch.zeros(0, dtype=torch.int32)),
                                   ("logprobs", torch.zeros(0, dtype=torch.float32)),
                                   ("versions", torch.zeros(0, dtype=torch.int32)))}}


def unpack(packed: dict) -> list[Carried]:
    lengths = packed["lengths"].tolist()
    parts = {name: torch.split(packed[name], lengths) for name in ("tokens", "logprobs", "versions")}
    talk = ([decode(bytes(x.tolist())) for x in torch.split(packed["talk"], packed["talk_lengths"].tolist())]
            if "talk" in packed else [None] * len(lengths))
    return [Carried(*m[:6], tokens=parts["tokens"][i], logprobs=parts["logprobs"][i], versions=parts["versions"][i],
                    ended=bool(m[6]), talk=talk[i]) for i, m in enumerate(packed["meta"].tolist())]


def talks(records: list[Carried]) -> dict:
    """Trajectories' talk as UTF-8 JSON in one uint8 tensor (nothing for single-turn samples)."""
    if not any(r.talk is not None for r in records):
        return {}
    raw = [encode(r.talk) for r in records]
    return {"talk": torch.tensor(list(b"".join(raw)), dtype=torch.uint8),
            "talk_lengths": torch.tensor([len(x) for x in raw], dtype=torch.long)}


def canonical_calls(calls: list[list[tuple[int, int, int]]], new: list[Carried], live: list[Carried],
                    pad: int) -> list[tuple[list, list[Carried], list[Carried]]]:
    """train.reproducibility=bitwise: a step's engine calls as (share, its new samples, live samples), one per
    canonical batch of new prompts (core.canonical), then one per live group in (step drawn, position) order (a
    group's live samples are on one rank: canonical batches deal whole prompts), then `pad` empty ones. Which
    samples share a call is then a function of the step's samples alone."""
    parts = [(b, [r for r in new if any(p == r.position and a <= r.sample < a + c for p, a, c in b)], [])
             for b in calls]
    groups: dict[tuple[int, int], list[Carried]] = {}
    for r in live:
        groups.setdefault(r.group, []).append(r)
    parts += [([], [], groups[g]) for g in sorted(groups)]
    return parts + [([], [], [])] * pad


@dataclass
class Delivery:
    """What a reserved rollout rank sends a trainer with a step's samples (packed): the done ones that wait there,
    and for trainer 0 the rollout rank's in-flight samples after the step (its copy for the checkpoints), the groups
    it dropped and how many samples it generated to their end at their last step (at_max_carry=wait)."""

    done: dict
    live: dict | None = None
    dropped: list[tuple[int, int]] = field(default_factory=list)
    waited: int = 0


class Carry:
    """A rank's samples of partial rollouts: `live` (in flight, continued by this rank; on trainer 0 with reserved
    rollout ranks, the copy of theirs) and `pool` (done, waiting here for their group)."""

    def __init__(self, cfg, turns: TrajectorySource | None = None):
        self.cfg, self.rules, self.turns = cfg, carry_rules(cfg), turns  # the run's trajectory loop, or None
        self.n = cfg.rollout.samples_per_prompt
        self.live: list[Carried] = []
        self.pool: list[Carried] = []
        self.dropped: list[tuple[int, int]] = []  # this step's, until settle
        self.waited = 0                           # this step's, until settle
        self.metrics: dict = {}                   # the last settle's

    # ------------------------------------------------------------------ generation side

    def advance(self, engine, prompts, step: int, version: int, prompt_ids: list[int],
                share: list[tuple[int, int, int]], gen: int, homes: dict[tuple[int, int], int],
                calls: list[list[tuple[int, int, int]]] | None = None, pad: int = 0) -> list[Carried]:
        """One step of generation on this rank under policy `version`: the new samples of `share` ((position,
        first sample, count) of `prompt_ids`) and every live sample, each by its round's tokens (core.carry).
        `homes`: (position, sample) -> the training rank a new sample waits on. Returns the samples done in this
        step; the carried ones stay live; dropped groups are noted. `prompts`: evenrl.train.trainer.Prompts.
        `calls` (train.reproducibility=bitwise): `share` as its canonical batches; each is an engine call of its
        own and so is each live group, so that which samples share a forward pass does not depend on the layout;
        `pad` more empty calls (with FSDP2 a call gathers the model: every rank makes as many)."""
        new = [Carried(step, p, s, prompt_ids[p], gen, homes[(p, s)]) for p, a, c in share for s in range(a, a + c)]
        live = sorted(self.live, key=lambda r: r.key)
        ages = [step - r.birth for r in live]
        if self.turns is not None:  # a new trajectory's talk is its loop's to open (TrajectorySource.advance)
            self.waited += sum(1 for a in ages if step_budget(self.rules, a) is None)  # generated to their end
        parts = [(share, new, live)] if calls is None else canonical_calls(calls, new, live, pad)
        complete = {}
        for entries, fresh, old in parts:
            flags = self._generate(engine, prompts, step, version, prompt_ids, entries, fresh, old)
            complete.update(zip((r.key for r in fresh + old), flags))
        return self._sort(new, live, ages, [complete[r.key] for r in new + live])

    def _generate(self, engine, prompts, step: int, version: int, prompt_ids: list[int],
                  share: list[tuple[int, int, int]], new: list[Carried], live: list[Carried]) -> list[bool]:
        """One engine call (a turn loop's calls with rollout.env / rollout.agent) for the new samples of `share` and
        the `live` ones; returns per sample (new, then live) whether its trajectory is complete (single-turn: False,
        _sort reads its EOS and length)."""
        rules, ages = self.rules, [step - r.birth for r in live]
        if self.turns is not None:  # the turn loop's or the agents' step (their transcripts replayed)
            return self.turns.advance(engine, prompts, new + live, [0] * len(new) + ages, rules,
                                      sampling_params(self.cfg), version)
        tokens = prompts.tokens
        fresh, caps = round_tokens(rules, 0, 0), [round_tokens(rules, len(r.tokens), a) for r, a in zip(live, ages)]
        self.waited += sum(1 for c in caps if c > rules.budget)  # generated to their end
        requests = [Request(tokens[prompt_ids[p]], p, step, range(a, a + c), max_tokens=fresh) for p, a, c in share]
        requests += [Request(tokens[r.row_id] + r.tokens.tolist(), r.position, r.birth, range(r.sample, r.sample + 1),
                             first_token=len(r.tokens), max_tokens=cap) for r, cap in zip(live, caps)]
        out = engine.generate(requests, sampling_params(self.cfg))
        made = {(c.prompt_key, c.sample_index): c for samples in out[:len(share)] for c in samples}
        for r in new:
            self._extend(r, made[(r.position, r.sample)], version)
        for r, [c] in zip(live, out[len(share):]):
            self._extend(r, c, version)
        return [False] * (len(new) + len(live))

    def _sort(self, new: list[Carried], live: list[Carried], ages: list[int], complete: list[bool]) -> list[Carried]:
        """After a step's generation: the done samples returned, the carried ones live, dropped groups noted. A
        trajectory is done when `complete`, a single-turn sample by its EOS or length."""
        rules, done, self.live = self.rules, [], []
        for r, age, whole in zip(new + live, [0] * len(new) + ages, complete):
            fate = outcome(rules, 0, age, whole) if r.talk is not None else outcome(rules, len(r.tokens), age, r.ended)
            if fate == "done":
                done.append(r)
            elif fate == "carried":
                self.live.append(r)
            elif r.group not in self.dropped:
                self.dropped.append(r.group)
        return done

    @staticmethod
    def _extend(r: Carried, c, version: int) -> None:
        r.tokens = torch.cat([r.tokens, torch.tensor(c.token_ids, dtype=torch.int32)])
        r.logprobs = torch.cat([r.logprobs, torch.tensor(c.logprobs, dtype=torch.float32)])
        r.versions = torch.cat([r.versions, torch.full((len(c.token_ids),), version, dtype=torch.int32)])
        r.ended = c.finished

    def deliveries(self, done: list[Carried], trainers: int) -> list[Delivery]:
        """A reserved rollout rank's step for each trainer (Delivery), after advance; resets the step's counts."""
        out = [Delivery(pack([r for r in done if r.home == t])) for t in range(trainers)]
        out[0].live, out[0].dropped, out[0].waited = pack(self.live), self.dropped, self.waited
        self.dropped, self.waited = [], 0
        return out

    def receive(self, deliveries: list[Delivery]) -> None:
        """A trainer's step from the reserved rollout ranks: its done samples, and on trainer 0 their live ones."""
        for d in deliveries:
            self.pool += unpack(d.done)
        if dist.is_main():
            self.live = sorted((r for d in deliveries for r in unpack(d.live)), key=lambda r: r.key)
            self.dropped += [g for d in deliveries for g in d.dropped if g not in self.dropped]
            self.waited += sum(d.waited for d in deliveries)

    # ------------------------------------------------------------------ training side

    def settle(self, step: int) -> tuple[list[Carried], list[tuple[int, int]]]:
        """The step's complete groups (on every training rank; one all-gather): (this rank's samples of them, all
        complete groups in order); the step's partial/ metrics in `metrics`. Dropped groups' waiting samples are
        discarded."""
        most = oldest_token_age(self.cfg.rollout.max_staleness, self.rules.max_carry)
        rows = [[*r.group, version_runs(r.sampled_versions()), *tokens_by_age([r.sampled_versions()], step - 1, most)]
                for r in self.pool]
        oldest = min((r.birth for r in self.live), default=step)
        parts = dist.all_gather_tensors({
            "pool": torch.tensor(rows, dtype=torch.long).reshape(len(rows), 4 + most),
            "dropped": torch.tensor(self.dropped, dtype=torch.long).reshape(len(self.dropped), 2),
            "counts": torch.tensor([len(self.live), step - oldest, self.waited], dtype=torch.long)})
        pool = torch.cat([p["pool"] for p in parts])
        dropped = {tuple(g) for p in parts for g in p["dropped"].tolist()}
        count: dict[tuple[int, int], int] = {}
        for g in map(tuple, pool[:, :2].tolist()):
            count[g] = count.get(g, 0) + 1
        complete = sorted(g for g, c in count.items() if c == self.n and g not in dropped)
        gone = set(complete) | dropped
        trained = torch.tensor([tuple(g) in set(complete) for g in pool[:, :2].tolist()], dtype=torch.bool)
        mine = [r for r in self.pool if r.group in set(complete)]
        self.pool = [r for r in self.pool if r.group not in gone]
        counts = torch.stack([p["counts"] for p in parts])
        self.dropped, self.waited = [], 0
        self.metrics = {
            "partial/trained_groups": len(complete), "partial/in_flight": int(counts[:, 0].sum()),
            "partial/waiting": sum(c for g, c in count.items() if g not in gone),
            "partial/oldest_age": int(counts[:, 1].max()),
            "partial/dropped_groups": len(dropped), "partial/waited": int(counts[:, 2].sum()),
            "rollout/versions_per_sample": [int((pool[trained, 2] == v).sum()) for v in range(1, self.rules.max_carry
                                                                                               + 2)],
            "rollout/tokens_per_version": pool[trained, 3:].sum(0).tolist() if len(pool) else [0] * (most + 1)}
        return mine, complete

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """Every rank's in-flight and waiting samples (a collective on the training ranks: trainer 0 saves them)."""
        return {name: pack([r for part in dist.all_gather_object(pack(getattr(self, name))) for r in unpack(part)])
                for name in ("live", "pool")}

    def load_live(self, state: dict, gen: int | None, gens: int) -> None:
        """The checkpoint's in-flight samples this rank continues: generator `gen` of `gens` (None: all of them,
        trainer 0's copy with reserved rollout ranks). A sample keeps its generator, modulo the generators there
        are now (a resume on another layout)."""
        self.live = [r for r in unpack(state["live"]) if gen is None or r.gen % gens == gen]
        for r in self.live:
            r.gen %= gens

    def load_pool(self, state: dict, home: int, homes: int) -> None:
        """The checkpoint's waiting samples this training rank holds (`home` of `homes`, as load_live)."""
        self.pool = [r for r in unpack(state["pool"]) if r.home % homes == home]
        for r in self.pool:
            r.home %= homes


# ------------------------------------------------------------------------------------------ the step's batch

def carried_rows(trainer, step: int, prompt_ids: list[int]) -> Batch:
    """A training rank's part of the step's rollout with rollout.partial (evenrl.rollout.generate.rollout): this
    step's generation (here, or received from the reserved rollout ranks), then the complete groups' samples this
    rank holds, as the step's rows."""
    carry, cfg = trainer.carry, trainer.cfg
    if dist.rollout_ranks():
        carry.receive([d for _, d in receive_checked(step, cfg.rollout.max_staleness)])
    else:
        costs = [len(trainer.prompts.tokens[i]) + cfg.response_tokens() for i in prompt_ids]
        batches = unit_batches(cfg, costs, dist.world(), trainer.balance.rollout)[dist.rank()]
        share, calls, pad = [x for b in batches for x in b], None, 0
        if cfg.train.reproducibility == "bitwise":  # canonical calls, as many on every rank (one all-gather)
            calls, mine = batches, len(batches) + len({r.group for r in carry.live})
            pad = max(int(p["calls"]) for p in dist.all_gather_tensors({"calls": torch.tensor([mine])})) - mine
        homes = {(p, s): dist.rank() for p, a, c in share for s in range(a, a + c)}
        carry.pool += carry.advance(trainer.engine, trainer.prompts, step, step - 1, prompt_ids, share,
                                    dist.rank(), homes, calls, pad)
        trainer.engine.sleep()
    return to_batch(trainer, *carry.settle(step))


def receive_checked(step: int, max_staleness: int) -> list:
    """The step's deliveries from the reserved rollout ranks, each checked to be of the version due."""
    version = policy_version(step, max_staleness)
    parts = dist.receive_rollouts(step)
    if any(v != version for v, _ in parts):
        raise RunStopped(f"step {step}: rollout ranks sampled with policy versions {sorted({v for v, _ in parts})} "
                         f"where version {version} was due")
    return parts


def to_batch(trainer, rows: list[Carried], complete: list[tuple[int, int]]) -> Batch:
    """The rows of complete groups as the step's Batch: groups numbered 0.. in (step drawn, position) order on every
    rank, sample_index = group x samples_per_prompt + sample."""
    n, number = trainer.cfg.rollout.samples_per_prompt, {g: i for i, g in enumerate(complete)}
    agents = isinstance(trainer.turns, Agents)
    stride = trainer.cfg.rollout.agent_max_calls if agents else 1  # an agent's trajectory: rows of its samples
    parts = []  # (carried sample, prompt ids, its row as a Trajectory, the row's token versions)
    for r in sorted(rows, key=lambda r: r.key):
        if agents:
            ts, vs = trainer.turns.carried_rows(r, trainer.prompts.tokens[r.row_id])
            parts += [(r, t.prompt_ids, t, torch.tensor(v, dtype=torch.int32)) for t, v in zip(ts, vs)]
        else:
            t = trajectory(r) if trainer.turns is not None else Trajectory(r.position, r.sample, r.tokens.tolist(),
                                                                          r.logprobs.tolist(), r.ended)
            parts.append((r, trainer.prompts.tokens[r.row_id], t, r.versions))
    group = torch.tensor([number[r.group] for r, *_ in parts], dtype=torch.long)
    return Batch({
        "sample_index": (group * n + torch.tensor([r.sample for r, *_ in parts], dtype=torch.long)) * stride
                        + torch.tensor([t.segment for _, _, t, _ in parts], dtype=torch.long),
        "tokens": Ragged.of([torch.tensor(p + t.token_ids) for _, p, t, _ in parts], torch.long),
        "response_len": torch.tensor([len(t.token_ids) for _, _, t, _ in parts], dtype=torch.long),
        "group": group,
        "finished": torch.tensor([t.finished for _, _, t, _ in parts], dtype=torch.bool),
        "engine_logp": Ragged.of([torch.tensor(t.logprobs, dtype=torch.float32) for _, _, t, _ in parts],
                                 torch.float32),
        "version": torch.tensor([int(v[0]) for *_, v in parts], dtype=torch.long),
        "token_version": Ragged.of([v for *_, v in parts], torch.long),
        "row_id": [r.row_id for r, *_ in parts],
        # a trajectory's text keeps its turn markers, as in an uncut rollout
        "completion": [trainer.tokenizer.decode(t.token_ids, skip_special_tokens=trainer.turns is None)
                       for _, _, t, _ in parts],
        **(trajectory_columns([t for _, _, t, _ in parts]) if trainer.turns is not None else {}),
    })


def serve_step(cfg, carry: Carry, engine, prompts, step: int, prompt_ids: list[int]) -> None:
    """A reserved rollout rank's step with rollout.partial: its share of the new prompts and its live samples under
    the step's version, the done ones sent to the trainers they wait on (as the trainers would split the step's
    prompts), the rest kept."""
    n, replicas, trainers = cfg.rollout.samples_per_prompt, dist.rollout_ranks(), dist.world()
    costs = [len(prompts.tokens[i]) + cfg.response_tokens() for i in prompt_ids]
    batches = unit_batches(cfg, costs, len(replicas), None)[replicas.index(dist.rank())]
    share = [x for b in batches for x in b]
    # bitwise: canonical calls (an engine of its own on each rollout rank: no call is a collective, no padding)
    calls = batches if cfg.train.reproducibility == "bitwise" else None
    split = rollout_shares(costs, n, trainers, dist.capacity())
    homes = {(p, s): t for t, part in enumerate(split) for p, a, c in part for s in range(a, a + c)}
    version = policy_version(step, cfg.rollout.max_staleness)
    dist.mark(f"step {step} generate (rollout rank)")
    done = carry.advance(engine, prompts, step, version, prompt_ids, share, replicas.index(dist.rank()), homes, calls)
    engine.sleep()
    dist.send_rollouts(step, version, carry.deliveries(done, trainers))
