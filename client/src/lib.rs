//! netagg's client library: allreduce through an in-network aggregation switch.
//!
//! A [`Context`] is one rank of a session. Start it from a [`Config`]; it registers with
//! a `netagg-switch` (or, with the dummy backend, emulates one in process) and runs
//! `num_worker_threads` threads that stream jobs through the switch:
//!
//! ```no_run
//! let config = netagg::Config::load(None)?;
//! let context = netagg::Context::start(config)?;
//! let mut gradients = vec![1.0f32; 1 << 20];
//! context.allreduce(&mut gradients)?; // now the sum over every rank
//! let job = context.allreduce_async(vec![1i32; 1000])?;
//! let sums = job.wait()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A job handle ([`Job`], [`TensorJob`]) is also a [`Future`](std::future::Future):
//! awaiting it suspends the task, not the thread, until the job ends. The worker thread
//! that ends the job wakes the task, so any executor will do; the library depends on
//! none. Jobs must be submitted in the same order on every rank, and may be awaited in
//! any order (`examples/rust/async_allreduce.rs` awaits several at once under tokio):
//!
//! ```no_run
//! # async fn sums(context: &netagg::Context) -> Result<(), netagg::Error> {
//! let integers = context.allreduce_async(vec![1i32; 1000])?;
//! let floats = context.allreduce_async(vec![0.5f32; 1000])?;
//! // Both run meanwhile; each await gives its buffer back holding the sums.
//! let (floats, integers) = (floats.await?, integers.await?);
//! # Ok(()) }
//! ```
//!
//! Errors are returned, never raised as panics or aborts: a dead switch or worker fails
//! jobs within `job_timeout`, and a session the switch closes fails them at once. A job
//! awaited or waited for on a context that stops fails with [`Error::Stopped`].

pub mod backend;
pub mod codec;
mod codec16;
mod context;
mod driver;
pub mod ffi;
mod in_flight;
mod job;
pub mod model;
mod registration;
mod slice_io;
mod sparse;
mod stats;

use std::io;
use std::sync::Arc;
use std::time::Duration;

pub use codec::{BlockFloatingPoint, Codec, Native};
pub use codec16::Float32As16Bit;
pub use context::Context;
/// The 16-bit float types [`Element`] is implemented for, re-exported so that callers
/// name the same crate version.
pub use half::{bf16, f16};
pub use job::{DataType, Element, Job, JobStatus, TensorJob};
pub use netagg_aggregator::worker::JobError;
pub use netagg_config as config;
pub use netagg_config::{BackendKind, Config, ConfigError, SparseMode, WirePrecision};
pub use netagg_wire::{Endpoint, RejectCode};
pub use stats::{Stats, ThreadCounters};

/// Why an operation of the library failed.
///
/// Errors from the operating system and the protocol keep theirs as their
/// [`std::error::Error::source`]; `Clone`, so that every waiter of a failed job gets it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    #[error("cannot reach the switch at {address}: {source}")]
    Connect { address: String, source: IoError },
    #[error(
        "the switch at {address} speaks control protocol version {switch}, this library version \
         {library}: use a switch and a library of the same release"
    )]
    Version { address: String, switch: u8, library: u8 },
    #[error("the switch refused the registration ({code:?}): {message}")]
    Rejected { code: RejectCode, message: String },
    #[error("session '{session}': not all {workers} workers registered with the switch at {switch} within {waited:?}")]
    RegisterTimeout { waited: Duration, session: String, workers: u16, switch: String },
    #[error("session lost: {0}")]
    SessionLost(String),
    #[error("job failed: {0}")]
    Job(#[from] JobError),
    #[error("job failed: worker thread {thread} panicked: {message}")]
    Panicked { thread: usize, message: String },
    #[error("the context is stopped")]
    Stopped,
    #[error("input has {input} elements but output has {output}")]
    LengthMismatch { input: usize, output: usize },
    #[error("a buffer pointer is null")]
    NullBuffer,
    #[error(
        "input and output overlap without being the same memory: reduce in place (one buffer) or \
         into memory of its own"
    )]
    OverlappingBuffers,
    /// A buffer of the job submitted meets one of a job still in flight where either
    /// writes: the two would race.
    #[error(
        "the {buffer} of this job ({bytes} bytes at {start:#x}) overlaps the {other_buffer} of job \
         {job}, which is still in flight: wait for that job first, or give this one memory of its \
         own"
    )]
    BufferInUse { buffer: &'static str, start: usize, bytes: usize, job: u64, other_buffer: &'static str },
    /// The codec's [`Codec::check`] refused the tensor.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error("{context}: {source}")]
    Io { context: String, source: IoError },
    /// The backend's device could not start: DPDK's EAL or port, with DPDK's reason.
    #[error("{0}")]
    Backend(String),
    /// The configured backend is a Cargo feature this build of the library left out.
    #[error(
        "backend = {backend} is not built into this netagg library: build it with the Cargo \
         feature `{backend}` (on by default; scripts/install-deps installs the system libraries \
         it needs)"
    )]
    NotBuiltIn { backend: BackendKind },
}

impl Error {
    /// An I/O error, and what the library was doing when it happened.
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Error {
        Error::Io { context: context.into(), source: IoError(Arc::new(source)) }
    }
}

/// An error of the operating system, shared by every waiter of the job it failed. Two are
/// equal when they have the same kind and message.
#[derive(Debug, Clone)]
pub struct IoError(Arc<io::Error>);

impl IoError {
    pub fn kind(&self) -> io::ErrorKind {
        self.0.kind()
    }

    pub fn get_ref(&self) -> &io::Error {
        &self.0
    }
}

impl From<io::Error> for IoError {
    fn from(error: io::Error) -> IoError {
        IoError(Arc::new(error))
    }
}

impl std::fmt::Display for IoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for IoError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl PartialEq for IoError {
    fn eq(&self, other: &IoError) -> bool {
        self.kind() == other.kind() && self.0.to_string() == other.0.to_string()
    }
}

impl Eq for IoError {}

/// What a caught panic said, for the error that reports it.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// A worker thread's transport failed.
impl From<io::Error> for Error {
    fn from(source: io::Error) -> Error {
        Error::io("the worker thread's transport", source)
    }
}
