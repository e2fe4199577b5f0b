//! A reliable connection (an RC queue pair) set up through rdma_cm, carrying whole
//! messages with two-sided SEND and RECV from a registered buffer: the simplest verbs a
//! peer without remote keys needs, and the ones Soft-RoCE carries best.
//!
//! Every wait has a timeout: rdma_cm's events are read from its channel's descriptor
//! after `poll`, never by blocking in `rdma_get_cm_event` itself, and completions are
//! waited for either by polling the completion queue ([`Wait::Busy`]) or by sleeping in
//! `poll` on a completion channel ([`Wait::Event`]) together with rdma_cm's descriptor,
//! so that a peer leaving wakes the wait too.
//!
//! Sends are written straight into registered send buffers ([`Connection::send_buffer`])
//! and posted together, one chain of work requests per [`Connection::flush`].
//!
//! The verbs objects are [`crate::verbs`]' owning wrappers; this module only decides
//! what to post and when.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::ops::ControlFlow;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys::{ibv_sge, ibv_wc, ibv_wc_opcode, ibv_wc_status, rdma_cm_event_type};

use crate::returns::{Queue, Returns};
use crate::verbs::cm::{CmId, EventChannel};
use crate::verbs::failed;
use crate::verbs::ibv::{
    completion_batch, status_name, CompletionChannel, CompletionQueue, MemoryRegion, ProtectionDomain,
    QueuePair, POLL_BATCH,
};

/// How many times a send is retried while the peer has no receive posted: finite (7
/// would mean for ever), so that a peer that stops receiving fails the send.
pub(crate) const RNR_RETRIES: u8 = 6;
/// Transport retries, which the side that connects sets for both: the most there are.
const TRANSPORT_RETRIES: u8 = 7;

/// How often a busy wait looks at rdma_cm's channel for a departed peer.
const PEER_CHECK_INTERVAL: Duration = Duration::from_millis(1);
/// How long an event-mode sender naps while every send buffer is in flight.
const SEND_WAIT_NAP: Duration = Duration::from_micros(20);
/// How long a failing connection waits for its posted requests to come back flushed:
/// far more than a device takes, and short enough not to hold up its caller.
///
/// The wait runs on the caller's data-path thread, but once per connection, when it
/// breaks, never per message: the queue pair is in error by then, and a device flushes
/// its requests at once (Soft-RoCE within microseconds), so only a device that never
/// returns them costs the whole bound. It stays in the failure rather than spread over
/// later polls because the error names every request that came back, and is reported at
/// once: a caller asleep on the completion channel need not be woken again to learn it.
const RETURN_WAIT: Duration = Duration::from_secs(1);
/// How long that wait naps while nothing comes back.
const RETURN_NAP: Duration = Duration::from_micros(100);
/// Why a connection broke when rdma_cm says its peer disconnected.
const PEER_DISCONNECTED: &str = "the peer disconnected";

/// How a connection waits for messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Polls the completion queue without pause: the lowest latency, a core per waiter.
    Busy,
    /// Sleeps until the device signals a completion on the connection's completion
    /// channel: for cores shared with other work.
    Event,
}

/// What a connection is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Receive buffers kept posted, and send buffers: sends in flight at most.
    pub depth: usize,
    /// Bytes of each buffer: the longest message.
    pub message_size: usize,
    pub wait: Wait,
}

impl Options {
    /// These options with room for a peer's window of `window` messages and as much
    /// again in answers to its retransmissions, so that the peer's sends never wait for
    /// a receive to be posted.
    pub fn with_window(self, window: usize) -> Options {
        Options { depth: self.depth.max(2 * window), ..self }
    }
}

/// What is left of the time until `deadline` (`None`: no deadline, for ever).
pub(crate) fn remaining(deadline: Option<Instant>) -> Duration {
    deadline.map_or(Duration::MAX, |deadline| deadline.saturating_duration_since(Instant::now()))
}

/// One connected RC queue pair and its registered buffer: `depth` receive buffers and
/// `depth` send buffers of `message_size` bytes each, receive buffers first.
pub struct Connection {
    /// First of the verbs objects to go: it holds the others it uses.
    qp: QueuePair,
    region: MemoryRegion,
    send_cq: Arc<CompletionQueue>,
    recv_cq: Arc<CompletionQueue>,
    /// Signals receive completions, in [`Wait::Event`] only.
    completions: Option<Arc<CompletionChannel>>,
    id: Arc<CmId>,
    options: Options,
    /// Send buffers neither lent nor in flight.
    free_sends: Vec<usize>,
    /// The send buffer [`Connection::send_buffer`] lent last, until queued.
    lent: Option<usize>,
    /// Sends queued for the next flush: buffer and length.
    queued: Vec<(usize, usize)>,
    established: bool,
    /// Receives and sends posted whose completions have not been taken.
    posted_receives: usize,
    posted_sends: usize,
    /// Receive buffers (index and length) that came back whole while the connection
    /// failed, to hand over before the failure is reported.
    salvaged: Vec<(usize, usize)>,
    /// Why the connection can no longer carry anything (the peer left, a completion
    /// failed): every call after says so at once, once the salvaged receives are taken.
    broken: Option<String>,
    /// Whether the connection broke because its peer disconnected, no request failing
    /// for a cause of its own: an orderly end, as of a process that closes or exits.
    peer_disconnected: bool,
    last_peer_check: Instant,
}

impl Connection {
    /// Connects to the listener at `address` within `timeout`, from `source` if given
    /// (else where the route leads), sending `private` (at most 56 bytes) with the
    /// request. The listener receives it padded with zeros to 56 bytes over RoCE:
    /// private data that varies in length carries its own.
    pub fn connect(
        address: SocketAddr,
        source: Option<IpAddr>,
        private: &[u8],
        timeout: Duration,
        options: Options,
    ) -> io::Result<Connection> {
        // One deadline for every step: the whole connection within `timeout`.
        let deadline = Instant::now().checked_add(timeout);
        let channel = EventChannel::new()?;
        let id = CmId::new(&channel)?;
        id.resolve_addr(source.map(|ip| SocketAddr::new(ip, 0)), address)
            .and_then(|()| {
                channel.expect(rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED, remaining(deadline)).map(drop)
            })
            .and_then(|()| id.resolve_route())
            .and_then(|()| {
                channel
                    .expect(rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED, remaining(deadline))
                    .map(drop)
            })?;
        let id = Arc::new(id);
        let mut connection = Connection::make(&id, options)?;
        id.connect(private, RNR_RETRIES, TRANSPORT_RETRIES, address)?;
        channel.expect(rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED, remaining(deadline))?;
        connection.established = true;
        Ok(connection)
    }

    /// The buffer, protection domain, completion queues (and channel) and queue pair of
    /// a connection on `id`, whose device is known; every receive buffer posted. What
    /// was made before a failure is freed with the error.
    pub(crate) fn make(id: &Arc<CmId>, options: Options) -> io::Result<Connection> {
        let Options { depth, message_size, wait } = options;
        // Fallible, not an abort: the sizes come from a config file.
        let bytes = depth.checked_mul(message_size).and_then(|bytes| bytes.checked_mul(2));
        let mut memory = Vec::new();
        if bytes.is_none_or(|bytes| memory.try_reserve_exact(bytes).is_err()) {
            let what = format!("{depth} receive and {depth} send buffers of {message_size} bytes");
            return Err(io::Error::new(io::ErrorKind::OutOfMemory, format!("cannot allocate {what}")));
        }
        memory.resize(bytes.expect("checked"), 0u8);
        let pd = Arc::new(ProtectionDomain::new(id)?);
        let completions = match wait {
            Wait::Event => Some(Arc::new(CompletionChannel::new(id)?)),
            Wait::Busy => None,
        };
        let send_cq = Arc::new(CompletionQueue::new(id, depth, None)?);
        let recv_cq = Arc::new(CompletionQueue::new(id, depth, completions.as_ref())?);
        let region = MemoryRegion::register(&pd, memory.into_boxed_slice())?;
        let qp = QueuePair::new(id, &pd, &send_cq, &recv_cq, depth)?;
        let mut connection = Connection {
            qp,
            region,
            send_cq,
            recv_cq,
            completions,
            id: Arc::clone(id),
            options,
            free_sends: (0..depth).rev().collect(),
            lent: None,
            queued: Vec::with_capacity(depth),
            established: false,
            posted_receives: 0,
            posted_sends: 0,
            salvaged: Vec::new(),
            broken: None,
            peer_disconnected: false,
            last_peer_check: Instant::now(),
        };
        for buffer in 0..depth {
            connection.post_receive(buffer)?;
        }
        Ok(connection)
    }

    /// Marks a connection accepted: from now on dropping it disconnects it.
    pub(crate) fn set_established(&mut self) {
        self.established = true;
    }

    /// The rdma_cm channel of the connection's own events.
    pub(crate) fn events(&self) -> &Arc<EventChannel> {
        self.id.channel()
    }

    /// The verbs device the connection runs on (`rxe0`, `mlx5_0`).
    pub fn device_name(&self) -> String {
        self.id.device_name()
    }

    /// The longest message, in bytes.
    pub fn message_size(&self) -> usize {
        self.options.message_size
    }

    /// Where buffer `index` starts in the region: receive buffers first, then send
    /// buffers.
    fn buffer_start(&self, index: usize) -> usize {
        index * self.options.message_size
    }

    fn sge(&self, index: usize, len: usize) -> ibv_sge {
        self.region.sge(self.buffer_start(index), len)
    }

    fn post_receive(&mut self, index: usize) -> io::Result<()> {
        let sge = self.sge(index, self.options.message_size);
        // SAFETY: receive buffer `index` lies in the connection's region, which outlives
        // the queue pair (dropped first); it is read only once its completion is polled.
        unsafe { self.qp.post_receive(index as u64, sge) }?;
        self.posted_receives += 1;
        Ok(())
    }

    /// Lends the next send buffer, all [`Connection::message_size`] bytes of it, waiting
    /// up to `timeout` for one while every buffer is in flight. Whatever is written goes
    /// at [`Connection::queue`]; lent again, the same buffer comes back.
    pub fn send_buffer(&mut self, timeout: Duration) -> io::Result<&mut [u8]> {
        self.check_broken()?;
        if self.lent.is_none() {
            let deadline = Instant::now() + timeout;
            loop {
                self.reap_sends()?;
                if !self.free_sends.is_empty() {
                    break;
                }
                // Posted sends may still wait for the flush that lets them go.
                self.flush()?;
                self.check_peer()?;
                if Instant::now() >= deadline {
                    let message = format!("no send completed within {timeout:?}");
                    return Err(io::Error::new(io::ErrorKind::TimedOut, message));
                }
                match self.options.wait {
                    Wait::Busy => std::hint::spin_loop(),
                    // Sends complete at the pace of the peer's acknowledgements: a nap
                    // costs little and keeps a shared core free.
                    Wait::Event => std::thread::sleep(SEND_WAIT_NAP),
                }
            }
            self.lent = self.free_sends.pop();
        }
        let start = self.buffer_start(self.options.depth + self.lent.expect("a lent buffer"));
        // SAFETY: no send uses the buffer (it was free), and the borrow of self keeps it
        // from being posted while lent.
        Ok(unsafe { self.region.bytes_mut(start, self.options.message_size) })
    }

    /// Queues the first `len` bytes of the buffer lent last as one message; it leaves at
    /// the next [`Connection::flush`].
    pub fn queue(&mut self, len: usize) -> io::Result<()> {
        let Some(lent) = self.lent.take() else {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "no send buffer was lent"));
        };
        if let Err(error) = self.fits(len) {
            self.free_sends.push(lent);
            return Err(error);
        }
        self.queued.push((lent, len));
        Ok(())
    }

    fn fits(&self, len: usize) -> io::Result<()> {
        if len <= self.options.message_size {
            return Ok(());
        }
        let detail = format!("a message of {len} bytes; the buffers hold {}", self.options.message_size);
        Err(io::Error::new(io::ErrorKind::InvalidInput, detail))
    }

    /// Queues a copy of `message` if a send buffer is free now; false if not (for a
    /// sender that drops what the network cannot take, as a switch does).
    pub fn try_queue_copy(&mut self, message: &[u8]) -> io::Result<bool> {
        self.fits(message.len())?;
        if self.free_sends.is_empty() && self.lent.is_none() {
            self.reap_sends()?;
            if self.free_sends.is_empty() {
                return Ok(false);
            }
        }
        self.send_buffer(Duration::ZERO)?[..message.len()].copy_from_slice(message);
        self.queue(message.len()).map(|()| true)
    }

    /// Sends a copy of `message` now, waiting up to `timeout` for a free send buffer.
    pub fn send(&mut self, message: &[u8], timeout: Duration) -> io::Result<()> {
        self.fits(message.len())?;
        self.send_buffer(timeout)?[..message.len()].copy_from_slice(message);
        self.queue(message.len())?;
        self.flush()
    }

    /// Posts every queued message, one chain of work requests.
    pub fn flush(&mut self) -> io::Result<()> {
        if self.queued.is_empty() {
            return Ok(());
        }
        if let Err(error) = self.check_broken() {
            self.free_sends.extend(self.queued.drain(..).map(|(index, _)| index));
            return Err(error);
        }
        let sends =
            self.queued.iter().map(|&(index, len)| (index as u64, self.sge(self.options.depth + index, len)));
        // SAFETY: the send buffers lie in the connection's region, which outlives the
        // queue pair (dropped first); a queued buffer is neither lent nor written again
        // until its completion frees it.
        let (posted, result) = unsafe { self.qp.post_sends(sends) };
        self.posted_sends += posted;
        // The requests after the first refused come back free.
        for &(index, _) in &self.queued[posted..] {
            self.free_sends.push(index);
        }
        self.queued.clear();
        match result {
            // A full send queue refuses only until completions free it.
            Err(error) if error.kind() != io::ErrorKind::OutOfMemory => Err(self.failed_post(&error)),
            other => other,
        }
    }

    /// After a post that failed with `error`: the peer's departure if rdma_cm says so (a
    /// queue pair in error may refuse posts), else the error; the connection is broken
    /// either way, since nothing it refused may follow.
    fn failed_post(&mut self, error: &io::Error) -> io::Error {
        let departure = self.departure().ok().flatten();
        let why = match departure {
            Some(departure) => format!("{departure} ({error})"),
            None => error.to_string(),
        };
        self.break_down(|_| why, Returns::default(), departure == Some(PEER_DISCONNECTED))
    }

    /// Whether the connection broke (its calls fail) because its peer disconnected, no
    /// request failing for a cause of its own: an orderly end, as of a process that
    /// closes its connection or exits, rather than a failure that may have lost messages.
    pub fn peer_disconnected(&self) -> bool {
        self.broken.is_some() && self.peer_disconnected
    }

    /// Moves the queue pair to the error state, as a failing device would, to inject
    /// that fault: the next call finds every request flushed and fails as after any
    /// failed completion.
    pub fn break_queue_pair(&mut self) -> io::Result<()> {
        self.qp.move_to_error()
    }

    /// The error of a connection that can carry nothing more.
    fn check_broken(&self) -> io::Result<()> {
        match &self.broken {
            None => Ok(()),
            Some(why) => Err(io::Error::new(io::ErrorKind::ConnectionAborted, why.clone())),
        }
    }

    /// Marks the connection broken for `why` (told what came back): disconnects our side
    /// too, so that the peer hears of it, moves the queue pair to the error state, and
    /// waits (up to [`RETURN_WAIT`]) until every request posted has come back, adding
    /// each to `returns`, which the error then tells. Receives that came back whole are
    /// kept for [`Connection::poll`]. `peer_disconnected` if rdma_cm said the peer
    /// disconnected: an orderly end unless a request came back failed for a cause.
    /// Returns the error.
    fn break_down(
        &mut self,
        why: impl FnOnce(&Returns) -> String,
        mut returns: Returns,
        peer_disconnected: bool,
    ) -> io::Error {
        if self.broken.is_none() {
            if self.established {
                self.id.disconnect();
                self.established = false;
            }
            // rdma_disconnect moves a connected queue pair to the error state, but not one
            // never connected, and its failure would leave requests posted.
            let moved = self.qp.move_to_error();
            self.take_returns(&mut returns);
            let moved = moved.err().map_or(String::new(), |error| format!(" ({error})"));
            self.peer_disconnected = peer_disconnected && returns.cause().is_none();
            self.broken = Some(format!("{}; {returns}{moved}", why(&returns)));
        }
        self.check_broken().expect_err("broken")
    }

    /// Takes completions from both queues until no request is posted or [`RETURN_WAIT`]
    /// has passed, counting each in `returns` and freeing its buffer.
    fn take_returns(&mut self, returns: &mut Returns) {
        let deadline = Instant::now() + RETURN_WAIT;
        while self.posted_sends + self.posted_receives > 0 {
            // A queue that cannot be polled gives nothing: the deadline ends the wait.
            let sends = self
                .reap(Queue::Send, |connection, completion| {
                    connection.send_returned(completion);
                    returns.count(Queue::Send, completion.status);
                    ControlFlow::Continue(())
                })
                .unwrap_or(0);
            let receives = self
                .reap(Queue::Receive, |connection, completion| {
                    if completion.status == ibv_wc_status::IBV_WC_SUCCESS {
                        let len = (completion.byte_len as usize).min(connection.options.message_size);
                        connection.salvaged.push((completion.wr_id as usize, len));
                    }
                    returns.count(Queue::Receive, completion.status);
                    ControlFlow::Continue(())
                })
                .unwrap_or(0);
            if Instant::now() >= deadline {
                returns.missing(self.posted_sends + self.posted_receives, RETURN_WAIT);
                return;
            }
            if sends + receives == 0 {
                std::thread::sleep(RETURN_NAP);
            }
        }
    }

    /// Why the peer is gone, if rdma_cm said so: a process that exits disconnects its
    /// queue pairs (a host that vanishes shows as failed completions instead), or a
    /// connection accepted without waiting never came about.
    fn departure(&mut self) -> io::Result<Option<&'static str>> {
        self.last_peer_check = Instant::now();
        while let Some(event) = self.events().next(Duration::ZERO)? {
            use rdma_cm_event_type::*;
            let why = match event.kind {
                RDMA_CM_EVENT_DISCONNECTED | RDMA_CM_EVENT_TIMEWAIT_EXIT => PEER_DISCONNECTED,
                RDMA_CM_EVENT_DEVICE_REMOVAL => "the RDMA device was removed",
                RDMA_CM_EVENT_ADDR_CHANGE => "the RDMA device's address changed",
                RDMA_CM_EVENT_CONNECT_ERROR | RDMA_CM_EVENT_UNREACHABLE | RDMA_CM_EVENT_REJECTED => {
                    "the connection never came about"
                }
                // ESTABLISHED, for a connection accepted without waiting.
                _ => continue,
            };
            return Ok(Some(why));
        }
        Ok(None)
    }

    /// An error if the peer left, as rdma_cm says; once said, it stays said. None while
    /// receives that came back before it left wait for [`Connection::poll`], which
    /// reports the departure after them.
    fn check_peer_now(&mut self) -> io::Result<()> {
        if self.broken.is_none() {
            if let Some(why) = self.departure()? {
                self.break_down(|_| why.into(), Returns::default(), why == PEER_DISCONNECTED);
            }
        }
        match self.salvaged.is_empty() {
            true => self.check_broken(),
            false => Ok(()),
        }
    }

    /// An error if the peer left, as rdma_cm says; it looks at most every millisecond,
    /// for busy waits.
    pub fn check_peer(&mut self) -> io::Result<()> {
        if self.last_peer_check.elapsed() < PEER_CHECK_INTERVAL && self.broken.is_none() {
            return Ok(());
        }
        self.check_peer_now()
    }

    /// After a completion that failed, counted in `returns`: the peer's departure if
    /// rdma_cm says so (it says more), else the completion's status; the connection is
    /// broken either way.
    fn failed_completion(&mut self, status: ibv_wc_status::Type, returns: Returns) -> io::Error {
        let departure = self.departure().ok().flatten();
        let why = move |returns: &Returns| {
            // Named by the request that failed for a cause, in either queue, rather than
            // by one flushed because the queue pair was in error already.
            let status = status_name(returns.cause().unwrap_or(status));
            match departure {
                Some(departure) => format!("{departure} (an RDMA completion failed: {status})"),
                None => format!("an RDMA completion failed: {status}"),
            }
        };
        self.break_down(why, returns, departure == Some(PEER_DISCONNECTED))
    }

    /// Takes the completions of `queue` there are, a batch at a time, handing each to
    /// `take` (which counts it out of the posted requests), until a batch comes back
    /// short, or `take` breaks: then the rest of that batch still goes to `take`, since
    /// the queue has given it up, and no more is polled. The count taken.
    fn reap(
        &mut self,
        queue: Queue,
        mut take: impl FnMut(&mut Connection, &ibv_wc) -> ControlFlow<()>,
    ) -> io::Result<usize> {
        let mut completions = completion_batch();
        let mut total = 0;
        loop {
            let (cq, what) = match queue {
                Queue::Send => (&self.send_cq, "polling the send completions"),
                Queue::Receive => (&self.recv_cq, "polling the receive completions"),
            };
            let count = cq.poll(&mut completions, what)?;
            let mut stop = false;
            for completion in &completions[..count] {
                match queue {
                    Queue::Send => self.posted_sends = self.posted_sends.saturating_sub(1),
                    Queue::Receive => self.posted_receives = self.posted_receives.saturating_sub(1),
                }
                stop |= take(self, completion).is_break();
            }
            total += count;
            if stop || count < POLL_BATCH {
                return Ok(total);
            }
        }
    }

    /// A send came back: its buffer is free again.
    fn send_returned(&mut self, completion: &ibv_wc) {
        self.free_sends.push(completion.wr_id as usize);
    }

    /// Takes the send completions there are, freeing their buffers; the first failed
    /// one breaks the connection, once all are taken.
    fn reap_sends(&mut self) -> io::Result<()> {
        let mut failure: Option<(ibv_wc_status::Type, Returns)> = None;
        self.reap(Queue::Send, |connection, completion| {
            connection.send_returned(completion);
            if completion.status != ibv_wc_status::IBV_WC_SUCCESS && failure.is_none() {
                failure = Some((completion.status, Returns::default()));
            }
            if let Some((_, returns)) = &mut failure {
                returns.count(Queue::Send, completion.status);
            }
            ControlFlow::Continue(())
        })?;
        match failure {
            Some((status, returns)) => Err(self.failed_completion(status, returns)),
            None => Ok(()),
        }
    }

    /// Hands every message received so far to `sink`, without waiting; returns how many.
    /// Messages that arrived before the connection failed are all handed over first:
    /// the failure is reported by the call after them.
    pub fn poll(&mut self, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        let taken = self.take_receives(sink);
        let salvaged = std::mem::take(&mut self.salvaged);
        for &(index, len) in &salvaged {
            // SAFETY: the device has finished with this receive buffer (its completion
            // came back whole) and the queue pair, in error, takes no more requests.
            sink(unsafe { self.region.bytes(self.buffer_start(index), len) });
        }
        match taken {
            Ok(count) => Ok(count + salvaged.len()),
            Err(_) if !salvaged.is_empty() => Ok(salvaged.len()),
            Err(error) => Err(error),
        }
    }

    /// What [`Connection::poll`] does, but for the receives salvaged from a failure.
    fn take_receives(&mut self, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        self.check_broken()?;
        self.reap_sends()?;
        let mut total = 0;
        let mut failure: Option<(ibv_wc_status::Type, Returns)> = None;
        let mut repost_failed = None;
        self.reap(Queue::Receive, |connection, completion| {
            if let Some((_, returns)) = &mut failure {
                // The queue pair is in error now: the rest of the batch was flushed.
                returns.count(Queue::Receive, completion.status);
                return ControlFlow::Break(());
            }
            if completion.status != ibv_wc_status::IBV_WC_SUCCESS {
                let mut returns = Returns::default();
                returns.count(Queue::Receive, completion.status);
                failure = Some((completion.status, returns));
                return ControlFlow::Break(());
            }
            debug_assert_eq!(completion.opcode, ibv_wc_opcode::IBV_WC_RECV);
            let index = completion.wr_id as usize;
            let len = (completion.byte_len as usize).min(connection.options.message_size);
            // SAFETY: the device has finished with this receive buffer (its completion
            // is here) and it is posted again only after `sink` returns.
            sink(unsafe { connection.region.bytes(connection.buffer_start(index), len) });
            total += 1;
            // The batch's other messages are handed over all the same: the queue has given
            // them up.
            if repost_failed.is_none() {
                repost_failed = connection.post_receive(index).err();
            }
            match repost_failed {
                Some(_) => ControlFlow::Break(()),
                None => ControlFlow::Continue(()),
            }
        })?;
        if let Some(error) = repost_failed {
            return Err(error);
        }
        match failure {
            Some((status, returns)) => {
                let error = self.failed_completion(status, returns);
                if total > 0 {
                    Ok(total)
                } else {
                    Err(error)
                }
            }
            None => Ok(total),
        }
    }

    /// Prepares to sleep: in [`Wait::Event`], asks the device to signal the next receive
    /// completion. Messages that arrived meanwhile are not signalled: poll once more
    /// after arming, and sleep only if it found none.
    pub fn arm(&mut self) -> io::Result<()> {
        match self.completions {
            Some(_) => self.recv_cq.arm(),
            None => Ok(()),
        }
    }

    /// The descriptors a sleeping waiter watches: the completion channel's (in
    /// [`Wait::Event`]) and rdma_cm's, where a departing peer shows.
    pub fn wait_fds(&self) -> impl Iterator<Item = RawFd> {
        let completions = self.completions.as_ref().map(|channel| channel.fd());
        completions.into_iter().chain([self.events().fd()])
    }

    /// After a sleep: takes the completion events signalled and looks at rdma_cm's
    /// channel, so that a peer that left is an error now.
    pub fn woken(&mut self) -> io::Result<()> {
        if let Some(channel) = &self.completions {
            self.recv_cq.acknowledge(channel.take_events());
        }
        self.check_peer_now()
    }

    /// Waits up to `timeout` for messages and hands each to `sink`; returns how many (0
    /// when the time ran out).
    pub fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        recv_any(std::slice::from_mut(self), timeout, sink).map_err(|failure| failure.error)
    }
}

/// Why [`recv_any`] failed: the error, and which of its connections failed (none when
/// the wait itself did).
#[derive(Debug)]
pub struct RecvFailure {
    pub connection: Option<usize>,
    pub error: io::Error,
}

/// Waits up to `timeout` for messages on any of `connections` and hands each to `sink`;
/// returns how many (0 when the time ran out). One thread so serves several peers (a
/// worker reaching every shard of a session): busy connections are polled in turn, and
/// connections that all wait in [`Wait::Event`] are armed together and slept on at once.
pub fn recv_any(
    connections: &mut [Connection],
    timeout: Duration,
    sink: &mut dyn FnMut(&[u8]),
) -> Result<usize, RecvFailure> {
    let failed = |index: usize| move |error| RecvFailure { connection: Some(index), error };
    let mut poll_all = |connections: &mut [Connection]| {
        connections.iter_mut().enumerate().try_fold(0, |total, (index, connection)| {
            Ok(total + connection.poll(sink).map_err(failed(index))?)
        })
    };
    let sleeps = connections.iter().all(|connection| connection.options.wait == Wait::Event);
    let deadline = Instant::now().checked_add(timeout);
    loop {
        let count = poll_all(connections)?;
        if count > 0 {
            return Ok(count);
        }
        let now = Instant::now();
        if deadline.is_some_and(|deadline| now >= deadline) {
            return Ok(0);
        }
        if !sleeps {
            for (index, connection) in connections.iter_mut().enumerate() {
                connection.check_peer().map_err(failed(index))?;
            }
            std::hint::spin_loop();
            continue;
        }
        for (index, connection) in connections.iter_mut().enumerate() {
            connection.arm().map_err(failed(index))?;
        }
        let count = poll_all(connections)?;
        if count > 0 {
            return Ok(count);
        }
        sleep_until_readable(connections.iter().flat_map(Connection::wait_fds), remaining(deadline))
            .map_err(|error| RecvFailure { connection: None, error })?;
        for (index, connection) in connections.iter_mut().enumerate() {
            connection.woken().map_err(failed(index))?;
        }
    }
}

/// Sleeps until one of `fds` is readable or `timeout` passes (a signal ends it early,
/// which callers treat as a spurious wake).
pub fn sleep_until_readable(fds: impl IntoIterator<Item = RawFd>, timeout: Duration) -> io::Result<()> {
    let mut polled: Vec<libc::pollfd> =
        fds.into_iter().map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    // ppoll rather than poll: a timeout in nanoseconds, not whole milliseconds, so that a
    // paced sender wakes when its next packet is due.
    let timeout = libc::timespec {
        tv_sec: timeout.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos().into(),
    };
    // SAFETY: `polled` and `timeout` are alive for the call; a null signal mask is allowed.
    let ready =
        unsafe { libc::ppoll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, &timeout, std::ptr::null()) };
    match ready {
        -1 if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted => {
            Err(failed("waiting for completions", io::Error::last_os_error()))
        }
        _ => Ok(()),
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // Before the queue pair goes (first of the fields), so that the peer hears of it.
        if self.established {
            self.id.disconnect();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_deepens_the_queues_to_twice_it_and_never_makes_them_shallower() {
        let options = Options { depth: 64, message_size: 1072, wait: Wait::Busy };
        assert_eq!(options.with_window(128), Options { depth: 256, ..options });
        assert_eq!(options.with_window(32), options);
    }

    #[test]
    fn what_remains_of_a_deadline_never_goes_negative_and_none_is_for_ever() {
        assert_eq!(remaining(None), Duration::MAX);
        assert_eq!(remaining(Some(Instant::now() - Duration::from_secs(1))), Duration::ZERO);
        let left = remaining(Some(Instant::now() + Duration::from_secs(60)));
        assert!(left > Duration::from_secs(59) && left <= Duration::from_secs(60), "{left:?}");
    }
}
