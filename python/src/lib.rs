//! `netagg._netagg`: the client library's contexts and jobs for Python.
//!
//! Tensors cross by the buffer protocol (NumPy arrays, `array.array`, memoryviews) or,
//! for PyTorch CPU tensors, through the array view `Tensor.numpy()` gives of the same
//! memory (of a bfloat16 tensor, which NumPy lacks, viewed as int16): the library reads and writes the caller's memory, and nothing is copied on
//! the way in or out. A job keeps the buffers it uses exported until it has ended, even
//! if Python drops every reference to them or to the job; whoever first sees it ended
//! with the interpreter at hand (a wait, `done()`, the callback thread) releases them.
//!
//! Every blocking call (a context's start, `wait_all` and `stop`, a job's waits) releases
//! the interpreter and waits a slice at a time, so that other Python threads run and
//! Ctrl-C interrupts the wait (the job itself ends by its own timeouts).
//! Callbacks of finished jobs run on one thread of this module's own, never on the
//! library's worker threads, which therefore never wait for the interpreter. At exit
//! (`atexit`) that thread is stopped, and from then on nothing waits for the
//! interpreter: what would need it is left for the process's end.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Wake, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use netagg::{Config, DataType, JobStatus, ThreadCounters};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyException, PyRuntimeError, PyTimeoutError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList};

mod model;

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
pyo3::create_exception!(
    netagg,
    BufferInUseError,
    InvalidInputError,
    "A tensor whose memory a job still in flight uses: wait for that job first."
);

/// The library's error as the exception of its kind, with the library's message.
fn to_py(error: netagg::Error) -> PyErr {
    use netagg::Error as E;
    let message = error.to_string();
    match error {
        E::Config(_) | E::InvalidConfig(_) | E::NotBuiltIn { .. } => ConfigError::new_err(message),
        E::Connect { .. }
        | E::Version { .. }
        | E::Rejected { .. }
        | E::RegisterTimeout { .. }
        | E::SessionLost(_) => SwitchError::new_err(message),
        E::Job(_) | E::Panicked { .. } => JobError::new_err(message),
        E::Stopped => StoppedError::new_err(message),
        E::LengthMismatch { .. } | E::NullBuffer | E::InvalidInput(_) => InvalidInputError::new_err(message),
        E::BufferInUse { .. } => BufferInUseError::new_err(message),
        // An argument error, as the other checks of `out` are.
        E::OverlappingBuffers => PyValueError::new_err(message),
        E::Io { .. } | E::Backend(_) => Error::new_err(message),
    }
}

/// How often a blocking wait looks at the interpreter's signals (Ctrl-C).
const SIGNAL_CHECK_INTERVAL: Duration = Duration::from_millis(50);

/// Waits with the interpreter released, in slices of at most [`SIGNAL_CHECK_INTERVAL`]
/// handed to `poll`, until `poll` returns a value (Some) or `timeout` passes (None);
/// between slices it looks at the interpreter's signals, so Ctrl-C raises
/// KeyboardInterrupt within a slice. Every blocking call of the module waits here.
fn wait_interruptibly<T: Send>(
    py: Python<'_>,
    timeout: Option<Duration>,
    poll: impl Fn(Duration) -> Option<T> + Sync,
) -> PyResult<Option<T>> {
    // A timeout past the clock's range is none.
    let deadline = timeout.and_then(|timeout| Instant::now().checked_add(timeout));
    loop {
        let slice = deadline.map_or(SIGNAL_CHECK_INTERVAL, |deadline| {
            deadline.saturating_duration_since(Instant::now()).min(SIGNAL_CHECK_INTERVAL)
        });
        if let Some(value) = py.detach(|| poll(slice)) {
            return Ok(Some(value));
        }
        if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
            return Ok(None);
        }
        py.check_signals()?;
    }
}

/// Runs `work` on a thread of its own while this one waits interruptibly, for calls
/// that cannot wait in slices themselves (a start that waits for the switch, a stop that
/// joins threads). Interrupted, `work` runs on to its end, and what it returns is
/// dropped on its thread.
fn run_interruptibly<T: Send + 'static>(
    py: Python<'_>,
    what: &str,
    work: impl FnOnce() -> T + Send + 'static,
) -> PyResult<T> {
    let (sender, receiver) = crossbeam_channel::bounded(1);
    std::thread::Builder::new()
        .name(format!("netagg-{what}"))
        .spawn(move || {
            let _ = sender.send(work());
        })
        .map_err(|error| {
            PyRuntimeError::new_err(format!("netagg: cannot start a thread to {what}: {error}"))
        })?;
    let received = wait_interruptibly(py, None, |slice| match receiver.recv_timeout(slice) {
        Ok(value) => Some(Some(value)),
        Err(crossbeam_channel::RecvTimeoutError::Timeout) => None,
        Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Some(None),
    })?;
    received
        .flatten()
        .ok_or_else(|| PyRuntimeError::new_err(format!("netagg: the thread to {what} panicked")))
}

/// A netagg context: the library's worker threads and their session at the switch.
///
/// `Context(config_file=None, settings=None)` reads the configuration as the C library
/// does (the file named, else `$NETAGG_CONFIG`, else `./netagg.cfg`...; then the
/// launcher's rank and size variables and `NETAGG_*` variables), then applies
/// `settings`, a dict of keys such as `"general.num_workers"` to values, and starts:
/// it returns once every rank has registered at the switch.
#[pyclass(module = "netagg", frozen)]
struct Context {
    /// Shared with the thread that stops it, which may outlive an interrupted `stop()`.
    inner: Arc<netagg::Context>,
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
        // The start validates the whole. Interrupted, it goes on alone, and a context it
        // then starts is dropped (stopped, leaving the session) on its thread.
        let inner = run_interruptibly(py, "start", move || netagg::Context::start(config))?.map_err(to_py)?;
        Ok(Context { inner: Arc::new(inner) })
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
    /// sums. float32, int32, float16 (NumPy or PyTorch) and bfloat16 (PyTorch),
    /// contiguous, on the CPU.
    #[pyo3(signature = (tensor, out=None))]
    fn allreduce<'py>(
        &self,
        py: Python<'py>,
        tensor: Bound<'py, PyAny>,
        out: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let job = self.submit(tensor, out)?;
        if let Some(Err(error)) = job.wait_for(py, None)? {
            return Err(to_py(error));
        }
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
    fn wait_all(&self, py: Python<'_>) -> PyResult<()> {
        wait_interruptibly(py, None, |slice| self.inner.wait_all_timeout(slice).then_some(()))?;
        Ok(())
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
        let inner = Arc::clone(&self.inner);
        let stats = run_interruptibly(py, "stop", move || inner.stop())?;
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

impl Drop for Context {
    /// A context dropped unstopped stops here, with the interpreter released: its worker
    /// threads are joined, which may take a moment. At exit, nothing waits for the
    /// interpreter any more, and the context stops as it is dropped.
    fn drop(&mut self) {
        if !self.inner.is_stopped() && !FINALIZING.load(Ordering::Acquire) {
            Python::attach(|py| py.detach(|| self.inner.stop()));
        }
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
        let exported = Arc::new(Exported(Mutex::new(Some([Some(input.buffer), output.map(|o| o.buffer)]))));
        let keepalive = Box::new(KeepAlive(Arc::clone(&exported)));
        // SAFETY: the buffers stay exported, their memory valid, until the job has ended
        // (all its slices: no worker thread touches them after) and someone releases them
        // then, or until the library drops the keepalive, which it does only after that.
        // That the caller neither touches nor resizes them meanwhile (a PyTorch tensor's
        // `resize_` or `set_` would free the memory under the export) is the contract of
        // allreduce_async, and of allreduce, which waits (a Ctrl-C in its wait leaves the
        // job running, its buffers exported).
        let job = unsafe { self.inner.submit_raw(source, destination, numel, data_type, Some(keepalive)) }
            .map_err(to_py)?;
        Ok(Job { job, exported, output: target.unbind() })
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
        let (buffer, data_type) = match PyUntypedBuffer::get(object) {
            Ok(buffer) => {
                let data_type = buffer_data_type(&buffer, name)?;
                (buffer, data_type)
            }
            Err(_) if object.hasattr("numpy")? && object.hasattr("is_contiguous")? => {
                torch_tensor_buffer(object, name)?
            }
            Err(error) => {
                return Err(PyTypeError::new_err(format!(
                    "{name} must be a NumPy array, a PyTorch CPU tensor or another buffer of {SUMMED_TYPES}; \
                     this {} is not ({error})",
                    object.get_type().name()?
                )))
            }
        };
        if !buffer.is_c_contiguous() {
            return Err(PyValueError::new_err(format!(
                "{name} is not contiguous (make it so with numpy.ascontiguousarray)"
            )));
        }
        let numel = buffer.item_count();
        Ok(Tensor { buffer, data_type, numel })
    }
}

/// The element types the library sums, as errors list them.
const SUMMED_TYPES: &str = "float32, int32, float16 and bfloat16";

/// A PyTorch CPU tensor's memory and element type, its dtype checked.
fn torch_tensor_buffer(object: &Bound<'_, PyAny>, name: &str) -> PyResult<(PyUntypedBuffer, DataType)> {
    let dtype = object.getattr("dtype")?.str()?.to_string();
    let data_type = match dtype.as_str() {
        "torch.float32" => DataType::Float32,
        "torch.int32" => DataType::Int32,
        "torch.float16" => DataType::Float16,
        "torch.bfloat16" => DataType::BFloat16,
        _ => {
            return Err(PyTypeError::new_err(format!(
                "{name} is a {dtype} tensor: netagg sums {SUMMED_TYPES}"
            )))
        }
    };
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
    let mut tensor = object.call_method0("detach")?;
    if data_type == DataType::BFloat16 {
        // NumPy has no bfloat16: the same memory viewed as int16 exports its bytes.
        let int16 = object.py().import("torch")?.getattr("int16")?;
        tensor = tensor.call_method1("view", (int16,))?;
    }
    Ok((PyUntypedBuffer::get(&tensor.call_method0("numpy")?)?, data_type))
}

/// The element type of a buffer's items, from its struct-module format code.
fn buffer_data_type(buffer: &PyUntypedBuffer, name: &str) -> PyResult<DataType> {
    // An optional byte order, then the type.
    let format = buffer.format().to_bytes();
    let (order, code) = match format {
        [order @ (b'@' | b'=' | b'<' | b'>' | b'!'), code @ ..] => (*order, code),
        code => (b'@', code),
    };
    let big_endian = matches!(order, b'>' | b'!') || (cfg!(target_endian = "big") && order == b'<');
    match (code, buffer.item_size()) {
        _ if big_endian => Err(PyTypeError::new_err(format!(
            "{name} holds elements in the other byte order ('{}'): convert them to native \
             order first (NumPy: .astype('=f4'), '=i4' or '=f2')",
            String::from_utf8_lossy(format)
        ))),
        (b"f", 4) => Ok(DataType::Float32),
        (b"i" | b"l", 4) => Ok(DataType::Int32),
        (b"e", 2) => Ok(DataType::Float16),
        _ => Err(PyTypeError::new_err(format!(
            "{name} holds elements of format '{}' ({} bytes): netagg sums {SUMMED_TYPES} (bfloat16 \
             as PyTorch tensors)",
            String::from_utf8_lossy(format),
            buffer.item_size()
        ))),
    }
}

/// Set by the `atexit` hook: the interpreter is finalizing, and no thread may wait for
/// it any more.
static FINALIZING: AtomicBool = AtomicBool::new(false);

/// Input, then output if not in place.
type Buffers = [Option<PyUntypedBuffer>; 2];

fn release(py: Python<'_>, buffers: Buffers) {
    for buffer in buffers.into_iter().flatten() {
        buffer.release(py);
    }
}

/// A job's exported buffers, shared by its Python handle, its callbacks and the
/// library's keepalive: the first to see the job ended with the interpreter at hand
/// releases them.
struct Exported(Mutex<Option<Buffers>>);

impl Exported {
    fn take(&self) -> Option<Buffers> {
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take()
    }

    /// Releases the buffers of a job that has ended.
    fn release(&self, py: Python<'_>) {
        if let Some(buffers) = self.take() {
            release(py, buffers);
        }
    }
}

/// What the library keeps alive for the job and drops once it has ended, on whichever
/// thread ends it last: a worker thread of the library, which must not wait for the
/// interpreter, so buffers still exported then are released on the callback thread.
struct KeepAlive(Arc<Exported>);

impl Drop for KeepAlive {
    fn drop(&mut self) {
        if let Some(buffers) = self.0.take() {
            callback_thread().send(Completion::Release(buffers));
        }
    }
}

/// A submitted allreduce. `wait()` blocks until it ends; `done()` tells whether it has;
/// `exception()` gives the error it failed with; `add_done_callback(fn)` calls `fn(job)`
/// once it has ended; `output` is the tensor the sums are written to.
#[pyclass(module = "netagg", frozen)]
struct Job {
    job: netagg::Job,
    exported: Arc<Exported>,
    output: Py<PyAny>,
}

#[pymethods]
impl Job {
    /// Waits until the job has ended, at most `timeout` seconds if given: True once it
    /// has finished, False if the timeout passed first; raises the job's error if it
    /// failed.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        match self.wait_for(py, seconds(timeout)?)? {
            None => Ok(false),
            Some(outcome) => outcome.map(|()| true).map_err(to_py),
        }
    }

    /// Waits as `wait` does, and returns the exception the job failed with, or None if
    /// it finished; raises TimeoutError if `timeout` passed first.
    #[pyo3(signature = (timeout=None))]
    fn exception(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Py<PyAny>>> {
        match self.wait_for(py, seconds(timeout)?)? {
            None => Err(PyTimeoutError::new_err(format!("job {} has not ended", self.job.id()))),
            Some(outcome) => Ok(outcome.err().map(|error| to_py(error).into_value(py).into_any())),
        }
    }

    /// Whether the job has ended, finished or failed.
    fn done(&self, py: Python<'_>) -> bool {
        let ended = matches!(self.job.status(), JobStatus::Finished | JobStatus::Failed);
        if ended {
            self.exported.release(py);
        }
        ended
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

    /// Calls `callback(job)` once the job has ended, on a thread of netagg's, where
    /// `job.exception()` then gives its outcome at once (an exception the callback raises
    /// is reported as unraisable). Called at once, on that thread, if the job has ended
    /// already. Callbacks run one at a time: one that blocks delays the others.
    fn add_done_callback(slf: &Bound<'_, Self>, callback: Bound<'_, PyAny>) -> PyResult<()> {
        if !callback.is_callable() {
            return Err(PyTypeError::new_err("callback must be callable"));
        }
        let notice = Arc::new(DoneNotice(Mutex::new(Some((slf.clone().unbind(), callback.unbind())))));
        let waker = Waker::from(Arc::clone(&notice));
        let mut job = slf.get().job.clone();
        if Pin::new(&mut job).poll(&mut std::task::Context::from_waker(&waker)).is_ready() {
            notice.wake_by_ref();
        }
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!("netagg.Job(id={}, status={:?})", self.job.id(), self.job.status())
    }
}

/// A timeout in seconds from Python, checked; one past what a `Duration` holds (some
/// 10^19 s) is none.
fn seconds(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout {
        Some(seconds) if !(seconds >= 0.0 && seconds.is_finite()) => {
            Err(PyValueError::new_err(format!("timeout must be a number of seconds >= 0, not {seconds}")))
        }
        timeout => Ok(timeout.and_then(|seconds| Duration::try_from_secs_f64(seconds).ok())),
    }
}

impl Job {
    /// Waits interruptibly ([`wait_interruptibly`]); the job's outcome once it has ended
    /// (its buffers then released), None at `timeout`.
    fn wait_for(
        &self,
        py: Python<'_>,
        timeout: Option<Duration>,
    ) -> PyResult<Option<Result<(), netagg::Error>>> {
        let outcome = wait_interruptibly(py, timeout, |slice| match self.job.wait_timeout(slice) {
            Ok(false) => None,
            Ok(true) => Some(Ok(())),
            Err(error) => Some(Err(error)),
        })?;
        if outcome.is_some() {
            self.exported.release(py);
        }
        Ok(outcome)
    }
}

/// A callback waiting for its job: the waker the job wakes when it ends, which hands the
/// callback to the callback thread.
struct DoneNotice(Mutex<Option<(Py<Job>, Py<PyAny>)>>);

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
    /// A job has ended: release its buffers and call its callback.
    Callback { job: Py<Job>, callback: Py<PyAny> },
    /// A job no longer needs these buffers.
    Release(Buffers),
    /// The interpreter is finalizing: end.
    Stop,
}

/// The thread that runs callbacks and releases buffers, with the interpreter attached.
struct CallbackThread {
    sender: crossbeam_channel::Sender<Completion>,
    handle: Mutex<Option<JoinHandle<()>>>,
}

impl CallbackThread {
    /// Hands the thread work; once the interpreter is finalizing, drops it without
    /// touching Python (its references and buffers are left for the process's end).
    fn send(&self, completion: Completion) {
        if FINALIZING.load(Ordering::Acquire) {
            std::mem::forget(completion);
        } else if let Err(crossbeam_channel::SendError(completion)) = self.sender.send(completion) {
            std::mem::forget(completion);
        }
    }

    fn start() -> std::io::Result<CallbackThread> {
        let (sender, receiver) = crossbeam_channel::unbounded::<Completion>();
        let handle = std::thread::Builder::new().name("netagg-callbacks".into()).spawn(move || {
            for completion in receiver {
                match completion {
                    Completion::Stop => break,
                    Completion::Release(buffers) => Python::attach(|py| release(py, buffers)),
                    Completion::Callback { job, callback } => Python::attach(|py| {
                        job.get().exported.release(py);
                        if let Err(error) = callback.call1(py, (job.clone_ref(py),)) {
                            error.write_unraisable(py, Some(callback.bind(py)));
                        }
                    }),
                }
            }
        })?;
        Ok(CallbackThread { sender, handle: Mutex::new(Some(handle)) })
    }
}

static CALLBACK_THREAD: OnceLock<CallbackThread> = OnceLock::new();

/// Started when the module is imported.
fn callback_thread() -> &'static CallbackThread {
    CALLBACK_THREAD.get().expect("the callback thread starts with the module")
}

/// Registered with `atexit`: stops the callback thread, letting it finish what it has
/// (with the interpreter released, so that it can), before the interpreter finalizes.
#[pyfunction]
fn _stop_callbacks(py: Python<'_>) {
    let thread = callback_thread();
    let _ = thread.sender.send(Completion::Stop);
    let handle = thread.handle.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
    if let Some(handle) = handle {
        py.detach(|| {
            let _ = handle.join();
        });
    }
    FINALIZING.store(true, Ordering::Release);
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
    if CALLBACK_THREAD.get().is_none() {
        let thread = CallbackThread::start().map_err(|error| {
            PyRuntimeError::new_err(format!("netagg: cannot start its callback thread: {error}"))
        })?;
        let _ = CALLBACK_THREAD.set(thread);
        py.import("atexit")?.call_method1("register", (wrap_pyfunction!(_stop_callbacks, module)?,))?;
    }
    module.add_class::<Context>()?;
    module.add_class::<Job>()?;
    module.add("Error", py.get_type::<Error>())?;
    module.add("ConfigError", py.get_type::<ConfigError>())?;
    module.add("SwitchError", py.get_type::<SwitchError>())?;
    module.add("JobError", py.get_type::<JobError>())?;
    module.add("StoppedError", py.get_type::<StoppedError>())?;
    module.add("InvalidInputError", py.get_type::<InvalidInputError>())?;
    module.add("BufferInUseError", py.get_type::<BufferInUseError>())?;
    module.add_function(wrap_pyfunction!(model::netagg_seconds, module)?)?;
    module.add_function(wrap_pyfunction!(model::ring_seconds, module)?)?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
