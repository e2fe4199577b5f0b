"""Trains a small CNN with DistributedDataParallel, its gradients averaged through netagg.

    netagg-run -n 4 -- python3 examples/python/train_ddp.py
    netagg-run -n 4 --link rate=100mbit,delay=1ms -- python3 examples/python/train_ddp.py --model alexnet
    netagg-run -n 4 -- python3 examples/python/train_ddp.py --baseline gloo
    netagg-run -n 4 -- python3 examples/python/train_ddp.py --gradients bfloat16

netagg-run starts a switch and the ranks, and sets what both netagg and PyTorch read
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); under torchrun, point netagg at a running
netagg-switch with NETAGG_GENERAL__CONTROLLER_IP and NETAGG_GENERAL__CONTROLLER_PORT.
The images are synthetic, each a random pattern of its class under noise, so that the
loss falls; nothing is downloaded. With ``--baseline gloo`` the same model trains with
PyTorch's own allreduce (DDP's built-in path over gloo) in place of netagg.

``--gradients float16`` or ``bfloat16`` keeps the model in float32 and sends its gradients
as 16-bit values: netagg's ``general.wire_precision``, or with ``--baseline gloo``
PyTorch's ``fp16_compress_hook`` or ``bf16_compress_hook``. Each rank
prints its loss per step; rank 0 then prints throughput and what communication costs a
step: the median step against the median of as many steps again without gradient
synchronisation (forward and backward under ``model.no_sync()``, parameters untouched),
measured alike for both; and, for netagg, how long buckets were in flight. On emulated
links (``netagg-run --link ...``) it also prints what the cost model (cost_model.py)
says a step's gradients take on them, through netagg and by a ring.

``--model alexnet`` trains a network of AlexNet's layers instead (``AlexNet32``): 4.36
million parameters, 17.4 MB of float32 gradients a step, 16 times the small CNN's.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import cost_model  # beside this file
import netagg
from netagg.ddp import NetaggState, allreduce_hook


class SmallCnn(nn.Module):
    """Two convolutions and two dense layers over 32x32 RGB images, 10 classes."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 8 * 8, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


class AlexNet32(nn.Module):
    """AlexNet's five convolutions (64, 192, 384, 256, 256 channels) and three dense
    layers over 32x32 RGB images, 10 classes: 3x3 kernels, the first of stride 2, and
    dense layers of 1024 where AlexNet has 4096, so that a step's gradients (17.4 MB)
    cross a 100 Mbit/s link in about 1.5 s; 4096 would make them 93 MB."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8
            nn.Conv2d(64, 192, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 4x4
            nn.Conv2d(192, 384, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(384, 256, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(256, 256, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 2x2
        )
        self.classifier = nn.Sequential(
            nn.Linear(256 * 2 * 2, 1024),
            nn.ReLU(),
            nn.Linear(1024, 1024),
            nn.ReLU(),
            nn.Linear(1024, 10),
        )

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


MODELS = {"small": SmallCnn, "alexnet": AlexNet32}


def synthetic_batches(rank, batch_size, seed):
    """This rank's endless stream of (images, labels): each image its class's pattern,
    which every rank shares, under noise from a generator of the rank's own."""
    patterns = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    data = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    while True:
        labels = torch.randint(0, 10, (batch_size,), generator=data)
        yield patterns[labels] + 3.0 * torch.randn(batch_size, 3, 32, 32, generator=data), labels


def add_training_arguments(parser, images_per="rank"):
    """The arguments every training program here takes (this one, ray_train.py and
    ray_parameter_server.py), so that their runs are compared by the same flags."""
    parser.add_argument("--model", choices=MODELS, default="small", help="the small CNN, or AlexNet32")
    parser.add_argument("--steps", type=int, default=50, help="training steps, at least 2")
    parser.add_argument("--batch-size", type=int, default=32, help=f"images per {images_per} per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=1)


def parse_training_arguments(parser):
    """The parsed arguments, refused when too few steps leave no timed step."""
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    return args


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_training_arguments(parser)
    parser.add_argument("--baseline", choices=["gloo"], help="train with PyTorch's allreduce instead")
    parser.add_argument(
        "--gradients",
        choices=["float32", "float16", "bfloat16"],
        default="float32",
        help="how a float32 model's gradients travel (gloo: PyTorch's compress hook)",
    )
    parser.add_argument("--bucket-mb", type=float, default=25, help="DDP's bucket size (its default: 25)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks)")
    parser.add_argument("--config", help="a netagg config file (otherwise the usual search)")
    parser.add_argument("--save", help="rank 0 saves the trained parameters here (torch.save)")
    parser.add_argument("--json", action="store_true", help="rank 0 also prints its figures as JSON")
    args = parse_training_arguments(parser)

    dist.init_process_group("gloo")  # DDP broadcasts the initial parameters through it
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = DistributedDataParallel(MODELS[args.model](), bucket_cap_mb=args.bucket_mb)

    context = state = None
    if args.baseline is None:
        narrowed = {"general.wire_precision": args.gradients} if args.gradients != "float32" else None
        context = netagg.Context(args.config, settings=narrowed)
        if (context.rank, context.num_workers) != (rank, world):
            raise SystemExit(f"netagg sees rank {context.rank} of {context.num_workers}, PyTorch {rank} of {world}")
        state = NetaggState(context)
        model.register_comm_hook(state, allreduce_hook)
    elif args.gradients != "float32":
        compress = {"float16": default_hooks.fp16_compress_hook, "bfloat16": default_hooks.bf16_compress_hook}
        model.register_comm_hook(None, compress[args.gradients])
    try:
        figures = train(args, model, rank, world, state)
    finally:
        if context is not None:
            context.stop()
    if rank == 0:
        links = cost_model.emulated_links(world)
        if links is not None:
            add_cost_model(figures, links)
        print(
            f"{figures['allreduce']}: {world} ranks, {figures['gradients']} gradients, median step {figures['median_step_ms']:.1f} ms, "
            f"forward and backward {figures['median_sync_ms']:.1f} ms against "
            f"{figures['median_compute_ms']:.1f} ms without synchronising gradients (communication adds "
            f"{figures['median_sync_ms'] - figures['median_compute_ms']:.1f} ms), "
            f"{figures['images_per_second']:.0f} images/s, {figures['gradient_bytes']} bytes of gradients per step"
            + (
                f", {figures['netagg_jobs']} netagg jobs, buckets in flight {figures['in_flight_seconds']:.2f} s "
                f"of {figures['train_seconds']:.2f} s"
                if state
                else ""
            )
        )
        if links is not None:
            print(cost_model_line(figures))
        if args.json:
            print(json.dumps(figures))
        if args.save:
            torch.save(model.module.state_dict(), args.save)
    dist.destroy_process_group()


def add_cost_model(figures, links):
    """Adds what the cost model predicts for a step's gradients on ``links``, as they
    travel (16-bit values: half the bytes), with the packet size and window the netagg
    run had (netagg's defaults for gloo's)."""
    wire_bytes = figures["gradient_bytes"] if figures["gradients"] == "float32" else figures["gradient_bytes"] // 2
    settings = {key: figures[key] for key in ("packet_numel", "window_packets") if figures[key] is not None}
    figures["cost_model"] = cost_model.predict(links, wire_bytes, **settings)


def cost_model_line(figures):
    """The cost model's figures beside what communication added to a step."""
    measured = figures["median_sync_ms"] - figures["median_compute_ms"]
    return f"{cost_model.summary(figures['cost_model'])}; measured: communication adds {measured:.1f} ms a step"


def train(args, model, rank, world, state):
    """Trains, then times the same work without synchronisation; returns the figures."""
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    batches = synthetic_batches(rank, args.batch_size, args.seed)
    step_seconds, sync_seconds = [], []
    for step in range(args.steps):
        images, labels = next(batches)
        started = time.perf_counter()
        optimizer.zero_grad()
        forward = time.perf_counter()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()  # returns once every bucket's gradients are averaged
        sync_seconds.append(time.perf_counter() - forward)
        optimizer.step()
        step_seconds.append(time.perf_counter() - started)
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    in_flight = state.comm_seconds if state else None

    # The same forward and backward without synchronising gradients: what they cost
    # without the network. The parameters stay as trained.
    compute_seconds = []
    for _ in range(args.steps):
        images, labels = next(batches)
        started = time.perf_counter()
        with model.no_sync():
            F.cross_entropy(model(images), labels).backward()
        compute_seconds.append(time.perf_counter() - started)
        model.zero_grad()

    # The first steps warm up (allocations, the session's first packets).
    warm = min(5, args.steps // 2)
    timed = step_seconds[warm:]
    return {
        "allreduce": args.baseline or "netagg",
        "model": args.model,
        "gradients": args.gradients,
        "ranks": world,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "median_step_ms": statistics.median(timed) * 1e3,
        "median_sync_ms": statistics.median(sync_seconds[warm:]) * 1e3,
        "median_compute_ms": statistics.median(compute_seconds[warm:]) * 1e3,
        "images_per_second": world * args.batch_size * len(timed) / sum(timed),
        "in_flight_seconds": in_flight,
        "netagg_jobs": state.context.stats()["jobs_finished"] if state else None,
        "train_seconds": sum(step_seconds),
        "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        # What of netagg's configuration the cost model reads.
        "packet_numel": int(state.context.setting("general.packet_numel")) if state else None,
        "window_packets": int(state.context.setting("general.max_outstanding_packets")) if state else None,
    }


if __name__ == "__main__":
    main()
