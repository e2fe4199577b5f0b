"""netagg in a Ray cluster: a switch owned by the cluster, Ray Train's DDP through it, and
a ``netagg`` backend for ``ray.util.collective``.

Ray Train::

    import netagg.ray
    from ray.train.torch import TorchTrainer

    def train_loop_per_worker(config):
        model = netagg.ray.prepare_ddp(MyModel())   # DDP, gradients averaged by netagg
        ...

    with netagg.ray.Switch():                       # an actor on the head node
        TorchTrainer(train_loop_per_worker, scaling_config=...).fit()

``Switch`` starts an actor that owns a ``netagg-switch`` process on the head node (or on
a node with the custom resource ``resource=``) and registers under a name the workers
look up, so that they learn its address and session without being told. Leaving the
``with`` block kills the actor, and the switch process dies with it. A switch that dies
during the run fails every rank's next gradient bucket with netagg's error (the switch
is unreachable, or the session lost), so the run fails with that error rather than
hanging.

ray.util.collective::

    netagg.ray.register_collective_backend()        # in the driver and in each actor
    collective.init_collective_group(world_size, rank, backend="netagg", group_name="g")
    collective.allreduce(array, group_name="g")     # sum, in place, through the switch

The group's ranks join a session of the running ``Switch`` named after the group.
"""

import ctypes
import hashlib
import shutil
import signal
import subprocess
import threading
import uuid

import numpy
import ray
from ray.exceptions import GetTimeoutError
from ray.util.collective.collective_group.base_collective_group import BaseGroup
from ray.util.collective.types import ReduceOp

from . import Context
from .ddp import NetaggState, allreduce_hook

SWITCH_ACTOR_NAME = "netagg-switch"
"""The name under which ``Switch`` registers its actor, unless given another."""

# The head node's resource in every Ray cluster (ray._common.constants).
HEAD_NODE_RESOURCE = "node:__internal_head__"

# From <linux/prctl.h>: a child asks to receive a signal when its parent dies.
_PR_SET_PDEATHSIG = 1
# How long a worker waits for a running switch's actor to say where it listens.
_ENDPOINT_TIMEOUT = 60


class SwitchDiedError(RuntimeError):
    """The ``netagg-switch`` process of a ``Switch`` has exited."""


def _die_with_parent():
    """A function for the switch process to run before it executes: the kernel then kills
    it when the actor's process ends, however the actor ends (ray.kill, a crashed node, a
    killed driver). ``prctl`` is looked up here, in the parent: between fork and exec in
    a threaded process only the call itself is safe, not ``dlopen``."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def request():
        if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")

    return request


@ray.remote(num_cpus=0)
class _SwitchActor:
    """Owns one ``netagg-switch`` process, bound to this node's address, and the name of
    the run's sessions on it."""

    def __init__(self, program, switch_args):
        ip = ray.util.get_node_ip_address()
        self.process = subprocess.Popen(
            [program, "--control", f"{ip}:0", "--data", f"{ip}:0", *switch_args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_die_with_parent(),
        )
        # "netagg-switch: control IP:PORT data IP:PORT", once it listens.
        first = self.process.stdout.readline().split()
        if len(first) < 3 or first[1] != "control":
            self.process.kill()
            self.process.wait()
            raise SwitchDiedError(f"{program} did not start: {self.process.stderr.read().strip()}")
        self.host, self.port = first[2].rsplit(":", 1)
        self.session = f"ray-{uuid.uuid4().hex[:12]}"
        self.stderr_tail = []
        # Drained, so that the switch never blocks on a full pipe; the last lines of its
        # errors are kept for the message if it dies.
        threading.Thread(target=self.process.stdout.read, daemon=True).start()
        threading.Thread(target=self._keep_stderr_tail, daemon=True).start()

    def _keep_stderr_tail(self):
        for line in self.process.stderr:
            self.stderr_tail = (self.stderr_tail + [line.rstrip()])[-5:]

    def endpoint(self):
        """The switch's control address and the run's session name; raises
        SwitchDiedError once the switch has exited."""
        code = self.process.poll()
        if code is not None:
            raise SwitchDiedError(
                f"netagg-switch at {self.host}:{self.port} exited with code {code}: "
                + (" | ".join(self.stderr_tail) or "no error output")
            )
        return {"general.controller_ip": self.host, "general.controller_port": self.port}, self.session

    def pid(self):
        """The switch process's id, on the actor's node."""
        return self.process.pid


class Switch:
    """A ``netagg-switch`` for one run in the Ray cluster, owned by a named actor.

    ``program``: the switch's executable (default: ``netagg-switch`` on the driver's
    PATH; the same path must hold it on the switch's node). ``resource``: a custom
    resource that names the node to run on (default: the head node). ``switch_args``:
    more arguments for the switch (``["--log-level", "error"]``). ``name``: the actor's
    name, which ``prepare_ddp`` and collective groups look up. ``start_timeout``: how
    many seconds the switch may take to be placed and listen.

    Once started, ``settings`` holds the switch's control address as netagg settings
    (for contexts outside Ray Train and collective groups) and ``session`` the run's
    session name, from which theirs derive."""

    def __init__(self, program=None, resource=None, switch_args=(), name=SWITCH_ACTOR_NAME, start_timeout=60.0):
        program = program or shutil.which("netagg-switch")
        if program is None:
            raise FileNotFoundError("netagg-switch is not on the PATH: pass Switch(program=...)")
        placement = resource or HEAD_NODE_RESOURCE
        self.actor = _SwitchActor.options(name=name, resources={placement: 0.001}).remote(
            str(program), list(switch_args)
        )
        try:
            # Once the switch listens (or raises why it did not start).
            self.settings, self.session = ray.get(self.actor.endpoint.remote(), timeout=start_timeout)
        except GetTimeoutError:
            self.stop()
            raise TimeoutError(
                f"the netagg switch was not running after {start_timeout} s: "
                f"does a node have the resource '{placement}'?"
            ) from None
        except BaseException:
            # Ctrl-C or a dead actor: the named actor must not outlive this object.
            self.stop()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        """Kills the actor, and so the switch; later calls do nothing more."""
        if self.actor is not None:
            ray.kill(self.actor)
            self.actor = None


def _context(switch_name, rank, world_size, purpose, name):
    """A context of rank ``rank`` of ``world_size`` in the named switch's session for
    ``purpose`` and ``name`` (a training run's, a collective group's): the run's session
    name and a digest of ``name``, which keeps it within the 64 bytes a session name may
    have."""
    try:
        actor = ray.get_actor(switch_name)
    except ValueError:
        raise LookupError(
            f"no netagg switch named '{switch_name}' in this Ray cluster: start one with netagg.ray.Switch()"
        ) from None
    try:
        settings, session = ray.get(actor.endpoint.remote(), timeout=_ENDPOINT_TIMEOUT)
    except GetTimeoutError:
        raise TimeoutError(
            f"the netagg switch '{switch_name}' did not answer within {_ENDPOINT_TIMEOUT} s"
        ) from None
    settings.update(
        {
            "general.backend": "udp",
            "general.rank": rank,
            "general.num_workers": world_size,
            "general.session": f"{session}-{purpose}-{hashlib.sha256(name.encode()).hexdigest()[:16]}",
        }
    )
    return Context(settings=settings)


def prepare_ddp(model, switch_name=SWITCH_ACTOR_NAME, **prepare_model_args):
    """Inside Ray Train's ``train_loop_per_worker``: the model wrapped in DDP by
    ``ray.train.torch.prepare_model`` (with ``prepare_model_args``), its gradients
    averaged through the named switch by this run's ranks (Ray Train's world rank and
    size) in a session named after the run's experiment. The context is the hook
    state's, ``model.netagg_state.context``: stop it when training ends."""
    import ray.train
    import ray.train.torch

    model = ray.train.torch.prepare_model(model, **prepare_model_args)
    train = ray.train.get_context()
    context = _context(
        switch_name, train.get_world_rank(), train.get_world_size(), "train", train.get_experiment_name()
    )
    state = NetaggState(context)
    model.register_comm_hook(state, allreduce_hook)
    model.netagg_state = state
    return model


def _refuse(operation):
    raise NotImplementedError(
        f"netagg's collective backend does allreduce (sum), barrier and broadcast, not {operation}: "
        "use the gloo backend for it"
    )


class NetaggGroup(BaseGroup):
    """A ``ray.util.collective`` group whose allreduce goes through netagg's switch:
    sums of float32, int32, float16 and bfloat16 NumPy arrays and PyTorch CPU tensors,
    in place. Its ranks join a session of the switch named ``SWITCH_ACTOR_NAME``."""

    def __init__(self, world_size, rank, group_name):
        super().__init__(world_size, rank, group_name)
        self.context = _context(SWITCH_ACTOR_NAME, rank, world_size, "collective", group_name)

    @classmethod
    def backend(cls):
        return "NETAGG"

    @classmethod
    def check_backend_availability(cls):
        return True

    def destroy_group(self):
        self.context.stop()

    def allreduce(self, tensors, allreduce_options=None):
        operation = getattr(allreduce_options, "reduceOp", ReduceOp.SUM)
        if operation != ReduceOp.SUM:
            raise ValueError(f"netagg's switch sums: it cannot allreduce with {operation}")
        for tensor in tensors:
            self.context.allreduce(tensor)

    def barrier(self, barrier_options=None):
        # An allreduce ends on every rank only once every rank has contributed.
        self.context.allreduce(numpy.ones(1, dtype=numpy.int32))

    def broadcast(self, tensors, broadcast_options=None):
        """The root's tensor to every rank: a sum of the root's values and zeros from
        the others (exact for int32, and for floats whose values the switch's
        fixed-point conversion holds)."""
        root = getattr(broadcast_options, "root_rank", 0)
        for tensor in tensors:
            if self.rank != root:
                tensor[...] = 0
            self.context.allreduce(tensor)

    def reduce(self, tensor, reduce_options=None):
        _refuse("reduce")

    def allgather(self, tensor_list, tensor, allgather_options=None):
        _refuse("allgather")

    def reducescatter(self, tensor, tensor_list, reducescatter_options=None):
        _refuse("reducescatter")

    def send(self, tensor, send_options):
        _refuse("send")

    def recv(self, tensor, recv_options):
        _refuse("recv")


def register_collective_backend():
    """Registers ``NetaggGroup`` as ray.util.collective's ``netagg`` backend in this
    process (the driver and each actor of a group, as Ray asks); again does nothing."""
    from ray.util import collective

    if not collective.is_backend_available(NetaggGroup.backend()):
        collective.register_collective_backend(NetaggGroup.backend(), NetaggGroup)
