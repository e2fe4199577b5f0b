//! The worker threads: each drives its own protocol core and transport through the
//! slices of every job, in submission order.
//!
//! A thread is a thin shell: it lends the core its transport's send buffers, hands it
//! what arrives and the time, and sleeps in the transport's receive until the core's
//! next timer or [`THREAD_WAKEUP`], whichever comes first.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use netagg_aggregator::pacer::LinkPacer;
use netagg_aggregator::{JobSpec, JobStatus as ProtocolStatus, PacingConfig, WorkerConfig, WorkerProtocol};
use netagg_config::SparseMode;
use netagg_wire::packet;

use crate::backend::Transport;
use crate::codec::Codec;
use crate::in_flight::InFlightMemory;
use crate::job::JobShared;
use crate::slice_io::SliceIo;
use crate::stats::Stats;
use crate::Error;

/// The longest a worker thread sleeps before it looks at `stop` and the session again.
const THREAD_WAKEUP: Duration = Duration::from_millis(50);
/// How long a thread whose transport failed waits for the switch's reason on the control
/// connection: a switch that closes a session closes its data connections (RDMA's) too,
/// and its reason says more than their end.
const SESSION_REASON_WAIT: Duration = Duration::from_millis(200);

/// One worker thread's share of a job: a run of whole blocks.
pub(crate) struct Slice {
    pub job: Arc<JobShared>,
    pub first_block: usize,
    /// Elements of a block: one packet's of the job's wire type (`packet_numel` of a
    /// 4-byte type, twice as many of a 16-bit one).
    pub block_elements: usize,
    /// Elements of this slice; it starts at element `first_block * block_elements`.
    pub elements: usize,
}

/// State the threads share with the context.
pub(crate) struct Shared {
    pub stopping: AtomicBool,
    /// Set when the switch closed the session; every job fails with it from then on.
    pub session_lost: Mutex<Option<String>>,
    pub stats: Mutex<Stats>,
    /// Jobs submitted and not yet ended, for `Context::wait_all`.
    pub outstanding: Mutex<usize>,
    /// The memory of those jobs, which no other job may race.
    pub in_flight: Mutex<InFlightMemory>,
    pub all_done: Condvar,
    /// Whether zero blocks stay off the wire (`general.sparse`).
    pub sparse: SparseMode,
    /// The pacer of this worker's path, which its threads share.
    pub pacer: Arc<LinkPacer>,
}

impl Shared {
    pub fn new(threads: usize, sparse: SparseMode, pacing: PacingConfig) -> Shared {
        Shared {
            pacer: LinkPacer::new(pacing),
            stopping: AtomicBool::new(false),
            session_lost: Mutex::new(None),
            stats: Mutex::new(Stats::new(threads)),
            outstanding: Mutex::new(0),
            in_flight: Mutex::new(InFlightMemory::default()),
            all_done: Condvar::new(),
            sparse,
        }
    }

    pub fn session_error(&self) -> Option<Error> {
        self.session_lost.lock().unwrap_or_else(|p| p.into_inner()).clone().map(Error::SessionLost)
    }

    /// Accounts job `job`'s end and frees its memory for other jobs.
    pub fn job_ended(&self, job: u64, failed: bool) {
        self.in_flight.lock().unwrap_or_else(|p| p.into_inner()).release(job);
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

/// Runs worker thread `thread` until the context drops the sending side of `slices`.
pub(crate) fn worker_thread(
    thread: usize,
    config: WorkerConfig,
    mut transport: Box<dyn Transport>,
    slices: Receiver<Slice>,
    shared: Arc<Shared>,
    codec: Arc<dyn Codec>,
) {
    let mut protocol = WorkerProtocol::with_pacer(config.clone(), Instant::now(), Arc::clone(&shared.pacer));
    // The protocol's counters when they were last added to the shared stats, which
    // reset_stats may have zeroed since.
    let mut reported = *protocol.counters();
    let mut exponents = Vec::new();
    while let Ok(slice) = slices.recv() {
        let outcome = if shared.stopping.load(Ordering::Acquire) {
            Err(Error::Stopped)
        } else if let Some(error) = shared.session_error() {
            Err(error)
        } else {
            slice.job.mark_running();
            let mut io = SliceIo::new(
                &slice.job,
                slice.first_block,
                slice.elements,
                slice.block_elements * slice.job.data_type.size(),
                Arc::clone(&codec),
                &mut exponents,
            );
            // A panic (in a user's codec, say) fails the slice rather than leaving its job
            // unfinished and its waiters blocked for ever.
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let data_type = slice.job.data_type;
                let spec = JobSpec {
                    job: slice.job.id as u32,
                    element_type: codec.wire_type(data_type),
                    elements: slice.elements as u64,
                    layout: io.layout(shared.sparse),
                    exponents: codec.uses_exponents(data_type),
                };
                run_slice(&mut protocol, transport.as_mut(), &mut io, spec, &shared)
            }));
            let outcome = run.unwrap_or_else(|panic| {
                Err(Error::Panicked { thread, message: crate::panic_message(&*panic) })
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
        slice.job.finish_slice(outcome, |failed| shared.job_ended(slice.job.id, failed));
    }
}

/// Drives one slice through the protocol until it is done or fails.
fn run_slice(
    protocol: &mut WorkerProtocol,
    transport: &mut dyn Transport,
    io: &mut SliceIo,
    spec: JobSpec,
    shared: &Shared,
) -> Result<(), Error> {
    // The session's largest datagram: what the protocol needs of a send buffer.
    let datagram_len = packet::datagram_len(protocol.config().packet_elements as usize);
    protocol.start_job(Instant::now(), spec)?;
    loop {
        let now = Instant::now();
        while let Some(len) = protocol.poll_transmit(now, transport.send_buffer(datagram_len), io) {
            transport.send(len).map_err(|error| transport_failed(shared, error))?;
        }
        transport.flush().map_err(|error| transport_failed(shared, error))?;
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
        transport
            .recv(wait, &mut |datagram| {
                protocol.handle_datagram(*arrived.get_or_insert_with(Instant::now), datagram, io);
            })
            .map_err(|error| transport_failed(shared, error))?;
        protocol.handle_timeout(Instant::now());
    }
}

/// The error of a job whose transport failed with `error`: the switch's reason for ending
/// the session if it comes within [`SESSION_REASON_WAIT`], else `error`.
fn transport_failed(shared: &Shared, error: std::io::Error) -> Error {
    let deadline = Instant::now() + SESSION_REASON_WAIT;
    loop {
        if let Some(lost) = shared.session_error() {
            return lost;
        }
        if Instant::now() >= deadline {
            return Error::from(error);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
