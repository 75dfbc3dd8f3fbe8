"""`Batch`: the per-sample container that carries a step from rollout to exchange to the update, and `COLUMNS`, the
one declaration of what travels in it.

Three kinds of column, all with one entry per sample (row):
  * sample: a tensor [N]                                    (rewards, advantages, sample_index)
  * token:  `Ragged(values [sum(L)], lengths [N])`, pad-free (token ids, per-token log-probs)
  * list:   a Python list of N objects                      (completion text, dataset row ids)
The step's columns are declared once in `COLUMNS` (kind, dtype, meaning); a Batch refuses a declared column of the
wrong kind or dtype, so a phase cannot hand the next one a float where it expects token ids. The same type holds a
rank's own samples and the all-ranks view of the per-sample numbers (`train.step.gather_rows`).

Why not tensordict (0.15): ragged columns there are lazy stacks or jagged nested tensors whose API is still
moving, strings live in NonTensorStack wrappers, and its own save format is memmap/pickle rather than a
plain dict that `torch.load(weights_only=True)` accepts; it also tests only against the newest torch.
What evenrl needs (select/split/concat/padded on three column kinds) is the ~150 lines below.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, Sequence

import torch
from torch import Tensor

from evenrl.core.moe import ROUTE_DTYPES


class Column(NamedTuple):
    kind: Literal["sample", "token", "list"]
    dtype: torch.dtype | tuple[torch.dtype, ...] | None  # None for list columns; a tuple: any of these
    meaning: str


COLUMNS: dict[str, Column] = {
    "sample_index": Column("sample", torch.long, "position in the step: prompt position x samples_per_prompt + "
                                                 "sample; the same on any layout, so exchange() orders rows by it"),
    "group": Column("sample", torch.long, "the prompt's position in the step; samples of one prompt form a group"),
    "tokens": Column("token", torch.long, "prompt + response token ids (a trajectory's response: every token after "
                                          "the prompt, sampled and environment turns in order)"),
    "total_len": Column("sample", torch.long, "prompt + response tokens (the all-ranks view; a rank's own rows "
                                              "read it from tokens)"),
    "response_len": Column("sample", torch.long, "response tokens (the last response_len of tokens)"),
    "finished": Column("sample", torch.bool, "the response ended with EOS (not cut at max_new_tokens)"),
    "reward": Column("sample", torch.float32, "summed weighted reward"),
    "reward_failed": Column("sample", torch.bool, "a reward call on this sample failed (it counts 0 in reward); "
                                                  "with rewards.on_failure=mask the sample is left out of learning"),
    "kl_sum": Column("sample", torch.float32, "summed per-token KL to the reference at sampling time (kl_in=reward)"),
    "advantage": Column("sample", torch.float32, "advantage, from the whole step's rewards (reinforce_pp, gae: the "
                                                 "mean of the sample's token advantages)"),
    "reward_kl": Column("token", torch.float32, "per-token KL to the reference at sampling time (kl_in=reward with "
                                                "reinforce_pp or gae: folded into each token's reward)"),
    "old_values": Column("token", torch.float32, "the critic's value of each response token's state at sampling "
                                                 "time (gae)"),
    "returns": Column("token", torch.float32, "value targets: GAE advantages + old_values (gae)"),
    "raw_advantage": Column("token", torch.float32, "per-token advantage before whitening: discounted returns "
                                                    "(reinforce_pp) or GAE (gae)"),
    "token_mean": Column("sample", torch.float64, "mean of the sample's raw_advantage (gathered: whitening)"),
    "token_m2": Column("sample", torch.float64, "sum of squared deviations of the sample's raw_advantage from "
                                                "token_mean (gathered: whitening)"),
    "token_advantage": Column("token", torch.float32, "per-token advantage, whitened over the whole step's "
                                                      "response tokens (reinforce_pp, gae)"),
    "engine_logp": Column("token", torch.float32, "response log-probs the rollout engine reported while sampling "
                                                  "(compared with the trainer's: rollout/logprob_mismatch; 0 on a "
                                                  "trajectory's environment tokens)"),
    "loss_mask": Column("token", torch.bool, "rollout.env: True on the response tokens the engine sampled, False on "
                                             "the environment's (no loss, not counted); absent: all were sampled"),
    "sampled_len": Column("sample", torch.long, "rollout.env: the trajectory's sampled tokens (what the loss "
                                                "denominators count)"),
    "turns": Column("sample", torch.long, "rollout.env: the trajectory's assistant turns"),
    "tool_calls": Column("sample", torch.long, "rollout.env: tool calls the trajectory made"),
    "tool_errors": Column("sample", torch.long, "rollout.env: of those, the ones that could not be read or run"),
    "cut_calls": Column("sample", torch.long, "rollout.env, rollout.agent: the trajectory's replies that ended at "
                                              "their token limit inside a tool call (which was never made)"),
    "error": Column("list", None, "rollout.env, rollout.agent: why the trajectory failed, in one line (None: it did "
                                  "not)"),
    "segment": Column("sample", torch.long, "rollout.agent: which sample of its trajectory this is (0: the first; "
                                            "k: the k-th split off where a call did not extend the conversation)"),
    "history_breaks": Column("sample", torch.long, "rollout.agent: on a trajectory's first sample, how many samples "
                                                   "were split off it (0 elsewhere)"),
    "version": Column("sample", torch.long, "the policy version that sampled (of its first token, where its tokens "
                                            "have several): the weights after this many steps "
                                            "(rollout.max_staleness)"),
    "token_version": Column("token", torch.long, "the policy version that sampled each response token, where a "
                                                 "sample's tokens have several (a sample carried across steps)"),
    "old_logp": Column("token", torch.float32, "response log-probs under the policy at the start of the step (the PPO "
                                               "ratio's denominator; the sampling policy unless max_staleness >= 1)"),
    "ref_logp": Column("token", torch.float32, "response log-probs under the frozen reference (kl_in=loss)"),
    "routes": Column("token", ROUTE_DTYPES, "a mixture of experts' routes: per token but the last, the expert ids "
                                            "each MoE layer chose, [tokens - 1, layers, top-k] per row, in the "
                                            "smallest integer dtype that holds them (rollout.router_replay)"),
    "pixel_values": Column("token", torch.float32, "the prompt's images as its image processor's patches, one row "
                                                   "of channels x temporal_patch x patch^2 values per patch "
                                                   "(vision-language models; every sample carries its prompt's)"),
    "image_grid_thw": Column("token", torch.long, "(t, h, w) patch grid of each of the prompt's images, one row of "
                                                  "3 per image, in the order its tokens show them"),
    "vision_tokens": Column("sample", torch.long, "the vision encoder's work on the sample's images in language-model "
                                                  "tokens: patches x the encoder's compute per patch over the "
                                                  "model's per token; added to the sample's cost and micro-batch "
                                                  "tokens by the schedule (0 without images)"),
    "row_id": Column("list", None, "the prompt's dataset row"),
    "completion": Column("list", None, "decoded response text"),
}
SAMPLE_INDEX = "sample_index"


class Ragged(NamedTuple):
    values: Tensor   # [sum(lengths), ...] rows stored back to back
    lengths: Tensor  # [N] int64, on the same device as values

    @staticmethod
    def of(rows: Sequence[Tensor], dtype: torch.dtype) -> Ragged:
        """Rows (1-D tensors) stored back to back; an empty list gives an empty column of `dtype`."""
        if rows:
            return Ragged(torch.cat(list(rows)).to(dtype), torch.tensor([len(r) for r in rows], dtype=torch.long))
        return Ragged(torch.zeros(0, dtype=dtype), torch.zeros(0, dtype=torch.long))


def _offsets(lengths: Tensor) -> Tensor:
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


def _column(value: Any) -> Tensor | Ragged | list:
    if isinstance(value, Ragged):
        lengths = value.lengths.to(device=value.values.device, dtype=torch.long)
        if value.values.dim() == 0 or value.values.shape[0] != int(lengths.sum()):
            raise ValueError(f"Ragged: {tuple(value.values.shape)} values for lengths summing to {int(lengths.sum())}")
        return Ragged(value.values, lengths)
    if isinstance(value, Tensor):
        if value.dim() == 0:
            raise ValueError("a fixed column needs a leading row dimension")
        return value
    value = list(value)
    if value and all(isinstance(v, Tensor) for v in value):  # a list of per-row tensors -> ragged
        lengths = torch.tensor([v.shape[0] for v in value], dtype=torch.long, device=value[0].device)
        return Ragged(torch.cat(value), lengths)
    return value


def _check_declared(name: str, col: Tensor | Ragged | list) -> None:
    spec = COLUMNS.get(name)
    if spec is None:
        return
    kind = "token" if isinstance(col, Ragged) else "sample" if isinstance(col, Tensor) else "list"
    dtype = col.values.dtype if isinstance(col, Ragged) else col.dtype if isinstance(col, Tensor) else None
    allowed = spec.dtype if isinstance(spec.dtype, tuple) else (spec.dtype,)
    if kind != spec.kind or dtype not in allowed or (kind == "sample" and col.dim() != 1):
        raise TypeError(f"column {name!r} ({spec.meaning}): declared {spec.kind} {spec.dtype}, "
                        f"got {kind} {dtype}" + (f" with shape {tuple(col.shape)}" if kind == "sample" else ""))


def _rows(col: Tensor | Ragged | list) -> int:
    return col.lengths.shape[0] if isinstance(col, Ragged) else len(col)


class Batch:
    """N samples in named columns. A list of tensors given for a column becomes a ragged column;
    pass `Ragged(values, lengths)` directly for a ragged column that may be empty."""

    def __init__(self, columns: dict[str, Any] | None = None):
        self._cols: dict[str, Tensor | Ragged | list] = {}
        self._n: int | None = None
        self._off: dict[str, Tensor] = {}
        for name, value in (columns or {}).items():
            self[name] = value

    # ---- columns -------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._n or 0

    def __contains__(self, name: str) -> bool:
        return name in self._cols

    def keys(self) -> list[str]:
        return list(self._cols)

    def __getitem__(self, name: str) -> Tensor | Ragged | list:
        return self._cols[name]

    def __setitem__(self, name: str, value: Any) -> None:
        col = _column(value)
        _check_declared(name, col)
        if self._n is not None and _rows(col) != self._n and not (len(self._cols) == 1 and name in self._cols):
            raise ValueError(f"column {name!r} has {_rows(col)} rows, the batch has {self._n}")
        self._cols[name] = col
        self._n = _rows(col)
        self._off.pop(name, None)

    def offsets(self, name: str) -> Tensor:
        """[N+1] start offsets of a ragged column's rows in its values (cached)."""
        if name not in self._off:
            self._off[name] = _offsets(self._cols[name].lengths)
        return self._off[name]

    def __repr__(self) -> str:
        def kind(c):
            if isinstance(c, Ragged):
                return f"ragged {str(c.values.dtype)[6:]}"
            return f"{str(c.dtype)[6:]}{list(c.shape)}" if isinstance(c, Tensor) else "list"
        return f"Batch(n={len(self)}, " + ", ".join(f"{k}={kind(c)}" for k, c in self._cols.items()) + ")"

    # ---- row operations ------------------------------------------------------------------
    def _new(self, cols: dict) -> Batch:
        return Batch(cols)

    def select(self, indices: Sequence[int] | Tensor) -> Batch:
        """Rows at `indices` (ints, an int tensor or a bool mask), in that order; repeats allowed."""
        idx = torch.as_tensor(indices, dtype=None if isinstance(indices, Tensor) else torch.long)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        idx = idx.to(torch.long).cpu()
        out: dict[str, Any] = {}
        for name, col in self._cols.items():
            if isinstance(col, Ragged):
                i = idx.to(col.lengths.device)
                lens = col.lengths[i]
                starts = self.offsets(name)[i]
                # flat index of every kept element: row start + position inside the row
                shift = torch.repeat_interleave(starts - (torch.cumsum(lens, 0) - lens), lens)
                flat = shift + torch.arange(shift.shape[0], device=shift.device)
                out[name] = Ragged(col.values[flat], lens)
            elif isinstance(col, Tensor):
                out[name] = col[idx.to(col.device)]
            else:
                out[name] = [col[j] for j in idx.tolist()]
        return self._new(out)

    def _slice(self, a: int, b: int) -> Batch:
        out: dict[str, Any] = {}
        for name, col in self._cols.items():
            if isinstance(col, Ragged):
                off = self.offsets(name)
                out[name] = Ragged(col.values[int(off[a]):int(off[b])], col.lengths[a:b])
            else:
                out[name] = col[a:b]
        return self._new(out)

    def split(self, sizes: Sequence[int]) -> list[Batch]:
        """Consecutive pieces of the given sizes (views where possible); sizes must sum to len(self)."""
        if sum(sizes) != len(self) or any(s < 0 for s in sizes):
            raise ValueError(f"split sizes {list(sizes)} do not add up to {len(self)} rows")
        pieces, a = [], 0
        for s in sizes:
            pieces.append(self._slice(a, a + s))
            a += s
        return pieces

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all batches in order; columns must match."""
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        names = batches[0].keys()
        for b in batches[1:]:
            if b.keys() != names:
                raise ValueError(f"Batch.concat: columns {b.keys()} differ from {names}")
        out: dict[str, Any] = {}
        for name in names:
            cols = [b[name] for b in batches]
            if isinstance(cols[0], Ragged):
                out[name] = Ragged(torch.cat([c.values for c in cols]), torch.cat([c.lengths for c in cols]))
            elif isinstance(cols[0], Tensor):
                out[name] = torch.cat(cols)
            else:
                out[name] = [v for c in cols for v in c]
        return Batch(out)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        def move(c):
            if isinstance(c, Ragged):
                return Ragged(*(t.to(device, non_blocking=non_blocking) for t in c))
            return c.to(device, non_blocking=non_blocking) if isinstance(c, Tensor) else c
        return self._new({k: move(c) for k, c in self._cols.items()})

    def padded(self, name: str, pad_value: float | int | bool = 0, side: str = "right") -> tuple[Tensor, Tensor]:
        """Ragged column as (values [N, Lmax, ...] padded on `side`, bool mask [N, Lmax] of real entries)."""
        col = self._cols[name]
        if not isinstance(col, Ragged):
            raise ValueError(f"padded: column {name!r} is not ragged")
        if side not in ("right", "left"):
            raise ValueError(f"padded: side must be 'right' or 'left', got {side!r}")
        lens = col.lengths
        width = int(lens.max()) if lens.numel() else 0
        pos = torch.arange(width, device=lens.device)[None, :]
        mask = pos < lens[:, None] if side == "right" else pos >= (width - lens)[:, None]
        out = col.values.new_full((lens.shape[0], width, *col.values.shape[1:]), pad_value)
        out[mask] = col.values  # row-major order of the mask matches the flat storage order
        return out, mask

    # ---- plain-dict form (exchange between ranks) --------------------------------------------
    def to_dict(self) -> dict:
        cols = {k: ({"values": c.values, "lengths": c.lengths} if isinstance(c, Ragged) else c)
                for k, c in self._cols.items()}
        return {"size": len(self), "columns": cols}

    @staticmethod
    def from_dict(d: dict) -> Batch:
        cols = {k: (Ragged(c["values"], c["lengths"]) if isinstance(c, dict) else c) for k, c in d["columns"].items()}
        b = Batch(cols)
        if b._n is None:
            b._n = d["size"]
        return b


def ragged_to_right_aligned(batch: Batch, name: str, device) -> Tensor:
    """A per-response-token ragged column as [B, R], right-aligned like the training forward's outputs
    (evenrl.models.forward: each row's response at the right edge, R the longest response)."""
    values, _ = batch.padded(name, 0.0, side="left")
    return values.to(device)


def response_mask(response_len: Tensor, width: int) -> Tensor:
    """[B, width] True on each row's response tokens, right-aligned (the training forward's layout)."""
    return torch.arange(width, device=response_len.device)[None, :] >= (width - response_len)[:, None]
