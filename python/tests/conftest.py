"""Fixtures of the netagg Python tests: the workspace's release binaries and a switch
process on free loopback ports; what netagg-run's report says a link carried."""

import os
import subprocess
import threading
import uuid
from pathlib import Path

import pytest

import netagg

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def bin_dir():
    """Where cargo built netagg-switch and netagg-run: the release profile's folder."""
    directory = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release"
    for program in ("netagg-switch", "netagg-run"):
        if not (directory / program).is_file():
            pytest.fail(f"{directory}/{program} is missing: cargo build --release --workspace --bins")
    return directory


class Switch:
    """A netagg-switch process; ``contexts(n)`` joins n ranks of a new session to it."""

    def __init__(self, bin_dir):
        self.process = subprocess.Popen(
            [bin_dir / "netagg-switch", "--control", "127.0.0.1:0", "--data", "127.0.0.1:0", "--log-level", "error"],
            stdout=subprocess.PIPE,
            text=True,
        )
        # "netagg-switch: control 127.0.0.1:PORT data 127.0.0.1:PORT"
        first = self.process.stdout.readline().split()
        self.host, self.port = first[2].rsplit(":", 1)
        # Drained, so that the switch never blocks on a full pipe.
        threading.Thread(target=self.process.stdout.read, daemon=True).start()

    def settings(self, rank, workers, session, **extra):
        settings = {
            "general.backend": "udp",
            "general.controller_ip": self.host,
            "general.controller_port": self.port,
            "general.rank": rank,
            "general.num_workers": workers,
            "general.session": session,
        }
        settings.update({key.replace("__", "."): value for key, value in extra.items()})
        return settings

    def contexts(self, workers, **extra):
        """Every rank's context of a new session, started concurrently (each start
        returns once all have registered)."""
        session = f"pytest-{uuid.uuid4().hex[:12]}"
        contexts = [None] * workers
        errors = []

        def start(rank):
            try:
                contexts[rank] = netagg.Context(settings=self.settings(rank, workers, session, **extra))
            except Exception as error:  # reported below, in the test's thread
                errors.append(error)

        threads = [threading.Thread(target=start, args=(rank,)) for rank in range(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            for context in contexts:
                if context is not None:
                    context.stop()
            raise errors[0]
        return contexts

    def kill(self):
        self.process.kill()
        self.process.wait()


@pytest.fixture
def switch(bin_dir):
    switch = Switch(bin_dir)
    yield switch
    switch.kill()


@pytest.fixture
def on_every_rank():
    return run_on_every_rank


def run_on_every_rank(contexts, call):
    """Runs ``call(rank, context)`` on a thread per rank; returns the results by rank."""
    results = [None] * len(contexts)
    errors = []

    def run(rank):
        try:
            results[rank] = call(rank, contexts[rank])
        except Exception as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(contexts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def carried_megabytes(output, rank):
    """What rank's emulated link carried up and down, in MB, by netagg-run's report."""
    row = next(line.split() for line in output.splitlines() if line.startswith(f"netagg-run: {rank} "))
    up, down = row[3].split("/")
    return float(up), float(down)
