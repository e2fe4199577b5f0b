"""Makes each netagg-run rank a Ray node, then runs a command on the cluster.

    netagg-run -n 2 --link rate=100mbit,delay=1ms -- \\
        python3 examples/python/ray_cluster.py -- python3 examples/python/ray_train.py

Rank 0 starts the head node, the other ranks join it as worker nodes, each at its own
namespace's address (so Ray's traffic, and Ray Train's, crosses the shaped links), with
``--cpus`` CPUs each. Once every node has joined, rank 0 runs the command with
``RAY_ADDRESS`` set, then stops its node; the other ranks stop theirs once the head has
gone. With ``--switch-node``, the last rank's node has no CPUs and the custom resource
``netagg_switch``, where ``netagg.ray.Switch(resource="netagg_switch")`` places the
switch: a host of its own, as a switch is. Each node is a ``ray start --block`` of this
script's, stopped by SIGTERM, so that no Ray process outlives the run (and netagg-run
ends whatever is left in its namespaces, also on Ctrl-C); its files go in a folder of
its own, removed at the end (after a Ctrl-C, by the next run).
"""

import argparse
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import time

HEAD_PORT = 6379
SWITCH_RESOURCE = "netagg_switch"
# Each node's Ray folder: this, the launcher's process id, and the rank.
TEMP_PREFIX = "/tmp/ray-netagg-run-"


def own_address(peer):
    """This namespace's address on the way to ``peer`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))
        return probe.getsockname()[0]


def reachable(host, port):
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def wait_until(condition, seconds, what):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"ray_cluster.py: {what} after {seconds} s")
        time.sleep(0.5)


def remove_folders_of_ended_runs():
    """Removes the Ray folders whose launcher has ended."""
    for folder in glob.glob(f"{TEMP_PREFIX}*-*"):
        launcher = folder.removeprefix(TEMP_PREFIX).split("-")[0]
        if launcher.isdigit() and not os.path.exists(f"/proc/{launcher}"):
            shutil.rmtree(folder, ignore_errors=True)


def start_node(arguments):
    """A Ray node of this rank's, in the foreground of a child process."""
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    command = [ray, "start", "--block", "--disable-usage-stats", *arguments]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL)


def stop_node(node):
    node.terminate()
    try:
        node.wait(timeout=30)
    except subprocess.TimeoutExpired:
        node.kill()
        node.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpus", type=int, default=1, help="CPUs each node offers Ray")
    parser.add_argument("--switch-node", action="store_true", help="the last rank hosts the switch, no workers")
    parser.add_argument("command", nargs="+", help="what rank 0 runs on the cluster")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Ray's token authentication keeps its token where each node generates it; these
    # nodes' addresses are reachable only from this run's namespaces, so it is off, for
    # the nodes, this driver and the command's.
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # A node is stopped once the command has run: there is no work left to drain.
    os.environ["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    head = os.environ["MASTER_ADDR"]  # netagg-run: rank 0's address
    address = own_address(head)
    # A folder of this node's own, removed at the end: Ray's default is shared by every
    # Ray on the machine. It is named after the launcher (this process's parent:
    # `ip netns exec` runs the program in its own place), whose Ctrl-C ends the ranks
    # with SIGKILL before they can remove anything: the next run removes those.
    launcher = os.getppid()
    temp_dir = f"{TEMP_PREFIX}{launcher}-{rank}"
    if rank == 0:
        remove_folders_of_ended_runs()
    node_args = ["--node-ip-address", address, "--temp-dir", temp_dir]
    if args.switch_node and rank == world - 1:
        node_args += ["--num-cpus", "0", "--resources", json.dumps({SWITCH_RESOURCE: 1})]
    else:
        node_args += ["--num-cpus", str(args.cpus)]

    try:
        return run_node(args, rank, world, head, node_args, temp_dir)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def run_node(args, rank, world, head, node_args, temp_dir):
    """Rank 0: the head node and the command (its temporary files in the node's folder,
    so that they go with it); the others: a worker node until the head has gone."""
    if rank != 0:
        wait_until(lambda: reachable(head, HEAD_PORT), 120, "no Ray head")
        node = start_node(["--address", f"{head}:{HEAD_PORT}", *node_args])
        try:
            # The head goes when the command has run; this node's raylet may end first.
            wait_until(lambda: not reachable(head, HEAD_PORT) or node.poll() is not None, 24 * 3600, "")
        finally:
            stop_node(node)
        return 0

    node = start_node(["--head", "--port", str(HEAD_PORT), "--include-dashboard", "false", *node_args])
    try:
        import ray

        wait_until(lambda: reachable(head, HEAD_PORT), 120, "the head did not listen")
        ray.init(address=f"{head}:{HEAD_PORT}", logging_level="ERROR")
        started = time.monotonic()
        wait_until(lambda: len([n for n in ray.nodes() if n["Alive"]]) == world, 120, f"not all {world} nodes joined")
        ray.shutdown()
        print(f"ray_cluster.py: {world} nodes up after {time.monotonic() - started:.1f} s more", flush=True)
        environment = dict(os.environ, RAY_ADDRESS=f"{head}:{HEAD_PORT}", TMPDIR=temp_dir)
        return subprocess.run(args.command, env=environment).returncode
    finally:
        stop_node(node)


if __name__ == "__main__":
    sys.exit(main())
