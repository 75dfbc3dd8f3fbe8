"""`Batch`: the per-sample container that moves from rollout to exchange to the update.

Three kinds of column, all with one entry per sample (row):
  * fixed:  a tensor [N, ...]                       (rewards, advantages, sample_index)
  * ragged: `Ragged(values [sum(L), ...], lengths [N])`, pad-free (tokens, log-probs, loss masks)
  * list:   a Python list of N objects               (prompt text, answers, ids, group ids)
plus `meta`, a step-level dict that is not indexed by row.

Why not tensordict (0.15): ragged columns there are lazy stacks or jagged nested tensors whose API is still
moving, strings live in NonTensorStack wrappers, and its own save format is memmap/pickle rather than a
plain dict that `torch.load(weights_only=True)` accepts; it also tests only against the newest torch.
What evenrl needs (select/split/concat/padded/to_dict on three column kinds) is the ~150 lines below.

`to_dict()` holds only tensors, lists, dicts, str, int, float, bool and None *provided list columns and meta
hold only those*, so `torch.save` / `torch.load(weights_only=True)` work on it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch
from torch import Tensor

SAMPLE_INDEX = "sample_index"  # int64 fixed column: a row's global index; exchange() sorts by it.


class Ragged(NamedTuple):
    values: Tensor   # [sum(lengths), ...] rows stored back to back
    lengths: Tensor  # [N] int64, on the same device as values


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
            raise ValueError("a fixed column needs a leading row dimension; put scalars in meta")
        return value
    value = list(value)
    if value and all(isinstance(v, Tensor) for v in value):  # a list of per-row tensors -> ragged
        lengths = torch.tensor([v.shape[0] for v in value], dtype=torch.long, device=value[0].device)
        return Ragged(torch.cat(value), lengths)
    return value


def _rows(col: Tensor | Ragged | list) -> int:
    return col.lengths.shape[0] if isinstance(col, Ragged) else len(col)


class Batch:
    """N samples in named columns. A list of tensors given for a column becomes a ragged column;
    pass `Ragged(values, lengths)` directly for a ragged column that may be empty."""

    def __init__(self, columns: dict[str, Any] | None = None, meta: dict | None = None):
        self._cols: dict[str, Tensor | Ragged | list] = {}
        self._n: int | None = None
        self._off: dict[str, Tensor] = {}
        self.meta: dict = dict(meta or {})
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

    def row(self, i: int) -> dict[str, Any]:
        """Row i as {name: value}; a ragged value is a view [L_i, ...] into the flat storage."""
        out = {}
        for name, col in self._cols.items():
            if isinstance(col, Ragged):
                off = self.offsets(name)
                out[name] = col.values[int(off[i]):int(off[i + 1])]
            else:
                out[name] = col[i]
        return out

    def __repr__(self) -> str:
        def kind(c):
            if isinstance(c, Ragged):
                return f"ragged {str(c.values.dtype)[6:]}"
            return f"{str(c.dtype)[6:]}{list(c.shape)}" if isinstance(c, Tensor) else "list"
        return f"Batch(n={len(self)}, " + ", ".join(f"{k}={kind(c)}" for k, c in self._cols.items()) + ")"

    # ---- row operations ------------------------------------------------------------------
    def _new(self, cols: dict) -> Batch:
        return Batch(cols, self.meta)

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
        """Rows of all batches in order; columns must match; meta is taken from the first."""
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
        return Batch(out, batches[0].meta)

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

    # ---- plain-dict form (exchange, checkpoints) ---------------------------------------------
    def to_dict(self) -> dict:
        cols = {k: ({"values": c.values, "lengths": c.lengths} if isinstance(c, Ragged) else c)
                for k, c in self._cols.items()}
        return {"size": len(self), "columns": cols, "meta": dict(self.meta)}

    @staticmethod
    def from_dict(d: dict) -> Batch:
        cols = {k: (Ragged(c["values"], c["lengths"]) if isinstance(c, dict) else c) for k, c in d["columns"].items()}
        b = Batch(cols, d.get("meta"))
        if b._n is None:
            b._n = d["size"]
        return b
