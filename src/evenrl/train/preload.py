"""What the launcher's fork server imports once before it forks the workers (evenrl.train.launch): the training
loop with torch, and transformers' model classes for the common families, which transformers imports lazily on the
first `AutoModelForCausalLM.from_pretrained` (~1 s of a core). Another family is imported by the worker that
loads it. Its standard streams are guarded first (evenrl.train.stdio), so that the loggers these imports make, which
the workers inherit, write through the guard."""

import atexit
import os

from evenrl.train import stdio

stdio.install()

try:
    import transformers
    from transformers.models.llama import modeling_llama  # noqa: F401
    from transformers.models.qwen2 import modeling_qwen2  # noqa: F401

    import evenrl.train.loop  # noqa: F401

    transformers.AutoModelForCausalLM, transformers.AutoTokenizer  # noqa: B018  (resolves the lazy modules)
except Exception:  # noqa: BLE001
    # multiprocessing's fork server dies on any error but ImportError in a preload, and every worker with it; a
    # worker imports what it needs itself and reports its own error
    pass


_SERVER = os.getpid()


def _exit_without_finalization() -> None:
    """The fork server exits when its launcher does (the last holder of its alive pipe), and only then do its
    workers get their parent-death SIGTERM (evenrl.train.launch): Python's finalization of torch and transformers
    (2-5 s of a core, far longer on a loaded machine: 35 s measured, in which the workers trained 58 more steps
    unsupervised) is skipped. Registered last, so run first; in the server only, not in a worker it forked."""
    if os.getpid() == _SERVER:
        os._exit(0)


atexit.register(_exit_without_finalization)


import traceback  # noqa: E402
from multiprocessing import spawn as _spawn  # noqa: E402

_run_worker = _spawn._main


def _worker_main(fd: int, parent_sentinel: int):
    """A worker the server forks just as its launcher exits (a Ctrl-C while the workers start) unpickles its process
    object after the launcher unlinked the semaphores in it: SemLock's FileNotFoundError, whose traceback would be
    printed beside the launcher's one line. Nothing is left to run for it: exit 1 quietly. Any other error, and this
    one raised anywhere else, is the worker's own (a worker's own code runs inside _bootstrap, which catches it)."""
    try:
        return _run_worker(fd, parent_sentinel)
    except FileNotFoundError as e:
        raised = traceback.extract_tb(e.__traceback__)[-1]
        if raised.name == "__setstate__" and raised.filename.endswith("synchronize.py"):
            os._exit(1)
        raise


_spawn._main = _worker_main
