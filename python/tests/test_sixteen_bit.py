"""float16 and bfloat16 against a real switch: NumPy and PyTorch tensors reduced in place,
and sums no less accurate than PyTorch's fp16_compress_hook and bf16_compress_hook give
on the same data, the same bits on every rank."""

import numpy as np
import pytest
import torch

TORCH_TYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def test_numpy_and_torch_16_bit_tensors_sum_exactly_where_they_are(switch, on_every_rank):
    contexts = switch.contexts(3)
    # Multiples of 1/4 below 128 (float16) and of 1/2 below 64 (bfloat16), sums too:
    # every value and sum is held exactly. 10007 elements: packets and threads split
    # them unevenly.
    steps = np.arange(10_007)
    halves = [((steps % 200) * 0.25 - 25 + rank).astype(np.float16) for rank in range(3)]
    brains = [torch.from_numpy(((steps % 64) * 0.5 - 16 - rank).astype(np.float32)).bfloat16() for rank in range(3)]
    torch_halves = [torch.from_numpy(h.copy()) for h in halves]
    outs = [torch.empty(10_007, dtype=torch.bfloat16) for _ in range(3)]
    pointers = [t.data_ptr() for t in brains]

    def run(rank, context):
        returned = context.allreduce(halves[rank])
        assert returned is halves[rank]
        context.allreduce(brains[rank], out=outs[rank])
        context.allreduce_async(torch_halves[rank]).wait(timeout=30)
        context.allreduce(brains[rank])

    on_every_rank(contexts, run)
    half_sum = sum(((steps % 200) * 0.25 - 25 + rank) for rank in range(3))
    brain_sum = torch.from_numpy(sum(((steps % 64) * 0.5 - 16 - rank) for rank in range(3)).astype(np.float32))
    for rank in range(3):
        assert halves[rank].dtype == np.float16
        np.testing.assert_array_equal(halves[rank], half_sum.astype(np.float16))
        assert torch.equal(torch_halves[rank], torch.from_numpy(half_sum.astype(np.float16)))
        assert torch.equal(outs[rank], brain_sum.bfloat16())
        assert brains[rank].data_ptr() == pointers[rank] and brains[rank].dtype == torch.bfloat16
        assert torch.equal(brains[rank], brain_sum.bfloat16())
    for context in contexts:
        stats = context.stop()
        assert stats["elements_submitted"] == 4 * 10_007 and stats["jobs_failed"] == 0


def random_tensors(ranks, numel, seed):
    """Uniform in (-10, 10)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(numel, generator=generator) * 20 - 10 for _ in range(ranks)]


def gradient_like_tensors(ranks, numel, seed):
    """Normal with a standard deviation of 1e-3, as gradients of a trained layer, and one
    element in a thousand an outlier up to a hundred times larger."""
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for _ in range(ranks):
        values = torch.randn(numel, generator=generator) * 1e-3
        outliers = torch.rand(numel, generator=generator) < 1e-3
        values[outliers] = (torch.rand(int(outliers.sum()), generator=generator) * 2 - 1) * 0.1
        tensors.append(values)
    return tensors


def compress_hook_sum(inputs, dtype):
    """The sum PyTorch's fp16_compress_hook or bf16_compress_hook gives: each rank's
    gradients cast to `dtype` and allreduced in it, which gloo's and NCCL's rings do by
    adding one rank's values at a time, rounding to `dtype` after every addition. (The
    hooks also divide by the world size first, which for 2, 4 and 8 ranks is exact.)"""
    total = inputs[0].to(dtype)
    for tensor in inputs[1:]:
        total = total + tensor.to(dtype)
    return total


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("type_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("data", [random_tensors, gradient_like_tensors])
@pytest.mark.parametrize("sent", ["16-bit tensors", "float32 tensors"])
def test_16_bit_sums_are_no_less_accurate_than_pytorch_s_compress_hooks(
    switch, on_every_rank, ranks, type_name, data, sent
):
    """16-bit tensors, and float32 tensors with general.wire_precision (as the hooks
    send float32 gradients), against the exact sums of the same inputs."""
    dtype = TORCH_TYPES[type_name]
    inputs = data(ranks, 65_537, seed=ranks)
    if sent == "16-bit tensors":
        inputs = [tensor.to(dtype) for tensor in inputs]
        contexts = switch.contexts(ranks)
    else:
        contexts = switch.contexts(ranks, general__wire_precision=type_name)
    results = [tensor.clone() for tensor in inputs]
    on_every_rank(contexts, lambda rank, context: context.allreduce(results[rank]))
    for context in contexts:
        context.stop()

    stacked = torch.stack([tensor.double() for tensor in inputs])
    exact = stacked.sum(dim=0)
    ours = (results[0].double() - exact).abs()
    hook = (compress_hook_sum(inputs, dtype).double() - exact).abs()
    assert ours.max() <= hook.max() and ours.mean() <= hook.mean(), (ours.max(), hook.max(), ours.mean(), hook.mean())
    if sent == "16-bit tensors":
        # Summed in float32 and rounded once, each sum is the 16-bit value nearest the
        # exact one, but for float32's own rounding of the running sum.
        float32_rounding = ranks * torch.finfo(torch.float32).eps * stacked.abs().sum(dim=0)
        worse = ours > hook + float32_rounding
        assert not worse.any(), f"{int(worse.sum())} sums worse than the hook's, at {worse.nonzero()[:5].flatten()}"
    else:
        # The sums crossed the wire in 16 bits: widened, they are 16-bit values.
        assert torch.equal(results[0].to(dtype).float(), results[0])
    # Data-parallel training needs the same sums on every rank, to the bit.
    for result in results[1:]:
        assert result.dtype == inputs[0].dtype
        assert result.view(torch.uint8).numpy().tobytes() == results[0].view(torch.uint8).numpy().tobytes()


class Bucket:
    """What the hook reads of DDP's GradBucket: its flat buffer of gradients."""

    def __init__(self, tensor):
        self.tensor = tensor

    def buffer(self):
        return self.tensor


@pytest.mark.parametrize("type_name", ["float16", "bfloat16"])
def test_the_ddp_hook_averages_16_bit_buckets_in_place(switch, on_every_rank, type_name):
    # Debian's PyTorch cannot train a 16-bit model on the CPU (no half convolution, and
    # its gloo sums no bfloat16), so the hook is called as DDP would call it.
    from netagg.ddp import NetaggState, allreduce_hook

    dtype = TORCH_TYPES[type_name]
    contexts = switch.contexts(2)
    steps = torch.arange(4099, dtype=torch.float32) % 32
    # x - 8 and x - 6: halved, summed and averaged, every value is exact in both types.
    buckets = [(steps - 8 + 2 * rank).to(dtype) for rank in range(2)]
    pointers = [bucket.data_ptr() for bucket in buckets]

    def run(rank, context):
        return allreduce_hook(NetaggState(context), Bucket(buckets[rank])).wait()

    averaged = on_every_rank(contexts, run)
    for rank in range(2):
        assert averaged[rank] is buckets[rank] and buckets[rank].data_ptr() == pointers[rank]
        assert buckets[rank].dtype == dtype
        assert torch.equal(buckets[rank], (steps - 7).to(dtype))
    for context in contexts:
        assert context.stop()["jobs_failed"] == 0
