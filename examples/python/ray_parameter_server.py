"""Trains train_ddp.py's model with a synchronous parameter server of Ray actors, for
comparison with allreduce on the same Ray cluster.

    netagg-run -n 4 --link rate=100mbit,delay=1ms -- python3 examples/python/ray_cluster.py -- \\
        python3 examples/python/ray_parameter_server.py --workers 4

The parameters, flattened, are cut into one shard per worker, each held by an actor
(``ParameterShard``) placed with its worker (one CPU bundle each, spread over the nodes),
as Ray's own parameter-server pattern has them. Each step, every worker computes its
gradients, pushes each shard's slice to its actor, and waits for the shards' new values:
an actor applies SGD with the workers' mean gradient once all have pushed, then answers
them all. The same mean and the same SGD as DDP's, so the parameters follow DDP's; each
node's link carries 2(N-1)/N of the gradients' bytes each way, as a ring's does (its
slices out and the others' in, its shard's values out and the others' in), in one round
trip a step instead of a ring's 2(N-1) steps.

Rank 0 reports train_ddp.py's figures (median step, forward and backward with and
without the exchange, images/s), which the driver prints, beside the cost model's on
emulated links.
"""

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import ray
import ray.cloudpickle
import torch
import torch.nn.functional as F
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch.nn.utils import parameters_to_vector, vector_to_parameters

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cost_model  # noqa: E402  (beside this file)
import train_ddp  # noqa: E402

# Ray's workers have no copy of this folder on their path.
ray.cloudpickle.register_pickle_by_value(train_ddp)
ray.cloudpickle.register_pickle_by_value(cost_model)


@ray.remote(num_cpus=0)
class ParameterShard:
    """One shard of the parameters: sums a step's gradient slices, and once every worker's
    has come, steps SGD with their mean and answers every worker with the new values."""

    def __init__(self, values, workers, lr):
        self.values, self.workers, self.lr = values, workers, lr
        self.gradient_sum, self.pushed = None, 0
        self.updated = {}  # step: set once that step's values are in place

    async def push(self, step, gradient):
        """Adds a worker's slice for ``step``; returns the values after the step."""
        self.gradient_sum = gradient.copy() if self.gradient_sum is None else self.gradient_sum + gradient
        self.pushed += 1
        updated = self.updated.setdefault(step, asyncio.Event())
        if self.pushed == self.workers:
            # A new array: the previous step's may still be on its way to a worker.
            self.values = self.values - self.lr * (self.gradient_sum / self.workers)
            self.gradient_sum, self.pushed = None, 0
            self.updated.pop(step - 1, None)
            updated.set()
        await updated.wait()
        return self.values


@ray.remote(num_cpus=1)
def train_worker(rank, world, shards, bounds, config):
    """One worker's training against the shards; rank 0 returns its figures and the
    trained parameters."""
    args = argparse.Namespace(**config)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # the model the shards were made from
    model = train_ddp.MODELS[args.model]()
    batches = train_ddp.synthetic_batches(rank, args.batch_size, args.seed)
    step_seconds, compute_seconds = [], []
    for step in range(args.steps):
        images, labels = next(batches)
        started = time.perf_counter()
        model.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        computed = time.perf_counter()
        gradient = parameters_to_vector(p.grad for p in model.parameters()).numpy()
        pushes = [shard.push.remote(step, gradient[start:end]) for shard, (start, end) in zip(shards, bounds)]
        values = np.concatenate(ray.get(pushes))
        vector_to_parameters(torch.from_numpy(values), model.parameters())
        step_seconds.append(time.perf_counter() - started)
        compute_seconds.append(computed - started)
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    if rank != 0:
        return None
    warm = min(5, args.steps // 2)
    timed = step_seconds[warm:]
    figures = {
        "allreduce": "parameter server",
        "model": args.model,
        "gradients": "float32",
        "ranks": world,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "median_step_ms": statistics.median(timed) * 1e3,
        # A step is its forward and backward and then the exchange: nothing overlaps.
        "median_sync_ms": statistics.median(timed) * 1e3,
        "median_compute_ms": statistics.median(compute_seconds[warm:]) * 1e3,
        "images_per_second": world * args.batch_size * len(timed) / sum(timed),
        "train_seconds": sum(step_seconds),
        "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "packet_numel": None,
        "window_packets": None,
    }
    return figures, model.state_dict()


def train(config, workers):
    """Trains on the connected Ray cluster: rank 0's figures and trained parameters."""
    torch.manual_seed(config["seed"])
    initial = parameters_to_vector(train_ddp.MODELS[config["model"]]().parameters()).detach().numpy()
    # Contiguous slices of as near equal length as they can be.
    edges = np.linspace(0, initial.size, workers + 1).astype(int)
    bounds = list(zip(edges[:-1], edges[1:]))
    # A CPU each, spread over the nodes: a worker and its shard share a bundle.
    group = placement_group([{"CPU": 1}] * workers, strategy="SPREAD")
    try:
        # Inside the try: a group never placed is removed too.
        ray.get(group.ready(), timeout=120)
        place = [PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i) for i in range(workers)]
        shards = [
            ParameterShard.options(scheduling_strategy=place[i]).remote(initial[start:end].copy(), workers, config["lr"])
            for i, (start, end) in enumerate(bounds)
        ]
        runs = [
            train_worker.options(scheduling_strategy=place[rank]).remote(rank, workers, shards, bounds, config)
            for rank in range(workers)
        ]
        return ray.get(runs)[0]
    finally:
        remove_placement_group(group)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="workers, one CPU each, and as many shards")
    train_ddp.add_training_arguments(parser, images_per="worker")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--save", help="the trained parameters go here (torch.save)")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = train_ddp.parse_training_arguments(parser)

    ray.init(logging_level="ERROR")
    config = {
        key: getattr(args, key) for key in ("model", "steps", "batch_size", "lr", "seed", "threads")
    }
    figures, parameters = train(config, args.workers)
    if args.save:
        torch.save(parameters, args.save)
    links = cost_model.emulated_links(args.workers)
    if links is not None:
        train_ddp.add_cost_model(figures, links)
    print(
        f"ray parameter server: {figures['ranks']} workers and shards, median step {figures['median_step_ms']:.1f} ms, "
        f"forward and backward {figures['median_compute_ms']:.1f} ms, {figures['images_per_second']:.0f} images/s, "
        f"{figures['gradient_bytes']} bytes of gradients per step",
        flush=True,
    )
    if links is not None:
        print(train_ddp.cost_model_line(figures), flush=True)
    if args.json:
        print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
