"""netagg in Ray: the ray.util.collective backend's sums, a switch killed under a Ray
Train run, the parameter-server example's training, and Ray Train on a 2-node Ray
cluster on emulated links (the parameters as gloo's). The first three share a local Ray
instance of this module's; each checks that nothing it started is left."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import ray
import ray.cloudpickle
import ray.train
import ray.train.torch
import torch
from ray.util import collective
from ray.util.collective.types import ReduceOp

import netagg.ray
from conftest import ROOT, carried_megabytes

# The functions this module hands Ray travel by value: Ray's workers cannot import it.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

EXAMPLES = ROOT / "examples" / "python"
sys.path.insert(0, str(EXAMPLES))
import ray_parameter_server  # noqa: E402
import train_ddp  # noqa: E402

ray.cloudpickle.register_pickle_by_value(ray_parameter_server)


def processes_naming(text):
    """The processes whose command line contains ``text``, as "PID COMMAND" lines."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it has ended
            continue
        if text in command:
            found.append(f"{pid} {command}")
    return found


def descendants(pid):
    """The ids of ``pid``'s child processes, theirs, and so on."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except OSError:  # it has ended
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@pytest.fixture(scope="module")
def local_ray():
    """A one-node Ray instance (2 CPUs) in a folder of its own; afterwards, none of the
    processes it ran (its servers, workers, actors and their switches) may remain."""
    # Short: Ray's socket paths inside it must fit in 107 bytes.
    folder = f"/tmp/ray-pytest-{uuid.uuid4().hex[:8]}"
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=folder, logging_level="ERROR")
    yield folder
    started = descendants(os.getpid())
    assert started, "no process of Ray's under this one: the check below would check nothing"
    ray.shutdown()
    deadline = time.monotonic() + 30
    while (left := [pid for pid in started if os.path.exists(f"/proc/{pid}")]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], [line for line in processes_naming("") if int(line.split()[0]) in left]
    subprocess.run(["rm", "-rf", folder], check=True)


@pytest.fixture
def ray_switch(local_ray, bin_dir):
    switch = netagg.ray.Switch(bin_dir / "netagg-switch", switch_args=["--log-level", "error"])
    pid = ray.get(switch.actor.pid.remote())
    yield switch, pid
    switch.stop()
    # The switch goes with its actor.
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{pid}"), "netagg-switch outlived its actor"


@ray.remote
class Member:
    """A rank of a ray.util.collective group on the netagg backend."""

    def __init__(self, world_size, rank, group):
        netagg.ray.register_collective_backend()
        collective.init_collective_group(world_size, rank, backend="netagg", group_name=group)
        self.rank, self.group = rank, group

    def run(self, call):
        """``call(rank, group)``'s result, or the text of what it raised."""
        try:
            return call(self.rank, self.group)
        except Exception as error:
            return f"{type(error).__name__}: {error}"


def group_of(size):
    group = f"g-{uuid.uuid4().hex[:8]}"
    return [Member.remote(size, rank, group) for rank in range(size)]


def on_every_member(members, call):
    return ray.get([member.run.remote(call) for member in members], timeout=120)


def test_a_collective_group_allreduces_through_netagg(ray_switch):
    members = group_of(2)
    n = 100_000

    def int32_sum(rank, group):
        # Values near 2^30 / 2: exact only if nothing on the way rounds.
        array = (np.arange(n, dtype=np.int64) * 5_000 % (1 << 29)).astype(np.int32) + rank
        collective.allreduce(array, group_name=group)
        return array

    def float32_sum(rank, group):
        tensor = torch.from_numpy(np.random.default_rng(rank).uniform(-1, 1, n).astype(np.float32))
        collective.allreduce(tensor, group_name=group)
        return tensor.numpy()

    expected = 2 * (np.arange(n, dtype=np.int64) * 5_000 % (1 << 29)) + 1
    for result in on_every_member(members, int32_sum):
        assert result.dtype == np.int32
        np.testing.assert_array_equal(result, expected)
    exact = sum(np.random.default_rng(rank).uniform(-1, 1, n).astype(np.float32).astype(np.float64) for rank in (0, 1))
    for result in on_every_member(members, float32_sum):
        assert np.max(np.abs(result - exact)) < 1e-5

    def broadcast_and_barrier(rank, group):
        array = np.full(1000, 7 + rank, dtype=np.int32)
        collective.broadcast(array, src_rank=1, group_name=group)
        collective.barrier(group_name=group)
        return array

    for result in on_every_member(members, broadcast_and_barrier):
        np.testing.assert_array_equal(result, np.full(1000, 8, dtype=np.int32))

    def refused(rank, group):
        messages = []
        for call in (
            lambda: collective.allreduce(np.ones(4, dtype=np.int32), group_name=group, op=ReduceOp.MAX),
            lambda: collective.reduce(np.ones(4, dtype=np.int32), group_name=group),
            lambda: collective.allreduce(np.ones(4, dtype=np.float64), group_name=group),
        ):
            try:
                call()
                messages.append("no error")
            except Exception as error:
                messages.append(f"{type(error).__name__}: {error}")
        return messages

    for messages in on_every_member(members, refused):
        assert messages[0] == "ValueError: netagg's switch sums: it cannot allreduce with ReduceOp.MAX"
        assert messages[1] == (
            "NotImplementedError: netagg's collective backend does allreduce (sum), barrier and broadcast, "
            "not reduce: use the gloo backend for it"
        )
        assert messages[2].startswith("TypeError: tensor holds elements of format 'd' (8 bytes)"), messages[2]
    on_every_member(members, lambda rank, group: collective.destroy_collective_group(group))
    for member in members:
        ray.kill(member)


def test_a_killed_switch_fails_the_training_run_with_its_error(ray_switch, tmp_path):
    _, pid = ray_switch

    def train_loop_per_worker(config):
        model = netagg.ray.prepare_ddp(torch.nn.Linear(256, 256))
        for step in range(100_000):
            model(torch.ones(4, 256)).sum().backward()
            if step == 3 and ray.train.get_context().get_world_rank() == 0:
                os.kill(config["pid"], signal.SIGKILL)

    trainer = ray.train.torch.TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"pid": pid},
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(storage_path=str(tmp_path)),
    )
    started = time.monotonic()
    with pytest.raises(ray.train.TrainingFailedError) as failure:
        trainer.fit()
    assert time.monotonic() - started < 120
    assert "session lost" in str(failure.value) or "cannot reach the switch" in str(failure.value), failure.value


def test_the_parameter_server_trains_as_sgd_on_the_mean_gradient(local_ray):
    config = {"model": "small", "steps": 3, "batch_size": 8, "lr": 0.05, "seed": 1, "threads": 1}
    figures, trained = ray_parameter_server.train(config, 2)
    assert (figures["allreduce"], figures["ranks"]) == ("parameter server", 2)
    # The same steps in this process: each worker's batch, their mean gradient, SGD.
    torch.manual_seed(1)
    model = train_ddp.MODELS["small"]()
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = [train_ddp.synthetic_batches(rank, 8, 1) for rank in (0, 1)]
    for _ in range(3):
        gradients = []
        for stream in batches:
            model.zero_grad()
            images, labels = next(stream)
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            gradients.append([p.grad.clone() for p in model.parameters()])
        for parameter, *each in zip(model.parameters(), *gradients):
            parameter.grad = sum(each) / 2
        optimizer.step()
    assert trained.keys() == initial.keys()
    for name, value in model.state_dict().items():
        assert not torch.allclose(trained[name], initial[name], rtol=0, atol=1e-4), name
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_ray_train_on_a_two_node_cluster_on_emulated_links_matches_gloo(bin_dir, tmp_path):
    """Ray's head and a worker node in netagg-run's namespaces behind 100 Mbit/s, 1 ms
    links; Ray Train's two workers train with netagg, then with gloo, on the same cluster."""
    train = [sys.executable, EXAMPLES / "ray_train.py", "--workers", "2", "--steps", "8", "--bucket-mb", "0.25"]
    train += ["--switch", bin_dir / "netagg-switch", "--json"]
    both = (
        f"{' '.join(map(str, train))} --save {tmp_path}/netagg.pt && "
        f"{' '.join(map(str, train))} --save {tmp_path}/gloo.pt --baseline gloo"
    )
    command = [bin_dir / "netagg-run", "-n", "2", "--link", "rate=100mbit,delay=1ms", "--"]
    command += [sys.executable, EXAMPLES / "ray_cluster.py", "--", "sh", "-c", both]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = run.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        output, _ = run.communicate()
        pytest.fail(f"{command} timed out:\n{output}")
    assert run.returncode == 0, output
    figures = [json.loads(line.split("] ", 1)[1]) for line in output.splitlines() if line.startswith("[0] {")]
    assert [f["allreduce"] for f in figures] == ["netagg", "gloo"], output
    # The driver's cost model for the two workers' links.
    assert "[0] model on 2 links of 100 Mbit/s, 1 ms: a step's gradients take " in output, output
    assert all(f["cost_model"]["links"] == "2 links of 100 Mbit/s, 1 ms" for f in figures), figures
    # Both trainings' gradients crossed both links, eight steps each way.
    least = 0.9 * 2 * 8 * figures[0]["gradient_bytes"] / 1e6
    for rank in (0, 1):
        up, down = carried_megabytes(output, rank)
        assert up > least and down > least, (rank, up, down, output)
    netagg_params = torch.load(tmp_path / "netagg.pt")
    gloo_params = torch.load(tmp_path / "gloo.pt")
    assert netagg_params.keys() == gloo_params.keys()
    for name, value in netagg_params.items():
        torch.testing.assert_close(value, gloo_params[name], rtol=1e-4, atol=1e-5, msg=name)
    # Nothing left: the namespaces and every Ray process of the run.
    prefix = output.split("namespaces ", 1)[1].split("-*", 1)[0]
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count(prefix) == 0
    # Each Ray node's folder, which its processes' command lines name, is gone too.
    assert processes_naming(f"/tmp/ray-netagg-run-{run.pid}-") == []
    assert list(Path("/tmp").glob(f"ray-netagg-run-{run.pid}-*")) == []
