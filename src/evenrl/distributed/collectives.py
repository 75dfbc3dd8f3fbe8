"""Every collective evenrl makes, by name: what the trainer calls as `dist.<name>` (`from evenrl.distributed import
collectives as dist`). The work is done by one module per job:

  mesh          who this process is and every process group: the one mesh (`Mesh`, built by from_config or init
                and handed to whoever needs a group or a size; its answers by name: rank, world, roles, the
                DeviceMeshes of FSDP2 and DTensor (device_mesh, expert_mesh), the sequence-parallel group,
                data_parallel, replica_size, and a group per dimension: group(dim), size(dim); mesh_shape has its
                sizes without torch)
  guard         a failed collective as one line naming every rank's phase (mark, guard)
  ops           barriers, sums, gathers and the gradient all-reduce of the trainers; every rank's device
  exchange      a step's rows moved to the ranks that train them
  rollout_link  weights to and samples from reserved rollout ranks

One code path for 1 and N ranks: with one process there is no process group and every collective is the identity
(or a local select), so callers never branch on the world size.
"""

from evenrl.distributed.exchange import exchange
from evenrl.distributed.mesh import (DistInfo, Mesh, before_shutdown, capacity, check_engine_blocks, coords,
                                     counts_rows, data_parallel, device_mesh, expert_mesh, from_config, group, init,
                                     is_main, is_rollout_rank, per_trainer, rank, replica_size, rollout_ranks,
                                     rollout_unit, sequence_group, shape, shutdown, size, trainer_group, unit_weights,
                                     world)
from evenrl.distributed.guard import guard, mark
from evenrl.distributed.ops import (all_gather_object, all_gather_tensors, all_reduce_grads, all_reduce_sum, barrier,
                                    barrier_all, broadcast_object, clip_grad_norm, gather_devices)
from evenrl.distributed.rollout_link import (WeightReceiver, WeightSender, finish_sends, push_weights,
                                             receive_rollouts, send_rollouts)

__all__ = ["all_gather_object", "all_gather_tensors", "all_reduce_grads", "all_reduce_sum", "barrier", "barrier_all",
           "before_shutdown", "broadcast_object", "capacity", "check_engine_blocks", "clip_grad_norm", "coords",
           "counts_rows", "data_parallel", "device_mesh", "DistInfo", "exchange", "expert_mesh", "finish_sends",
           "from_config", "gather_devices", "group", "guard", "init", "is_main", "is_rollout_rank", "mark", "Mesh",
           "per_trainer", "push_weights", "rank", "receive_rollouts", "replica_size", "rollout_ranks", "rollout_unit",
           "send_rollouts", "sequence_group", "shape", "shutdown", "size", "trainer_group", "unit_weights",
           "WeightReceiver", "WeightSender", "world"]
