//! `netagg._netagg`: the client library's contexts and jobs for Python.
//!
//! Tensors cross by the buffer protocol (NumPy arrays, `array.array`, memoryviews) or,
//! for PyTorch CPU tensors, through the array view `Tensor.numpy()` gives of the same
//! memory: the library reads and writes the caller's memory, and nothing is copied on
//! the way in or out. A job keeps the buffers it uses exported until it has ended, even
//! if Python drops every reference to them or to the job.
//!
//! Blocking calls wait with the interpreter released, a slice at a time, so that other
//! Python threads run and Ctrl-C interrupts the wait (the job itself ends by its own
//! timeouts). Callbacks of finished jobs run on one thread of this module's own, never
//! on the library's worker threads, which therefore never wait for the interpreter.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};

use netagg::{Config, DataType, JobStatus, ThreadCounters};
use pyo3::buffer::{ElementType, PyUntypedBuffer};
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList};

pyo3::create_exception!(netagg, Error, PyException, "An error of the netagg library.");
pyo3::create_exception!(
    netagg,
    ConfigError,
    Error,
    "An invalid configuration: a file, a variable or a setting."
);
pyo3::create_exception!(
    netagg,
    SwitchError,
    Error,
    "The switch could not be reached, refused the session, or the session was lost."
);
pyo3::create_exception!(
    netagg,
    JobError,
    Error,
    "An allreduce failed: a timeout, a lost peer, a failed thread."
);
pyo3::create_exception!(netagg, StoppedError, Error, "The context is stopped.");
pyo3::create_exception!(netagg, InvalidInputError, Error, "A tensor the library refused.");

/// The library's error as the exception of its kind, with the library's message.
fn to_py(error: netagg::Error) -> PyErr {
    use netagg::Error as E;
    let message = error.to_string();
    match error {
        E::Config(_) | E::InvalidConfig(_) => ConfigError::new_err(message),
        E::Connect { .. }
        | E::Version { .. }
        | E::Rejected { .. }
        | E::RegisterTimeout { .. }
        | E::SessionLost(_) => SwitchError::new_err(message),
        E::Job(_) | E::Panicked { .. } => JobError::new_err(message),
        E::Stopped => StoppedError::new_err(message),
        E::LengthMismatch { .. } | E::NullBuffer | E::InvalidInput(_) => InvalidInputError::new_err(message),
        E::Io { .. } => Error::new_err(message),
    }
}

/// How often a blocking wait looks at the interpreter's signals (Ctrl-C).
const SIGNAL_CHECK_INTERVAL: Duration = Duration::from_millis(50);

/// A netagg context: the library's worker threads and their session at the switch.
///
/// `Context(config_file=None, settings=None)` reads the configuration as the C library
/// does (the file named, else `$NETAGG_CONFIG`, else `./netagg.cfg`...; then the
/// launcher's rank and size variables and `NETAGG_*` variables), then applies
/// `settings`, a dict of keys such as `"general.num_workers"` to values, and starts:
/// it returns once every rank has registered at the switch.
#[pyclass(module = "netagg", frozen)]
struct Context {
    inner: netagg::Context,
}

#[pymethods]
impl Context {
    #[new]
    #[pyo3(signature = (config_file=None, settings=None))]
    fn new(
        py: Python<'_>,
        config_file: Option<PathBuf>,
        settings: Option<HashMap<String, Bound<'_, PyAny>>>,
    ) -> PyResult<Context> {
        let mut config = Config::load(config_file.as_deref()).map_err(|e| to_py(e.into()))?;
        for (key, value) in settings.unwrap_or_default() {
            // Python's True is the config file's true.
            let text = match value.cast::<PyBool>() {
                Ok(flag) => flag.is_true().to_string(),
                Err(_) => value.str()?.to_string(),
            };
            config.set(&key, &text).map_err(|e| to_py(e.into()))?;
        }
        config
            .validate()
            .map_err(|message| ConfigError::new_err(format!("invalid configuration: {message}")))?;
        let inner = py.detach(|| netagg::Context::start(config)).map_err(to_py)?;
        Ok(Context { inner })
    }

    /// This process's rank in the session.
    #[getter]
    fn rank(&self) -> u16 {
        self.inner.config().general.rank
    }

    /// How many ranks the session has.
    #[getter]
    fn num_workers(&self) -> u16 {
        self.inner.config().general.num_workers
    }

    /// The session's number at the switch.
    #[getter]
    fn session(&self) -> u32 {
        self.inner.session()
    }

    /// One key of the configuration in force, as text (`"general.packet_numel"`).
    fn setting(&self, key: &str) -> PyResult<String> {
        self.inner.config().get(key).ok_or_else(|| ConfigError::new_err(format!("unknown key '{key}'")))
    }

    /// Sums `tensor` over every rank, in place, or into `out`; returns what holds the
    /// sums. float32 and int32, contiguous, on the CPU.
    #[pyo3(signature = (tensor, out=None))]
    fn allreduce<'py>(
        &self,
        py: Python<'py>,
        tensor: Bound<'py, PyAny>,
        out: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let job = self.submit(tensor, out)?;
        job.wait_for(py, None)?;
        Ok(job.output.into_bound(py))
    }

    /// Submits the allreduce `allreduce` would run and returns its `Job` at once.
    /// Neither `tensor` nor `out` may be touched until the job has ended.
    #[pyo3(signature = (tensor, out=None))]
    fn allreduce_async<'py>(
        &self,
        tensor: Bound<'py, PyAny>,
        out: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Job> {
        self.submit(tensor, out)
    }

    /// Waits until every job submitted has ended.
    fn wait_all(&self, py: Python<'_>) {
        py.detach(|| self.inner.wait_all());
    }

    /// The counters: jobs, elements, and each worker thread's packets (`threads`) and
    /// their sum (`total`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, &self.inner.stats())
    }

    fn reset_stats(&self) {
        self.inner.reset_stats();
    }

    /// Stops the worker threads (jobs not ended fail) and leaves the session; returns
    /// the final counters. Later calls do nothing more.
    fn stop<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = py.detach(|| self.inner.stop());
        stats_dict(py, &stats)
    }

    #[getter]
    fn stopped(&self) -> bool {
        self.inner.is_stopped()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _type: Option<Bound<'_, PyAny>>,
        _value: Option<Bound<'_, PyAny>>,
        _traceback: Option<Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        self.stop(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        let general = &self.inner.config().general;
        format!(
            "netagg.Context(rank={}, num_workers={}, session={}, backend={:?}{})",
            general.rank,
            general.num_workers,
            self.inner.session(),
            general.backend.to_string(),
            if self.inner.is_stopped() { ", stopped" } else { "" }
        )
    }
}

impl Context {
    fn submit<'py>(&self, tensor: Bound<'py, PyAny>, out: Option<Bound<'py, PyAny>>) -> PyResult<Job> {
        let input = Tensor::export(&tensor, "tensor")?;
        let (output, target) = match out {
            Some(out) => (Some(Tensor::export(&out, "out")?), out),
            None => (None, tensor),
        };
        let written = output.as_ref().unwrap_or(&input);
        if written.buffer.readonly() {
            let name = if output.is_some() { "out" } else { "tensor" };
            return Err(PyValueError::new_err(format!("{name} is read-only: the sums are written to it")));
        }
        if let Some(output) = &output {
            if (output.data_type, output.numel) != (input.data_type, input.numel) {
                return Err(PyValueError::new_err(format!(
                    "out holds {} {} elements, tensor {} {}: they must match",
                    output.numel,
                    output.data_type.name(),
                    input.numel,
                    input.data_type.name()
                )));
            }
        }
        let (source, destination) =
            (input.buffer.buf_ptr() as *const u8, written.buffer.buf_ptr() as *mut u8);
        let (numel, data_type) = (input.numel, input.data_type);
        let exported = Exported(Some([Some(input.buffer), output.map(|o| o.buffer)]));
        // SAFETY: the buffers stay exported (their memory valid, and not resizable) until
        // the job's keepalive is dropped, after the job has ended; that the caller does not
        // touch them meanwhile is the contract of allreduce_async, and of allreduce, which
        // waits (a Ctrl-C in the wait leaves the job running, its buffers exported).
        let job =
            unsafe { self.inner.submit_raw(source, destination, numel, data_type, Some(Box::new(exported))) }
                .map_err(to_py)?;
        Ok(Job { job, output: target.unbind() })
    }
}

/// A tensor's memory, exported by the buffer protocol.
struct Tensor {
    buffer: PyUntypedBuffer,
    data_type: DataType,
    numel: usize,
}

impl Tensor {
    /// Exports `object`'s memory: a buffer, or a PyTorch CPU tensor's (through the array
    /// view of the same memory that `Tensor.numpy()` gives); `name` names it in errors.
    fn export(object: &Bound<'_, PyAny>, name: &str) -> PyResult<Tensor> {
        let buffer = match PyUntypedBuffer::get(object) {
            Ok(buffer) => buffer,
            Err(_) if object.hasattr("numpy")? && object.hasattr("is_contiguous")? => {
                let device = object.getattr("device")?.getattr("type")?.extract::<String>()?;
                if device != "cpu" {
                    return Err(PyValueError::new_err(format!(
                        "{name} is on device '{device}': netagg reduces CPU tensors (copy it with .cpu())"
                    )));
                }
                if !object.call_method0("is_contiguous")?.extract::<bool>()? {
                    return Err(PyValueError::new_err(format!(
                        "{name} is not contiguous (make it so with .contiguous())"
                    )));
                }
                PyUntypedBuffer::get(&object.call_method0("detach")?.call_method0("numpy")?)?
            }
            Err(_) => {
                return Err(PyTypeError::new_err(format!(
                    "{name} must be a NumPy array, a PyTorch CPU tensor or another buffer of float32 or \
                     int32, not {}",
                    object.get_type().name()?
                )))
            }
        };
        if !buffer.is_c_contiguous() {
            return Err(PyValueError::new_err(format!(
                "{name} is not contiguous (make it so with numpy.ascontiguousarray)"
            )));
        }
        let data_type = match (ElementType::from_format(buffer.format()), buffer.item_size()) {
            (ElementType::Float { bytes: 4 }, 4) => DataType::Float32,
            (ElementType::SignedInteger { bytes: 4 }, 4) => DataType::Int32,
            _ => {
                return Err(PyTypeError::new_err(format!(
                    "{name} holds elements of format '{}' ({} bytes): netagg sums float32 and int32",
                    buffer.format().to_string_lossy(),
                    buffer.item_size()
                )))
            }
        };
        let numel = buffer.item_count();
        Ok(Tensor { buffer, data_type, numel })
    }
}

/// A job's exported buffers: input, then output if not in place. They are released on
/// the callback thread rather than where the job drops them, which may be a worker
/// thread of the library that must not wait for the interpreter.
struct Exported(Option<[Option<PyUntypedBuffer>; 2]>);

impl Drop for Exported {
    fn drop(&mut self) {
        if let Some(buffers) = self.0.take() {
            callback_thread().send(Completion::Release(buffers));
        }
    }
}

/// A submitted allreduce. `wait()` blocks until it ends; `done()` tells whether it has;
/// `add_done_callback(fn)` calls `fn(None)`, or `fn(exception)` if it failed, once it
/// has; `output` is the tensor the sums are written to.
#[pyclass(module = "netagg", frozen)]
struct Job {
    job: netagg::Job,
    output: Py<PyAny>,
}

#[pymethods]
impl Job {
    /// Waits until the job has ended, at most `timeout` seconds if given: True once it
    /// has finished, False if the timeout passed first; raises the job's error if it
    /// failed.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let timeout = match timeout {
            Some(seconds) if !(seconds >= 0.0 && seconds.is_finite()) => {
                return Err(PyValueError::new_err(format!(
                    "timeout must be a number of seconds >= 0, not {seconds}"
                )))
            }
            Some(seconds) => Some(Duration::from_secs_f64(seconds)),
            None => None,
        };
        self.wait_for(py, timeout)
    }

    /// Whether the job has ended, finished or failed.
    fn done(&self) -> bool {
        matches!(self.job.status(), JobStatus::Finished | JobStatus::Failed)
    }

    /// The job's number, the same on every rank.
    #[getter]
    fn id(&self) -> u64 {
        self.job.id()
    }

    /// The tensor the sums are written to: the input, or `out`.
    #[getter]
    fn output(&self, py: Python<'_>) -> Py<PyAny> {
        self.output.clone_ref(py)
    }

    /// Calls `callback` once the job has ended, with None if it finished or the
    /// exception it failed with, on a thread of netagg's (an exception the callback
    /// raises is reported as unraisable). Called at once, on that thread, if the job has
    /// ended already.
    fn add_done_callback(&self, callback: Bound<'_, PyAny>) -> PyResult<()> {
        if !callback.is_callable() {
            return Err(PyTypeError::new_err("callback must be callable"));
        }
        let notice = Arc::new(DoneNotice(Mutex::new(Some((self.job.clone(), callback.unbind())))));
        let waker = Waker::from(Arc::clone(&notice));
        let mut job = self.job.clone();
        if Pin::new(&mut job).poll(&mut std::task::Context::from_waker(&waker)).is_ready() {
            notice.wake_by_ref();
        }
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!("netagg.Job(id={}, status={:?})", self.job.id(), self.job.status())
    }
}

impl Job {
    /// Waits with the interpreter released, looking at signals between slices.
    fn wait_for(&self, py: Python<'_>, timeout: Option<Duration>) -> PyResult<bool> {
        let deadline = timeout.map(|timeout| Instant::now() + timeout);
        loop {
            let slice = match deadline {
                Some(deadline) => {
                    deadline.saturating_duration_since(Instant::now()).min(SIGNAL_CHECK_INTERVAL)
                }
                None => SIGNAL_CHECK_INTERVAL,
            };
            if py.detach(|| self.job.wait_timeout(slice)).map_err(to_py)? {
                return Ok(true);
            }
            if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
                return Ok(false);
            }
            py.check_signals()?;
        }
    }
}

/// A callback waiting for its job: the waker the job wakes when it ends, which hands the
/// callback to the callback thread.
struct DoneNotice(Mutex<Option<(netagg::Job, Py<PyAny>)>>);

impl Wake for DoneNotice {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let entry = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        if let Some((job, callback)) = entry {
            callback_thread().send(Completion::Callback { job, callback });
        }
    }
}

/// Work for the callback thread.
enum Completion {
    /// A job has ended: call its callback.
    Callback { job: netagg::Job, callback: Py<PyAny> },
    /// A job no longer needs these buffers.
    Release([Option<PyUntypedBuffer>; 2]),
}

/// The thread that runs callbacks and releases buffers, with the interpreter attached.
struct CallbackThread(crossbeam_channel::Sender<Completion>);

impl CallbackThread {
    fn send(&self, completion: Completion) {
        // Fails only once the thread has ended, as the interpreter shuts down: what it
        // would have done no longer matters then.
        let _ = self.0.send(completion);
    }
}

fn callback_thread() -> &'static CallbackThread {
    static THREAD: OnceLock<CallbackThread> = OnceLock::new();
    THREAD.get_or_init(|| {
        let (sender, receiver) = crossbeam_channel::unbounded::<Completion>();
        let spawned = std::thread::Builder::new().name("netagg-callbacks".into()).spawn(move || {
            for completion in receiver {
                let attached = Python::try_attach(|py| match completion {
                    Completion::Callback { job, callback } => {
                        let argument = match job.wait() {
                            Ok(()) => py.None(),
                            Err(error) => to_py(error).into_value(py).into_any(),
                        };
                        if let Err(error) = callback.call1(py, (argument,)) {
                            error.write_unraisable(py, Some(callback.bind(py)));
                        }
                    }
                    Completion::Release(buffers) => {
                        for buffer in buffers.into_iter().flatten() {
                            buffer.release(py);
                        }
                    }
                });
                if attached.is_none() {
                    // The interpreter is shutting down.
                    break;
                }
            }
        });
        if let Err(error) = spawned {
            // Without the thread, callbacks never run and buffers stay exported; say so.
            eprintln!("netagg: cannot start the callback thread: {error}");
        }
        CallbackThread(sender)
    })
}

fn counters_dict<'py>(py: Python<'py>, counters: &ThreadCounters) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for (name, value) in counters.named() {
        dict.set_item(name, value)?;
    }
    Ok(dict)
}

fn stats_dict<'py>(py: Python<'py>, stats: &netagg::Stats) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("jobs_submitted", stats.jobs_submitted)?;
    dict.set_item("jobs_finished", stats.jobs_finished)?;
    dict.set_item("jobs_failed", stats.jobs_failed)?;
    dict.set_item("elements_submitted", stats.elements_submitted)?;
    let threads = PyList::empty(py);
    for counters in &stats.threads {
        threads.append(counters_dict(py, counters)?)?;
    }
    dict.set_item("threads", threads)?;
    dict.set_item("total", counters_dict(py, &stats.total())?)?;
    Ok(dict)
}

#[pymodule]
fn _netagg(module: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = module.py();
    module.add_class::<Context>()?;
    module.add_class::<Job>()?;
    module.add("Error", py.get_type::<Error>())?;
    module.add("ConfigError", py.get_type::<ConfigError>())?;
    module.add("SwitchError", py.get_type::<SwitchError>())?;
    module.add("JobError", py.get_type::<JobError>())?;
    module.add("StoppedError", py.get_type::<StoppedError>())?;
    module.add("InvalidInputError", py.get_type::<InvalidInputError>())?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
