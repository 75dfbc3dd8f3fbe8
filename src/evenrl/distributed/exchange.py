"""Moving a step's rows to the ranks that train them: `exchange`, two all_to_all_single calls carrying a Batch's
columns as bytes, with every rank's arguments checked on all ranks before any data moves."""

from __future__ import annotations

import pickle
import zlib
from typing import Any, Sequence

import torch
import torch.distributed as tdist

from evenrl.core.batch import SAMPLE_INDEX, Batch, Ragged
from evenrl.distributed.mesh import G, comm_device, rank, world
from evenrl.distributed.guard import guard
from evenrl.distributed.ops import all_gather_object

def _pieces(b: Batch) -> list[torch.Tensor]:
    out = []
    for name in b.keys():
        col = b[name]
        if isinstance(col, Ragged):
            out += [col.values, col.lengths]
        elif isinstance(col, torch.Tensor):
            out.append(col)
    return out


def _schema(b: Batch) -> tuple[list, int]:
    shapes = [(t.dtype, tuple(t.shape[1:]), t.device) for t in _pieces(b)]
    text = repr([(n, type(b[n]).__name__) for n in b.keys()] + [(str(d), s) for d, s, _ in shapes])
    return shapes, zlib.crc32(text.encode()) & 0x7FFFFFFF


def _rebuild(template: Batch, tensors: list[torch.Tensor], lists: dict) -> Batch:
    cols: dict[str, Any] = {}
    it = iter(tensors)
    for name in template.keys():
        col = template[name]
        if isinstance(col, Ragged):
            cols[name] = Ragged(next(it), next(it))
        elif isinstance(col, torch.Tensor):
            cols[name] = next(it)
        else:
            cols[name] = lists[name]
    return Batch(cols)


def _pack(p: Batch, dev: torch.device) -> torch.Tensor:
    """One destination's rows as self-describing bytes: int64 (rows of each piece, length of the pickled list
    columns), then the pieces' bytes, then the pickle. The receiver reads the counts with its own schema, which
    the header collective has checked to be the sender's."""
    pieces = [t.contiguous().reshape(-1).view(torch.uint8) for t in _pieces(p)]
    lists = {n: p[n] for n in p.keys() if isinstance(p[n], list)}
    blob = pickle.dumps(lists) if lists else b""
    counts = torch.tensor([t.shape[0] for t in _pieces(p)] + [len(blob)], dtype=torch.long)
    if blob:
        pieces.append(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    return torch.cat([x.to(dev) for x in [counts.view(torch.uint8), *pieces]])


def _unpack(chunk: torch.Tensor, template: Batch, shapes: list) -> Batch:
    at = 8 * (len(shapes) + 1)
    h = chunk[:at].clone().view(torch.long).tolist()  # clone: view(dtype) needs an aligned offset
    tensors = []
    for n, (dtype, shape, device) in zip(h[:-1], shapes):
        size = n * torch.Size(shape).numel() * dtype.itemsize
        piece = chunk[at:at + size].clone()  # clone: view(dtype) needs an aligned offset
        tensors.append(piece.view(dtype).reshape(n, *shape).to(device))
        at += size
    lists = pickle.loads(chunk[at:at + h[-1]].cpu().numpy().tobytes()) if h[-1] else {}
    return _rebuild(template, tensors, lists)


def _exchange_all_to_all(parts: list[Batch] | None, template: Batch, problem: str | None = None) -> list[Batch]:
    """Two all_to_all_single calls. First 3 int64 per pair of ranks: the sender's schema fingerprint, whether its
    arguments were bad (`problem`; then parts is None and it sends nothing), and how many bytes follow. Every rank
    sees every other rank's fingerprint and flag, so a mistake anywhere raises ValueError on every rank before any
    data moves, and this check costs no collective of its own.
    Then all rows at once, each part with its own row counts in front (see _pack)."""
    W, dev = world(), comm_device()
    shapes, fingerprint = _schema(template)
    empty = torch.zeros(0, dtype=torch.uint8, device=dev)
    sends = [_pack(p, dev) for p in parts] if parts is not None and problem is None else [empty] * W
    head = torch.tensor([[fingerprint, problem is not None, x.numel()] for x in sends], dtype=torch.long, device=dev)
    got = torch.empty_like(head)
    tdist.all_to_all_single(got, head, group=G.trainers)
    got = got.tolist()
    if problem:
        raise ValueError(problem)
    if any(g[1] for g in got):
        raise ValueError("exchange: another rank passed bad arguments (see its error)")
    if any(g[0] != fingerprint for g in got):
        raise ValueError(_SCHEMA_MISMATCH)
    sizes = [g[2] for g in got]
    recv = torch.empty(sum(sizes), dtype=torch.uint8, device=dev)
    tdist.all_to_all_single(recv, torch.cat(sends), sizes, [x.numel() for x in sends], group=G.trainers)
    return [_unpack(chunk, template, shapes) for chunk in recv.split(sizes)]


_SCHEMA_MISMATCH = ("exchange: ranks hold batches with different columns/dtypes; give a rank without rows an empty "
                    "batch with the same columns, e.g. batch.select([])")


def _exchange_objects(parts: list[Batch], template: Batch) -> list[Batch]:
    """Fallback for backends without all_to_all: every rank receives everything and keeps its share."""
    gathered = all_gather_object([p.to("cpu").to_dict() for p in parts])
    out = []
    for g in gathered:
        b = Batch.from_dict(g[rank()])
        cols: dict[str, Any] = {}
        for n in b.keys():
            c, t = b[n], template[n]
            if isinstance(c, Ragged):
                c = Ragged(c.values.to(t.values.device), c.lengths.to(t.lengths.device))
            elif isinstance(c, torch.Tensor):
                c = c.to(t.device)
            cols[n] = c
        out.append(Batch(cols))
    return out


def exchange(local: Batch, dest: Sequence[int], *, key: str = SAMPLE_INDEX) -> Batch:
    """Send local row i to rank dest[i]; return the rows this rank received, sorted by the int column `key`.

    Every rank must call it (a rank with no rows passes an empty batch with the same columns). Arguments and
    columns are checked on all ranks first (a mismatch raises ValueError everywhere). gloo/NCCL/MPI: two
    all_to_all_single, the first of which also carries that check (each row crosses the network once; measured
    4-12x faster than all_gather_object on gloo, 3 ranks). Other backends: an all-reduce for the check, then
    all_gather_object.
    """
    W = world()
    d = torch.as_tensor(list(dest), dtype=torch.long)
    problem = None
    if len(d) != len(local):
        problem = f"exchange: {len(d)} destinations for {len(local)} rows"
    elif key not in local:
        problem = f"exchange: the batch has no {key!r} column to order rows by"
    elif d.numel() and (int(d.min()) < 0 or int(d.max()) >= W):
        problem = f"exchange: destinations must be ranks 0..{W - 1}"
    parts = None
    if problem is None and W > 1:
        order = torch.argsort(d, stable=True)
        parts = local.select(order).split(torch.bincount(d, minlength=W).tolist())
    if W == 1:
        if problem:
            raise ValueError(problem)
        return local.select(torch.argsort(local[key].cpu(), stable=True))
    with guard("exchange"):
        if any(b in str(tdist.get_backend()) for b in ("gloo", "nccl", "mpi")):
            received = Batch.concat(_exchange_all_to_all(parts, local, problem))  # agrees on arguments first
        else:  # agree first, so a mistake on one rank fails every rank instead of hanging the others
            fingerprint = _schema(local)[1]
            check = torch.tensor([fingerprint, -fingerprint, problem is not None], dtype=torch.long,
                                 device=comm_device())
            tdist.all_reduce(check, op=tdist.ReduceOp.MAX, group=G.trainers)
            if problem is None and check[2]:
                problem = "exchange: another rank passed bad arguments (see its error)"
            elif problem is None and check.tolist()[:2] != [fingerprint, -fingerprint]:
                problem = _SCHEMA_MISMATCH
            if problem:
                raise ValueError(problem)
            received = Batch.concat(_exchange_objects(parts, local))
    return received.select(torch.argsort(received[key].cpu(), stable=True))
