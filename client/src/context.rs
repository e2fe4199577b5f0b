//! The context: one rank of a session, its lifecycle, and the jobs it takes.
//!
//! Starting a context opens the configured backend's transports ([`crate::backend::open`]),
//! registers them with the switch (`registration`), and starts one worker thread per
//! transport (`driver`). A job is cut into blocks of a packet's elements (`packet_numel` of
//! 4 bytes, twice as many 16-bit ones) and the blocks into one contiguous run per worker
//! thread, the same way on every rank, so the same elements meet in the same slots. Each
//! thread takes its slices in submission order with no barrier between threads: a thread
//! that finished its part of one job starts on the next while the others still work
//! (SwitchML makes all threads wait for each other at every job).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use netagg_aggregator::worker::thread_blocks;
use netagg_aggregator::{PacingConfig, SessionKey, SessionKeys, WorkerConfig};
use netagg_config::Config;
use netagg_wire::Integrity;

use crate::backend::faults::with_faults;
use crate::backend::{Links, SwitchTransport, Transport};
use crate::codec::{BlockFloatingPoint, Codec, Native};
use crate::codec16::Float32As16Bit;
use crate::driver::{worker_thread, Shared, Slice};
use crate::in_flight::JobMemory;
use crate::job::{wait_while_until, DataType, Element, Job, JobBuffers, JobShared, OutputMemory, TensorJob};
use crate::registration::{leave, register, shard_name, watch_session, SwitchSession};
use crate::stats::Stats;
use crate::Error;

/// A started netagg context: one rank of a session.
pub struct Context {
    config: Config,
    /// What carries the packets, as the backend describes it.
    transport: String,
    shared: Arc<Shared>,
    /// One queue per worker thread; emptied on stop. The lock serialises submissions so
    /// every thread sees jobs in the same order.
    slices: Mutex<Vec<Sender<Slice>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Each switch's session and control connection; emptied on stop.
    switches: Mutex<Vec<SwitchSession>>,
    session: u32,
    codec: Arc<dyn Codec>,
    next_job: AtomicU64,
}

impl Context {
    /// Starts a context: registers with the switch and waits until every rank has (or,
    /// with the dummy backend, sets up the emulated switch); then starts the threads.
    /// Float32 travels as `general.prepostprocessor` says.
    pub fn start(config: Config) -> Result<Context, Error> {
        let codec = configured_codec(&config);
        Context::start_with_codec(config, codec)
    }

    /// [`Context::start`] with one's own pre- and post-processing. Every rank must use the
    /// same codec; the switch checks only the configured `prepostprocessor`.
    pub fn start_with_codec(config: Config, codec: Arc<dyn Codec>) -> Result<Context, Error> {
        config.validate().map_err(Error::InvalidConfig)?;
        let links = crate::backend::open(&config)?;
        Context::start_with_links(config, codec, links)
    }

    /// [`Context::start`] over transports of one's own, one per worker thread, instead of
    /// the configured backend's: they register with the switch as the backend's would.
    pub fn start_with_transports(
        config: Config,
        transports: Vec<Box<dyn SwitchTransport>>,
    ) -> Result<Context, Error> {
        config.validate().map_err(Error::InvalidConfig)?;
        let threads = config.general.num_worker_threads as usize;
        if transports.len() != threads {
            return Err(Error::InvalidConfig(format!(
                "{} transports for general.num_worker_threads = {threads}",
                transports.len()
            )));
        }
        let codec = configured_codec(&config);
        Context::start_with_links(config, codec, Links::Switch(transports))
    }

    fn start_with_links(config: Config, codec: Arc<dyn Codec>, links: Links) -> Result<Context, Error> {
        let general = &config.general;
        // Every event of this rank, here, on its worker threads and on its control
        // connection's watcher, carries the rank and the session: a span at the error
        // level, so that it is enabled whenever any event is.
        let span = tracing::error_span!(
            "worker",
            rank = general.rank,
            name = %general.session,
            session = tracing::field::Empty
        );
        let _entered = span.enter();
        let slots_per_thread = config.slots_per_thread();
        let (transports, keys, mut switches, integrity) = match links {
            Links::Emulated { transports, session, token, integrity } => {
                (transports, SessionKeys::one(SessionKey { session, token }), Vec::new(), integrity)
            }
            Links::Switch(mut transports) => {
                let registration =
                    register(&config, slots_per_thread * general.num_worker_threads, &mut transports)?;
                let transports = transports.into_iter().map(|t| t as Box<dyn Transport>).collect();
                (transports, registration.keys, registration.switches, Integrity::Checksummed)
            }
        };
        // The first switch's, which owns slot 0.
        let session = keys.key(0).session;
        span.record("session", tracing::field::display(format_args!("{session:#010x}")));
        let transports = with_faults(transports, &config);
        let transport = transports.first().map(|transport| transport.describe()).unwrap_or_default();
        let pacing = PacingConfig { enabled: general.pacing, target: general.pacing_target };
        let shared = Arc::new(Shared::new(transports.len(), general.sparse, pacing));
        for switch in &mut switches {
            let shard = shard_name(&config, &switch.address);
            watch_session(switch, shard, Arc::clone(&shared))
                .map_err(|e| Error::io("watching the control connection", e))?;
        }
        let mut senders = Vec::new();
        let mut handles = Vec::new();
        for (thread, transport) in transports.into_iter().enumerate() {
            let (sender, receiver) = crossbeam_channel::unbounded();
            let protocol_config = WorkerConfig {
                keys: keys.clone(),
                rank: general.rank,
                slot_base: thread as u16 * slots_per_thread,
                slots: slots_per_thread,
                packet_elements: general.packet_numel,
                depth: general.depth,
                retransmit_timeout: general.timeout,
                max_retransmit_timeout: general
                    .timeout
                    .saturating_mul(64)
                    .min(general.job_timeout / 4)
                    .max(general.timeout),
                job_timeout: general.job_timeout,
                pacing,
                integrity,
            };
            let shared = Arc::clone(&shared);
            let codec = Arc::clone(&codec);
            let span = span.clone();
            let handle = std::thread::Builder::new()
                .name(format!("netagg-worker-{thread}"))
                .spawn(move || {
                    let _entered = span.enter();
                    worker_thread(thread, protocol_config, transport, receiver, shared, codec)
                })
                .map_err(|e| Error::io("starting a worker thread", e))?;
            senders.push(sender);
            handles.push(handle);
        }
        tracing::info!(workers = general.num_workers, threads = handles.len(), %transport, "context started");
        Ok(Context {
            config,
            transport,
            shared,
            slices: Mutex::new(senders),
            threads: Mutex::new(handles),
            switches: Mutex::new(switches),
            session,
            codec,
            next_job: AtomicU64::new(1),
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// What carries the packets, for people: the backend and its device or address
    /// (worker thread 0's; the others' differ only in their ports).
    pub fn transport(&self) -> &str {
        &self.transport
    }

    /// The session id the switch assigned (with several switches, the first's).
    pub fn session(&self) -> u32 {
        self.session
    }

    /// Sums `data` over every rank, in place, and waits for the result.
    pub fn allreduce<T: Element>(&self, data: &mut [T]) -> Result<(), Error> {
        // One pointer for both sides: a read pointer taken before `as_mut_ptr` would be
        // invalidated by it.
        let pointer = data.as_mut_ptr();
        // SAFETY: `data` stays borrowed until the job ends: `wait` returns only then.
        let job = unsafe {
            self.submit(
                pointer.cast_const().cast(),
                pointer.cast(),
                data.len(),
                T::DATA_TYPE,
                None,
                OutputMemory::Initialised,
            )?
        };
        job.wait()
    }

    /// Sums `input` over every rank into `output`, and waits for the result.
    pub fn allreduce_into<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<(), Error> {
        if input.len() != output.len() {
            return Err(Error::LengthMismatch { input: input.len(), output: output.len() });
        }
        // SAFETY: both buffers stay borrowed until the job ends: `wait` returns only then.
        let job = unsafe {
            self.submit(
                input.as_ptr().cast(),
                output.as_mut_ptr().cast(),
                input.len(),
                T::DATA_TYPE,
                None,
                OutputMemory::Initialised,
            )?
        };
        job.wait()
    }

    /// Submits an in-place allreduce of a buffer the job takes; [`TensorJob::wait`] gives
    /// it back holding the sums.
    pub fn allreduce_async<T: Element>(&self, mut data: Vec<T>) -> Result<TensorJob<T>, Error> {
        let pointer = data.as_mut_ptr();
        let len = data.len();
        // SAFETY: the Vec's heap buffer does not move when the Vec is boxed, and the job
        // keeps the box alive until it ends.
        let job = unsafe {
            self.submit(
                pointer.cast(),
                pointer.cast(),
                len,
                T::DATA_TYPE,
                Some(Box::new(data)),
                OutputMemory::Initialised,
            )?
        };
        Ok(TensorJob::new(job))
    }

    /// Submits an allreduce of `numel` elements read from `input` and written to `output`
    /// (they may be equal: in place; otherwise they must not overlap).
    ///
    /// A job whose buffers meet those of a job still in flight where either writes is
    /// refused ([`Error::BufferInUse`]), unless both are the same buffers of the same type:
    /// such jobs run one after the other on each element.
    ///
    /// # Safety
    /// `input` must be readable and initialised, and `output` writable, for `numel`
    /// elements of `data_type` (`output` may hold bytes never written, as C's `malloc`
    /// gives them); neither may be written by anyone else (nor `output` read) until the
    /// job has finished or failed.
    pub unsafe fn submit_raw(
        &self,
        input: *const u8,
        output: *mut u8,
        numel: usize,
        data_type: DataType,
        keepalive: Option<Box<dyn std::any::Any + Send>>,
    ) -> Result<Job, Error> {
        // SAFETY: the caller's contract, which allows output never written.
        unsafe { self.submit(input, output, numel, data_type, keepalive, OutputMemory::MaybeUninitialised) }
    }

    /// [`Context::submit_raw`], told whether `output` is initialised memory.
    ///
    /// # Safety
    /// As [`Context::submit_raw`]'s, and `output` holds initialised bytes if
    /// `output_memory` says so.
    unsafe fn submit(
        &self,
        input: *const u8,
        output: *mut u8,
        numel: usize,
        data_type: DataType,
        keepalive: Option<Box<dyn std::any::Any + Send>>,
        output_memory: OutputMemory,
    ) -> Result<Job, Error> {
        if self.shared.stopping.load(Ordering::Acquire) {
            return Err(Error::Stopped);
        }
        if let Some(error) = self.shared.session_error() {
            return Err(error);
        }
        if numel > 0 && (input.is_null() || output.is_null()) {
            return Err(Error::NullBuffer);
        }
        let memory = JobMemory::new(input, output, numel, data_type);
        memory.check_apart_or_in_place()?;
        // In place, the output is the input, which is initialised.
        let output_memory =
            if std::ptr::eq(input, output) { OutputMemory::Initialised } else { output_memory };
        let queues = self.slices.lock().unwrap_or_else(|p| p.into_inner());
        if queues.is_empty() {
            return Err(Error::Stopped);
        }
        // Numbered before admission: a job refused from here on (its buffers in use by a
        // job in flight, its input refused by the codec) keeps its number, since another
        // rank may admit it. Their later jobs then differ in number, which the switch will
        // not sum together, rather than one rank's next job meeting another's this one.
        let id = self.next_job.fetch_add(1, Ordering::Relaxed);
        let packet = self.codec.wire_type(data_type).per_packet(self.config.general.packet_numel) as usize;
        let blocks = numel.div_ceil(packet);
        let mut slices = Vec::new();
        for (thread, run) in thread_blocks(blocks, queues.len()).enumerate() {
            if !run.is_empty() {
                let start = run.start * packet;
                slices.push((thread, run.start, (run.len() * packet).min(numel - start)));
            }
        }
        if !slices.is_empty() {
            let mut in_flight = self.shared.in_flight.lock().unwrap_or_else(|p| p.into_inner());
            // Checked only once admitted, when no other job writes the input; input that a
            // job in flight over the same memory still writes is not what this job will
            // read, so it is not checked (netagg's own codecs check nothing).
            if !in_flight.admit(id, memory)? {
                // SAFETY: the caller guarantees `numel` readable elements at `input`, and
                // no job in flight writes them.
                let elements = unsafe { crate::slice_io::input_bytes(input, numel * data_type.size()) };
                if let Err(reason) = self.codec.check(data_type, elements) {
                    in_flight.release(id);
                    return Err(Error::InvalidInput(reason));
                }
            }
        }
        let buffers = JobBuffers { input, output, output_memory };
        let job = JobShared::new(id, data_type, numel, buffers, keepalive, slices.len());
        {
            let mut stats = self.shared.stats.lock().unwrap_or_else(|p| p.into_inner());
            stats.jobs_submitted += 1;
            stats.elements_submitted += numel as u64;
            if slices.is_empty() {
                stats.jobs_finished += 1;
            }
        }
        if !slices.is_empty() {
            *self.shared.outstanding.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        }
        for (thread, first_block, elements) in slices {
            let slice = Slice { job: Arc::clone(&job), first_block, block_elements: packet, elements };
            if let Err(crossbeam_channel::SendError(slice)) = queues[thread].send(slice) {
                // The thread is gone (stopped): the slice fails rather than hangs.
                slice.job.finish_slice(Err(Error::Stopped), |failed| self.shared.job_ended(id, failed));
            }
        }
        Ok(Job { shared: job })
    }

    /// Waits until every submitted job has finished or failed.
    pub fn wait_all(&self) {
        self.wait_all_until(None);
    }

    /// Waits at most `timeout` for every submitted job to end: whether they all have.
    pub fn wait_all_timeout(&self, timeout: Duration) -> bool {
        // A timeout past the clock's range is none.
        self.wait_all_until(Instant::now().checked_add(timeout))
    }

    fn wait_all_until(&self, deadline: Option<Instant>) -> bool {
        let outstanding = self.shared.outstanding.lock().unwrap_or_else(|p| p.into_inner());
        *wait_while_until(&self.shared.all_done, outstanding, deadline, |outstanding| *outstanding > 0) == 0
    }

    /// Counters so far.
    pub fn stats(&self) -> Stats {
        self.shared.stats.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Zeroes the counters.
    pub fn reset_stats(&self) {
        let mut stats = self.shared.stats.lock().unwrap_or_else(|p| p.into_inner());
        *stats = Stats::new(stats.threads.len());
    }

    /// Stops the threads (running and queued jobs fail with [`Error::Stopped`]) and leaves
    /// the session; later submissions fail the same way. Any thread may call it, also while
    /// others wait for jobs; stopping twice is harmless. Also done on drop.
    pub fn stop(&self) -> Stats {
        self.shutdown();
        self.stats()
    }

    /// Whether [`Context::stop`] was called.
    pub fn is_stopped(&self) -> bool {
        self.shared.stopping.load(Ordering::Acquire)
    }

    fn shutdown(&self) {
        self.shared.stopping.store(true, Ordering::Release);
        self.slices.lock().unwrap_or_else(|p| p.into_inner()).clear();
        // Joined with the lock held: a second stop returns only when the first is done.
        let mut threads = self.threads.lock().unwrap_or_else(|p| p.into_inner());
        for handle in threads.drain(..) {
            let _ = handle.join();
        }
        drop(threads);
        // Left with the lock held, as the threads were joined.
        let mut switches = self.switches.lock().unwrap_or_else(|p| p.into_inner());
        leave(std::mem::take(&mut *switches), self.config.general.rank);
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The codec `general.prepostprocessor` and `general.wire_precision` name (the
/// configuration's validation refuses a 16-bit wire with block floating point).
fn configured_codec(config: &Config) -> Arc<dyn Codec> {
    match config.general.prepostprocessor.as_str() {
        "cpu_exponent_quantizer" => Arc::new(BlockFloatingPoint::new(config.general.num_workers)),
        _ => match Float32As16Bit::new(config.general.wire_precision) {
            Some(codec) => Arc::new(codec),
            None => Arc::new(Native),
        },
    }
}
