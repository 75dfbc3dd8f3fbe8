"""What travels between the trainers and reserved rollout ranks (`--rollout-devices R`): weights from trainer 0 to
the rollout ranks over the push group (`push_weights`; `WeightSender` runs it in the background from a host copy,
`WeightReceiver` receives on a thread), and samples from the rollout ranks to each trainer, point to point
(`send_rollouts` / `receive_rollouts`), so a rollout rank runs ahead without waiting for anyone."""

from __future__ import annotations

import pickle
import queue
import threading
import time
from typing import Iterable, Iterator

import torch
import torch.distributed as tdist

from evenrl.distributed.mesh import G, comm_device, rank, rollout_ranks
from evenrl.distributed.guard import guard, whereabouts
from evenrl.errors import RunStopped

def push_weights(buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The weight push to the rollout ranks, bucket by bucket over the push group (gloo on CPU, NCCL on GPU), each
    bucket one broadcast per dtype from trainer 0. Trainer 0 passes the weights to send; other trainers pass the
    weights and send nothing (a sharded model's gathers still need them); a rollout rank receives with
    `WeightReceiver`. Yields each bucket once it is sent. A rollout rank that stopped fails this within the
    collective timeout, in one line naming where each rank was (RunStopped), instead of hanging a broadcast."""
    for bucket in buckets:
        if rank() == 0 and G.push is not None:
            with guard("weight push"):
                for dtype in dict.fromkeys(t.dtype for _, t in bucket):
                    flat = torch.cat([t.reshape(-1) for _, t in bucket if t.dtype == dtype]).to(comm_device())
                    tdist.broadcast(flat, src=0, group=G.push)
        yield bucket


class WeightSender:
    """Trainer 0's end of the push when generation runs ahead of training (rollout.max_staleness >= 1): `send`
    copies a version's buckets to host memory, then a thread broadcasts them while the trainers go on with the
    step. The copy fixes the version (the update that follows cannot change what is sent), so the push costs the
    trainers a copy instead of the broadcast. At most one push is in flight (`send` waits for the one before):
    memory for one copy of the weights in host RAM on trainer 0. A failed broadcast stops the run at the next
    `send` or `wait`, in one line."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> list[list[tuple[str, torch.Tensor]]]:
        """Start pushing `buckets` (consumed here, so a sharded model's gathers happen now, on every trainer);
        returns the host copy."""
        self.wait()
        staged = [[(name, t.to("cpu", copy=True)) for name, t in bucket] for bucket in buckets]
        self.thread = threading.Thread(target=self._run, args=(staged,), name="evenrl-weight-sender", daemon=True)
        self.thread.start()
        return staged

    def _run(self, staged) -> None:
        try:
            for _ in push_weights(staged):
                pass
        except BaseException as e:  # raised by the main thread in wait()
            self.error = e

    def wait(self) -> None:
        """The push in flight, if any, done (or its failure raised here)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            if isinstance(error, RunStopped):
                raise error
            raise RunStopped(f"rank {rank()}: weight push failed ({_last(error)})")


def _last(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:160]


class WeightReceiver:
    """A rollout rank's end of `push_weights`: a thread that receives each push as soon as trainer 0 sends it, into
    fresh buffers, and queues it, while this rank keeps generating with the weights it has. So the trainer never
    waits for a busy rollout rank, and a rank generating step t+k holds the pushes meant for later steps until it
    gets there (at most rollout.max_staleness of them, the memory it costs).

    layout: the push's buckets as [(name, shape, dtype)], the order and bucket size push_weights sends (the
    rollout rank's own copy's full_weights). count: how many pushes the run makes."""

    def __init__(self, layout: list[list[tuple[str, torch.Size, torch.dtype]]], count: int):
        self.layout, self.count = layout, count
        self.device = comm_device()  # here: the CUDA device is per thread, and the receiver's starts at cuda:0
        self.ready: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="evenrl-weight-receiver", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        dev = self.device
        try:
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            for _ in range(self.count):
                buckets = []
                for spec in self.layout:
                    bucket = [(name, torch.empty(shape, dtype=dtype)) for name, shape, dtype in spec]
                    for dtype in dict.fromkeys(t.dtype for _, t in bucket):
                        ts = [t for _, t in bucket if t.dtype == dtype]
                        flat = torch.empty(sum(t.numel() for t in ts), dtype=dtype, device=dev)
                        tdist.broadcast(flat, src=0, group=G.push)
                        flat = flat.cpu()
                        at = 0
                        for t in ts:
                            t.copy_(flat[at:at + t.numel()].view(t.shape))
                            at += t.numel()
                    buckets.append(bucket)
                self.ready.put(buckets)
        except BaseException as e:  # handed to the main thread, which raises it in its own phase
            self.ready.put(e)

    def next(self) -> list[list[tuple[str, torch.Tensor]]]:
        """The next push's buckets (on the CPU), waiting for it within the collective timeout."""
        t0 = time.monotonic()
        try:
            got = self.ready.get(timeout=G.wait.total_seconds())
        except queue.Empty:
            got = RuntimeError("no weights arrived")
        if isinstance(got, BaseException):
            raise RunStopped(f"rank {rank()} in {G.phase}: weight push failed after {time.monotonic() - t0:.0f} s "
                             f"({_last(got)}); {whereabouts()}")
        return got

    def join(self) -> None:
        self.thread.join()


def send_rollouts(step: int, version: int, per_trainer: list[list]) -> None:
    """A rollout rank sends each trainer its share of this rank's samples of `step` (made by the policy after step
    `version`), point to point, without waiting for the trainers to take them: they arrive when the trainers reach
    that step. The payload is pickled completions (this job's own ranks, like all_gather_object)."""
    done = [(w, b) for w, b in G.sending if w.is_completed()]
    for item in done:
        G.sending.remove(item)
    with guard("send of rollouts"):
        for trainer, completions in enumerate(per_trainer):
            blob = torch.frombuffer(bytearray(pickle.dumps((step, version, completions))), dtype=torch.uint8)
            head = torch.tensor([blob.numel()], dtype=torch.long)
            for t in (head, blob):
                G.sending.append((tdist.isend(t, dst=trainer, group=G.samples), t))


def receive_rollouts(step: int) -> list[tuple[int, list]]:
    """A trainer's share of `step`'s samples from each rollout rank, in rank order: [(version, completions)].
    A rollout rank that stopped fails this within the collective timeout, in one line (RunStopped)."""
    out = []
    with guard("receive of rollouts"):
        for src in rollout_ranks():
            head = torch.empty(1, dtype=torch.long)
            tdist.irecv(head, src=src, group=G.samples).wait(G.wait)
            blob = torch.empty(int(head), dtype=torch.uint8)
            tdist.irecv(blob, src=src, group=G.samples).wait(G.wait)
            sent_step, version, completions = pickle.loads(blob.numpy().tobytes())
            if sent_step != step:
                raise RunStopped(f"rank {rank()}: rollout rank {src} sent the samples of step {sent_step} where "
                                 f"step {step} was due")
            out.append((version, completions))
    return out


def finish_sends() -> None:
    """A rollout rank's last sends taken by the trainers (their buffers must live until then)."""
    with guard("send of rollouts"):
        for work, _ in G.sending:
            work.wait(G.wait)
    G.sending.clear()
