"""netagg: allreduce through an in-network aggregation switch.

A ``Context`` joins the session its configuration names (a file, the launcher's rank and
size variables, ``NETAGG_*`` variables, then ``settings``) and sums float32, int32,
float16 and bfloat16 tensors over every rank::

    import numpy, torch, netagg
    with netagg.Context() as context:
        grads = numpy.ones(1 << 20, dtype=numpy.float32)
        context.allreduce(grads)                  # in place: now the sum over the ranks
        job = context.allreduce_async(grads)      # returns at once
        job.wait()
        halves = torch.ones(1 << 20, dtype=torch.bfloat16)
        context.allreduce(halves)                 # 2 bytes an element on the wire

NumPy arrays, PyTorch CPU tensors and other buffers are read and written where they
are: nothing is copied on the way in or out. ``netagg.ddp`` holds a communication hook
for PyTorch's DistributedDataParallel, and ``netagg.model`` the cost model: what an
allreduce should take on given links.
"""

from ._netagg import (
    BufferInUseError,
    ConfigError,
    Context,
    Error,
    InvalidInputError,
    Job,
    JobError,
    StoppedError,
    SwitchError,
    __version__,
)

__all__ = [
    "BufferInUseError",
    "ConfigError",
    "Context",
    "Error",
    "InvalidInputError",
    "Job",
    "JobError",
    "StoppedError",
    "SwitchError",
    "__version__",
]
