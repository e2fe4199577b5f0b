//! netagg's C API (`include/netagg.h`, generated from this module by cbindgen).
//!
//! Each function mirrors one method of the Rust API. Every one:
//! - returns a `netagg_result` (or, for `netagg_version`, a static string), never aborts
//!   and never unwinds into C: a panic becomes `NETAGG_PANIC`;
//! - checks its pointer arguments for NULL (`NETAGG_NULL_ARGUMENT`) and writes its outputs
//!   only when it succeeds;
//! - records the detail of a failure for `netagg_last_error_message` on the calling thread.
//!
//! Ownership: every object made by a `_new` or `_load` is the caller's until its `_free`;
//! `_free(NULL)` does nothing. Jobs are handles, not pointers, so a handle that was freed
//! is reported (`NETAGG_INVALID_JOB`) rather than read after free.
//!
//! Thread safety: a context may be used from any number of threads at once (start, stop,
//! submissions, waits, stats), except `netagg_context_free`, which must be the last call
//! on it. Job handles may be waited on from any thread. A config object must not be
//! changed while another thread uses it.

#![allow(non_camel_case_types)]

mod boundary;
mod result;

use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use std::time::Duration;

use crate::Config;

use crate::{Context, DataType, Error, Job, JobStatus};
use boundary::{
    borrow, borrow_mut, borrow_str, free_boxed, guard, into_raw, write_text, Failure, Output, SizedOutput,
};
pub use result::netagg_result;
use result::netagg_result::*;

/// A configuration: SwitchML's keys plus netagg's (see `configs/netagg.cfg`).
pub struct netagg_config {
    config: Config,
}

/// One rank of a session: started from a configuration, it takes allreduce jobs.
pub struct netagg_context {
    config: Config,
    state: Mutex<State>,
    /// Held through a whole start or stop, so that they happen one at a time (a stop
    /// during a start waits for it), while `state` is locked only briefly and submissions,
    /// waits and statistics never wait for a registration.
    lifecycle: Mutex<()>,
}

enum State {
    Created,
    /// `netagg_context_start` is registering with the switch.
    Starting,
    Running(Arc<Context>),
    /// Kept for its statistics and for waits on the jobs it had.
    Stopped(Arc<Context>),
}

/// A submitted job. Zero is never a valid handle.
pub type netagg_job = u64;

/// Element types: FLOAT32 and INT32 have the values of SwitchML's `DataType`, which
/// has no 16-bit type.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum netagg_data_type {
    NETAGG_FLOAT32 = 0,
    NETAGG_INT32 = 1,
    /// IEEE 754 half precision (`_Float16`), 2 bytes on the wire, summed in float32 by
    /// the switch and rounded once: a sum past 65504 is infinity, as IEEE arithmetic
    /// gives.
    NETAGG_FLOAT16 = 2,
    /// bfloat16, float32's upper 16 bits, 2 bytes on the wire, summed in float32 by the
    /// switch and rounded once.
    NETAGG_BFLOAT16 = 3,
}

/// Each C element type and the library's.
const DATA_TYPES: [(netagg_data_type, DataType); 4] = [
    (netagg_data_type::NETAGG_FLOAT32, DataType::Float32),
    (netagg_data_type::NETAGG_INT32, DataType::Int32),
    (netagg_data_type::NETAGG_FLOAT16, DataType::Float16),
    (netagg_data_type::NETAGG_BFLOAT16, DataType::BFloat16),
];

/// Where a job stands: the values match SwitchML's `JobStatus` (which also has INIT = 0).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum netagg_job_state {
    NETAGG_JOB_STATE_QUEUED = 1,
    NETAGG_JOB_STATE_RUNNING = 2,
    NETAGG_JOB_STATE_FINISHED = 3,
    NETAGG_JOB_STATE_FAILED = 4,
}

/// Where a context stands: the values match SwitchML's `Context::ContextState`.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum netagg_context_state {
    NETAGG_CONTEXT_CREATED = 0,
    NETAGG_CONTEXT_STARTING = 1,
    NETAGG_CONTEXT_RUNNING = 2,
    NETAGG_CONTEXT_STOPPED = 4,
}

/// A context's counters since it started or they were reset; packet counters are summed
/// over its worker threads.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct netagg_stats {
    pub jobs_submitted: u64,
    pub jobs_finished: u64,
    pub jobs_failed: u64,
    pub elements_submitted: u64,
    pub worker_threads: u64,
    /// Datagrams sent: data, acknowledgements and retransmissions.
    pub packets_sent: u64,
    /// Bytes of those datagrams, headers included.
    pub bytes_sent: u64,
    pub retransmissions: u64,
    /// Results received that were new.
    pub results_received: u64,
    pub bytes_received: u64,
    /// Results received again, or for rounds already over, or malformed.
    pub duplicates: u64,
    pub stale: u64,
    pub rejected: u64,
    /// Retransmission timers that fired.
    pub timeouts: u64,
    /// Requests for a result sent at once because a gap in the switch's numbering of its
    /// broadcasts showed one lost.
    pub gap_requests: u64,
    /// Contributions sent again at once because the switch named their first sending
    /// missing.
    pub lost_notices: u64,
    /// Data packets sent, retransmissions included.
    pub data_sent: u64,
    /// Acknowledgements and requests sent.
    pub acks_sent: u64,
    /// Probes sent while every slot of a thread waited.
    pub probes: u64,
    /// Data packets the pacer held back before their first sending.
    pub paced: u64,
    /// Datagrams received whose checksum did not match (dropped, recovered as lost).
    pub corrupt: u64,
    /// Pending notices received from the switch.
    pub pending: u64,
    /// Progress reports received, the switch's answers to probes.
    pub progress_reports: u64,
}

// SAFETY: a repr(C) struct of u64s only, which has no padding.
unsafe impl boundary::Plain for netagg_stats {}

static JOBS: LazyLock<Mutex<HashMap<netagg_job, Job>>> = LazyLock::new(Default::default);
static NEXT_JOB: AtomicU64 = AtomicU64::new(1);

fn jobs() -> MutexGuard<'static, HashMap<netagg_job, Job>> {
    JOBS.lock().unwrap_or_else(|p| p.into_inner())
}

fn live_job(handle: netagg_job) -> Result<Job, Failure> {
    jobs().get(&handle).cloned().ok_or_else(|| {
        Failure::new(NETAGG_INVALID_JOB, format!("job handle {handle} was freed or never issued"))
    })
}

impl netagg_context {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lifecycle(&self) -> MutexGuard<'_, ()> {
        self.lifecycle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The running context, for submissions.
    fn running(&self) -> Result<Arc<Context>, Failure> {
        self.context(false)
    }

    /// The context running or stopped: for statistics, and for waits, which must last
    /// until a stop has ended every job (the caller may free the buffers then).
    fn started(&self) -> Result<Arc<Context>, Failure> {
        self.context(true)
    }

    fn context(&self, stopped_too: bool) -> Result<Arc<Context>, Failure> {
        match &*self.state() {
            State::Running(context) => Ok(Arc::clone(context)),
            State::Stopped(context) if stopped_too => Ok(Arc::clone(context)),
            State::Created => Err(Failure::new(NETAGG_NOT_STARTED, "call netagg_context_start first")),
            State::Starting => Err(Failure::new(NETAGG_NOT_STARTED, "the context is still starting")),
            State::Stopped(_) => Err(Failure::new(NETAGG_STOPPED, "the context was stopped")),
        }
    }
}

fn data_type(value: u32) -> Result<DataType, Failure> {
    let known = DATA_TYPES.iter().find(|(code, _)| *code as u32 == value);
    known.map(|&(_, data_type)| data_type).ok_or_else(|| {
        let names: Vec<String> =
            DATA_TYPES.iter().map(|(code, _)| format!("{code:?} ({})", *code as u32)).collect();
        Failure::new(NETAGG_INVALID_ARGUMENT, format!("data type {value} is none of {}", names.join(", ")))
    })
}

/// Submits a job after checking what C callers can get wrong that Rust callers cannot.
///
/// # Safety
/// The buffers are as `netagg_allreduce_async` documents.
unsafe fn submit(
    context: *const netagg_context,
    input: *const c_void,
    output: *mut c_void,
    numel: u64,
    data_type_value: u32,
) -> Result<Job, Failure> {
    // SAFETY: the caller passes a live context.
    let context = unsafe { borrow(context, "context")? };
    let data_type = data_type(data_type_value)?;
    let bytes = usize::try_from(numel)
        .ok()
        .and_then(|n| n.checked_mul(data_type.size()))
        .filter(|&bytes| bytes <= isize::MAX as usize)
        .ok_or_else(|| {
            Failure::new(NETAGG_INVALID_ARGUMENT, format!("numel {numel} exceeds the address space"))
        })?;
    if numel > 0 && input.is_null() {
        return Err(Failure::null("input"));
    }
    if numel > 0 && output.is_null() {
        return Err(Failure::null("output"));
    }
    let running = context.running()?;
    // SAFETY: the caller keeps both buffers valid and untouched until the job ends.
    let job = unsafe {
        running.submit_raw(input.cast(), output.cast(), bytes / data_type.size(), data_type, None)?
    };
    Ok(job)
}

/// The library's version, e.g. "0.2.0": a static NUL-terminated string. Thread-safe.
#[no_mangle]
pub extern "C" fn netagg_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// Writes a fixed description of `result` into `buffer` (see `netagg_last_error_message`
/// for the `buffer`, `capacity` and `length` conventions). An unknown code gives
/// `NETAGG_INVALID_ARGUMENT`. Thread-safe.
///
/// # Safety
/// `buffer` is NULL or writable for `capacity` bytes; `length` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn netagg_result_message(
    result: u32,
    buffer: *mut c_char,
    capacity: usize,
    length: *mut usize,
) -> netagg_result {
    guard("netagg_result_message", || {
        let known = netagg_result::from_code(result).ok_or_else(|| {
            Failure::new(NETAGG_INVALID_ARGUMENT, format!("{result} is not a netagg_result"))
        })?;
        // SAFETY: the caller's contract.
        unsafe { write_text(known.description(), buffer, capacity, length) }
    })
}

/// Writes the detail of the calling thread's last failed call, e.g. "netagg_config_load:
/// test.cfg: unknown key 'general.num_wokers'; known keys: ...", NUL-terminated, into
/// `buffer` of `capacity` bytes, and its length without the NUL into `*length`. If no
/// call failed yet the text is empty. If it does not fit, nothing is copied, `*length`
/// is the length needed and the result is `NETAGG_BUFFER_TOO_SMALL`; pass NULL and 0 to
/// ask the length. This call does not change the last error. Thread-safe: every thread
/// has its own last error.
///
/// # Safety
/// `buffer` is NULL or writable for `capacity` bytes; `length` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn netagg_last_error_message(
    buffer: *mut c_char,
    capacity: usize,
    length: *mut usize,
) -> netagg_result {
    let message = boundary::last_error().map(|(_, message)| message).unwrap_or_default();
    // Not through `guard`, which would replace the message being read.
    // SAFETY: the caller's contract.
    match std::panic::catch_unwind(|| unsafe { write_text(&message, buffer, capacity, length) }) {
        Ok(Ok(())) => NETAGG_OK,
        Ok(Err(failure)) => failure.code,
        Err(_) => NETAGG_PANIC,
    }
}

/// Makes a configuration with every key at its default, reading no file and no
/// environment, into `*config`; free it with `netagg_config_free`. Thread-safe.
///
/// # Safety
/// `config` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn netagg_config_new(config: *mut *mut netagg_config) -> netagg_result {
    guard("netagg_config_new", || {
        // SAFETY: the caller's contract.
        let out = unsafe { Output::new(config, "config")? };
        out.write(into_raw(netagg_config { config: Config::default() }));
        Ok(())
    })
}

/// Loads a configuration as every netagg program does: the file at `path`, or if `path`
/// is NULL the first of `$NETAGG_CONFIG`, `./netagg.cfg`, `./netagg-<hostname>.cfg`,
/// `/etc/netagg.cfg` (none is fine), then the launcher's rank and size variables and
/// `NETAGG_<SECTION>__<KEY>` variables. Errors name the file or variable, the key and
/// the values allowed. Free the result with `netagg_config_free`. Thread-safe.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string; `config` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn netagg_config_load(
    path: *const c_char,
    config: *mut *mut netagg_config,
) -> netagg_result {
    guard("netagg_config_load", || {
        // SAFETY: the caller's contract.
        let out = unsafe { Output::new(config, "config")? };
        let path = if path.is_null() {
            None
        } else {
            // SAFETY: non-NULL, so NUL-terminated by the caller's contract.
            Some(std::path::PathBuf::from(unsafe { borrow_str(path, "path")? }))
        };
        let loaded = Config::load(path.as_deref())?;
        out.write(into_raw(netagg_config { config: loaded }));
        Ok(())
    })
}

/// Sets one key, named `section.key` as in the file (`general.num_workers`,
/// `backend.dummy.bandwidth`), from its text. Combinations are checked when a context is
/// made from the configuration. Not thread-safe for one configuration: no other thread
/// may use it meanwhile.
///
/// # Safety
/// `config` is NULL or a live configuration no other thread uses; `key` and `value` are
/// NULL or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn netagg_config_set(
    config: *mut netagg_config,
    key: *const c_char,
    value: *const c_char,
) -> netagg_result {
    guard("netagg_config_set", || {
        // SAFETY: the caller's contract.
        let (config, key, value) =
            unsafe { (borrow_mut(config, "config")?, borrow_str(key, "key")?, borrow_str(value, "value")?) };
        config.config.set(key, value)?;
        Ok(())
    })
}

/// Writes one key's value as text (as `netagg_config_set` accepts it) into `buffer`, with
/// the conventions of `netagg_last_error_message`. Thread-safe while no thread sets a key
/// of the same configuration.
///
/// # Safety
/// `config` is NULL or live; `key` is NULL or NUL-terminated; `buffer` is NULL or
/// writable for `capacity` bytes; `length` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn netagg_config_get(
    config: *const netagg_config,
    key: *const c_char,
    buffer: *mut c_char,
    capacity: usize,
    length: *mut usize,
) -> netagg_result {
    guard("netagg_config_get", || {
        // SAFETY: the caller's contract.
        let (config, key) = unsafe { (borrow(config, "config")?, borrow_str(key, "key")?) };
        let value = config
            .config
            .get(key)
            .ok_or_else(|| Failure::new(NETAGG_CONFIG_UNKNOWN_KEY, format!("unknown key '{key}'")))?;
        // SAFETY: the caller's contract.
        unsafe { write_text(&value, buffer, capacity, length) }
    })
}

/// Frees a configuration; NULL is fine. Contexts made from it keep their own copy. No
/// other thread may use the configuration any more.
///
/// # Safety
/// `config` is NULL or came from `netagg_config_new`/`_load`/`netagg_context_config` and
/// was not freed.
#[no_mangle]
pub unsafe extern "C" fn netagg_config_free(config: *mut netagg_config) {
    let _ = guard("netagg_config_free", || {
        // SAFETY: the caller's contract.
        unsafe { free_boxed(config) };
        Ok(())
    });
}

/// Makes a context from a copy of `config` (checked: invalid combinations fail here with
/// `NETAGG_CONFIG_INVALID`), not yet started. Free it with `netagg_context_free`.
/// Thread-safe while no thread sets a key of `config`.
///
/// # Safety
/// `config` is NULL or live; `context` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn netagg_context_new(
    config: *const netagg_config,
    context: *mut *mut netagg_context,
) -> netagg_result {
    guard("netagg_context_new", || {
        // SAFETY: the caller's contract.
        let (config, out) = unsafe { (borrow(config, "config")?, Output::new(context, "context")?) };
        config.config.validate().map_err(Error::InvalidConfig)?;
        out.write(into_raw(netagg_context {
            config: config.config.clone(),
            state: Mutex::new(State::Created),
            lifecycle: Mutex::new(()),
        }));
        Ok(())
    })
}

/// Copies the context's configuration into `*config`, for reading with
/// `netagg_config_get`; free it with `netagg_config_free`. Thread-safe.
///
/// # Safety
/// `context` is NULL or live; `config` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn netagg_context_config(
    context: *const netagg_context,
    config: *mut *mut netagg_config,
) -> netagg_result {
    guard("netagg_context_config", || {
        // SAFETY: the caller's contract.
        let (context, out) = unsafe { (borrow(context, "context")?, Output::new(config, "config")?) };
        out.write(into_raw(netagg_config { config: context.config.clone() }));
        Ok(())
    })
}

/// Starts the context: registers with the switch and waits until every rank has (at most
/// `general.connect_timeout`), or sets up the in-process switch of the dummy backend.
/// A context that was stopped may be started again: it joins a new session.
/// `NETAGG_ALREADY_STARTED` if it is starting or running. Thread-safe: starts and stops
/// happen one at a time (a stop called during a start waits for it), while other calls
/// see the context as starting.
///
/// # Safety
/// `context` is NULL or live.
#[no_mangle]
pub unsafe extern "C" fn netagg_context_start(context: *const netagg_context) -> netagg_result {
    guard("netagg_context_start", || {
        // SAFETY: the caller's contract.
        let context = unsafe { borrow(context, "context")? };
        let _lifecycle = context.lifecycle();
        {
            let mut state = context.state();
            if let State::Starting | State::Running(_) = &*state {
                return Err(Failure::new(NETAGG_ALREADY_STARTED, "the context is already started"));
            }
            *state = State::Starting;
        }
        // Registration may take up to connect_timeout: the state lock is not held, so
        // other threads see "starting" rather than block.
        let started = Context::start(context.config.clone());
        let mut state = context.state();
        match started {
            Ok(started) => {
                *state = State::Running(Arc::new(started));
                Ok(())
            }
            Err(error) => {
                *state = State::Created;
                Err(error.into())
            }
        }
    })
}

/// Whether the context is created, starting, running or stopped, into `*state`.
/// Thread-safe.
///
/// # Safety
/// `context` is NULL or live; `state` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn netagg_context_get_state(
    context: *const netagg_context,
    state: *mut netagg_context_state,
) -> netagg_result {
    guard("netagg_context_get_state", || {
        // SAFETY: the caller's contract.
        let (context, out) = unsafe { (borrow(context, "context")?, Output::new(state, "state")?) };
        out.write(match &*context.state() {
            State::Created => netagg_context_state::NETAGG_CONTEXT_CREATED,
            State::Starting => netagg_context_state::NETAGG_CONTEXT_STARTING,
            State::Running(_) => netagg_context_state::NETAGG_CONTEXT_RUNNING,
            State::Stopped(_) => netagg_context_state::NETAGG_CONTEXT_STOPPED,
        });
        Ok(())
    })
}

/// Stops the context: jobs still running or queued fail with `NETAGG_STOPPED`, the worker
/// threads end and the context leaves its session; returns when no job touches its
/// buffers any more. `NETAGG_NOT_STARTED` if it never started, `NETAGG_STOPPED` if it was
/// stopped already. Thread-safe, also while other threads wait for jobs.
///
/// # Safety
/// `context` is NULL or live.
#[no_mangle]
pub unsafe extern "C" fn netagg_context_stop(context: *const netagg_context) -> netagg_result {
    guard("netagg_context_stop", || {
        // SAFETY: the caller's contract.
        let context = unsafe { borrow(context, "context")? };
        let _lifecycle = context.lifecycle();
        let running = {
            let mut state = context.state();
            let running = match &*state {
                State::Running(running) => Arc::clone(running),
                State::Created | State::Starting => {
                    return Err(Failure::new(NETAGG_NOT_STARTED, "the context was never started"))
                }
                State::Stopped(_) => {
                    return Err(Failure::new(NETAGG_STOPPED, "the context is already stopped"))
                }
            };
            *state = State::Stopped(Arc::clone(&running));
            running
        };
        running.stop();
        Ok(())
    })
}

/// Stops the context if it runs and frees it; NULL is fine. Job handles stay valid
/// (their jobs failed with `NETAGG_STOPPED` if they had not ended) until freed.
///
/// # Safety
/// `context` is NULL or came from `netagg_context_new`, was not freed, and no other
/// thread uses it any more.
#[no_mangle]
pub unsafe extern "C" fn netagg_context_free(context: *mut netagg_context) {
    // A panic while stopping must not unwind into C; the context is freed either way.
    let _ = guard("netagg_context_free", || {
        // SAFETY: the caller's contract.
        unsafe { free_boxed(context) };
        Ok(())
    });
}

/// Sums `numel` elements of `data_type` (a `netagg_data_type`) over every rank: reads
/// `input`, writes the sums to `output` (the same pointer for in place) and returns when
/// they are there, or the job failed (within `general.job_timeout` if the switch or a
/// worker died). The buffers may not overlap unless they are the same
/// (`NETAGG_INVALID_ARGUMENT`); `output` may be memory never written (`malloc`'s). A
/// buffer another job still in flight writes, or reads where this one would write, is
/// `NETAGG_BUFFER_IN_USE`, unless that job has the same buffers and type (then the two
/// run one after the other on each element). float32 elements
/// travel as the configuration's `general.wire_precision` says: as they are, or rounded
/// to float16 or bfloat16 (half the bytes) and their sums widened back. Thread-safe.
///
/// # Safety
/// `context` is NULL or live; `input` is readable and `output` writable for `numel`
/// elements, and no other thread touches them during the call.
#[no_mangle]
pub unsafe extern "C" fn netagg_allreduce(
    context: *const netagg_context,
    input: *const c_void,
    output: *mut c_void,
    numel: u64,
    data_type: u32,
) -> netagg_result {
    guard("netagg_allreduce", || {
        // SAFETY: the caller's contract, held until `wait` returns.
        let job = unsafe { submit(context, input, output, numel, data_type)? };
        job.wait()?;
        Ok(())
    })
}

/// Submits the allreduce `netagg_allreduce` does and returns at once with its handle in
/// `*job`. The buffers must stay valid and untouched (`output` unread) until the job has
/// finished or failed: `netagg_job_wait` or `netagg_wait_all` tell. Free the handle with
/// `netagg_job_free`. Jobs are numbered, and summed with other ranks' jobs, in submission
/// order. Thread-safe.
///
/// # Safety
/// As `netagg_allreduce`, for as long as the job runs; `job` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn netagg_allreduce_async(
    context: *const netagg_context,
    input: *const c_void,
    output: *mut c_void,
    numel: u64,
    data_type: u32,
    job: *mut netagg_job,
) -> netagg_result {
    guard("netagg_allreduce_async", || {
        // SAFETY: the caller's contract.
        let out = unsafe { Output::new(job, "job")? };
        // SAFETY: the caller's contract, held until the job ends.
        let submitted = unsafe { submit(context, input, output, numel, data_type)? };
        let handle = NEXT_JOB.fetch_add(1, Ordering::Relaxed);
        jobs().insert(handle, submitted);
        out.write(handle);
        Ok(())
    })
}

/// Waits until the job has finished (`NETAGG_OK`) or failed (its error). Thread-safe.
#[no_mangle]
pub extern "C" fn netagg_job_wait(job: netagg_job) -> netagg_result {
    guard("netagg_job_wait", || {
        live_job(job)?.wait()?;
        Ok(())
    })
}

/// Waits at most `timeout_ms` milliseconds: `NETAGG_OK` if the job finished,
/// `NETAGG_WAIT_TIMEOUT` if it is still queued or running, its error if it failed.
/// Thread-safe.
#[no_mangle]
pub extern "C" fn netagg_job_wait_timeout(job: netagg_job, timeout_ms: u64) -> netagg_result {
    guard("netagg_job_wait_timeout", || {
        if live_job(job)?.wait_timeout(Duration::from_millis(timeout_ms))? {
            Ok(())
        } else {
            Err(Failure::new(
                NETAGG_WAIT_TIMEOUT,
                format!("job handle {job} still runs after {timeout_ms} ms"),
            ))
        }
    })
}

/// Writes where the job stands into `*status`. Thread-safe.
///
/// # Safety
/// `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn netagg_job_status(job: netagg_job, status: *mut netagg_job_state) -> netagg_result {
    guard("netagg_job_status", || {
        // SAFETY: the caller's contract.
        let out = unsafe { Output::new(status, "status")? };
        out.write(match live_job(job)?.status() {
            JobStatus::Queued => netagg_job_state::NETAGG_JOB_STATE_QUEUED,
            JobStatus::Running => netagg_job_state::NETAGG_JOB_STATE_RUNNING,
            JobStatus::Finished => netagg_job_state::NETAGG_JOB_STATE_FINISHED,
            JobStatus::Failed => netagg_job_state::NETAGG_JOB_STATE_FAILED,
        });
        Ok(())
    })
}

/// Writes the job's number into `*id`: jobs are numbered from 1 in submission order, the
/// same on every rank (SwitchML's `Job::id_`). Thread-safe.
///
/// # Safety
/// `id` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn netagg_job_id(job: netagg_job, id: *mut u64) -> netagg_result {
    guard("netagg_job_id", || {
        // SAFETY: the caller's contract.
        let out = unsafe { Output::new(id, "id")? };
        out.write(live_job(job)?.id());
        Ok(())
    })
}

/// Releases a job handle; 0 is fine, a handle freed already is `NETAGG_INVALID_JOB`. A job
/// still running goes on (its buffers must stay valid until `netagg_wait_all` returns).
/// Thread-safe.
#[no_mangle]
pub extern "C" fn netagg_job_free(job: netagg_job) -> netagg_result {
    guard("netagg_job_free", || {
        if job != 0 {
            jobs().remove(&job).ok_or_else(|| {
                Failure::new(
                    NETAGG_INVALID_JOB,
                    format!("job handle {job} was freed already or never issued"),
                )
            })?;
        }
        Ok(())
    })
}

/// Waits until every job submitted to the context has finished or failed (a failed job
/// counts as ended: check each job's status). On a context being stopped, it waits until
/// the stop has ended every job, so that the buffers may be freed when it returns.
/// Thread-safe.
///
/// # Safety
/// `context` is NULL or live.
#[no_mangle]
pub unsafe extern "C" fn netagg_wait_all(context: *const netagg_context) -> netagg_result {
    guard("netagg_wait_all", || {
        // SAFETY: the caller's contract.
        let context = unsafe { borrow(context, "context")? };
        context.started()?.wait_all();
        Ok(())
    })
}

/// Writes the context's counters into the `stats_size` bytes at `stats` (also after it
/// stopped); pass `sizeof(netagg_stats)`. Thread-safe.
///
/// The size keeps programs and libraries of different versions apart (from 0.2 on, whose
/// soname, libnetagg.so.0.2, no program built for 0.1's two-argument call loads):
/// counters are only ever appended, so the struct of an older header is a prefix of this
/// library's and gets the counters it names, and counters of a newer header that this
/// library does not keep read 0. A size of 0, or one that is not a whole number of 8-byte
/// counters, is refused with `NETAGG_INVALID_ARGUMENT`.
///
/// # Safety
/// `context` is NULL or live; `stats` is NULL or writable for `stats_size` bytes.
#[no_mangle]
pub unsafe extern "C" fn netagg_context_stats(
    context: *const netagg_context,
    stats: *mut netagg_stats,
    stats_size: usize,
) -> netagg_result {
    guard("netagg_context_stats", || {
        // SAFETY: the caller's contract.
        let (context, out) =
            unsafe { (borrow(context, "context")?, SizedOutput::new(stats, stats_size, "stats")?) };
        if stats_size == 0 || stats_size % size_of::<u64>() != 0 {
            return Err(Failure::new(
                NETAGG_INVALID_ARGUMENT,
                format!(
                    "stats_size {stats_size} is no netagg_stats's size: pass sizeof(netagg_stats), a whole \
                     number of 8-byte counters"
                ),
            ));
        }
        let stats = context.started()?.stats();
        let total = stats.total();
        out.write(netagg_stats {
            jobs_submitted: stats.jobs_submitted,
            jobs_finished: stats.jobs_finished,
            jobs_failed: stats.jobs_failed,
            elements_submitted: stats.elements_submitted,
            worker_threads: stats.threads.len() as u64,
            packets_sent: total.packets_sent,
            bytes_sent: total.bytes_sent,
            retransmissions: total.retransmissions,
            results_received: total.results_received,
            bytes_received: total.bytes_received,
            duplicates: total.duplicates,
            stale: total.stale,
            rejected: total.rejected,
            timeouts: total.timeouts,
            gap_requests: total.gap_requests,
            lost_notices: total.lost_notices,
            data_sent: total.data_sent,
            acks_sent: total.acks_sent,
            probes: total.probes,
            paced: total.paced,
            corrupt: total.corrupt,
            pending: total.pending,
            progress_reports: total.progress_reports,
        });
        Ok(())
    })
}

/// Writes the counters as readable text, one line for the jobs and one per worker thread,
/// into `buffer`, with the conventions of `netagg_last_error_message`. Thread-safe.
///
/// # Safety
/// `context` is NULL or live; `buffer` is NULL or writable for `capacity` bytes;
/// `length` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn netagg_context_stats_text(
    context: *const netagg_context,
    buffer: *mut c_char,
    capacity: usize,
    length: *mut usize,
) -> netagg_result {
    guard("netagg_context_stats_text", || {
        // SAFETY: the caller's contract.
        let context = unsafe { borrow(context, "context")? };
        let text = context.started()?.stats().to_string();
        // SAFETY: the caller's contract.
        unsafe { write_text(&text, buffer, capacity, length) }
    })
}

/// Zeroes the context's counters. Thread-safe.
///
/// # Safety
/// `context` is NULL or live.
#[no_mangle]
pub unsafe extern "C" fn netagg_context_reset_stats(context: *const netagg_context) -> netagg_result {
    guard("netagg_context_reset_stats", || {
        // SAFETY: the caller's contract.
        let context = unsafe { borrow(context, "context")? };
        context.started()?.reset_stats();
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    #[test]
    fn version_is_the_crate_version() {
        // SAFETY: netagg_version returns a static NUL-terminated string.
        let version = unsafe { CStr::from_ptr(netagg_version()) };
        assert_eq!(version.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    }
}
