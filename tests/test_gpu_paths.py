"""Code paths that only CUDA runs take, checked on a CPU-only machine with stand-ins. The real thing ran on an H100
(benchmarks/gpu.py; docs/performance.md, "GPU (one H100)"): FSDP2 with parallel.cpu_offload=full failed there at the
first log-prob pass before these fixes."""

import types

import torch

from evenrl.models.loading import compute_device


class _Model(torch.nn.Module):
    def __init__(self, param):
        super().__init__()
        self._p = param

    def parameters(self, recurse=True):
        yield self._p


def test_compute_device_is_the_parameters_device_without_offload():
    model = torch.nn.Linear(2, 2)
    assert compute_device(model) == torch.device("cpu")


def test_compute_device_under_cpu_offload_is_the_mesh_accelerator(monkeypatch):
    # FSDP2's CPU offload: a sharded parameter (a DTensor) whose local shard lives on the host while its mesh, and
    # every forward, is on the accelerator; model.device would say "cpu" and the targets would stay on the host
    offloaded = types.SimpleNamespace(device=torch.device("cpu"), device_mesh=types.SimpleNamespace(device_type="cuda"))
    monkeypatch.setattr(torch, "get_device_module", lambda kind: types.SimpleNamespace(current_device=lambda: 3))
    assert compute_device(_Model(offloaded)) == torch.device("cuda", 3)


def test_compute_device_of_a_sharded_parameter_on_its_own_device():
    on_cpu_mesh = types.SimpleNamespace(device=torch.device("cpu"), device_mesh=types.SimpleNamespace(device_type="cpu"))
    assert compute_device(_Model(on_cpu_mesh)) == torch.device("cpu")
