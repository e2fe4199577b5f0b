//! `switch_load`: the switch's own packet rate, against a load generator in the same
//! process, for each count of data-path threads (`switch.threads`).
//!
//! An in-process [`Switch`] on loopback takes one session of `--workers` ranks. The
//! generator registers them over the control protocol, as workers do, but sends no more
//! than the protocol needs: each of its `--generators` threads owns one UDP socket,
//! announced as that worker thread of every rank, and keeps a window of slots in flight,
//! sending every rank's contribution to a slot's round (prebuilt int32 packets, with only
//! round, ack round and number written per packet) to the lane that owns the slot, and the
//! next round once every rank's copy of the result is back. A result whose first element
//! is not the sum fails the run. So the switch, not a client library, is what is loaded.
//!
//! First sendings are numbered as a worker thread numbers them, per rank and lane, so
//! that the switch's check of those numbers takes its common case, the next number; a
//! window sent again after a loss goes as retransmissions, unnumbered. A lossless run thus
//! has the switch send no LOST notices, which each run prints.
//!
//! Runs alternate between thread counts (`--threads 1,2`), `--rounds` times, and print
//! each run and the medians: rounds completed per second (each is `--workers` datagrams
//! into the switch and as many out) and the goodput per worker in Gbit/s.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use clap::Parser;
use netagg_switch::Switch;
use netagg_udp::{BatchSocket, SegmentBatch};
use netagg_wire::{
    ControlMessage, ElementType, Flags, MessageType, Packet, PacketRepr, SlotSplit, ValueEncoding,
};

/// The switch alone under load, for each count of its data-path threads.
#[derive(Debug, Parser)]
#[command(name = "switch_load", version)]
struct Options {
    /// Data-path thread counts to measure, alternating (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    threads: Vec<u16>,
    /// Ranks of the session.
    #[arg(long, default_value_t = 4)]
    workers: u16,
    /// Generator threads, each one worker thread of every rank.
    #[arg(long, default_value_t = 2)]
    generators: u16,
    /// Slots each generator thread keeps in flight.
    #[arg(long, default_value_t = 64)]
    window: u16,
    /// Elements per packet.
    #[arg(long, default_value_t = 256)]
    packet_elements: u16,
    /// Seconds measured per run, after a quarter of that to warm up.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Runs of each thread count.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
}

/// A generator thread with nothing back for this long sends its window again.
const RESEND_AFTER: Duration = Duration::from_millis(20);
/// Socket buffers asked for, as the switch's.
const SOCKET_BUFFER: usize = netagg_switch::DATA_SOCKET_BUFFER;

fn main() -> ExitCode {
    let options = Options::parse();
    let mut runs: Vec<(u16, Vec<Run>)> =
        options.threads.iter().map(|&threads| (threads, Vec::new())).collect();
    for round in 0..options.rounds {
        for (threads, rates) in &mut runs {
            match measure(&options, *threads) {
                Ok(run) => {
                    println!(
                        "run {round} threads {threads}: {:.0} rounds/s, {:.2} Gbit/s per worker, {:.0} rounds per CPU second, {} windows sent again, {} LOST notices",
                        run.rate,
                        gbps(&options, run.rate),
                        run.per_cpu_second,
                        run.resends,
                        run.lost_notices
                    );
                    rates.push(run);
                }
                Err(message) => {
                    eprintln!("switch_load: {message}");
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    let medians = |runs: &[Run]| {
        let rates: Vec<f64> = runs.iter().map(|run| run.rate).collect();
        let per_cpu: Vec<f64> = runs.iter().map(|run| run.per_cpu_second).collect();
        (median(&rates), median(&per_cpu))
    };
    let (baseline, baseline_per_cpu) = medians(&runs[0].1);
    for (threads, rates) in &runs {
        let (rate, per_cpu) = medians(rates);
        println!(
            "threads {threads}: median {rate:.0} rounds/s ({:.0} datagrams/s in), {:.2} Gbit/s per worker, {:.2} of \
             threads {}; {per_cpu:.0} rounds per CPU second, {:.2} of threads {}",
            rate * f64::from(options.workers),
            gbps(&options, rate),
            rate / baseline,
            runs[0].0,
            per_cpu / baseline_per_cpu,
            runs[0].0
        );
    }
    ExitCode::SUCCESS
}

fn gbps(options: &Options, rounds_per_second: f64) -> f64 {
    rounds_per_second * f64::from(options.packet_elements) * 32.0 / 1e9
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// What one run measured.
struct Run {
    /// Rounds completed per second.
    rate: f64,
    /// Rounds completed per second of CPU the process (switch and generator) used: on a
    /// machine shared with other work, more threads also take a larger share of its
    /// cores, which this sets apart.
    per_cpu_second: f64,
    /// How often a generator thread sent its window again after a loss.
    resends: u64,
    /// Notices of lost contributions the switch sent or dropped: none without a loss.
    lost_notices: u64,
}

/// User and system CPU seconds this process has used (`/proc/self/stat`, in ticks of
/// 1/100 s).
fn process_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> =
        stat.rsplit_once(')').map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
    let ticks = |index: usize| fields.get(index).and_then(|field| field.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are the 14th and 15th fields, the 12th and 13th after the name.
    (ticks(11) + ticks(12)) / 100.0
}

/// One run: a switch of `threads` data-path threads, loaded until the time is up.
fn measure(options: &Options, threads: u16) -> Result<Run, String> {
    let mut settings = netagg::Config::default().switch;
    settings.control = "127.0.0.1:0".parse().expect("an address");
    settings.data = "127.0.0.1:0".parse().expect("an address");
    settings.threads = threads;
    let switch = Switch::start(&settings).map_err(|e| e.to_string())?;
    let sockets = (0..options.generators)
        .map(|_| BatchSocket::bind("127.0.0.1:0".parse().expect("an address"), SOCKET_BUFFER))
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(|e| format!("binding the generator's sockets: {e}"))?;
    let endpoints = sockets
        .iter()
        .map(|socket| socket.local_addr().map(netagg_wire::Endpoint::Udp))
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(|e| e.to_string())?;
    let slots = options.generators * options.window;
    let (session, token, lanes, _control) = register(options, &switch, slots, endpoints)?;

    let stop = AtomicBool::new(false);
    let mut cpu = 0.0;
    let start = Barrier::new(usize::from(options.generators) + 1);
    let warmup = Duration::from_secs_f64(options.seconds / 4.0);
    let measured = Duration::from_secs_f64(options.seconds);
    let counts: Vec<(u64, u64, u64)> = std::thread::scope(|scope| {
        let generators: Vec<_> = (0..options.generators)
            .zip(sockets)
            .map(|(index, socket)| {
                let generator = Generator::new(options, session, token, &lanes, slots, index);
                let (stop, start) = (&stop, &start);
                scope.spawn(move || generator.run(socket, start, stop, warmup))
            })
            .collect();
        start.wait();
        std::thread::sleep(warmup);
        let cpu_before = process_cpu_seconds();
        std::thread::sleep(measured);
        cpu = process_cpu_seconds() - cpu_before;
        stop.store(true, Ordering::Relaxed);
        generators.into_iter().map(|g| g.join().expect("a generator did not panic")).collect()
    });
    let counters = switch.counters().ok_or("a data-path thread did not give its counters")?;
    let lost_notices = counters
        .sessions
        .iter()
        .map(|(_, session)| session.lost_notices + session.lost_notices_dropped)
        .sum();
    switch.stop().map_err(|e| e.to_string())?;
    let (mut rounds, mut resends) = (0, 0);
    for (completed, wrong, resent) in counts {
        if wrong > 0 {
            return Err(format!("{wrong} results with a wrong sum"));
        }
        rounds += completed;
        resends += resent;
    }
    Ok(Run {
        rate: rounds as f64 / measured.as_secs_f64(),
        per_cpu_second: rounds as f64 / cpu.max(0.01),
        resends,
        lost_notices,
    })
}

/// Registers every rank with the same generator endpoints; the session, its token, the
/// lanes' addresses and the control connections, which must stay open.
fn register(
    options: &Options,
    switch: &Switch,
    slots: u16,
    endpoints: Vec<netagg_wire::Endpoint>,
) -> Result<(u32, u64, Vec<SocketAddr>, Vec<TcpStream>), String> {
    let name = format!("switch-load-{}", std::process::id());
    let mut streams = Vec::new();
    for rank in 0..options.workers {
        let mut stream = TcpStream::connect(switch.control_addr()).map_err(|e| e.to_string())?;
        let register = ControlMessage::Register {
            rank,
            world_size: options.workers,
            packet_elements: options.packet_elements,
            slots,
            depth: 2,
            encoding: ValueEncoding::Native,
            sparse_blocks: false,
            name: name.clone(),
            endpoints: endpoints.clone(),
        };
        register.write_to(1, &mut stream).map_err(|e| e.to_string())?;
        stream.flush().map_err(|e| e.to_string())?;
        streams.push(stream);
    }
    let mut accepted = None;
    for stream in &mut streams {
        match ControlMessage::read_from(stream).map_err(|e| e.to_string())? {
            (_, ControlMessage::Accept { session, token, data, split: SlotSplit::Ranges, .. }) => {
                let ip = switch.control_addr().ip();
                let lanes = data.iter().filter_map(|endpoint| endpoint.udp_address(ip)).collect();
                accepted = Some((session, token, lanes));
            }
            (_, other) => return Err(format!("registration refused: {other:?}")),
        }
    }
    let (session, token, lanes) = accepted.ok_or("no rank registered")?;
    Ok((session, token, lanes, streams))
}

/// Whether a contribution goes for the first time, numbered, or again.
#[derive(Debug, Clone, Copy)]
enum Sending {
    First,
    Again,
}

/// One generator thread: worker thread `index` of every rank.
struct Generator {
    workers: u16,
    /// Per rank, a prebuilt data packet (rank `r` contributes `r + 1` everywhere).
    packets: Vec<Vec<u8>>,
    /// This thread's slots, and the lane each goes to.
    slots: Vec<(u16, usize)>,
    lanes: Vec<SocketAddr>,
    /// The number of each rank's next first sending to each lane, at `rank * lanes +
    /// lane`: a worker thread numbers its first sendings to each switch endpoint, modulo
    /// 256.
    first_numbers: Vec<u8>,
    expected_sum: i32,
}

impl Generator {
    fn new(
        options: &Options,
        session: u32,
        token: u64,
        lanes: &[SocketAddr],
        slots: u16,
        index: u16,
    ) -> Generator {
        let elements = options.packet_elements;
        let packets = (0..options.workers)
            .map(|rank| {
                let repr = PacketRepr {
                    job: 1,
                    rank,
                    ..PacketRepr::new(MessageType::Data, ElementType::Int32, session, token, elements)
                };
                let mut bytes = vec![0; repr.buffer_len()];
                let mut packet = repr.emit(&mut bytes).expect("the buffer fits the packet");
                let value = i32::from(rank) + 1;
                packet
                    .payload_mut()
                    .chunks_exact_mut(4)
                    .for_each(|element| element.copy_from_slice(&value.to_le_bytes()));
                packet.seal();
                bytes
            })
            .collect();
        let first = index * options.window;
        let owned = (first..first + options.window)
            .map(|slot| (slot, SlotSplit::Ranges.owner(slot, slots, lanes.len())))
            .collect();
        let workers = i32::from(options.workers);
        Generator {
            workers: options.workers,
            packets,
            slots: owned,
            lanes: lanes.to_vec(),
            first_numbers: vec![0; usize::from(options.workers) * lanes.len()],
            expected_sum: workers * (workers + 1) / 2,
        }
    }

    /// Drives the window until `stop`; returns the rounds completed after `warmup`, the
    /// results whose sum was wrong and how often the window was sent again.
    fn run(
        mut self,
        mut socket: BatchSocket,
        start: &Barrier,
        stop: &AtomicBool,
        warmup: Duration,
    ) -> (u64, u64, u64) {
        let first_slot = self.slots[0].0;
        // Per slot of this thread: its round, and the copies of its result back.
        let mut rounds = vec![0u32; self.slots.len()];
        let mut copies = vec![0u16; self.slots.len()];
        let mut batches: Vec<SegmentBatch> =
            self.lanes.iter().map(|_| SegmentBatch::new(socket.max_segments())).collect();
        let (mut completed, mut wrong, mut resends) = (0u64, 0u64, 0u64);
        start.wait();
        let counting_from = Instant::now() + warmup;
        let mut counting = false;
        for index in 0..self.slots.len() {
            self.queue(&socket, &mut batches, index, 0, Sending::First);
        }
        self.flush(&socket, &mut batches);
        let mut last_progress = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            let mut ready = Vec::new();
            let received = socket
                .recv(RESEND_AFTER, |_, datagram| {
                    let Ok(packet) = Packet::new_checked(datagram) else { return };
                    // A pending notice (a duplicate's, or LOST after a loss) is no copy.
                    if packet.message_type() != MessageType::Result {
                        return;
                    }
                    let index = usize::from(packet.slot().wrapping_sub(first_slot));
                    if index >= rounds.len() || packet.round() != rounds[index] {
                        return;
                    }
                    let first =
                        packet.payload().get(..4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                    if first != Some(self.expected_sum) {
                        wrong += 1;
                    }
                    copies[index] += 1;
                    if copies[index] == self.workers {
                        copies[index] = 0;
                        rounds[index] = rounds[index].wrapping_add(1);
                        ready.push(index);
                    }
                })
                .unwrap_or(0);
            if !counting && Instant::now() >= counting_from {
                counting = true;
            }
            if counting {
                completed += ready.len() as u64;
            }
            if !ready.is_empty() {
                last_progress = Instant::now();
            }
            for index in ready {
                self.queue(&socket, &mut batches, index, rounds[index], Sending::First);
            }
            // Lost on a full socket buffer: the window again, as a worker's timer would.
            if received == 0 && last_progress.elapsed() >= RESEND_AFTER {
                resends += 1;
                copies.iter_mut().for_each(|c| *c = 0);
                for (index, &round) in rounds.iter().enumerate() {
                    self.queue(&socket, &mut batches, index, round, Sending::Again);
                }
                last_progress = Instant::now();
            }
            self.flush(&socket, &mut batches);
        }
        (completed, wrong, resends)
    }

    /// Queues every rank's contribution to `round` of this thread's slot `index`.
    fn queue(
        &mut self,
        socket: &BatchSocket,
        batches: &mut [SegmentBatch],
        index: usize,
        round: u32,
        sending: Sending,
    ) {
        let (slot, lane) = self.slots[index];
        for (rank, packet) in self.packets.iter_mut().enumerate() {
            let mut view = Packet::new_unchecked(&mut packet[..]);
            view.set_slot(slot);
            view.set_round(round);
            view.set_packet_id(round.wrapping_mul(1 << 16) | u32::from(slot));
            view.set_block(u32::from(slot));
            view.set_ack_round(round.wrapping_sub(1));
            match sending {
                Sending::First => {
                    let number = &mut self.first_numbers[rank * self.lanes.len() + lane];
                    view.set_flags(Flags::NONE);
                    view.set_sequence(*number);
                    *number = number.wrapping_add(1);
                }
                Sending::Again => {
                    view.set_flags(Flags::RETRANSMISSION);
                    view.set_sequence(0);
                }
            }
            view.seal();
            if !batches[lane].accepts(packet.len()) {
                let _ = socket.send(self.lanes[lane], &batches[lane]);
                batches[lane].clear();
            }
            batches[lane].push(packet);
        }
    }

    fn flush(&self, socket: &BatchSocket, batches: &mut [SegmentBatch]) {
        for (lane, batch) in batches.iter_mut().enumerate().filter(|(_, batch)| !batch.is_empty()) {
            let _ = socket.send(self.lanes[lane], batch);
            batch.clear();
        }
    }
}
