//! Jobs awaited as futures: several at once under tokio, woken once each by a waker of a
//! hand-made executor, and ended with an error, not left pending, when the context stops;
//! jobs in flight own their buffers.

mod common;

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

use common::Switch;
use netagg::{Error, JobStatus};

/// What rank `rank` holds at element `i` of job `job`.
fn value(rank: usize, job: usize, i: usize) -> i32 {
    (i % 997) as i32 * (job as i32 + 1) - 3 * rank as i32
}

#[test]
fn jobs_awaited_concurrently_under_tokio_sum_exactly_on_two_ranks() {
    let switch = Switch::start(&[]);
    let contexts = common::contexts(&switch, 2, |_| {});
    let sizes = [100_000, 1, 4096, 0, 33_333, 257];
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).build().unwrap();
    // Every rank submits in the same order; the tasks then await in whatever order the
    // jobs end.
    let mut tasks = tokio::task::JoinSet::new();
    for (rank, context) in contexts.iter().enumerate() {
        for (job, &numel) in sizes.iter().enumerate() {
            let handle = context.allreduce_async((0..numel).map(|i| value(rank, job, i)).collect()).unwrap();
            tasks.spawn_on(async move { (rank, job, handle.await) }, runtime.handle());
        }
    }
    let finished = runtime.block_on(async {
        let mut finished = 0;
        while let Some(joined) = tasks.join_next().await {
            let (rank, job, sums) = joined.unwrap();
            let sums = sums.unwrap_or_else(|e| panic!("rank {rank} job {job}: {e}"));
            assert_eq!(sums.len(), sizes[job]);
            let wrong =
                sums.iter().enumerate().filter(|&(i, &sum)| sum != value(0, job, i) + value(1, job, i));
            assert_eq!(wrong.count(), 0, "rank {rank} job {job}");
            finished += 1;
        }
        finished
    });
    assert_eq!(finished, 2 * sizes.len());
    for context in &contexts {
        assert_eq!(context.stop().jobs_finished, sizes.len() as u64);
    }
}

/// Counts its wakes and unparks the thread that polls.
struct CountingWaker {
    wakes: AtomicUsize,
    thread: Thread,
}

impl Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.wakes.fetch_add(1, Ordering::SeqCst);
        self.thread.unpark();
    }
}

#[test]
fn a_job_wakes_its_task_once_when_it_ends_and_needs_no_polling_before() {
    let switch = Switch::start(&[]);
    let contexts = common::contexts(&switch, 2, |_| {});
    let counter = Arc::new(CountingWaker { wakes: AtomicUsize::new(0), thread: std::thread::current() });
    let waker = Waker::from(Arc::clone(&counter));
    let mut cx = std::task::Context::from_waker(&waker);

    // Rank 1 has not submitted yet, so rank 0's job cannot end.
    let mut job = pin!(contexts[0].allreduce_async(vec![5i32; 10_000]).unwrap());
    for _ in 0..3 {
        assert!(job.as_mut().poll(&mut cx).is_pending());
    }
    let mut other = vec![7i32; 10_000];
    contexts[1].allreduce(&mut other).unwrap();
    assert!(other.iter().all(|&sum| sum == 12));
    let deadline = Instant::now() + Duration::from_secs(20);
    while counter.wakes.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the job's end woke nobody");
        std::thread::park_timeout(Duration::from_millis(100));
    }
    // Woken once, though polled three times: then it is ready.
    let Poll::Ready(sums) = job.as_mut().poll(&mut cx) else { panic!("woken but still pending") };
    assert!(sums.unwrap().iter().all(|&sum| sum == 12));
    assert_eq!(counter.wakes.load(Ordering::SeqCst), 1);
}

#[test]
fn stopping_the_context_ends_an_awaited_job_with_an_error() {
    let switch = Switch::start(&[]);
    let mut contexts = common::contexts(&switch, 2, |_| {});
    // Rank 1 stays in the session but never submits: the job could only end by the job
    // timeout, but the stop ends it first.
    let idle = contexts.pop().unwrap();
    let context = Arc::new(contexts.pop().unwrap());
    let tensor_job = context.allreduce_async(vec![1i32; 1000]).unwrap();
    let job = tensor_job.job().clone();
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_time().build().unwrap();
    let (job_outcome, tensor_outcome) = runtime.block_on(async {
        let stopper = Arc::clone(&context);
        let stopped = tokio::task::spawn_blocking(move || {
            std::thread::sleep(Duration::from_millis(200));
            stopper.stop();
        });
        let within = Duration::from_secs(5);
        let outcomes =
            tokio::join!(tokio::time::timeout(within, job), tokio::time::timeout(within, tensor_job));
        stopped.await.unwrap();
        outcomes
    });
    assert_eq!(job_outcome.expect("the job still pending after the stop"), Err(Error::Stopped));
    assert_eq!(tensor_outcome.expect("the job still pending after the stop"), Err(Error::Stopped));
    assert_eq!(context.allreduce_async(vec![1i32]).unwrap_err(), Error::Stopped);
    drop(idle);
}

#[test]
fn a_job_that_ended_before_it_is_awaited_is_ready_at_once() {
    let context = netagg::Context::start(common::dummy_config(3)).unwrap();
    let job = context.allreduce_async(vec![2i32; 5000]).unwrap();
    job.job().wait().unwrap();
    assert_eq!(job.job().status(), JobStatus::Finished);
    let waker = Waker::noop();
    let Poll::Ready(sums) = pin!(job).poll(&mut std::task::Context::from_waker(waker)) else {
        panic!("pending although ended")
    };
    assert!(sums.unwrap().iter().all(|&sum| sum == 6));
}

#[test]
fn a_job_racing_another_s_buffers_is_refused_until_that_one_ends() {
    let mut config = common::dummy_config(3);
    config.dummy.bandwidth = 1000.0; // Mbit/s: 4 MiB stay in flight for tens of ms
    let context = netagg::Context::start(config).unwrap();
    let mut shared = vec![1.0f32; 1 << 20];
    let mut other = vec![0.0f32; 16];
    let pointer: *mut u8 = shared.as_mut_ptr().cast();
    let (floats, bytes) = (netagg::DataType::Float32, shared.len() * 4);
    // SAFETY: `shared` outlives every job (waited for below); `other` is only written
    // by jobs that are refused.
    unsafe {
        let first = context.submit_raw(pointer, pointer, shared.len(), floats, None).unwrap();
        let error =
            context.submit_raw(pointer.add(64), other.as_mut_ptr().cast(), 16, floats, None).unwrap_err();
        assert_eq!(
            error,
            Error::BufferInUse {
                buffer: "input",
                start: pointer as usize + 64,
                bytes: 64,
                job: 1,
                other_buffer: "output"
            }
        );
        let last = pointer.add(bytes - 4);
        assert!(matches!(
            context.submit_raw(other.as_ptr().cast(), last, 1, floats, None),
            Err(Error::BufferInUse { buffer: "output", bytes: 4, job: 1, .. })
        ));
        assert_eq!(
            context.submit_raw(pointer, pointer.add(4), 16, floats, None).unwrap_err(),
            Error::OverlappingBuffers
        );
        // The same buffers again run after the first, element by element.
        let again = context.submit_raw(pointer, pointer, shared.len(), floats, None).unwrap();
        assert_eq!(again.id(), 4, "jobs refused for buffers in use keep their numbers");
        assert!(!context.wait_all_timeout(Duration::from_millis(1)), "the jobs take longer");
        assert!(context.wait_all_timeout(Duration::from_secs(30)));
        // A timeout past the clock's range is none (it once overflowed the deadline).
        assert!(context.wait_all_timeout(Duration::MAX) && again.wait_timeout(Duration::MAX).unwrap());
        assert_eq!((first.status(), again.status()), (JobStatus::Finished, JobStatus::Finished));
        context
            .submit_raw(pointer.add(64), other.as_mut_ptr().cast(), 16, floats, None)
            .unwrap()
            .wait()
            .unwrap();
    }
    assert_eq!((shared[0], shared[shared.len() - 1]), (9.0, 9.0));
    assert_eq!(other, vec![27.0f32; 16]);
}
