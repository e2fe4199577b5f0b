"""Trains train_ddp.py's model with Ray Train's TorchTrainer, gradients averaged through a
netagg switch that the Ray cluster runs (or, with ``--baseline gloo``, through PyTorch's
allreduce over gloo).

    python3 examples/python/ray_train.py --workers 2            # on RAY_ADDRESS's cluster
    netagg-run -n 3 --link rate=100mbit,delay=1ms --rank-link 2:rate=10gbit,delay=0ms -- \\
        python3 examples/python/ray_cluster.py --switch-node -- \\
        python3 examples/python/ray_train.py --workers 2 --switch-resource netagg_switch

``netagg.ray.Switch`` starts the switch in an actor (on the head node, or on the node
with ``--switch-resource``); in each worker, ``netagg.ray.prepare_ddp`` wraps the model
in DDP and registers netagg's hook. Rank 0 reports train_ddp.py's figures (median step,
forward and backward with and without gradient synchronisation, images/s), which the
driver prints, and its trained parameters as the run's checkpoint (``--save``). On
emulated links (netagg-run's, through ray_cluster.py) the driver also prints what the
cost model says the first ``--workers`` nodes' links allow a step's gradients.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import ray
import ray.cloudpickle
import ray.train
import ray.train.torch
import torch

import netagg.ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cost_model  # noqa: E402  (beside this file)
import train_ddp  # noqa: E402

# The workers have no copy of this folder on their path: its code travels with the
# training function.
ray.cloudpickle.register_pickle_by_value(train_ddp)
ray.cloudpickle.register_pickle_by_value(cost_model)


def train_loop_per_worker(config):
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    args = argparse.Namespace(**config)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # the same initial model on every rank
    ddp = {"parallel_strategy_kwargs": {"bucket_cap_mb": args.bucket_mb}}
    network = train_ddp.MODELS[args.model]()
    if args.baseline is None:
        model = netagg.ray.prepare_ddp(network, **ddp)
        state = model.netagg_state
    else:
        model = ray.train.torch.prepare_model(network, **ddp)
        state = None
    try:
        figures = train_ddp.train(args, model, rank, world, state)
    finally:
        if state is not None:
            state.context.stop()
    if rank != 0:
        ray.train.report(figures)
        return
    # The trained parameters as the run's checkpoint, which carries rank 0's figures to
    # the driver.
    with tempfile.TemporaryDirectory() as folder:
        torch.save(model.module.state_dict(), os.path.join(folder, "model.pt"))
        ray.train.report(figures, checkpoint=ray.train.Checkpoint.from_directory(folder))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="Ray Train workers, one CPU each")
    train_ddp.add_training_arguments(parser)
    parser.add_argument("--bucket-mb", type=float, default=25, help="DDP's bucket size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--baseline", choices=["gloo"], help="train with PyTorch's allreduce instead")
    parser.add_argument("--switch", help="netagg-switch's path (default: the one on the PATH)")
    parser.add_argument("--switch-resource", help="the custom resource of the switch's node (default: the head)")
    parser.add_argument("--save", help="the trained parameters go here (torch.save)")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = train_ddp.parse_training_arguments(parser)

    ray.init(logging_level="ERROR")
    storage = tempfile.mkdtemp(prefix="ray-train-")  # Ray Train's checkpoints: none kept
    config = {
        "model": args.model,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "bucket_mb": args.bucket_mb,
        "threads": args.threads,
        "baseline": args.baseline,
        "gradients": "float32",
    }
    trainer = ray.train.torch.TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=args.workers),
        run_config=ray.train.RunConfig(storage_path=storage),
    )
    try:
        if args.baseline is None:
            with netagg.ray.Switch(args.switch, resource=args.switch_resource, switch_args=["--log-level", "error"]):
                result = trainer.fit()
        else:
            result = trainer.fit()
        figures = result.metrics
        if args.save:
            with result.checkpoint.as_directory() as folder:
                shutil.copyfile(os.path.join(folder, "model.pt"), args.save)
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    links = cost_model.emulated_links(args.workers)
    if links is not None:
        train_ddp.add_cost_model(figures, links)
    line = (
        f"ray train, {figures['allreduce']}: {figures['ranks']} workers, "
        f"median step {figures['median_step_ms']:.1f} ms, "
        f"forward and backward {figures['median_sync_ms']:.1f} ms against {figures['median_compute_ms']:.1f} ms "
        f"without synchronising gradients, {figures['images_per_second']:.0f} images/s, "
        f"{figures['gradient_bytes']} bytes of gradients per step"
    )
    print(line, flush=True)
    if links is not None:
        print(train_ddp.cost_model_line(figures), flush=True)
    if args.json:
        print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
