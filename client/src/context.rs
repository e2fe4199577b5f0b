//! The context: registers with the switch, runs the worker threads, takes jobs.
//!
//! A job is cut into blocks of `packet_numel` elements and the blocks into one contiguous
//! run per worker thread, the same way on every rank, so the same elements meet in the
//! same slots. Each thread takes its slices in submission order with no barrier between
//! threads: a thread that finished its part of one job starts on the next while the
//! others still work (SwitchML makes all threads wait for each other at every job).

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use netagg_aggregator::worker::JobError;
use netagg_aggregator::{
    BlockIo, JobSpec, JobStatus as ProtocolStatus, Layout, SessionSpec, WorkerConfig, WorkerProtocol,
};
use netagg_wire::{ControlMessage, ValueEncoding, MAX_DATAGRAM_LEN};

use crate::backend::dummy::DummyTransport;
use crate::backend::faults::FaultyTransport;
use crate::backend::udp::UdpTransport;
use crate::backend::Transport;
use crate::codec::{BlockFloatingPoint, Codec, Native};
use crate::job::{DataType, Element, Job, JobShared, TensorJob};
use crate::stats::Stats;
use crate::Error;
use netagg_config::{BackendKind, Config, SparseMode};

/// What starting a backend gives: a transport per worker thread, the session id and
/// token, and the control connection (none for the dummy backend).
type Started = (Vec<Box<dyn Transport>>, u32, u64, Option<TcpStream>);

/// The longest a worker thread sleeps before it looks at `stop` and the session again.
const THREAD_WAKEUP: Duration = Duration::from_millis(50);

struct Slice {
    job: Arc<JobShared>,
    first_block: usize,
    /// Elements of this slice; it starts at element `first_block * packet_numel`.
    elements: usize,
}

/// State the threads share with the context.
struct Shared {
    stopping: AtomicBool,
    /// Set when the switch closed the session; every job fails with it from then on.
    session_lost: Mutex<Option<String>>,
    stats: Mutex<Stats>,
    /// Jobs submitted and not yet ended, for [`Context::wait_all`].
    outstanding: Mutex<usize>,
    all_done: Condvar,
    /// Whether zero blocks stay off the wire (`general.sparse`).
    sparse: SparseMode,
}

impl Shared {
    fn session_error(&self) -> Option<Error> {
        self.session_lost.lock().unwrap_or_else(|p| p.into_inner()).clone().map(Error::SessionLost)
    }

    fn job_ended(&self, failed: bool) {
        {
            let mut stats = self.stats.lock().unwrap_or_else(|p| p.into_inner());
            if failed {
                stats.jobs_failed += 1;
            } else {
                stats.jobs_finished += 1;
            }
        }
        let mut outstanding = self.outstanding.lock().unwrap_or_else(|p| p.into_inner());
        *outstanding = outstanding.saturating_sub(1);
        if *outstanding == 0 {
            self.all_done.notify_all();
        }
    }
}

/// A started netagg context: one rank of a session.
pub struct Context {
    config: Config,
    shared: Arc<Shared>,
    /// One queue per worker thread; emptied on stop. The lock serialises submissions so
    /// every thread sees jobs in the same order.
    slices: Mutex<Vec<Sender<Slice>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    control: Mutex<Option<TcpStream>>,
    session: u32,
    codec: Arc<dyn Codec>,
    next_job: AtomicU64,
}

impl Context {
    /// Starts a context: registers with the switch (UDP backend) and waits until every
    /// rank has, or sets up the in-process switch (dummy backend); then starts the threads.
    /// Float32 travels as `general.prepostprocessor` says.
    pub fn start(config: Config) -> Result<Context, Error> {
        let codec: Arc<dyn Codec> = match config.general.prepostprocessor.as_str() {
            "cpu_exponent_quantizer" => Arc::new(BlockFloatingPoint::new(config.general.num_workers)),
            _ => Arc::new(Native),
        };
        Context::start_with_codec(config, codec)
    }

    /// [`Context::start`] with one's own pre- and post-processing. Every rank must use the
    /// same codec; the switch checks only the configured `prepostprocessor`.
    pub fn start_with_codec(config: Config, codec: Arc<dyn Codec>) -> Result<Context, Error> {
        config.validate().map_err(Error::InvalidConfig)?;
        let general = &config.general;
        let threads = general.num_worker_threads as usize;
        let slots_per_thread = config.slots_per_thread();
        let total_slots = slots_per_thread * general.num_worker_threads;

        let (transports, session, token, control): Started = match general.backend {
            BackendKind::Dummy => {
                let spec = SessionSpec {
                    workers: general.num_workers,
                    slots: total_slots,
                    packet_elements: general.packet_numel,
                    depth: general.depth,
                };
                let mut transports: Vec<Box<dyn Transport>> = Vec::new();
                let mut session = 0;
                let token = DummyTransport::new_token();
                for _ in 0..threads {
                    let (transport, id) = DummyTransport::new(
                        spec,
                        token,
                        config.dummy.bandwidth,
                        config.dummy.process_packets,
                    )
                    .map_err(Error::InvalidConfig)?;
                    session = id.0;
                    transports.push(Box::new(transport));
                }
                (transports, session, token, None)
            }
            BackendKind::Udp => {
                let mut sockets = (0..threads)
                    .map(|_| {
                        UdpTransport::bind(SocketAddr::new(config.udp.bind_ip, 0), config.udp.socket_buffer)
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| Error::Io(format!("binding the worker threads' UDP sockets: {e}")))?;
                let ports = sockets
                    .iter()
                    .map(|s| s.local_addr().map(|a| a.port()))
                    .collect::<Result<Vec<_>, _>>()?;
                let (stream, switch_ip, session, token, data_port) = register(&config, total_slots, ports)?;
                for socket in &mut sockets {
                    socket.connect(SocketAddr::new(switch_ip, data_port))?;
                }
                let transports = sockets.into_iter().map(|s| Box::new(s) as Box<dyn Transport>).collect();
                (transports, session, token, Some(stream))
            }
        };

        let transports = with_faults(transports, &config);
        let shared = Arc::new(Shared {
            stopping: AtomicBool::new(false),
            session_lost: Mutex::new(None),
            stats: Mutex::new(Stats::new(threads)),
            outstanding: Mutex::new(0),
            all_done: Condvar::new(),
            sparse: general.sparse,
        });
        if let Some(stream) = &control {
            watch_session(stream.try_clone()?, Arc::clone(&shared));
        }
        let mut senders = Vec::new();
        let mut handles = Vec::new();
        for (thread, transport) in transports.into_iter().enumerate() {
            let (sender, receiver) = crossbeam_channel::unbounded();
            let protocol_config = WorkerConfig {
                session,
                token,
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
            };
            let shared = Arc::clone(&shared);
            let codec = Arc::clone(&codec);
            let handle = std::thread::Builder::new()
                .name(format!("netagg-worker-{thread}"))
                .spawn(move || worker_thread(thread, protocol_config, transport, receiver, shared, codec))?;
            senders.push(sender);
            handles.push(handle);
        }
        tracing::info!(
            rank = general.rank,
            workers = general.num_workers,
            threads,
            session = format_args!("{session:#010x}"),
            "context started"
        );
        Ok(Context {
            config,
            shared,
            slices: Mutex::new(senders),
            threads: Mutex::new(handles),
            control: Mutex::new(control),
            session,
            codec,
            next_job: AtomicU64::new(1),
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The session id the switch assigned.
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
            self.submit_raw(pointer.cast_const().cast(), pointer.cast(), data.len(), T::DATA_TYPE, None)?
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
            self.submit_raw(
                input.as_ptr().cast(),
                output.as_mut_ptr().cast(),
                input.len(),
                T::DATA_TYPE,
                None,
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
            self.submit_raw(pointer.cast(), pointer.cast(), len, T::DATA_TYPE, Some(Box::new(data)))?
        };
        Ok(TensorJob::new(job))
    }

    /// Submits an allreduce of `numel` elements read from `input` and written to `output`
    /// (they may be equal: in place).
    ///
    /// # Safety
    /// `input` must be readable and `output` writable for `numel` elements of
    /// `data_type`, and neither may be written by anyone else (nor `output` read) until
    /// the job has finished or failed.
    pub unsafe fn submit_raw(
        &self,
        input: *const u8,
        output: *mut u8,
        numel: usize,
        data_type: DataType,
        keepalive: Option<Box<dyn std::any::Any + Send>>,
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
        if numel > 0 {
            // SAFETY: the caller guarantees `numel` readable elements at `input`.
            let elements = unsafe { std::slice::from_raw_parts(input, numel * data_type.size()) };
            self.codec.check(data_type, elements).map_err(Error::InvalidInput)?;
        }
        let queues = self.slices.lock().unwrap_or_else(|p| p.into_inner());
        if queues.is_empty() {
            return Err(Error::Stopped);
        }
        let id = self.next_job.fetch_add(1, Ordering::Relaxed);
        let packet = self.config.general.packet_numel as usize;
        let blocks = numel.div_ceil(packet);
        let threads = queues.len();
        let (share, extra) = (blocks / threads, blocks % threads);
        let mut slices = Vec::new();
        let mut first_block = 0;
        for thread in 0..threads {
            let count = share + usize::from(thread < extra);
            if count > 0 {
                let start = first_block * packet;
                slices.push((thread, first_block, (count * packet).min(numel - start)));
            }
            first_block += count;
        }
        let job = JobShared::new(id, data_type, numel, input, output, keepalive, slices.len());
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
            let slice = Slice { job: Arc::clone(&job), first_block, elements };
            if let Err(crossbeam_channel::SendError(slice)) = queues[thread].send(slice) {
                // The thread is gone (stopped): the slice fails rather than hangs.
                slice.job.finish_slice(Err(Error::Stopped), |failed| self.shared.job_ended(failed));
            }
        }
        Ok(Job { shared: job })
    }

    /// Waits until every submitted job has finished or failed.
    pub fn wait_all(&self) {
        let mut outstanding = self.shared.outstanding.lock().unwrap_or_else(|p| p.into_inner());
        while *outstanding > 0 {
            outstanding = self.shared.all_done.wait(outstanding).unwrap_or_else(|p| p.into_inner());
        }
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
        if let Some(mut stream) = self.control.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let leave = ControlMessage::Leave { session: self.session, rank: self.config.general.rank };
            let _ = leave.write_to(0, &mut stream);
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Wraps every transport in the fault injector of `[faults]`, if any fault is set.
fn with_faults(transports: Vec<Box<dyn Transport>>, config: &Config) -> Vec<Box<dyn Transport>> {
    if !config.faults.is_active() {
        return transports;
    }
    tracing::warn!(faults = ?config.faults, "injecting faults into this worker's packets");
    let rank = config.general.rank as u64;
    (0..)
        .zip(transports)
        .map(|(thread, transport)| {
            let stream = rank << 16 | thread;
            Box::new(FaultyTransport::new(transport, &config.faults, stream)) as Box<dyn Transport>
        })
        .collect()
}

/// Registers with the switch and waits for every rank; returns the control connection,
/// the switch's address, the session id and token, and the data port.
fn register(
    config: &Config,
    slots: u16,
    ports: Vec<u16>,
) -> Result<(TcpStream, std::net::IpAddr, u32, u64, u16), Error> {
    let general = &config.general;
    let target = format!("{}:{}", general.controller_ip, general.controller_port);
    let deadline = Instant::now() + general.connect_timeout;
    let mut stream = loop {
        let attempt = target
            .to_socket_addrs()
            .map_err(|e| Error::Connect { address: target.clone(), reason: e.to_string() })?
            .next()
            .ok_or_else(|| Error::Connect { address: target.clone(), reason: "no address".into() })
            .and_then(|address| {
                let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
                TcpStream::connect_timeout(&address, left)
                    .map_err(|e| Error::Connect { address: target.clone(), reason: e.to_string() })
            });
        match attempt {
            Ok(stream) => break stream,
            // The switch may still be starting: try again until the deadline.
            Err(error) if Instant::now() + Duration::from_millis(100) < deadline => {
                tracing::debug!(%error, "switch not reachable yet");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(error) => return Err(error),
        }
    };
    let _ = stream.set_nodelay(true);
    let register = ControlMessage::Register {
        rank: general.rank,
        world_size: general.num_workers,
        packet_elements: general.packet_numel,
        slots,
        depth: general.depth,
        encoding: match general.prepostprocessor.as_str() {
            "cpu_exponent_quantizer" => ValueEncoding::BlockFloatingPoint,
            _ => ValueEncoding::Native,
        },
        sparse_blocks: general.sparse == SparseMode::Auto,
        name: general.session.clone(),
        ports,
    };
    register.write_to(1, &mut stream)?;
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left))?;
    let reply = ControlMessage::read_from(&mut stream).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Error::RegisterTimeout {
            waited: general.connect_timeout,
            session: general.session.clone(),
            workers: general.num_workers,
        },
        _ => Error::Io(format!("registration with {target}: {e}")),
    })?;
    stream.set_read_timeout(None)?;
    match reply {
        (_, ControlMessage::Accept { session, data_port, token, .. }) => {
            let switch_ip = stream.peer_addr()?.ip();
            Ok((stream, switch_ip, session, token, data_port))
        }
        (_, ControlMessage::Reject { code, message }) => Err(Error::Rejected { code, message }),
        (_, other) => Err(Error::Io(format!("registration with {target}: unexpected reply {other:?}"))),
    }
}

/// Watches the control connection: the switch says so there when the session ends.
fn watch_session(mut stream: TcpStream, shared: Arc<Shared>) {
    std::thread::spawn(move || {
        let reason = match ControlMessage::read_from(&mut stream) {
            Ok((_, ControlMessage::Reject { message, .. })) => message,
            Ok((_, other)) => format!("unexpected control message {other:?}"),
            Err(error) => format!("the switch closed the control connection ({error})"),
        };
        if !shared.stopping.load(Ordering::Acquire) {
            tracing::warn!(%reason, "session lost");
            *shared.session_lost.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason);
        }
    });
}

/// Blocks whose exponents one look-up finds together: a run of 32 KiB at 256-element
/// packets, read in one sequential pass, where a block at a time, between the other work
/// of a packet, waits on memory for each. Each look-up also prefetches one block of the
/// next run, so that the run finds its blocks in cache.
const EXPONENT_RUN: usize = 32;

/// How many blocks ahead a store prefetches the output: a few packets' time, as the
/// memory system takes to answer.
const STORE_PREFETCH_DISTANCE: usize = 16;

/// The longest block [`SliceIo`] prefetches: 1024 float32 elements.
const PREFETCH_MAX_BLOCK_BYTES: usize = 4096;

/// Moves a slice's blocks between the caller's buffers and packets through the codec.
struct SliceIo<'a> {
    input: *const u8,
    output: *mut u8,
    bytes: usize,
    block_bytes: usize,
    data_type: DataType,
    codec: Arc<dyn Codec>,
    /// The exponents of the slice's first blocks, found [`EXPONENT_RUN`] at a time; the
    /// worker thread's buffer, empty at the start of a slice.
    exponents: &'a mut Vec<i8>,
}

impl SliceIo<'_> {
    fn range(&self, block: u32, len: usize) -> std::ops::Range<usize> {
        let start = block as usize * self.block_bytes;
        start..(start + len).min(self.bytes)
    }

    /// Whether blocks are short enough to prefetch: a long block is a sequential run the
    /// hardware prefetcher streams by itself, and prefetching blocks of 16 KiB (those of
    /// `configs/large-packets.cfg`) ran a fifth slower.
    fn prefetches(&self) -> bool {
        self.block_bytes <= PREFETCH_MAX_BLOCK_BYTES
    }

    /// Whether the slice has a block `block` (a multiplication: this runs per packet).
    fn has_block(&self, block: usize) -> bool {
        block * self.block_bytes < self.bytes
    }

    fn input(&self, block: u32, len: usize) -> &[u8] {
        let range = self.range(block, len);
        // SAFETY: the protocol only asks for blocks of this slice, whose bytes lie within
        // the job's input (the submitter's contract); `range` clamps to the slice.
        unsafe { std::slice::from_raw_parts(self.input.add(range.start), range.len()) }
    }
}

#[cfg(target_endian = "big")]
compile_error!("netagg's wire format is little-endian; big-endian hosts need a byte-swapping codec");

impl BlockIo for SliceIo<'_> {
    fn load(&mut self, block: u32, payload: &mut [u8], exponent: Option<i8>) {
        let elements = self.input(block, payload.len());
        let len = elements.len();
        self.codec.encode(self.data_type, elements, &mut payload[..len], exponent);
    }

    fn store(&mut self, block: u32, payload: &[u8], exponent: Option<i8>) {
        let range = self.range(block, if payload.is_empty() { self.block_bytes } else { payload.len() });
        // SAFETY: as in `input`; this thread alone writes this slice's bytes.
        let target = unsafe { std::slice::from_raw_parts_mut(self.output.add(range.start), range.len()) };
        if payload.is_empty() {
            target.fill(0);
        } else {
            let len = target.len();
            self.codec.decode(self.data_type, &payload[..len], target, exponent);
        }
        // Results come back about in block order: the output a later one writes is
        // fetched now, so that its store finds the lines in cache.
        let ahead = block as usize + STORE_PREFETCH_DISTANCE;
        if self.prefetches() && self.has_block(ahead) {
            let range = self.range(ahead as u32, self.block_bytes);
            // SAFETY: as in `input`: the range lies within the slice.
            prefetch(unsafe { self.output.add(range.start) }, range.len());
        }
    }

    fn exponent(&mut self, block: u32) -> i8 {
        let block = block as usize;
        if block >= self.exponents.len() {
            let end = (block + EXPONENT_RUN).min(self.bytes.div_ceil(self.block_bytes));
            for next in self.exponents.len()..end {
                let elements = self.input(next as u32, self.block_bytes);
                let exponent = self.codec.exponent(self.data_type, elements);
                self.exponents.push(exponent);
            }
        }
        // One block of the next run per look-up: its reads from memory then overlap the
        // packets' work instead of stalling the run that scans them.
        let ahead = block + EXPONENT_RUN;
        if self.prefetches() && self.has_block(ahead) {
            let ahead = self.input(ahead as u32, self.block_bytes);
            prefetch(ahead.as_ptr(), ahead.len());
        }
        self.exponents[block]
    }
}

/// Asks the processor to bring the `len` bytes at `start` into its caches, without
/// waiting for them. A pointer, not a slice: an output buffer may hold uninitialised
/// bytes, which no slice may cover.
fn prefetch(start: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for offset in (0..len).step_by(64) {
        // SAFETY: the caller passes bytes of one allocation, so the offset stays within
        // it; a prefetch reads nothing the program sees, and never faults.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(start.add(offset).cast())
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, len);
}

impl SliceIo<'_> {
    /// How the slice travels ([`crate::sparse::layout`]); out of place, clears the
    /// outputs of the blocks it leaves off the wire, which no result will overwrite.
    fn layout(&self, mode: SparseMode) -> Layout {
        let (output, in_place) = (self.output, std::ptr::eq(self.input, self.output));
        let input = self.input(0, self.bytes);
        crate::sparse::layout(mode, self.codec.as_ref(), self.data_type, input, self.block_bytes, |range| {
            if !in_place {
                // SAFETY: `range` lies within the slice (it indexes `input`, of the same
                // length), which this thread alone writes.
                unsafe { std::ptr::write_bytes(output.add(range.start), 0, range.len()) }
            }
        })
    }
}

fn worker_thread(
    thread: usize,
    config: WorkerConfig,
    mut transport: Box<dyn Transport>,
    slices: Receiver<Slice>,
    shared: Arc<Shared>,
    codec: Arc<dyn Codec>,
) {
    let mut protocol = WorkerProtocol::new(config.clone(), Instant::now());
    // The protocol's counters when they were last added to the shared stats, which
    // reset_stats may have zeroed since.
    let mut reported = *protocol.counters();
    let mut buffer = vec![0u8; MAX_DATAGRAM_LEN];
    let mut exponents = Vec::new();
    let block_bytes = config.packet_elements as usize * 4;
    // Ends when the context drops the sending side.
    while let Ok(slice) = slices.recv() {
        let outcome = if shared.stopping.load(Ordering::Acquire) {
            Err(Error::Stopped)
        } else if let Some(error) = shared.session_error() {
            Err(error)
        } else {
            slice.job.mark_running();
            let offset = slice.first_block * block_bytes;
            exponents.clear();
            // SAFETY: the slice lies within the job's buffers (split in `submit_raw`).
            let mut io = unsafe {
                SliceIo {
                    input: slice.job.input.add(offset),
                    output: slice.job.output.add(offset),
                    bytes: slice.elements * slice.job.data_type.size(),
                    block_bytes,
                    data_type: slice.job.data_type,
                    codec: Arc::clone(&codec),
                    exponents: &mut exponents,
                }
            };
            // A panic (in a user's codec, say) fails the slice rather than leaving its job
            // unfinished and its waiters blocked for ever.
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let spec = JobSpec {
                    job: slice.job.id as u32,
                    element_type: codec.wire_type(slice.job.data_type),
                    elements: slice.elements as u64,
                    layout: io.layout(shared.sparse),
                    exponents: codec.uses_exponents(slice.job.data_type),
                };
                run_slice(&mut protocol, transport.as_mut(), &mut io, &mut buffer, spec, &shared)
            }));
            let outcome = run.unwrap_or_else(|panic| {
                Err(Error::Job(format!("worker thread {thread} panicked: {}", crate::panic_message(&*panic))))
            });
            if let Err(error) = &outcome {
                // The protocol may still count the slice as running; it cannot continue.
                protocol.abort(&error.to_string());
            }
            outcome
        };
        if let Err(error) = &outcome {
            tracing::debug!(thread, job = slice.job.id, %error, "slice failed");
        }
        {
            let now = *protocol.counters();
            let mut stats = shared.stats.lock().unwrap_or_else(|p| p.into_inner());
            stats.add_thread(thread, &now.since(&reported));
            reported = now;
        }
        slice.job.finish_slice(outcome, |failed| shared.job_ended(failed));
    }
}

/// Drives one slice through the protocol until it is done or fails.
fn run_slice(
    protocol: &mut WorkerProtocol,
    transport: &mut dyn Transport,
    io: &mut SliceIo,
    buffer: &mut [u8],
    spec: JobSpec,
    shared: &Shared,
) -> Result<(), Error> {
    protocol.start_job(Instant::now(), spec).map_err(Error::from)?;
    loop {
        let now = Instant::now();
        while let Some(len) = protocol.poll_transmit(now, buffer, io) {
            transport.send(&buffer[..len])?;
        }
        transport.flush()?;
        match protocol.status() {
            ProtocolStatus::Done => return Ok(()),
            ProtocolStatus::Failed(error) => {
                // A timeout after the switch ended the session is reported as that.
                return Err(shared.session_error().unwrap_or_else(|| Error::from(error.clone())));
            }
            ProtocolStatus::Idle | ProtocolStatus::Running => {}
        }
        if shared.stopping.load(Ordering::Acquire) {
            return Err(Error::Stopped);
        }
        if let Some(error) = shared.session_error() {
            return Err(error);
        }
        let wait = protocol
            .poll_timeout()
            .map_or(THREAD_WAKEUP, |deadline| deadline.saturating_duration_since(Instant::now()))
            .min(THREAD_WAKEUP);
        // One clock read per batch: the datagrams of a batch arrived together.
        let mut arrived = None;
        transport.recv(wait, &mut |datagram| {
            protocol.handle_datagram(*arrived.get_or_insert_with(Instant::now), datagram, io);
        })?;
        protocol.handle_timeout(Instant::now());
    }
}

impl From<JobError> for Error {
    fn from(error: JobError) -> Error {
        Error::Job(error.to_string())
    }
}
