"""The Python API against a real switch: sums, zero copies, asynchronous jobs, errors."""

import os
import signal
import threading
import time
import tracemalloc
import weakref

import numpy as np
import pytest
import torch

import netagg


def float_bound(inputs):
    """Float32 sums of N terms in any order differ from the exact sum by at most about
    N·ε·Σ|x|; twice that, per element."""
    return 2 * len(inputs) * np.finfo(np.float32).eps * np.sum(np.abs(np.stack(inputs).astype(np.float64)), axis=0)


@pytest.mark.parametrize("workers", [2, 4])
def test_numpy_int32_sums_are_exact_in_place_and_out_of_place(switch, on_every_rank, workers):
    contexts = switch.contexts(workers)
    rng = np.random.default_rng(7)
    # 100003 elements: not a multiple of a packet's 256.
    inputs = [rng.integers(-(2**20), 2**20, size=100_003, dtype=np.int32) for _ in range(workers)]
    expected = np.sum(np.stack(inputs).astype(np.int64), axis=0)

    in_place = [x.copy() for x in inputs]
    returned = on_every_rank(contexts, lambda rank, c: c.allreduce(in_place[rank]))
    outputs = [np.zeros_like(x) for x in inputs]
    on_every_rank(contexts, lambda rank, c: c.allreduce(inputs[rank], out=outputs[rank]))
    for rank in range(workers):
        assert returned[rank] is in_place[rank]
        np.testing.assert_array_equal(in_place[rank], expected)
        np.testing.assert_array_equal(outputs[rank], expected)
    for context in contexts:
        stats = context.stop()
        assert stats["jobs_finished"] == 2 and stats["jobs_failed"] == 0
        assert stats["total"]["data_sent"] > 0


def test_losses_found_by_the_packets_numbers_are_counted_in_the_stats(switch, on_every_rank):
    # 2 % of datagrams dropped each way at every rank: exact sums, and the losses that the
    # numbering of packets showed, recovered without a timer, in every thread's counters.
    contexts = switch.contexts(2, faults__send_drop="0.02", faults__receive_drop="0.02", faults__seed=5)
    inputs = [np.arange(100_003, dtype=np.int32) * (rank + 1) for rank in range(2)]
    for _ in range(3):
        sums = on_every_rank(contexts, lambda rank, c: c.allreduce(inputs[rank].copy()))
        for result in sums:
            np.testing.assert_array_equal(result, np.arange(100_003, dtype=np.int32) * 3)
    for context in contexts:
        stats = context.stop()
        assert all({"gap_requests", "lost_notices"} <= thread.keys() for thread in stats["threads"])
        assert stats["total"]["gap_requests"] > 0 and stats["total"]["lost_notices"] > 0, stats["total"]


def test_numpy_float32_sums_are_within_the_rounding_bound(switch, on_every_rank):
    contexts = switch.contexts(3)
    rng = np.random.default_rng(11)
    inputs = [rng.standard_normal(50_000).astype(np.float32) * 1e3 for _ in range(3)]
    sums = on_every_rank(contexts, lambda rank, c: c.allreduce(inputs[rank].copy()))
    exact = np.sum(np.stack(inputs).astype(np.float64), axis=0)
    for result in sums:
        assert result.dtype == np.float32
        assert np.all(np.abs(result - exact) <= float_bound(inputs))
        # Every rank gets the same bits, as data-parallel training needs.
        assert result.tobytes() == sums[0].tobytes()
    # PyTorch tensors, out of place.
    tensors = [torch.from_numpy(x) for x in inputs]
    outs = [torch.empty(50_000) for _ in range(3)]
    on_every_rank(contexts, lambda rank, c: c.allreduce(tensors[rank], out=outs[rank]))
    for out in outs:
        assert np.all(np.abs(out.numpy() - exact) <= float_bound(inputs))
        assert torch.equal(out, outs[0])
    for context in contexts:
        context.stop()


def test_torch_tensors_are_reduced_where_they_are(switch, on_every_rank):
    contexts = switch.contexts(2)
    ints = [torch.arange(10_000, dtype=torch.int32) * (rank + 1) for rank in range(2)]
    pointers = [t.data_ptr() for t in ints]
    floats = [torch.full((4096,), 0.25 * (rank + 1)) for rank in range(2)]
    outs = [torch.empty(4096) for _ in range(2)]
    # A tensor that requires grad, as parameters do: its memory is reduced all the same.
    weights = [torch.ones(300, requires_grad=True) for _ in range(2)]

    def run(rank, context):
        context.allreduce(ints[rank])
        context.allreduce(floats[rank], out=outs[rank])
        with torch.no_grad():
            context.allreduce(weights[rank])

    on_every_rank(contexts, run)
    for rank in range(2):
        assert ints[rank].data_ptr() == pointers[rank]
        assert torch.equal(ints[rank], torch.arange(10_000, dtype=torch.int32) * 3)
        assert torch.equal(outs[rank], torch.full((4096,), 0.75))
        assert torch.equal(floats[rank], torch.full((4096,), 0.25 * (rank + 1)))  # input untouched
        assert torch.equal(weights[rank].detach(), torch.full((300,), 2.0))
    for context in contexts:
        context.stop()


def test_async_jobs_overlap_and_call_back_once_done(switch, on_every_rank):
    contexts = switch.contexts(2)
    tensors = [[np.full(20_000, job + rank, dtype=np.int32) for job in range(8)] for rank in range(2)]
    called = [[] for _ in range(2)]
    all_called = [threading.Event() for _ in range(2)]

    def run(rank, context):
        jobs = [context.allreduce_async(t) for t in tensors[rank]]
        for job in jobs:
            job.add_done_callback(lambda job: on_done(rank, job))
        for job in jobs:
            assert job.wait(timeout=30.0)
        assert all(job.done() for job in jobs)
        return [job.id for job in jobs]

    def on_done(rank, job):
        called[rank].append((job.id, job.exception(), threading.current_thread() is threading.main_thread()))
        if len(called[rank]) == 8:
            all_called[rank].set()

    ids = on_every_rank(contexts, run)
    assert ids[0] == ids[1]  # jobs are numbered alike on every rank
    for rank in range(2):
        assert all_called[rank].wait(10)
        assert sorted(id for id, _, _ in called[rank]) == ids[rank]
        assert all(error is None and not on_main for _, error, on_main in called[rank])
        for job, tensor in enumerate(tensors[rank]):
            np.testing.assert_array_equal(tensor, np.full(20_000, 2 * job + 1, dtype=np.int32))
    # A callback added after the job ended is called too.
    job = contexts[0].allreduce_async(np.zeros(0, dtype=np.float32))
    late = threading.Event()
    job.wait()
    job.add_done_callback(lambda job: late.set())
    assert late.wait(10)
    for context in contexts:
        context.stop()


def test_a_job_keeps_its_buffers_alive_when_python_drops_them(switch, on_every_rank):
    contexts = switch.contexts(2)
    outputs = [np.zeros(200_000, dtype=np.int32) for _ in range(2)]

    def run(rank, context):
        data = np.full(200_000, rank + 1, dtype=np.int32)
        freed = weakref.finalize(data, lambda: None)
        if rank == 1:
            time.sleep(0.5)  # rank 0's job waits at the switch meanwhile
        job = context.allreduce_async(data, out=outputs[rank])
        ended = threading.Event()
        job.add_done_callback(lambda job: ended.set())
        del data, job  # the job alone holds the input now
        assert freed.alive, "the input was freed under a running job"
        assert ended.wait(30)
        # Released once the job ended: nothing holds the input any more.
        deadline = time.monotonic() + 10
        while freed.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not freed.alive, "the job kept its input after it ended"

    on_every_rank(contexts, run)
    for output in outputs:
        np.testing.assert_array_equal(output, np.full(200_000, 3, dtype=np.int32))
    for context in contexts:
        context.stop()


def test_nothing_is_copied_on_the_way_in_or_out():
    with dummy() as context:
        tensor = np.ones(4 << 20, dtype=np.float32)  # 16 MiB
        tracemalloc.start()
        context.allreduce(tensor)
        context.allreduce_async(tensor).wait()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 64 << 10, f"{peak} bytes allocated by Python for a 16 MiB tensor"
        assert tensor[0] == 4.0 and tensor[-1] == 4.0


def dummy(**settings):
    return netagg.Context(
        settings={"general.backend": "dummy", "general.num_workers": 2, "backend.dummy.bandwidth": 0, **settings}
    )


def test_bad_tensors_raise_clear_errors():
    with dummy() as context:
        with pytest.raises(TypeError, match="format 'd'.*float32, int32, float16 and bfloat16"):
            context.allreduce(np.zeros(8))
        with pytest.raises(TypeError, match="must be a NumPy array, a PyTorch CPU tensor .* this list is not"):
            context.allreduce([1, 2, 3])
        with pytest.raises(TypeError, match="format 'O' \\(8 bytes\\): netagg sums float32, int32, float16 and bfloat16"):
            context.allreduce(np.array([object()] * 4))
        with pytest.raises(TypeError, match="this datetime is not"):
            context.allreduce(__import__("datetime").datetime.now())
        with pytest.raises(TypeError, match="other byte order \\('>f'\\)"):
            context.allreduce(np.zeros(8, dtype=">f4"))
        with pytest.raises(TypeError, match="tensor is a torch.float64 tensor: netagg sums float32, int32, float16 and bfloat16"):
            context.allreduce(torch.zeros(8, dtype=torch.float64))
        with pytest.raises(TypeError, match="tensor is a torch.int16 tensor"):
            context.allreduce(torch.zeros(8, dtype=torch.int16))
        # NumPy's int16 has float16's size, not its type.
        with pytest.raises(TypeError, match="format 'h' \\(2 bytes\\)"):
            context.allreduce(np.zeros(8, dtype=np.int16))
        shared = np.zeros(64, dtype=np.int32)
        with pytest.raises(ValueError, match="input and output overlap without being the same memory"):
            context.allreduce(shared[:-1], out=shared[1:])
        np.testing.assert_array_equal(context.allreduce(shared, out=shared), np.zeros(64, dtype=np.int32))
        with pytest.raises(ValueError, match="tensor is not contiguous"):
            context.allreduce(np.zeros(16, dtype=np.int32)[::2])
        with pytest.raises(ValueError, match="tensor is not contiguous"):
            context.allreduce(torch.zeros(4, 4).t())
        read_only = np.zeros(8, dtype=np.int32)
        read_only.flags.writeable = False
        with pytest.raises(ValueError, match="tensor is read-only"):
            context.allreduce(read_only)
        context.allreduce(read_only, out=np.zeros(8, dtype=np.int32))  # read-only input is fine
        with pytest.raises(ValueError, match="out holds 7 int32 elements, tensor 8 int32"):
            context.allreduce(np.zeros(8, dtype=np.int32), out=np.zeros(7, dtype=np.int32))
        with pytest.raises(ValueError, match="out holds 8 float32 elements, tensor 8 int32"):
            context.allreduce(np.zeros(8, dtype=np.int32), out=np.zeros(8, dtype=np.float32))
        with pytest.raises(ValueError, match="out holds 8 bfloat16 elements, tensor 8 float16"):
            context.allreduce(torch.zeros(8, dtype=torch.float16), out=torch.zeros(8, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0, not -1"):
            context.allreduce_async(np.zeros(8, dtype=np.int32)).wait(timeout=-1)
        # A timeout past any clock's range waits as no timeout does.
        assert context.allreduce_async(np.zeros(8, dtype=np.int32)).wait(timeout=1e30)
        with pytest.raises(TypeError, match="callback must be callable"):
            context.allreduce_async(np.zeros(8, dtype=np.int32)).add_done_callback(3)
    with pytest.raises(netagg.StoppedError, match="the context is stopped"):
        context.allreduce(np.zeros(8, dtype=np.int32))


def test_memory_a_job_in_flight_uses_is_refused_to_another_until_it_ends():
    # 1 Gbit/s: a job of 4 MiB stays in flight for tens of milliseconds.
    with dummy(**{"backend.dummy.bandwidth": 1000}) as context:
        shared = np.ones(1 << 20, dtype=np.float32)
        elsewhere = np.zeros(16, dtype=np.float32)
        first = context.allreduce_async(shared)
        with pytest.raises(netagg.BufferInUseError, match="the output of this job .* overlaps the input of job 1"):
            context.allreduce(shared[16:32])
        with pytest.raises(netagg.BufferInUseError, match="the input of this job .* overlaps the output of job 1"):
            context.allreduce(shared[16:32], out=elsewhere)
        assert issubclass(netagg.BufferInUseError, netagg.InvalidInputError)
        again = context.allreduce_async(shared)  # the same memory: runs after the first
        assert again.id == 4, "jobs refused for buffers in use keep their numbers"
        context.wait_all()
        assert first.done() and again.done()
        context.allreduce(shared[16:32], out=elsewhere)
        np.testing.assert_array_equal(shared, np.full(1 << 20, 4.0, dtype=np.float32))
        np.testing.assert_array_equal(elsewhere, np.full(16, 8.0, dtype=np.float32))


def test_bad_configuration_raises_config_error_with_the_library_s_message(tmp_path):
    with pytest.raises(netagg.ConfigError, match="key 'general.num_workers' = 'many': expected an integer"):
        netagg.Context(settings={"general.num_workers": "many"})
    with pytest.raises(netagg.ConfigError, match="unknown key 'general.colour'"):
        netagg.Context(settings={"general.colour": "blue"})
    with pytest.raises(
        netagg.ConfigError,
        match=r"general.rank 5 \(set by the program\) must be below general.num_workers 2 \(set by the program\)",
    ):
        netagg.Context(settings={"general.backend": "dummy", "general.rank": 5, "general.num_workers": 2})
    bad_file = tmp_path / "bad.cfg"
    bad_file.write_text("[general]\nnum_worker_threads = 0\n")
    with pytest.raises(netagg.ConfigError, match=f"{bad_file}: key 'general.num_worker_threads' = '0'"):
        netagg.Context(str(bad_file))
    with pytest.raises(netagg.ConfigError, match="missing.cfg"):
        netagg.Context(str(tmp_path / "missing.cfg"))
    assert issubclass(netagg.ConfigError, netagg.Error)


def test_a_switch_that_is_not_there_raises_within_the_connect_timeout(switch):
    settings = switch.settings(0, 2, "nobody-listens", **{"general.connect_timeout": 2})
    switch.kill()
    started = time.monotonic()
    with pytest.raises(netagg.SwitchError, match="cannot reach the switch"):
        netagg.Context(settings=settings)
    assert time.monotonic() - started < 10


def test_a_switch_that_dies_fails_the_job_without_hanging(switch, on_every_rank):
    contexts = switch.contexts(2, general__job_timeout=2)
    on_every_rank(contexts, lambda rank, c: c.allreduce(np.ones(1000, dtype=np.int32)))
    # In flight: rank 1 never contributes, so the job waits at the switch until it dies.
    job = contexts[0].allreduce_async(np.ones(100_000, dtype=np.float32))
    assert not job.wait(timeout=0.5)
    switch.kill()
    started = time.monotonic()
    with pytest.raises(netagg.Error) as failure:
        job.wait(timeout=30)
    assert isinstance(failure.value, (netagg.JobError, netagg.SwitchError)), failure.value
    assert time.monotonic() - started < 20
    # And a job submitted after: refused at once, or failed by its timeout.
    with pytest.raises((netagg.JobError, netagg.SwitchError)):
        contexts[1].allreduce_async(np.ones(10, dtype=np.int32)).wait(timeout=30)
    for context in contexts:
        context.stop()


def test_a_switch_that_stops_answering_fails_the_job_by_its_timeout(switch, on_every_rank):
    contexts = switch.contexts(2, general__job_timeout=2)
    on_every_rank(contexts, lambda rank, c: c.allreduce(np.ones(1000, dtype=np.int32)))
    os.kill(switch.process.pid, signal.SIGSTOP)  # alive, connections open, silent
    try:
        started = time.monotonic()
        jobs = on_every_rank(contexts, lambda rank, c: c.allreduce_async(np.ones(50_000, dtype=np.int32)))
        assert not jobs[0].wait(timeout=0.5)
        error = jobs[0].exception(timeout=30)
        assert isinstance(error, netagg.JobError), error
        assert "job failed" in str(error)
        assert time.monotonic() - started < 20
        with pytest.raises(netagg.JobError):
            jobs[1].wait(timeout=30)
        assert jobs[0].done() and jobs[1].done()
    finally:
        os.kill(switch.process.pid, signal.SIGCONT)
    for context in contexts:
        context.stop()


def test_exception_times_out_on_a_running_job(switch):
    contexts = switch.contexts(2)
    job = contexts[0].allreduce_async(np.ones(10, dtype=np.int32))  # rank 1 never joins in
    with pytest.raises(TimeoutError, match="has not ended"):
        job.exception(timeout=0.2)
    contexts[1].allreduce(np.ones(10, dtype=np.int32))
    assert job.exception(timeout=30) is None
    for context in contexts:
        context.stop()


@pytest.mark.skipif(os.path.exists("/sys/class/infiniband"), reason="this host has RDMA devices")
def test_rdma_without_a_device_raises_the_error_that_says_how_to_get_one():
    with pytest.raises(netagg.Error, match="backend.rdma: no RDMA device: this kernel has no RDMA support") as error:
        netagg.Context(settings={"general.backend": "rdma"})
    assert "rdma link add rxe0 type rxe netdev eth0" in str(error.value)
    assert "backend = udp needs none" in str(error.value)
