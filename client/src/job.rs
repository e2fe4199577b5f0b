//! Jobs: one allreduce each, shared by the worker threads that carry its slices.
//!
//! A job's end is signalled two ways, from the same place (its last slice): a condition
//! variable for the blocking waits, and the wakers of the futures that await it, so that
//! a handle can be awaited on any executor with no thread of its own and no polling.

use std::any::Any;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use netagg_wire::ElementType;

use crate::Error;

/// Element types an allreduce sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataType {
    Int32,
    Float32,
    /// IEEE binary16 ([`half::f16`]): summed in float32 by the switch, rounded once.
    Float16,
    /// bfloat16 ([`half::bf16`]): summed as [`DataType::Float16`].
    BFloat16,
}

impl DataType {
    /// Bytes of one element in the caller's buffers.
    pub const fn size(self) -> usize {
        self.element_type().size()
    }

    /// The type's name as NumPy and PyTorch spell it: `int32`, `float32`, `float16`,
    /// `bfloat16`.
    pub const fn name(self) -> &'static str {
        match self {
            DataType::Int32 => "int32",
            DataType::Float32 => "float32",
            DataType::Float16 => "float16",
            DataType::BFloat16 => "bfloat16",
        }
    }

    /// The wire's element type of the same representation.
    pub(crate) const fn element_type(self) -> ElementType {
        match self {
            DataType::Int32 => ElementType::Int32,
            DataType::Float32 => ElementType::Float32,
            DataType::Float16 => ElementType::Float16,
            DataType::BFloat16 => ElementType::BFloat16,
        }
    }
}

/// A Rust type that travels as one of the [`DataType`]s.
pub trait Element: Copy + Send + Sync + 'static {
    const DATA_TYPE: DataType;
}

impl Element for i32 {
    const DATA_TYPE: DataType = DataType::Int32;
}

impl Element for f32 {
    const DATA_TYPE: DataType = DataType::Float32;
}

impl Element for half::f16 {
    const DATA_TYPE: DataType = DataType::Float16;
}

impl Element for half::bf16 {
    const DATA_TYPE: DataType = DataType::BFloat16;
}

/// Where a job stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum JobStatus {
    /// Submitted; no worker thread has started it.
    Queued,
    Running,
    Finished,
    Failed,
}

/// Whether a job's output memory holds initialised bytes, which a `&mut [u8]` may cover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OutputMemory {
    /// A Rust buffer, or the input itself (in place).
    Initialised,
    /// A caller's memory that may never have been written (C's `malloc`, NumPy's
    /// `empty`): each block is zeroed just before its sums are stored there.
    MaybeUninitialised,
}

/// Where a job's elements are read from and its sums written to; valid, and not touched
/// by the caller, until the job is finished or failed (the submitter's contract).
pub(crate) struct JobBuffers {
    pub input: *const u8,
    pub output: *mut u8,
    pub output_memory: OutputMemory,
}

/// State shared by a job's handle and the threads carrying its slices.
pub(crate) struct JobShared {
    pub id: u64,
    pub data_type: DataType,
    pub numel: usize,
    pub buffers: JobBuffers,
    /// Keeps owned buffers alive while the threads use them.
    keepalive: Mutex<Option<Box<dyn Any + Send>>>,
    state: Mutex<JobState>,
    done: Condvar,
}

// SAFETY: the raw pointers are only dereferenced by worker threads on disjoint block
// ranges while the job runs, under the submitter's contract above; everything else is
// behind mutexes.
unsafe impl Send for JobShared {}
// SAFETY: as for Send: shared access reads the pointers, never the memory behind them,
// outside those disjoint ranges.
unsafe impl Sync for JobShared {}

struct JobState {
    status: JobStatus,
    slices_left: usize,
    error: Option<Error>,
    /// The tasks awaiting the job, woken when it ends: each once, however often it
    /// polled. A future dropped before then leaves its waker here until then, which at
    /// worst wakes a task for nothing.
    wakers: Vec<Waker>,
}

impl JobState {
    /// The job's outcome, once it has ended.
    fn outcome(&self) -> Option<Result<(), Error>> {
        match self.status {
            JobStatus::Finished => Some(Ok(())),
            JobStatus::Failed => Some(Err(self.error.clone().unwrap_or(Error::Stopped))),
            JobStatus::Queued | JobStatus::Running => None,
        }
    }
}

/// Waits on `condvar` while `waiting` holds, at most until `deadline` if one is given;
/// the guard, with `waiting` false unless the deadline passed. A poisoned lock is taken
/// as it is: a panicking thread must not make every waiter panic too.
pub(crate) fn wait_while_until<'a, T>(
    condvar: &Condvar,
    guard: MutexGuard<'a, T>,
    deadline: Option<Instant>,
    waiting: impl FnMut(&mut T) -> bool,
) -> MutexGuard<'a, T> {
    match deadline {
        None => condvar.wait_while(guard, waiting).unwrap_or_else(PoisonError::into_inner),
        Some(deadline) => {
            let left = deadline.saturating_duration_since(Instant::now());
            condvar.wait_timeout_while(guard, left, waiting).unwrap_or_else(PoisonError::into_inner).0
        }
    }
}

impl JobShared {
    pub fn new(
        id: u64,
        data_type: DataType,
        numel: usize,
        buffers: JobBuffers,
        keepalive: Option<Box<dyn Any + Send>>,
        slices: usize,
    ) -> Arc<JobShared> {
        let status = if slices == 0 { JobStatus::Finished } else { JobStatus::Queued };
        Arc::new(JobShared {
            id,
            data_type,
            numel,
            buffers,
            keepalive: Mutex::new(keepalive),
            state: Mutex::new(JobState { status, slices_left: slices, error: None, wakers: Vec::new() }),
            done: Condvar::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, JobState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn status(&self) -> JobStatus {
        self.lock().status
    }

    pub fn mark_running(&self) {
        let mut state = self.lock();
        if state.status == JobStatus::Queued {
            state.status = JobStatus::Running;
        }
    }

    /// Records one slice's end; the job ends with its last slice, failed if any failed.
    /// `on_end(failed)` runs once, with the last slice, before any waiter can see the job
    /// ended: whoever sees it ended also sees what `on_end` accounted (stats, counts).
    pub fn finish_slice(&self, outcome: Result<(), Error>, on_end: impl FnOnce(bool)) {
        let mut state = self.lock();
        if let Err(error) = outcome {
            state.error.get_or_insert(error);
        }
        state.slices_left = state.slices_left.saturating_sub(1);
        if state.slices_left > 0 {
            return;
        }
        let failed = state.error.is_some();
        on_end(failed);
        state.status = if failed { JobStatus::Failed } else { JobStatus::Finished };
        let wakers = std::mem::take(&mut state.wakers);
        drop(state);
        self.done.notify_all();
        for waker in wakers {
            waker.wake();
        }
    }

    /// Waits until the job ended, or `deadline` passed (then returns None).
    pub fn wait_until(&self, deadline: Option<Instant>) -> Option<Result<(), Error>> {
        let running = |state: &mut JobState| matches!(state.status, JobStatus::Queued | JobStatus::Running);
        wait_while_until(&self.done, self.lock(), deadline, running).outcome()
    }

    /// The job's outcome if it has ended; otherwise registers `waker` to be woken when it
    /// does.
    fn poll_end(&self, waker: &Waker) -> Poll<Result<(), Error>> {
        let mut state = self.lock();
        if let Some(outcome) = state.outcome() {
            return Poll::Ready(outcome);
        }
        if !state.wakers.iter().any(|registered| registered.will_wake(waker)) {
            state.wakers.push(waker.clone());
        }
        Poll::Pending
    }

    pub fn take_keepalive(&self) -> Option<Box<dyn Any + Send>> {
        self.keepalive.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// A handle to a submitted allreduce.
///
/// [`Job::wait`] blocks until the job ends; awaiting the handle (it is a [`Future`])
/// suspends the task instead, on any executor. Either gives the job's outcome: a stopped
/// context, a lost session or a timeout ends it with an error, so neither waits for ever.
/// Clones are handles to the same job, each of which may be waited for or awaited.
#[derive(Clone)]
pub struct Job {
    pub(crate) shared: Arc<JobShared>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job").field("id", &self.id()).field("status", &self.status()).finish()
    }
}

impl Job {
    /// The job's number, the same on every rank (jobs are numbered in submission order).
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    pub fn status(&self) -> JobStatus {
        self.shared.status()
    }

    pub fn numel(&self) -> usize {
        self.shared.numel
    }

    pub fn data_type(&self) -> DataType {
        self.shared.data_type
    }

    /// Waits until the job has finished or failed.
    pub fn wait(&self) -> Result<(), Error> {
        self.shared.wait_until(None).unwrap_or(Err(Error::Stopped))
    }

    /// Waits at most `timeout` (one past the clock's range waits as `wait` does);
    /// `Ok(false)` if the job is still running then.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<bool, Error> {
        match self.shared.wait_until(Instant::now().checked_add(timeout)) {
            None => Ok(false),
            Some(result) => result.map(|()| true),
        }
    }
}

/// Awaits the job's end: `Ok` once it has finished, the error it failed with otherwise.
/// The task is woken when the job's last slice ends, from the worker thread that ran it.
impl Future for Job {
    type Output = Result<(), Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Self::Output> {
        self.shared.poll_end(cx.waker())
    }
}

/// An allreduce over a buffer the job owns; [`TensorJob::wait`], or awaiting it (it is
/// a [`Future`]), hands the sums back.
#[derive(Debug)]
pub struct TensorJob<T: Element> {
    job: Job,
    /// `fn() -> T`: the handle holds no `T`, so it is `Unpin` and `Send` whatever `T` is.
    element: PhantomData<fn() -> T>,
}

impl<T: Element> TensorJob<T> {
    pub(crate) fn new(job: Job) -> TensorJob<T> {
        TensorJob { job, element: PhantomData }
    }

    /// The untyped handle: id, status, timed waits.
    pub fn job(&self) -> &Job {
        &self.job
    }

    /// Waits for the job and returns the buffer, now holding the sums.
    pub fn wait(self) -> Result<Vec<T>, Error> {
        self.job.wait()?;
        self.take_buffer()
    }

    /// The buffer of a job that has finished; an error if it was taken already.
    fn take_buffer(&self) -> Result<Vec<T>, Error> {
        let buffer = self.job.shared.take_keepalive().ok_or(Error::Stopped)?;
        buffer.downcast::<Vec<T>>().map(|b| *b).map_err(|_| Error::Stopped)
    }
}

/// Awaits the job and gives the buffer back holding the sums, as [`TensorJob::wait`]
/// does without blocking the thread.
impl<T: Element> Future for TensorJob<T> {
    type Output = Result<Vec<T>, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Self::Output> {
        self.job.shared.poll_end(cx.waker()).map(|outcome| outcome.and_then(|()| self.take_buffer()))
    }
}
