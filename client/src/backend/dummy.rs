//! The dummy backend: no network. An in-process engine answers every packet as if all
//! workers had sent the same data, and the thread sleeps to emulate a link's bandwidth:
//! one link per worker, shared by its threads as a network interface would be.
//!
//! The private engine holds a session of one worker, and each data packet's payload is
//! summed into its round as many times as the session has ranks, as the switch would
//! sum it (`Replicated`). The result is thus exactly what the switch would return if every
//! worker held this worker's tensor, bit for bit, and the engine retains and resends it
//! as the switch does: dense and sparse jobs and the whole worker-side protocol run as
//! they would over a network, at the cost of one engine pass per packet whatever the
//! number of ranks (SwitchML's dummy keeps no state). An int32 sum is made as a product,
//! as SwitchML's dummy makes it; a float32 one by additions, which round as the switch's do.
//!
//! Checksums: the link is this process's memory, which nothing can alter on the way
//! unless the fault injector corrupts datagrams (`send_corrupt` or `receive_corrupt` above
//! 0). Only then ([`netagg_config::Faults::may_alter_bytes`]) are packets sealed and
//! checked, all of them, on both sides, as over a network; otherwise neither the worker
//! nor this switch writes or checks a checksum ([`Integrity::InProcess`]), as Linux's
//! loopback marks its packets as needing none. Every other field is checked either way.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use netagg_aggregator::sum::{add_assign_with, add_with, multiply_i32_with, InstructionSet};
use netagg_aggregator::sum16;
use netagg_aggregator::{Engine, EngineLimits, SessionError, SessionId, SessionSpec, Summand, Verdict};
use netagg_config::Config;
use netagg_wire::packet::{datagram_len, BROADCAST_RANK};
use netagg_wire::{ElementType, Integrity, MessageType, Packet, PacketRepr, MAX_DATAGRAM_LEN};

use super::{Links, Transport};
use crate::Error;

/// One transport per worker thread of `config`, all in one emulated session.
pub fn links(config: &Config) -> Result<Links, Error> {
    let general = &config.general;
    let spec = SessionSpec {
        workers: general.num_workers,
        slots: config.slots_per_thread() * general.num_worker_threads,
        packet_elements: general.packet_numel,
        depth: general.depth,
    };
    let token = DummyTransport::new_token();
    let integrity =
        if config.faults.may_alter_bytes() { Integrity::Checksummed } else { Integrity::InProcess };
    let link = Arc::new(EmulatedLink::new(config.dummy.bandwidth));
    let mut transports: Vec<Box<dyn Transport>> = Vec::new();
    let mut session = 0;
    for _ in 0..general.num_worker_threads {
        let (transport, id) =
            DummyTransport::new(spec, token, Arc::clone(&link), config.dummy.process_packets, integrity)
                .map_err(Error::InvalidConfig)?;
        session = id.0;
        transports.push(Box::new(transport));
    }
    Ok(Links::Emulated { transports, session, token, integrity })
}

/// A worker's emulated link, which its threads' datagrams cross one after another.
pub struct EmulatedLink {
    /// Bits per second, 0 for an unlimited link.
    bits_per_second: f64,
    /// The time `busy_until` counts from.
    epoch: Instant,
    /// Nanoseconds after `epoch` at which the link has carried everything sent so far.
    busy_until: AtomicU64,
}

impl EmulatedLink {
    pub fn new(bandwidth_mbps: f64) -> EmulatedLink {
        EmulatedLink {
            bits_per_second: bandwidth_mbps * 1e6,
            epoch: Instant::now(),
            busy_until: AtomicU64::new(0),
        }
    }

    /// Puts `bytes` on the link behind what is already on it; returns when they will
    /// have crossed it, or `None` for an unlimited link.
    fn carry(&self, bytes: usize) -> Option<Instant> {
        if self.bits_per_second <= 0.0 {
            return None;
        }
        let wire_nanos = (bytes as f64 * 8.0 / self.bits_per_second * 1e9) as u64;
        let now = self.epoch.elapsed().as_nanos() as u64;
        let previous = self
            .busy_until
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |busy| Some(busy.max(now) + wire_nanos))
            .expect("the update always succeeds");
        Some(self.epoch + Duration::from_nanos(previous.max(now) + wire_nanos))
    }
}

pub struct DummyTransport {
    engine: Engine,
    workers: u16,
    process_packets: bool,
    /// Whether packets are sealed and checked (see the module's docs).
    integrity: Integrity,
    link: Arc<EmulatedLink>,
    /// When the emulated link has delivered everything this thread sent so far; None on
    /// an unlimited link.
    delivered_at: Option<Instant>,
    /// The engine's clock: read once per batch of results, not per packet (the engine
    /// needs it only for idle sessions, which this one never is).
    engine_now: Instant,
    results: PendingResults,
    /// Bytes of the session's largest packet: the room the engine needs for a result.
    max_result_len: usize,
    /// Where the worker writes the datagram it sends.
    outgoing: Vec<u8>,
    /// Room for a payload summed once per rank, where the engine cannot take the sum
    /// straight into its round ([`Replicated`]).
    scratch: Vec<u8>,
}

impl DummyTransport {
    /// A session token for [`DummyTransport::new`], drawn as the switch draws one.
    pub fn new_token() -> u64 {
        rand::RngCore::next_u64(&mut rand::rngs::OsRng)
    }

    /// A transport for one worker thread; `spec` and `token` are the session every
    /// thread shares, as the workers see it (the engine's own has one worker);
    /// `integrity`, the workers' too.
    pub fn new(
        spec: SessionSpec,
        token: u64,
        link: Arc<EmulatedLink>,
        process_packets: bool,
        integrity: Integrity,
    ) -> Result<(DummyTransport, SessionId), String> {
        let limits = EngineLimits { session_idle_timeout: Duration::MAX, ..EngineLimits::default() };
        // The engine's own session has one worker, so the session's real size is checked
        // against a switch's limit here.
        if spec.workers == 0 || spec.workers > limits.max_workers {
            return Err(
                SessionError::Workers { requested: spec.workers, max: limits.max_workers }.to_string()
            );
        }
        let mut engine = Engine::with_integrity(limits, integrity);
        let one_worker = SessionSpec { workers: 1, ..spec };
        let session = engine.open_session(Instant::now(), one_worker, token).map_err(|e| e.to_string())?;
        let transport = DummyTransport {
            engine,
            workers: spec.workers,
            process_packets,
            integrity,
            link,
            delivered_at: None,
            engine_now: Instant::now(),
            results: PendingResults::default(),
            max_result_len: datagram_len(spec.packet_elements as usize),
            outgoing: vec![0; MAX_DATAGRAM_LEN],
            scratch: vec![0; MAX_DATAGRAM_LEN],
        };
        Ok((transport, session))
    }
}

impl Transport for DummyTransport {
    fn describe(&self) -> String {
        "dummy: no network, an emulated switch in this process".into()
    }

    fn send_buffer(&mut self, len: usize) -> &mut [u8] {
        if self.outgoing.len() < len {
            self.outgoing.resize(len, 0);
        }
        &mut self.outgoing
    }

    fn send(&mut self, len: usize) -> io::Result<()> {
        let datagram = &self.outgoing[..len];
        if let Some(delivered_at) = self.link.carry(datagram.len()) {
            self.delivered_at = Some(delivered_at);
        }
        let packet = match self.integrity.check(datagram) {
            Ok(packet) => packet,
            // As a switch drops one (a fault injector may have flipped its bits, which the
            // checksum shows): the protocol's timers recover.
            Err(error) => {
                tracing::debug!(%error, "dummy backend: packet dropped");
                return Ok(());
            }
        };
        if !self.process_packets {
            // Returned unchanged but for its type: the payload is this worker's alone.
            if packet.message_type() == MessageType::Data {
                let room = self.results.room(datagram.len());
                room.copy_from_slice(datagram);
                let mut view = Packet::new_unchecked(room);
                view.set_message_type(MessageType::Result);
                view.set_rank(BROADCAST_RANK);
                self.integrity.seal(&mut view);
                self.results.push(datagram.len());
            }
            return Ok(());
        }
        let mut repr = PacketRepr::parse(&packet);
        let own_rank = repr.rank;
        // The engine's session has one worker.
        repr.rank = 0;
        let payload =
            Replicated { payload: packet.payload(), workers: self.workers, scratch: &mut self.scratch };
        let out = self.results.room(self.max_result_len);
        // Parsed here from a checked packet: the engine neither checks nor parses it again.
        if let Verdict::Send(transmit) = self.engine.handle_parsed(self.engine_now, repr, payload, out) {
            self.results.keep(transmit.len, own_rank, self.integrity);
        }
        // A notice of a lost contribution waits behind the result its packet completed.
        while let Some(transmit) = self.engine.poll_notice(self.results.room(self.max_result_len)) {
            self.results.keep(transmit.len, own_rank, self.integrity);
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        if self.results.ends.is_empty() {
            std::thread::sleep(timeout.min(Duration::from_millis(1)));
            return Ok(0);
        }
        if let Some(delivered_at) = self.delivered_at {
            let wait = delivered_at.saturating_duration_since(Instant::now());
            if !wait.is_zero() {
                std::thread::sleep(wait.min(timeout));
                if Instant::now() < delivered_at {
                    return Ok(0);
                }
            }
        }
        let delivered = self.results.drain(sink);
        self.engine_now = Instant::now();
        Ok(delivered)
    }
}

/// A worker's payload as the engine's one worker contributes it: summed once per rank of
/// the session, as the switch would sum it if every worker had sent it. A round's first
/// contribution of 32-bit elements is summed straight into the round's sum, with no
/// packet between that the engine would copy (a pass over the payload fewer a packet).
struct Replicated<'a> {
    payload: &'a [u8],
    workers: u16,
    /// Room for the sum as a packet would carry it, where the engine needs one.
    scratch: &'a mut [u8],
}

impl<'a> Replicated<'a> {
    /// Writes the `workers`-fold sum of the payload into `sum`, as a packet carries it:
    /// as many bytes as the payload.
    // Inlined by force, as `start`, its caller per packet, is into the engine: at 16
    // codegen units the hint alone left two calls (about 50 instructions a packet,
    // callgrind).
    #[inline(always)]
    fn write(&self, instruction_set: InstructionSet, element_type: ElementType, sum: &mut [u8]) {
        let payload = self.payload;
        match element_type {
            // The n-fold wrapping sum is the product, in one pass rather than n.
            ElementType::Int32 => multiply_i32_with(instruction_set, sum, payload, self.workers.into()),
            // A float32 sum rounds at every addition, so it is made as a switch adds: the
            // first contribution copied, each further one added to it (the first addition
            // fused with the copy).
            ElementType::Float32 if self.workers == 1 => sum.copy_from_slice(payload),
            ElementType::Float32 => {
                add_with(instruction_set, element_type, sum, payload, payload);
                for _ in 2..self.workers {
                    add_assign_with(instruction_set, element_type, sum, payload);
                }
            }
            // A 16-bit payload cannot carry float32 partial sums: the n-fold sum is made at
            // once and rounded once, as the engine rounds its float32 sum.
            ElementType::Float16 | ElementType::BFloat16 => {
                sum16::scale(element_type, sum, payload, self.workers)
            }
        }
    }

    /// The sum as a packet would carry it, written into the scratch room.
    fn packet(mut self, instruction_set: InstructionSet, element_type: ElementType) -> &'a [u8] {
        let scratch = &mut std::mem::take(&mut self.scratch)[..self.payload.len()];
        self.write(instruction_set, element_type, scratch);
        scratch
    }
}

impl Summand for Replicated<'_> {
    #[inline(always)]
    fn start(self, instruction_set: InstructionSet, element_type: ElementType, sum: &mut [u8]) {
        // A 16-bit sum is rounded to its packet's 16 bits, as the switch's would be, before
        // the engine widens it.
        if element_type.is_16_bit() {
            return self.packet(instruction_set, element_type).start(instruction_set, element_type, sum);
        }
        self.write(instruction_set, element_type, sum);
    }

    fn add_to(self, instruction_set: InstructionSet, element_type: ElementType, sum: &mut [u8]) {
        self.packet(instruction_set, element_type).add_to(instruction_set, element_type, sum);
    }
}

/// Results not yet received, back to back in `bytes[..len]`, and where each ends. Each
/// result is written in place (by the engine); the buffer only grows, so it is neither
/// allocated nor zeroed per packet.
#[derive(Default)]
struct PendingResults {
    bytes: Vec<u8>,
    len: usize,
    ends: Vec<usize>,
}

impl PendingResults {
    /// Room for one more result of up to `len` bytes after the pending ones.
    fn room(&mut self, len: usize) -> &mut [u8] {
        let end = self.len + len;
        if self.bytes.len() < end {
            self.bytes.resize(end, 0);
        }
        &mut self.bytes[self.len..end]
    }

    /// Keeps the first `len` bytes the engine wrote into the last [`PendingResults::room`]:
    /// a packet to every rank as it is, one to the engine's only worker readdressed to
    /// this worker's rank, `own_rank`.
    // Inlined into `send`, its caller per packet: a call of about 25 instructions a
    // packet at 16 codegen units (callgrind).
    #[inline(always)]
    fn keep(&mut self, len: usize, own_rank: u16, integrity: Integrity) {
        let mut packet = Packet::new_unchecked(&mut self.bytes[self.len..self.len + len]);
        if packet.rank() != BROADCAST_RANK {
            packet.set_rank(own_rank);
            integrity.seal(&mut packet);
        }
        self.push(len);
    }

    /// Keeps the first `len` bytes of the last [`PendingResults::room`] as a result.
    fn push(&mut self, len: usize) {
        self.len += len;
        self.ends.push(self.len);
    }

    /// Hands every pending result to `sink`, in order; returns how many.
    fn drain(&mut self, sink: &mut dyn FnMut(&[u8])) -> usize {
        let mut start = 0;
        for &end in &self.ends {
            sink(&self.bytes[start..end]);
            start = end;
        }
        let delivered = self.ends.len();
        self.len = 0;
        self.ends.clear();
        delivered
    }
}

#[cfg(test)]
mod tests {
    use netagg_wire::packet::HEADER_LEN;
    use netagg_wire::WireError;

    use super::*;

    fn spec(workers: u16) -> SessionSpec {
        SessionSpec { workers, slots: 4, packet_elements: 8, depth: 2 }
    }

    fn unlimited() -> Arc<EmulatedLink> {
        Arc::new(EmulatedLink::new(0.0))
    }

    #[test]
    fn a_worker_s_threads_queue_on_one_link() {
        // 8 Mbit/s: a 1000-byte datagram takes a millisecond on the wire.
        let link = EmulatedLink::new(8.0);
        let sent = Instant::now();
        let first = link.carry(1000).unwrap();
        let second = std::thread::scope(|scope| scope.spawn(|| link.carry(1000).unwrap()).join().unwrap());
        assert!(first >= sent + Duration::from_millis(1), "{:?}", first - sent);
        assert!(second >= first + Duration::from_millis(1), "{:?}", second - first);
        assert_eq!(unlimited().carry(1000), None);
    }

    #[test]
    fn a_malformed_datagram_is_dropped_as_a_switch_drops_it() {
        let (mut transport, _) =
            DummyTransport::new(spec(2), 7, unlimited(), true, Integrity::InProcess).unwrap();
        for garbage in [&[][..], &[0xFF; 10][..], &[0; 60][..]] {
            transport.send_copy(garbage).unwrap();
        }
        let mut delivered = 0;
        let count = transport.recv(Duration::ZERO, &mut |_| delivered += 1).unwrap();
        assert_eq!((count, delivered), (0, 0));
    }

    /// What a `Replicated` of `payload` over `workers` ranks writes into a round's sum of
    /// `sum_len` bytes as its first contribution, and then adds as a second.
    fn replicated_sums(
        element_type: ElementType,
        payload: &[u8],
        workers: u16,
        sum_len: usize,
    ) -> [Vec<u8>; 2] {
        let instruction_set = InstructionSet::best();
        let mut scratch = vec![0xAA; MAX_DATAGRAM_LEN];
        let mut sum = vec![0xAA; sum_len];
        Replicated { payload, workers, scratch: &mut scratch }.start(instruction_set, element_type, &mut sum);
        let first = sum.clone();
        Replicated { payload, workers, scratch: &mut scratch }.add_to(
            instruction_set,
            element_type,
            &mut sum,
        );
        [first, sum]
    }

    #[test]
    fn a_payload_is_summed_into_the_round_once_per_rank() {
        let int32 = |values: &[i32]| values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        let payload = int32(&[3, -5, 0x4000_0001]);
        let sums = replicated_sums(ElementType::Int32, &payload, 3, payload.len());
        assert_eq!(sums, [int32(&[9, -15, -0x3FFF_FFFD]), int32(&[18, -30, -0x7FFF_FFFA])]);
        // Float32 is added as a switch adds, rounding at every addition.
        let float32 = |values: &[f32]| values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        let payload = float32(&[0.1, -2.5, 3e38]);
        let thrice = 0.1f32 + 0.1 + 0.1;
        let sums = replicated_sums(ElementType::Float32, &payload, 3, payload.len());
        let twice = thrice + thrice;
        assert_eq!(sums, [float32(&[thrice, -7.5, f32::INFINITY]), float32(&[twice, -15.0, f32::INFINITY])]);
        // A 16-bit sum is rounded to 16 bits once, as its packet would carry it, and held
        // in float32: three times float16's 0.1, rounded to float16.
        let payload =
            [half::f16::from_f32(0.1), half::f16::from_f32(-2.5)].map(half::f16::to_le_bytes).concat();
        let rounded = half::f16::from_f32(half::f16::from_f32(0.1).to_f32() * 3.0).to_f32();
        let sums = replicated_sums(ElementType::Float16, &payload, 3, 2 * payload.len());
        assert_eq!(sums, [float32(&[rounded, -7.5]), float32(&[rounded + rounded, -15.0])]);
    }

    #[test]
    fn sessions_beyond_a_switch_s_worker_limit_are_refused() {
        let max = EngineLimits::default().max_workers;
        assert!(DummyTransport::new(spec(max), 7, unlimited(), true, Integrity::InProcess).is_ok());
        let error =
            DummyTransport::new(spec(max + 1), 7, unlimited(), true, Integrity::InProcess).err().unwrap();
        assert_eq!(error, format!("{} workers requested, a session holds 1 to {max}", max + 1));
    }

    /// Sends the transport's switch a sealed int32 packet for `slot` carrying `values`, with
    /// bit 2 of the first value flipped after sealing if `flipped` (as an injector flips
    /// one); returns each result's checksum check and payload.
    fn exchange(
        transport: &mut DummyTransport,
        session: SessionId,
        slot: u16,
        values: [i32; 2],
        flipped: bool,
    ) -> Vec<(Result<(), WireError>, Vec<i32>)> {
        let repr =
            PacketRepr { slot, ..PacketRepr::new(MessageType::Data, ElementType::Int32, session.0, 7, 2) };
        let mut datagram = vec![0; repr.buffer_len()];
        let mut packet = repr.emit(&mut datagram).unwrap();
        packet.payload_mut().copy_from_slice(&[values[0].to_le_bytes(), values[1].to_le_bytes()].concat());
        packet.seal();
        if flipped {
            datagram[HEADER_LEN] ^= 0x04;
        }
        transport.send_copy(&datagram).unwrap();
        let mut results = Vec::new();
        transport
            .recv(Duration::ZERO, &mut |result| {
                let packet = Integrity::InProcess.check(result).unwrap();
                let sums = packet.payload().chunks(4).map(|e| i32::from_le_bytes(e.try_into().unwrap()));
                let sums = sums.collect();
                results.push((netagg_wire::packet::verify(result), sums));
            })
            .unwrap();
        results
    }

    #[test]
    fn packets_are_sealed_and_checked_only_where_bytes_may_be_altered() {
        // Where a fault injector may corrupt, a flipped bit is caught and the packet
        // dropped, and results are sealed.
        let (mut transport, session) =
            DummyTransport::new(spec(2), 7, unlimited(), true, Integrity::Checksummed).unwrap();
        assert_eq!(exchange(&mut transport, session, 0, [3, -5], true), []);
        assert_eq!(exchange(&mut transport, session, 1, [3, -5], false), [(Ok(()), vec![6, -10])]);
        // Where nothing can alter a byte, nothing is checked (3 became 7 unseen) and results
        // carry no checksum.
        let (mut transport, session) =
            DummyTransport::new(spec(2), 7, unlimited(), true, Integrity::InProcess).unwrap();
        let results = exchange(&mut transport, session, 0, [3, -5], true);
        assert!(matches!(results[..], [(Err(WireError::Checksum { .. }), ref sums)] if sums == &[14, -10]));
    }
}
