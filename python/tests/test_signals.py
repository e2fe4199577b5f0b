"""Ctrl-C interrupts every blocking call: a subprocess sends itself SIGINT while it waits
on a switch that never answers, and must raise KeyboardInterrupt within a second."""

import json
import re
import socket
import subprocess
import sys

import pytest

# Runs `call` in a process that interrupts itself half a second in, and prints how long
# the interrupt took to surface before letting it end the process.
PROGRAM = """
import json, os, signal, sys, threading, time
import numpy as np
import netagg

settings = json.loads(sys.argv[1])
sent = []

def interrupt():
    sent.append(time.monotonic())
    os.kill(os.getpid(), signal.SIGINT)

def interrupted(call):
    threading.Timer(0.5, interrupt).start()
    try:
        call()
    except KeyboardInterrupt:
        print(f"interrupted after {time.monotonic() - sent[0]:.3f} s", flush=True)
        raise
    print("not interrupted", flush=True)

"""

# Rank 1 registers and never submits: rank 0's job waits at the switch for ever (its
# timeout is far away).
TWO_RANKS = """
contexts = [None, None]
def start(rank):
    contexts[rank] = netagg.Context(settings={**settings, "general.rank": rank})
threads = [threading.Thread(target=start, args=(rank,)) for rank in range(2)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
tensor = np.ones(1000, dtype=np.int32)
"""

CALLS = {
    "Context()": "interrupted(lambda: netagg.Context(settings=settings))",
    "wait_all()": TWO_RANKS + "contexts[0].allreduce_async(tensor)\ninterrupted(contexts[0].wait_all)",
    "allreduce()": TWO_RANKS + "interrupted(lambda: contexts[0].allreduce(tensor))",
    "Job.wait()": TWO_RANKS + "interrupted(contexts[0].allreduce_async(tensor).wait)",
}


def run_interrupted(call, settings):
    process = subprocess.run(
        [sys.executable, "-c", PROGRAM + CALLS[call], json.dumps(settings)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "KeyboardInterrupt" in process.stderr, process.stdout + process.stderr
    assert process.returncode != 0
    delay = re.search(r"interrupted after ([0-9.]+) s", process.stdout)
    assert delay, process.stdout + process.stderr
    assert float(delay.group(1)) < 1.0, process.stdout


def test_ctrl_c_interrupts_a_start_whose_switch_never_answers():
    # Accepted by the kernel's backlog, never read from, never answered.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        settings = {
            "general.backend": "udp",
            "general.controller_ip": "127.0.0.1",
            "general.controller_port": silent.getsockname()[1],
            "general.num_workers": 2,
            "general.connect_timeout": 60,
        }
        run_interrupted("Context()", settings)


@pytest.mark.parametrize("call", ["wait_all()", "allreduce()", "Job.wait()"])
def test_ctrl_c_interrupts_a_wait_for_a_job_the_switch_never_ends(switch, call):
    settings = switch.settings(0, 2, f"signals-{call}", general__job_timeout=60)
    run_interrupted(call, settings)
