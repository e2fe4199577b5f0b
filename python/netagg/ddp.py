"""A DistributedDataParallel communication hook that reduces gradients through netagg.

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    import netagg
    from netagg.ddp import NetaggState, allreduce_hook

    dist.init_process_group("gloo")        # DDP still wants a group for its setup
    model = DistributedDataParallel(model)
    model.register_comm_hook(NetaggState(netagg.Context()), allreduce_hook)

For every gradient bucket, DDP calls the hook during the backward pass; the hook divides
the bucket by the number of ranks (DDP averages gradients), submits it to netagg as an
asynchronous in-place allreduce and returns a ``torch.futures.Future`` that the job
completes. Buckets thus travel while backward computes the next ones, as they do with
PyTorch's own allreduce. Rank and world size come from the same variables as ever
(torchrun's ``RANK``/``WORLD_SIZE``, mpirun's, Slurm's), read by the context.

16-bit gradients: the buckets of a bfloat16 or float16 model are summed as they are, two
bytes an element, in float32 at the switch. A float32 model's gradients travel as 16-bit
values, as PyTorch's ``fp16_compress_hook`` and ``bf16_compress_hook`` send them, with
the context's ``general.wire_precision``, which the worker threads apply as they fill
packets (no extra pass over the bucket)::

    context = netagg.Context(settings={"general.wire_precision": "bfloat16"})
    model.register_comm_hook(NetaggState(context), allreduce_hook)

The future is completed on netagg's callback thread, where DDP's own continuations then
run too; callbacks there run one at a time, so anything chained on the future should
not block.
"""

import threading
import time

import torch
import torch.distributed as dist

from . import Context


class NetaggState:
    """What the hook needs: the context every bucket goes through. It also counts how
    long buckets were in flight: ``comm_seconds``, the time at least one bucket was
    outstanding, overlapping buckets counted once."""

    def __init__(self, context: Context):
        self.context = context
        self.world_size = context.num_workers
        if dist.is_initialized() and dist.get_world_size() != self.world_size:
            raise ValueError(
                f"netagg's session has {self.world_size} ranks, the process group "
                f"{dist.get_world_size()}: the hook would average wrongly"
            )
        self.comm_seconds = 0.0
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy_since = 0.0

    def bucket_started(self):
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1

    def bucket_ended(self):
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self.comm_seconds += time.perf_counter() - self._busy_since


AVERAGED_TYPES = (torch.float32, torch.float16, torch.bfloat16)


def allreduce_hook(state: NetaggState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket's gradients over the ranks through netagg, in place, in the
    bucket's own type."""
    tensor = bucket.buffer()
    if tensor.dtype not in AVERAGED_TYPES:
        raise TypeError(f"the netagg hook averages float32, float16 and bfloat16 gradients, not {tensor.dtype}")
    # DDP hands the hook sums to average; dividing first, as DDP's own path does, keeps
    # the sum in the gradients' range.
    tensor.div_(state.world_size)
    future = torch.futures.Future()
    job = state.context.allreduce_async(tensor)
    state.bucket_started()

    def done(job):
        state.bucket_ended()
        error = job.exception()
        if error is None:
            future.set_result(tensor)
        else:
            future.set_exception(error)

    job.add_done_callback(done)
    return future
