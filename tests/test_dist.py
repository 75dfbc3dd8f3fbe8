"""evenrl.distributed.collectives on real gloo process groups: the update of one step is the single-device update
on 1..6 ranks.

One spawn per world size (spawning costs seconds); each worker loops over all sample counts and loss modes.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from e2e import free_port, spawn
from evenrl.distributed import collectives as dist
from evenrl.distributed import exchange as exchange_mod
from evenrl.core.aggregation import MODES, aggregate
from test_aggregation import local_counts
from evenrl.core.batch import Batch, Ragged
from evenrl.core.schedule import make_schedule

pytestmark = pytest.mark.slow

# (N samples, M mini-batches, token cap in padded tokens): several micro-batches per rank, uneven shards
CASES = [(1, 1, 96), (2, 2, 96), (5, 1, 64), (7, 2, 64), (512, 2, 320)]
VOCAB = 11
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS")


class TinyPolicy(nn.Module):
    """Per-token log-probs over variable-length sequences (embedding + GRU + head)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, VOCAB)
        self.long_bias = nn.Parameter(torch.zeros(VOCAB))  # in the graph only when a row > 30 tokens is
        self.unused = nn.Linear(2, 2)  # never used: its grad must stay None on every rank

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.gru(self.emb(tokens))[0])
        long = lengths > 30
        if bool(long.any()):  # per row, so the function does not depend on who shares the micro-batch
            logits = logits + self.long_bias * long[:, None, None]
        return torch.log_softmax(logits, -1)


def make_data(n: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 41, (n,), generator=g)
    total = int(lens.sum())
    mask = torch.rand(total, generator=g) < 0.8
    starts = torch.cumsum(lens, 0) - lens
    mask[starts] = False  # first token of each row is "prompt"
    if n > 3:
        mask[starts[3]:starts[3] + lens[3]] = False  # a row without response tokens: not a sequence
    return Batch({
        "sample_index": torch.arange(n),
        "tokens": Ragged(torch.randint(0, VOCAB, (total,), generator=g), lens),
        "targets": Ragged(torch.randint(0, VOCAB, (total,), generator=g), lens.clone()),
        "loss_mask": Ragged(mask, lens.clone()),
        "advantage": torch.randn(n, generator=g),
        "prompt": [f"prompt {i}" for i in range(n)],
    })


def per_token_loss(model: TinyPolicy, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, _ = b.padded("tokens")
    targets, _ = b.padded("targets")
    mask, _ = b.padded("loss_mask", False)
    logp = model(tokens, b["tokens"].lengths).gather(-1, targets[..., None])[..., 0]
    return -b["advantage"][:, None] * logp, mask


def naive_value(x: torch.Tensor, m: torch.Tensor, mode: str) -> torch.Tensor:
    """The mode computed directly over a whole mini-batch on one process."""
    x = torch.where(m, x, 0.0)
    if mode == "token-mean":
        return x.sum() / m.sum()
    if mode == "token-sum-norm":  # no mean over rows; the norm length is Denominators' default, 1
        return x.sum()
    seq = m.sum(-1) > 0
    per_seq = x.sum(-1)[seq] / (m.sum(-1)[seq] if mode == "seq-mean-token-mean" else 1)
    return per_seq.mean()


def fresh_model():
    torch.manual_seed(0)
    model = TinyPolicy()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def grads(model) -> dict:
    return {k: (None if p.grad is None else p.grad.detach().clone()) for k, p in model.named_parameters()}


def params(model) -> dict:
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def reference(n: int, minibatches: int, cap: int, mode: str) -> dict:
    """Single process, whole mini-batch in one forward."""
    data = make_data(n, seed=n)
    sched = make_schedule(data["tokens"].lengths.tolist(), world=1, minibatches=minibatches, token_cap=cap)
    model, opt = fresh_model()
    out = {"rows": [list(mb.rows) for mb in sched.minibatches], "grads": []}
    for mb in sched.minibatches:
        naive_value(*per_token_loss(model, data.select(list(mb.rows))), mode).backward()
        out["grads"].append(grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = params(model)
    return out


def distributed(n: int, minibatches: int, cap: int, mode: str) -> dict:
    """What a trainer rank does: produce some rows, exchange to the scheduled ranks, exact update."""
    W, me = dist.world(), dist.rank()
    data = make_data(n, seed=n)
    produced = data.select([i for i in range(n) if (3 * i + 1) % W == me])  # uneven, often empty
    sched = make_schedule(data["tokens"].lengths.tolist(), world=W, minibatches=minibatches, token_cap=cap)
    owner = {row: r for r in range(W) for row in sched.rank_rows(r)}
    local = dist.exchange(produced, [owner[int(i)] for i in produced["sample_index"]])
    assert local["sample_index"].tolist() == sorted(sched.rank_rows(me))
    pos = {int(s): j for j, s in enumerate(local["sample_index"])}
    model, opt = fresh_model()
    out = {"rows": [list(mb.rows) for mb in sched.minibatches], "grads": [], "micro": []}
    for mb in sched.minibatches:
        assert len({len(p) for p in mb.per_rank}) == 1  # same number of micro-steps on every rank
        micro = [local.select([pos[r] for r in m.rows]) for m in mb.per_rank[me]]
        losses = [per_token_loss(model, b) if len(b) else None for b in micro]
        # the whole mini-batch's counts, from data every rank holds, as the trainer does from the step's lengths
        denom = local_counts([data.select(list(mb.rows)).padded("loss_mask", False)[0]])
        for item in losses:
            if item is not None:  # an empty filler has nothing to forward; its share would be 0
                aggregate(*item, mode, denom).backward()
        dist.all_reduce_grads(model.parameters())
        out["grads"].append(grads(model))
        out["micro"].append(len(micro))
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = params(model)
    return out


def same_batch(a: Batch, b: Batch) -> bool:
    def eq(x, y):
        if isinstance(x, Ragged):
            return isinstance(y, Ragged) and eq(x.values, y.values) and eq(x.lengths, y.lengths)
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        return x == y
    return a.keys() == b.keys() and all(eq(a[k], b[k]) for k in a.keys())


def dest_rows_of(rank: int) -> list[int]:
    """exchange_checks' rows that end on `rank`: rank 1 sends nothing, row 4 is produced by nobody."""
    sent = [i for i in range(10) if i != 4 and i % 3 != 1]
    return [i for i in sent if (i % 2 == 1) == (rank == 0)] if rank < 2 else []


def exchange_checks() -> dict:
    """3 ranks, uneven destinations (rank 2 receives nothing, rank 1 sends nothing); both transports."""
    data = make_data(10, seed=1)
    me = dist.rank()
    produced = data.select([i for i in [9, 0, 4, 7, 2, 5, 8, 1, 3, 6] if i % 3 == me and i != 4])  # 4: nobody
    dest = [0 if int(i) % 2 else 1 for i in produced["sample_index"]]
    if me == 1:
        produced, dest = produced.select([]), []
    out = {"got": dist.exchange(produced, dest).to_dict()}
    parts = produced.select(torch.argsort(torch.tensor(dest, dtype=torch.long), stable=True)).split(
        torch.bincount(torch.tensor(dest, dtype=torch.long), minlength=3).tolist())
    a = Batch.concat(exchange_mod._exchange_all_to_all(parts, produced))
    b = Batch.concat(exchange_mod._exchange_objects(parts, produced))
    out["same_transport"] = same_batch(a, b) and len(a) == len(dest_rows_of(me))
    bad = produced.select([])
    bad["extra"] = torch.zeros(0)  # every rank must notice a column mismatch, not hang
    try:
        dist.exchange(bad if me == 2 else produced, [] if me == 2 else dest)
        out["mismatch_raised"] = False
    except ValueError:
        out["mismatch_raised"] = True
    try:  # a bad destination on one rank fails all ranks
        dist.exchange(produced, [7] * len(produced) if me == 0 else dest)
        out["bad_dest_raised"] = False
    except ValueError:
        out["bad_dest_raised"] = True
    return out


def grads_checks() -> dict:
    """all_reduce_grads in many small buckets, with `extra` tensors, against one plain all_reduce per tensor.
    Integer-valued grads, so the sum is exact whatever order gloo adds in."""
    W, me = dist.world(), dist.rank()
    g = torch.Generator().manual_seed(100 + me)
    shapes = [(5, 3), (3, 5), (7,), (4,), (2,), (6,)]
    ps = [nn.Parameter(torch.zeros(s, dtype=torch.float64 if i == 2 else torch.float32)) for i, s in enumerate(shapes)]
    ps[1] = nn.Parameter(torch.zeros(5, 3).t())  # non-contiguous: its grad must keep the parameter's strides
    ps[5].requires_grad_(False)  # frozen: skipped, grad stays None
    for i, p in enumerate(ps[:5]):
        if i == 3 and me != W - 1:
            continue  # a grad on the last rank only: everyone gets the sum
        if i == 4:
            continue  # a grad on no rank: stays None everywhere
        p.grad = torch.randint(-50, 50, p.shape, generator=g).to(p.dtype)
        if i == 1:
            p.grad = torch.randint(-50, 50, (5, 3), generator=g).float().t()
    want = []
    for i, p in enumerate(ps[:5]):
        t = (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
        dist.all_reduce_sum(t)
        want.append(None if i == 4 else t)
    extra = [torch.arange(4, dtype=torch.float64) + me / 4, torch.tensor([me, 1], dtype=torch.long)]
    dist.all_reduce_grads(ps, bucket_mb=40 / 2**20, extra=extra)  # ~one bucket per parameter
    return {"grads": [p.grad for p in ps], "want": want + [None], "strides": [p.grad.stride() == p.stride()
            for p in ps if p.grad is not None], "extra": extra}


def gather_checks() -> dict:
    """all_gather_tensors: uneven and empty first dimensions, several dtypes, a 0-d tensor; a schema mismatch on
    one rank raises on every rank and leaves the group usable."""
    W, me = dist.world(), dist.rank()
    mine = {"x": torch.arange(me + 1, dtype=torch.float32) * 1.5 + me, "m": torch.ones(me % 2, 2, 3, dtype=torch.bool),
            "n": torch.tensor(me), "i": torch.full((W - me,), -me, dtype=torch.long)}
    out = {"got": dist.all_gather_tensors(mine)}
    bad = dict(mine, x=mine["x"].double()) if me == W - 1 else mine
    try:
        dist.all_gather_tensors(bad)
        out["mismatch_raised"] = False
    except ValueError:
        out["mismatch_raised"] = True
    out["after"] = dist.all_gather_tensors({"y": torch.tensor([me])})
    return out


def exact_checks(sharded: bool) -> dict:
    """train.reproducibility=bitwise's update on this layout: canonical micro-batches (core.canonical), each one's
    gradient into fixed point (ExactGrads, or FSDP2's fixed-point reduce-scatter), statistics in canonical order,
    the fixed-point clip norm, the weights' hash; every number must be the same bits on 1, 2 and 3 ranks. Gradients
    over several scales (a micro-batch's loss x 1e-9 .. 1e3) so that the tensors' top bins move between
    micro-batches."""
    from torch.distributed.fsdp import fully_shard

    from evenrl.core.canonical import canonical_schedule
    from evenrl.distributed import exact, exact_fsdp

    W, me = dist.world(), dist.rank()
    data = make_data(40, seed=5)
    sched = canonical_schedule(data["tokens"].lengths.tolist(), world=W, minibatches=2, token_cap=90)
    model, opt = fresh_model()
    if sharded:
        fully_shard(model, mesh=dist.device_mesh(torch.device("cpu")))
        model.set_gradient_divide_factor(1.0)
        model.set_force_sum_reduction_for_comms(True)
        if W > 1:
            exact_fsdp.install(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    params = [p for p in model.parameters() if p.requires_grad]
    whole = (lambda t: None if t is None else (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone())
    out = {"grads": [], "norms": [], "stats": [], "hashes": []}
    for mb in sched.minibatches:
        denom = local_counts([data.select(list(mb.rows)).padded("loss_mask", False)[0]])
        bins = None if sharded and W > 1 else exact.ExactGrads(params, every=sharded)  # as train.reduction
        keyed = []
        for m in mb.per_rank[me]:
            b = data.select(list(m.rows) or [0])
            x, mask = per_token_loss(model, b)
            scale = 10.0 ** (3 * (m.rows[0] % 5) - 9) if m.rows else 0.0
            (aggregate(x, mask, "token-mean", denom) * scale).backward()
            if bins is not None:
                bins.deposit()
            if m.rows:
                keyed.append((m.rows[0], [float(x.detach()[mask].sum()), float(mask.sum())]))
        out["stats"].append(exact.canonical_sum([k for k, _ in keyed], [v for _, v in keyed], 2))
        if bins is not None:
            bins.reduce()
        else:
            exact_fsdp.finish(model)
        out["norms"].append(exact.clip_grad_norm(params, 1e-6))
        out["grads"].append({k: whole(p.grad) for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["hashes"].append(exact.weights_hash(params))
    out["params"] = {k: whole(p) for k, p in model.named_parameters()}
    return out


def run_all() -> dict:
    out = {f"{n},{m},{mode}": distributed(n, m, cap, mode) for n, m, cap in CASES for mode in MODES}
    out["exact"] = exact_checks(sharded=False)
    out["exact_fsdp"] = exact_checks(sharded=True)
    if dist.world() == 3:
        out["exchange"] = exchange_checks()
    if dist.world() > 1:
        out["grads_checks"] = grads_checks()
        out["gather_checks"] = gather_checks()
    return out


def _worker(rank: int, world: int, port: int, path: str) -> None:
    torch.set_num_threads(1)
    for k in ENV_KEYS:
        os.environ.pop(k, None)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    mesh = dist.init(timeout=60)
    assert (mesh.info.rank, mesh.info.world, mesh.info.backend) == (rank, world, "gloo")
    result = run_all()
    dist.shutdown()
    torch.save(result, f"{path}.{rank}")
    os._exit(0)  # saved; Python's finalization of torch's modules would cost each rank ~0.5 s of CPU, spawn waits


_RESULTS: dict[int, list[dict]] = {}
_REFERENCE: dict[str, dict] = {}


def results(world: int, tmp_path_factory) -> list[dict]:
    if world not in _RESULTS:
        path = str(tmp_path_factory.mktemp(f"w{world}") / "out")
        spawn(_worker, args=(world, free_port(), path), nprocs=world)
        _RESULTS[world] = [torch.load(f"{path}.{r}", weights_only=True) for r in range(world)]
    return _RESULTS[world]


def close(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    d = float((a - b).abs().max())
    return d <= 1e-6 or d <= 1e-5 * float(b.abs().max())


def check_against_reference(per_rank: list[dict]) -> None:
    for n, m, cap in CASES:
        for mode in MODES:
            key = f"{n},{m},{mode}"
            if key not in _REFERENCE:
                _REFERENCE[key] = reference(n, m, cap, mode)
            ref = _REFERENCE[key]
            for r, res in enumerate(per_rank):
                got = res[key]
                assert got["rows"] == ref["rows"], f"{key}: mini-batch rows depend on world"
                for step, (g, h) in enumerate(zip(got["grads"], ref["grads"])):
                    bad = [k for k in h if not close(g[k], h[k])]
                    assert not bad, f"{key} rank {r} mini-batch {step}: grads differ in {bad}"
                bad = [k for k in ref["params"] if not close(got["params"][k], ref["params"][k])]
                assert not bad, f"{key} rank {r}: params after the update differ in {bad}"
                assert got["grads"][-1]["unused.weight"] is None and ref["grads"][-1]["unused.weight"] is None


def test_world_one_without_env_has_no_process_group(monkeypatch):
    for k in ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mesh = dist.init()
        assert (mesh.info.world, mesh.info.rank, mesh.info.backend, mesh.device) == (1, 0, None, torch.device("cpu"))
        assert dist.init() is mesh and not tdist.is_initialized()
        assert dist.all_gather_object("x") == ["x"] and float(dist.all_reduce_sum(torch.ones(1))) == 1.0
        cols = {"a": torch.arange(3)}
        assert dist.all_gather_tensors(cols) == [cols]
        p, extra = nn.Parameter(torch.ones(2)), torch.ones(2)
        p.grad = torch.full((2,), 3.0)
        dist.all_reduce_grads([p], extra=[extra])  # one rank: nothing to sum, nothing touched
        assert p.grad.tolist() == [3.0, 3.0] and extra.tolist() == [1.0, 1.0]
        b = make_data(4, 0).select([2, 0, 3])
        assert dist.exchange(b, [0, 0, 0])["sample_index"].tolist() == [0, 2, 3]
        with pytest.raises(ValueError):
            dist.exchange(b, [0, 1, 0])
        result = run_all()
        check_against_reference([result])
        _EXACT_ONE.update(exact=result["exact"], exact_fsdp=result["exact_fsdp"])
    finally:
        dist.shutdown()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("world", [2, 3, *(pytest.param(w, marks=pytest.mark.large_world) for w in (4, 6))])
def test_update_equals_single_device(world, tmp_path_factory):
    per_rank = results(world, tmp_path_factory)
    check_against_reference(per_rank)
    # ranks holding no rows of a mini-batch still ran the same micro-steps (N=1 and 2 leave most ranks empty)
    assert len({tuple(res["1,1,token-mean"]["micro"]) for res in per_rank}) == 1


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_grads_buckets_and_extra(world, tmp_path_factory):
    for res in results(world, tmp_path_factory):
        got = res["grads_checks"]
        for g, w in zip(got["grads"], got["want"]):
            assert (g is None and w is None) or (g is not None and w is not None and torch.equal(g, w))
        assert len(got["strides"]) == 4 and all(got["strides"])
        assert torch.equal(got["extra"][0], sum(torch.arange(4, dtype=torch.float64) + r / 4 for r in range(world)))
        assert got["extra"][1].tolist() == [sum(range(world)), world]


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_tensors(world, tmp_path_factory):
    for res in results(world, tmp_path_factory):
        got = res["gather_checks"]
        assert [p["y"].tolist() for p in got["after"]] == [[r] for r in range(world)] and got["mismatch_raised"]
        for r, part in enumerate(got["got"]):
            assert torch.equal(part["x"], torch.arange(r + 1, dtype=torch.float32) * 1.5 + r)
            assert part["m"].shape == (r % 2, 2, 3) and part["m"].dtype == torch.bool and bool(part["m"].all())
            assert part["n"].shape == () and int(part["n"]) == r
            assert torch.equal(part["i"], torch.full((world - r,), -r, dtype=torch.long))


def test_exchange_on_three_ranks(tmp_path_factory):
    per_rank = [res["exchange"] for res in results(3, tmp_path_factory)]
    data = make_data(10, seed=1)
    assert [len(dest_rows_of(r)) for r in range(3)] == [3, 4, 0]
    for r, res in enumerate(per_rank):
        assert same_batch(Batch.from_dict(res["got"]), data.select(dest_rows_of(r)))  # ascending sample_index
        assert res["same_transport"] and res["mismatch_raised"] and res["bad_dest_raised"]


_EXACT_ONE: dict = {}  # one process's exact_checks, from test_world_one_without_env_has_no_process_group


def same_bits(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("world", [2, 3])
def test_bitwise_update_is_the_same_bits_on_any_world(world, tmp_path_factory):
    """bitwise (distributed.exact): gradients, clip norm, statistics, hashes and the parameters after the AdamW
    steps are identical on 1, 2 and 3 ranks, replicated or FSDP2 (its reduce-scatter in fixed point), and FSDP2 is
    the replicated result itself, but for the parameter no forward uses (FSDP2 reduces every trainable parameter,
    so it gets zeros and AdamW's weight decay where replicated it keeps grad None)."""
    if not _EXACT_ONE:
        test_world_one_without_env_has_no_process_group(pytest.MonkeyPatch())
    one = _EXACT_ONE["exact"]
    assert len(set(one["hashes"])) == 2 and min(one["norms"]) > 1e-6  # the hash moved; the clip cut
    for r, res in enumerate(results(world, tmp_path_factory)):
        for name in ("exact", "exact_fsdp"):
            for key in ("grads", "norms", "stats", "hashes", "params"):
                assert same_bits(res[name][key], _EXACT_ONE[name][key]), (world, r, name, key)
    fsdp = _EXACT_ONE["exact_fsdp"]
    used = [k for k in one["params"] if not k.startswith("unused")]
    assert all(torch.equal(one["params"][k], fsdp["params"][k]) for k in used)
    assert one["norms"] == fsdp["norms"] and one["stats"] == fsdp["stats"]
    assert one["grads"][0]["unused.weight"] is None and torch.equal(fsdp["grads"][0]["unused.weight"],
                                                                   torch.zeros(2, 2))


def test_fixed_point_sum_ignores_grouping_and_order():
    """ExactGrads' bins, without processes: the same terms cut into ranks and micro-batches in several ways, in
    several orders, with top bins that move (terms from 1e-30 to 1e30, zeros, one tensor all zero), give the same
    bits; and they are the float sum to 2^-32 of the largest term."""
    from evenrl.distributed.exact import ExactGrads, combine, realign

    g = torch.Generator().manual_seed(3)
    terms = [torch.randn(7, generator=g) * 10.0 ** float(torch.randint(-30, 31, (), generator=g)) for _ in range(12)]
    terms[4] = torch.zeros(7)

    def summed(groups):
        ranks = []
        for group in groups:
            p = nn.Parameter(torch.zeros(7))
            bins = ExactGrads([p])
            for i in group:
                p.grad = terms[i].clone()
                bins.deposit()
            ranks.append(bins)
        top = max(b.tops[0] for b in ranks)
        hi, lo = torch.zeros(7, dtype=torch.float64), torch.zeros(7, dtype=torch.float64)
        for b in ranks:
            if b.buf is not None:
                h, l_ = b._bins(0)
                realign(h, l_, b.tops[0], top)
                hi, lo = hi + h, lo + l_
        return combine(hi, lo, top).float()

    want = summed([list(range(12))])
    for groups in ([[11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0]], [[0, 5, 9], [1, 2, 3, 4], [6, 7, 8, 10, 11]],
                   [[i] for i in range(12)], [[3, 1], [0, 2, 11, 4], [10, 9, 8, 7, 6, 5]]):
        assert torch.equal(summed(groups), want), groups
    exact_sum = torch.stack([t.double() for t in terms]).sum(0)
    largest = max(float(t.abs().max()) for t in terms)
    assert float((want.double() - exact_sum).abs().max()) <= 2 ** -23 * largest + 12 * 2 ** -32 * largest


def test_naive_per_rank_mean_is_not_the_single_device_gradient():
    """The check above can fail: averaging each rank's own token-mean (DDP-style) on an uneven 2-way split."""
    data = make_data(7, seed=7)
    model, _ = fresh_model()
    naive_value(*per_token_loss(model, data), "token-mean").backward()
    want = grads(model)
    model, _ = fresh_model()
    for rows in ([0, 1, 2, 3], [4, 5, 6]):
        (naive_value(*per_token_loss(model, data.select(rows)), "token-mean") / 2).backward()
    assert not all(close(g, want[k]) for k, g in grads(model).items() if g is not None)


def test_init_joins_no_group_unless_launched_as_a_rank(monkeypatch):
    """A shell in a Slurm allocation (no SLURM_PROCID) reads the allocation's 4 tasks but is not one of them:
    init runs it as one process instead of waiting for 3 ranks that never come."""
    for k in ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    try:
        mesh = dist.init()
        assert (mesh.info.world, mesh.info.rank, mesh.info.backend) == (1, 0, None) and not tdist.is_initialized()
    finally:
        dist.shutdown()
