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
//! Errors are returned, never raised as panics or aborts: a dead switch or worker fails
//! jobs within `job_timeout`, and a session the switch closes fails them at once.

pub mod backend;
pub mod codec;
mod context;
pub mod ffi;
mod job;
mod sparse;
mod stats;

use std::time::Duration;

pub use codec::{BlockFloatingPoint, Codec, Native};
pub use context::Context;
pub use job::{DataType, Element, Job, JobStatus, TensorJob};
pub use netagg_config as config;
pub use netagg_config::{BackendKind, Config, ConfigError, SparseMode};
pub use netagg_wire::RejectCode;
pub use stats::{Stats, ThreadCounters};

/// Why an operation of the library failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    #[error("cannot reach the switch at {address}: {reason}")]
    Connect { address: String, reason: String },
    #[error("the switch refused the registration ({code:?}): {message}")]
    Rejected { code: RejectCode, message: String },
    #[error("session '{session}': not all {workers} workers registered within {waited:?}")]
    RegisterTimeout { waited: Duration, session: String, workers: u16 },
    #[error("session lost: {0}")]
    SessionLost(String),
    #[error("job failed: {0}")]
    Job(String),
    #[error("the context is stopped")]
    Stopped,
    #[error("input has {input} elements but output has {output}")]
    LengthMismatch { input: usize, output: usize },
    #[error("a buffer pointer is null")]
    NullBuffer,
    /// The codec's [`Codec::check`] refused the tensor.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error("I/O error: {0}")]
    Io(String),
}

/// What a caught panic said, for the error that reports it.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

impl From<std::io::Error> for Error {
    fn from(error: std::io::Error) -> Error {
        Error::Io(error.to_string())
    }
}
