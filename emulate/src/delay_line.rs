//! Delay, jitter and loss in user space, for kernels without `netem`.
//!
//! A [`DelayLine`] sits between two devices of one network namespace and forwards every
//! Ethernet frame arriving on one out of the other, after a delay, in both directions,
//! like a wire with a queue in it. One thread serves both directions: for each it reads
//! frames from a packet socket on the input device, decides each one's fate in a
//! [`Schedule`] (the part without I/O, tested on its own) and writes the frames whose time
//! has come to a packet socket on the output device. It wakes once per batch of frames due
//! in either direction, not once per frame, and reads all frames waiting with one call: the
//! schedule says when, and how a frame read late keeps its arrival time.
//!
//! Unlike `netem`, jitter never reorders frames: a frame is never due before the one ahead
//! of it. Reordering makes TCP retransmit, which is not what one emulating a path wants by
//! default; the price is that jitter larger than the gap between frames delays a burst as a
//! whole. A segmentation-offload super-frame (up to 64 KB that TCP or UDP hands a veth)
//! would be one frame to the line, and lost whole; the fabric's veths take none
//! (`gso_max_segs 1`, see `fabric`), so every frame here is one a real link would carry.

mod lateness;
mod packet_socket;
mod schedule;

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant, SystemTime};

use rand::rngs::SmallRng;
use rand::SeedableRng;

use lateness::LatenessHistogram;
use packet_socket::{PacketSocket, ReceiveBatch, VNET_HDR_LEN};
use schedule::{Arrival, ArrivalTime, HoldLimit, ReadWindow, Schedule};

/// What one direction of a link does to each frame besides limiting its rate.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Impairment {
    pub delay: Duration,
    /// Each frame's delay varies uniformly within plus or minus this, never below zero.
    pub jitter: Duration,
    /// The probability, in 0..=1, that a frame is dropped.
    pub loss: f64,
}

/// Counters of one direction of a [`DelayLine`], updated about every 10 ms.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DirectionStats {
    /// Frames forwarded (a segmentation-offload super-frame counts once).
    pub frames: u64,
    /// Bytes of the Ethernet frames forwarded.
    pub bytes: u64,
    /// Frames dropped on purpose, as the impairment's loss says.
    pub lost: u64,
    /// Frames dropped because the line held its limit of frames or bytes.
    pub overflowed: u64,
    /// Frames the kernel dropped before we read them, our receive buffer being full.
    pub receive_dropped: u64,
    /// Frames the kernel would not hand over whole: longer than 64 KiB, or a kind of
    /// segmentation offload that a `virtio_net_hdr` cannot describe.
    pub unreadable: u64,
    /// Frames the output device would not take: its queue (a rate limiter's) full, the device
    /// down, the frame too long.
    pub send_failed: u64,
    /// Frames (held, lost or overflowed) whose arrival the kernel did not stamp within their read's window: they
    /// count as arrived when read, and the thread reads often while they come.
    pub unstamped: u64,
    /// How much later than its due time a frame was sent: median, 99th percentile (both to
    /// within an eighth) and maximum. For a frame without an arrival stamp, counted from the
    /// earliest it could have been due, so that the error of its arrival time is included.
    pub lateness_median: Duration,
    pub lateness_p99: Duration,
    pub lateness_max: Duration,
    /// Why the line's thread ended before the line was dropped (such as a device
    /// removed); `None` while it runs.
    pub ended_by: Option<String>,
}

/// Forwards frames between two devices of a network namespace, each direction with its
/// impairment; its thread stops when it is dropped.
pub struct DelayLine {
    stop: Arc<AtomicBool>,
    /// Each direction's counters: [a to b, b to a].
    counters: [Arc<Mutex<Counters>>; 2],
    thread: Option<JoinHandle<()>>,
}

/// The most a direction holds; a 100 ms delay at 10 Gbit/s holds about 125 MB.
const HOLD_LIMIT: HoldLimit = HoldLimit { frames: 100_000, bytes: 256 << 20 };
/// The longest delay plus jitter a line takes: far beyond any network's, and far from
/// overflowing a due time.
const MAX_DELAY: Duration = Duration::from_secs(3600);
/// The longest the thread waits before looking at the stop flag.
const STOP_CHECK_INTERVAL: Duration = Duration::from_millis(50);
/// How often the thread copies its counters where `stats` reads them.
const PUBLISH_INTERVAL: Duration = Duration::from_millis(10);
/// Frames read with one system call at most.
const RECEIVE_BATCH: usize = 32;
/// Batches read in a row before sending those due, so that a flood cannot starve sending.
const RECEIVE_BATCHES: usize = 8;
/// Room for a 64 KiB segmentation-offload super-frame, its Ethernet header and its
/// `virtio_net_hdr`.
const RECEIVE_BUFFER_BYTES: usize = VNET_HDR_LEN + (64 << 10) + 256;

impl DelayLine {
    /// Starts forwarding between devices `a` and `b` of the network namespace `netns` (a
    /// name as `ip netns` knows it, whose file is /run/netns/NAME); needs root.
    pub fn start(
        netns: &str,
        a: &str,
        b: &str,
        a_to_b: Impairment,
        b_to_a: Impairment,
    ) -> io::Result<DelayLine> {
        let context = |what: &str, error| with_context(netns, what, error);
        for (name, impairment) in [("a to b", a_to_b), ("b to a", b_to_a)] {
            if !(0.0..=1.0).contains(&impairment.loss) {
                let message = format!("loss {} is not a probability in 0..=1", impairment.loss);
                return Err(context(name, io::Error::new(io::ErrorKind::InvalidInput, message)));
            }
            // Refused here rather than overflowing a due time in the line's thread.
            if impairment.delay.checked_add(impairment.jitter).is_none_or(|most| most > MAX_DELAY) {
                let message = format!(
                    "delay {:?} with jitter {:?} is more than the line holds ({MAX_DELAY:?})",
                    impairment.delay, impairment.jitter
                );
                return Err(context(name, io::Error::new(io::ErrorKind::InvalidInput, message)));
            }
        }
        let namespace_path = crate::netns::path(netns);
        let namespace = File::open(&namespace_path).map_err(|error| context(&namespace_path, error))?;

        let stop = Arc::new(AtomicBool::new(false));
        let counters: [Arc<Mutex<Counters>>; 2] = Default::default();
        let (ready_sender, ready) = mpsc::channel();
        let (thread_stop, thread_counters) = (stop.clone(), counters.clone());
        let (a_name, b_name, netns_name) = (a.to_owned(), b.to_owned(), netns.to_owned());
        let thread = thread::Builder::new()
            .name(format!("delay {a}={b}"))
            .spawn(move || {
                let [a_to_b_counters, b_to_a_counters] = thread_counters;
                let opened = crate::netns::enter(&namespace)
                    .map_err(|error| ("entering it".to_owned(), error))
                    .and_then(|()| {
                        packet_socket::tighten_timer_slack();
                        packet_socket::run_before_ordinary_threads();
                        Ok([
                            Direction::open(&a_name, &b_name, a_to_b, a_to_b_counters)?,
                            Direction::open(&b_name, &a_name, b_to_a, b_to_a_counters)?,
                        ])
                    })
                    .map_err(|(what, error)| with_context(&netns_name, &what, error));
                match opened {
                    Ok(directions) => {
                        let _ = ready_sender.send(Ok(()));
                        run(directions, &thread_stop);
                    }
                    Err(error) => {
                        let _ = ready_sender.send(Err(error));
                    }
                }
            })
            .map_err(|error| context("starting a thread", error))?;
        // Built now so that dropping it on an error below stops and joins the thread.
        let line = DelayLine { stop, counters, thread: Some(thread) };
        // A thread that panicked drops its sender, which ends recv with an error.
        match ready.recv() {
            Ok(Ok(())) => Ok(line),
            Ok(Err(error)) => Err(error),
            Err(_) => Err(context("starting", io::Error::other("its thread panicked"))),
        }
    }

    /// Counters of each direction so far: [a to b, b to a].
    pub fn stats(&self) -> [DirectionStats; 2] {
        self.counters
            .each_ref()
            .map(|counters| counters.lock().unwrap_or_else(PoisonError::into_inner).to_stats())
    }
}

/// An error that says which namespace, and what in it (a device, a file), it concerns.
fn with_context(netns: &str, what: &str, error: io::Error) -> io::Error {
    io::Error::new(error.kind(), format!("delay line in namespace {netns}: {what}: {error}"))
}

impl Drop for DelayLine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Forwards both directions until `stop` is set or a socket fails for good (a device
/// removed, which ends the whole line: both directions report the error, which names it).
fn run(mut directions: [Direction; 2], stop: &AtomicBool) {
    let mut last_publish = Instant::now();
    let mut ended = Ok(());
    while ended.is_ok() && !stop.load(Ordering::Relaxed) {
        ended = forward_once(&mut directions);
        if last_publish.elapsed() >= PUBLISH_INTERVAL {
            directions.iter_mut().for_each(Direction::publish);
            last_publish = Instant::now();
        }
    }
    for direction in &mut directions {
        if let Err(error) = &ended {
            direction.counters.ended_by = Some(error.to_string());
        }
        direction.publish();
    }
}

/// Sends what is due each way; then sleeps until the earliest wake-up of a direction holding
/// frames, while waiting for a frame in any direction holding none; and reads every frame
/// waiting.
fn forward_once(directions: &mut [Direction; 2]) -> io::Result<()> {
    let mut wake: Option<Instant> = None;
    let mut idle = [false; 2];
    let mut read_before_waiting = false;
    for (direction, idle) in directions.iter_mut().zip(&mut idle) {
        direction.send_due()?;
        match direction.schedule.next_wake(direction.last_emptied) {
            Some(at) => wake = Some(wake.map_or(at, |earliest| earliest.min(at))),
            // Read before waiting, so that a frame that ends the wait is known to have
            // arrived after it began.
            None if direction.receive_waiting()? > 0 => read_before_waiting = true,
            None => *idle = true,
        }
    }
    // Frames read now have a wake-up of their own to plan: no wait this pass. The other
    // direction still had its turn to send, so that a flood of frames lost on one side
    // (read, never held) cannot hold the other's back.
    if read_before_waiting {
        return Ok(());
    }
    let timeout = wake.map_or(STOP_CHECK_INTERVAL, |wake| {
        wake.saturating_duration_since(Instant::now()).min(STOP_CHECK_INTERVAL)
    });
    let [a_to_b, b_to_a] = directions.each_ref();
    let waiting = [idle[0].then_some(&a_to_b.input), idle[1].then_some(&b_to_a.input)];
    packet_socket::wait_readable(waiting, timeout).map_err(|error| {
        let devices = [(idle[0], a_to_b.input_name.as_str()), (idle[1], b_to_a.input_name.as_str())];
        waiting_error(devices.iter().filter(|(idle, _)| *idle).map(|&(_, name)| name), error)
    })?;
    for direction in directions.iter_mut() {
        direction.receive_waiting()?;
    }
    Ok(())
}

/// An error of the wait for frames, naming the devices waited on (none: the line only
/// slept until a held frame fell due).
fn waiting_error<'a>(devices: impl Iterator<Item = &'a str>, error: io::Error) -> io::Error {
    let devices: Vec<&str> = devices.collect();
    let what = match devices.as_slice() {
        [] => "sleeping until a frame is due".to_owned(),
        names => format!("waiting for frames from {}", names.join(" and ")),
    };
    io::Error::new(error.kind(), format!("{what}: {error}"))
}

/// What the thread counts of one direction, copied out for `stats` every `PUBLISH_INTERVAL`.
#[derive(Debug, Clone, Default)]
struct Counters {
    frames: u64,
    bytes: u64,
    lost: u64,
    overflowed: u64,
    receive_dropped: u64,
    unreadable: u64,
    send_failed: u64,
    unstamped: u64,
    lateness: LatenessHistogram,
    ended_by: Option<String>,
}

impl Counters {
    fn to_stats(&self) -> DirectionStats {
        DirectionStats {
            frames: self.frames,
            bytes: self.bytes,
            lost: self.lost,
            overflowed: self.overflowed,
            receive_dropped: self.receive_dropped,
            unreadable: self.unreadable,
            send_failed: self.send_failed,
            unstamped: self.unstamped,
            lateness_median: self.lateness.quantile(0.5),
            lateness_p99: self.lateness.quantile(0.99),
            lateness_max: self.lateness.max(),
            ended_by: self.ended_by.clone(),
        }
    }
}

/// One direction's sockets and schedule, owned by its thread.
struct Direction {
    input_name: String,
    output_name: String,
    input_index: libc::c_int,
    input: PacketSocket,
    output: PacketSocket,
    schedule: Schedule<Vec<u8>>,
    batch: ReceiveBatch,
    /// When a read last found nothing more waiting: every frame read since arrived after it.
    last_emptied: Instant,
    counters: Counters,
    published: Arc<Mutex<Counters>>,
}

impl Direction {
    /// Opens the sockets, in the calling thread's namespace; an error names what it concerns.
    fn open(
        input: &str,
        output: &str,
        impairment: Impairment,
        published: Arc<Mutex<Counters>>,
    ) -> Result<Direction, (String, io::Error)> {
        let on = |name: &str| {
            let what = format!("device {name}");
            move |error| (what, error)
        };
        let input_index = packet_socket::interface_index(input).map_err(on(input))?;
        let output_index = packet_socket::interface_index(output).map_err(on(output))?;
        Ok(Direction {
            input_name: input.to_owned(),
            output_name: output.to_owned(),
            input_index,
            input: PacketSocket::receiver(input_index).map_err(on(input))?,
            output: PacketSocket::sender(output_index).map_err(on(output))?,
            schedule: Schedule::new(impairment, HOLD_LIMIT, SmallRng::from_entropy()),
            batch: ReceiveBatch::new(RECEIVE_BATCH, RECEIVE_BUFFER_BYTES),
            last_emptied: Instant::now(),
            counters: Counters::default(),
            published,
        })
    }

    fn send_due(&mut self) -> io::Result<()> {
        let mut now = Instant::now();
        while let Some(due) = self.schedule.pop_due(now) {
            match self.output.send(&due.frame) {
                Ok(()) => {
                    self.counters.frames += 1;
                    self.counters.bytes += due.frame.len().saturating_sub(VNET_HDR_LEN) as u64;
                }
                // Gone for good: the device was removed (its index is no longer valid).
                Err(error) if matches!(error.raw_os_error(), Some(libc::ENXIO | libc::ENODEV)) => {
                    let message = format!("sending to {}: {error}", self.output_name);
                    return Err(io::Error::new(error.kind(), message));
                }
                // The rest concern this frame or a passing state (queue full, device down).
                Err(_) => self.counters.send_failed += 1,
            }
            now = Instant::now();
            self.counters.lateness.record(now.saturating_duration_since(due.lateness_from));
        }
        Ok(())
    }

    /// Reads the frames waiting, a batch per system call, until none is left or
    /// `RECEIVE_BATCHES` were read; the number of frames read.
    fn receive_waiting(&mut self) -> io::Result<usize> {
        let mut frames_read = 0;
        for _ in 0..RECEIVE_BATCHES {
            let began = Instant::now();
            let count = match self.input.receive_batch(&mut self.batch) {
                Ok(count) => count,
                // The kernel could not describe a frame in a virtio_net_hdr and dropped it.
                Err(error) if error.raw_os_error() == Some(libc::EINVAL) => {
                    self.counters.unreadable += 1;
                    continue;
                }
                // Reported once when the device goes down, and when it is removed.
                Err(error) if error.raw_os_error() == Some(libc::ENETDOWN) => {
                    return self.check_input_present().map(|()| frames_read);
                }
                Err(error) => {
                    let message = format!("receiving from {}: {error}", self.input_name);
                    return Err(io::Error::new(error.kind(), message));
                }
            };
            // The kernel stamps frames with the system clock; the schedule runs on the
            // monotonic one. Read together, the two clocks convert one into the other.
            let (read, read_system) = (Instant::now(), SystemTime::now());
            let window = ReadWindow { after: self.last_emptied, read };
            for (received, frame) in self.batch.iter() {
                if received.outgoing {
                    continue;
                }
                if received.truncated {
                    self.counters.unreadable += 1;
                    continue;
                }
                let stamp = received.stamp.and_then(|stamp| match read_system.duration_since(stamp) {
                    Ok(ago) => read.checked_sub(ago),
                    Err(ahead) => read.checked_add(ahead.duration()),
                });
                let arrival = window.arrival(stamp);
                if matches!(arrival, ArrivalTime::Read { .. }) {
                    self.counters.unstamped += 1;
                }
                match self.schedule.arrive(arrival, frame.to_vec()) {
                    Arrival::Held => {}
                    Arrival::Lost => self.counters.lost += 1,
                    Arrival::Overflowed => self.counters.overflowed += 1,
                }
            }
            frames_read += count;
            if count < RECEIVE_BATCH {
                // The call emptied the socket: frames still to come arrive after it began.
                self.last_emptied = began;
                break;
            }
        }
        Ok(frames_read)
    }

    /// An error if the input device was removed (a device merely down comes back up).
    fn check_input_present(&self) -> io::Result<()> {
        match packet_socket::interface_index(&self.input_name) {
            Ok(index) if index == self.input_index => Ok(()),
            _ => Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("receiving from {}: the device was removed", self.input_name),
            )),
        }
    }

    fn publish(&mut self) {
        if let Ok(dropped) = self.input.take_kernel_drops() {
            self.counters.receive_dropped += dropped;
        }
        *self.published.lock().unwrap_or_else(PoisonError::into_inner) = self.counters.clone();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_wait_names_the_devices_waited_on() {
        let failed = || io::Error::from_raw_os_error(libc::ENOMEM);
        let error = waiting_error(["va", "vb"].into_iter(), failed());
        assert_eq!(error.kind(), failed().kind());
        assert!(error.to_string().starts_with("waiting for frames from va and vb: "), "{error}");
        let error = waiting_error(std::iter::empty(), failed());
        assert!(error.to_string().starts_with("sleeping until a frame is due: "), "{error}");
    }
}
