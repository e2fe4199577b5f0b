//! A sequence of datagrams, waits and session restarts through the aggregation engine:
//! no panic, and every packet it asks to send is a well-formed result or pending notice.
//!
//! Raw datagrams alone rarely get past the header checks, so most steps describe a
//! packet by a few small fields that index the open sessions, emitted with
//! `PacketRepr::emit`; and since a round completes only when every worker sent the same
//! header, a step can repeat the last one from another rank or for the slot's next round.

#![no_main]

use std::time::{Duration, Instant};

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use netagg_aggregator::{Engine, EngineLimits, Recipient, SessionId, SessionSpec, Transmit, Verdict};
use netagg_fuzz::Raw;
use netagg_wire::packet::{datagram_len, BROADCAST_RANK, END_OF_STREAM, PROGRESS_SLOTS};
use netagg_wire::{ElementType, Flags, MessageType, Packet, PacketRepr, MAX_DATAGRAM_LEN};

/// The two sessions every input starts with: different shapes, so that rank, slot and
/// size checks differ between them.
/// Each session's token; a header may carry the wrong one.
const TOKENS: [u64; 2] = [0x1111_2222_3333_4444, 0x5555_6666_7777_8888];

const SPECS: [SessionSpec; 2] = [
    SessionSpec { workers: 3, slots: 4, packet_elements: 16, depth: 4 },
    SessionSpec { workers: 2, slots: 2, packet_elements: 8, depth: 2 },
];

const IDLE_TIMEOUT: Duration = Duration::from_secs(1);

/// Blocks named in structured packets: few, so that streams meet on the same block.
const BLOCKS: u32 = 8;

#[derive(Debug, Arbitrary)]
enum Step {
    Raw(Raw),
    Packet(Header),
    Again(Again),
    /// Lets time pass (in 10 ms units, so idle sessions can expire) and fires timeouts.
    Wait(u8),
    /// Closes session `index % 2` if open and opens a new one of its shape, so an input
    /// goes on after an expiry and reaches index reuse.
    Reopen(u8),
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum Kind {
    Data,
    Ack,
    Result,
    Pending,
    Probe,
    Progress,
}

/// A worker → switch packet in a few bytes: small values where the engine compares.
#[derive(Debug, Clone, Copy, Arbitrary)]
struct Header {
    kind: Kind,
    session: u8,
    /// Carries the other session's token (forged or misdirected).
    wrong_token: bool,
    /// Arrives from an address other than its rank's.
    wrong_source: bool,
    rank: u8,
    slot: u8,
    /// Sign-extended, so rounds just below zero (wrapped) are reachable too.
    round: i8,
    /// How far `ack round` trails `round`; 1 is what a worker in step sends.
    ack_lag: u8,
    flags: u8,
    /// One of the four element types, taken modulo 4.
    element_type: u8,
    job: u8,
    /// The packet id is the block, as workers send it, or one more.
    other_packet_id: bool,
    exponent: i8,
    block: u8,
    /// `None` is the end of the stream.
    next_block: Option<u8>,
    /// Element count; data may carry one more than the larger session takes.
    elements: u8,
    /// Seed of the element values.
    value: i32,
    /// A data packet's number among its thread's first sendings: in or out of order,
    /// repeated or skipped, as the fuzzer picks (0 on messages that carry none).
    sequence: u8,
}

/// The last header again, from `rank`, naming `next_block` as the sender's next block.
#[derive(Debug, Arbitrary)]
struct Again {
    rank: u8,
    /// For the slot's next round: of the stream's next block if the last header named
    /// one, else of the same block.
    next_round: bool,
    /// With `next_round`: acknowledge every earlier round, else none more than before
    /// (sets then fill up with unacknowledged results).
    ack: bool,
    next_block: Option<u8>,
}

struct Harness {
    engine: Engine,
    now: Instant,
    sessions: [SessionId; 2],
    last: Option<Header>,
    out: Vec<u8>,
}

impl Harness {
    fn new() -> Harness {
        let now = Instant::now();
        let mut engine = Engine::new(EngineLimits {
            max_sessions: 2,
            max_workers: 4,
            max_slots: 4,
            max_depth: 4,
            max_packet_elements: 16,
            max_bytes: 1 << 20,
            max_session_bytes: 1 << 19,
            session_idle_timeout: IDLE_TIMEOUT,
        });
        let sessions = [0, 1].map(|i| engine.open_session(now, SPECS[i], TOKENS[i]).expect("spec fits"));
        Harness { engine, now, sessions, last: None, out: vec![0; MAX_DATAGRAM_LEN] }
    }

    fn step(&mut self, step: Step) {
        match step {
            Step::Raw(Raw(bytes)) => self.feed(&bytes, false),
            Step::Packet(header) => self.send(header),
            Step::Again(again) => {
                let Some(mut header) = self.last else {
                    return;
                };
                header.rank = again.rank;
                if again.next_round {
                    header.round = header.round.wrapping_add(1);
                    header.ack_lag = if again.ack { 1 } else { header.ack_lag.wrapping_add(1) };
                    if let Some(next) = header.next_block {
                        header.block = next;
                    }
                }
                header.next_block = again.next_block;
                self.send(header);
            }
            Step::Wait(ticks) => {
                self.now += Duration::from_millis(10 * ticks as u64);
                let due = self.engine.poll_timeout().is_some_and(|t| t <= self.now);
                let expired = self.engine.handle_timeout(self.now);
                assert_eq!(due, !expired.is_empty(), "poll_timeout disagrees");
                for id in expired {
                    assert!(self.engine.session(id).is_none(), "{id:?} expired but open");
                }
            }
            Step::Reopen(index) => {
                let index = index as usize % SPECS.len();
                // An expired session is already gone: closing it fails, which is fine.
                let _ = self.engine.close_session(self.sessions[index]);
                self.sessions[index] = self
                    .engine
                    .open_session(self.now, SPECS[index], TOKENS[index])
                    .expect("a closed session's room is free again");
            }
        }
    }

    fn send(&mut self, header: Header) {
        let bytes = self.build(&header);
        self.feed(&bytes, header.wrong_source);
        self.last = Some(header);
    }

    fn build(&self, h: &Header) -> Vec<u8> {
        let element_type =
            [ElementType::Int32, ElementType::Float32, ElementType::Float16, ElementType::BFloat16]
                [h.element_type as usize % 4];
        // One element past a full packet of this type, so that overflows are tried too.
        let full_packet = element_type.per_packet(SPECS[0].packet_elements);
        let (message_type, max_elements) = match h.kind {
            Kind::Data => (MessageType::Data, full_packet as u8 + 1),
            Kind::Ack => (MessageType::Ack, 0),
            Kind::Result => (MessageType::Result, 1),
            Kind::Pending => (MessageType::Pending, 0),
            Kind::Probe => (MessageType::Probe, 0),
            Kind::Progress => (MessageType::Progress, 2),
        };
        // A progress report's elements are rounds: int32 whatever the session sums.
        let element_type =
            if message_type == MessageType::Progress { ElementType::Int32 } else { element_type };
        let round = h.round as i32 as u32;
        let block = h.block as u32 % BLOCKS;
        let session = self.sessions[h.session as usize % SPECS.len()].0;
        let token = TOKENS[(h.session as usize + h.wrong_token as usize) % SPECS.len()];
        let elements = (h.elements % (max_elements + 1)) as u16;
        let repr = PacketRepr {
            flags: Flags::from_bits(h.flags & 0b1_1111).expect("masked to the known bits"),
            job: h.job as u32 % 2,
            packet_id: block + h.other_packet_id as u32,
            rank: h.rank as u16 % 4,
            slot: h.slot as u16 % 5,
            exponent: h.exponent,
            round,
            block,
            next_block: h.next_block.map_or(END_OF_STREAM, |b| b as u32 % BLOCKS),
            ack_round: round.wrapping_sub(h.ack_lag as u32),
            ..PacketRepr::new(message_type, element_type, session, token, elements)
        };
        let repr = PacketRepr {
            sequence: if message_type.is_numbered(repr.flags) { h.sequence } else { 0 },
            ..repr
        };
        let mut bytes = vec![0; repr.buffer_len()];
        let mut packet = repr.emit(&mut bytes).expect("fields are in range");
        for (i, element) in packet.payload_mut().chunks_exact_mut(element_type.size()).enumerate() {
            let value = h.value.rotate_left(i as u32).to_le_bytes();
            element.copy_from_slice(&value[..element.len()]);
        }
        packet.seal();
        bytes
    }

    fn feed(&mut self, datagram: &[u8], wrong_source: bool) {
        let verdict =
            self.engine.handle_datagram_from(self.now, datagram, &mut self.out, |_, _, _| !wrong_source);
        if let Verdict::Send(transmit) = verdict {
            self.check_sent(transmit);
        }
        // Notices of lost contributions that waited behind a result.
        while let Some(transmit) = self.engine.poll_notice(&mut self.out) {
            self.check_sent(transmit);
        }
    }

    /// Checks a packet the engine wrote into `out`.
    fn check_sent(&self, transmit: Transmit) {
        let bytes = &self.out[..transmit.len];
        let packet = match Packet::new_checked(bytes) {
            Ok(packet) => packet,
            Err(error) => panic!("engine sent a malformed packet ({error}): {bytes:02x?}"),
        };
        let repr = PacketRepr::parse(&packet);
        match repr.message_type {
            MessageType::Result => {}
            // Answers one worker's question, or tells one worker refused a set that the
            // round has room (never a broadcast: a worker whose contribution is in must
            // not send it again), with its header alone.
            MessageType::Pending => {
                assert!(matches!(transmit.recipient, Recipient::Worker(_)), "{repr:?}");
                assert_eq!(transmit.len, datagram_len(0), "{repr:?}");
            }
            // Answers one worker's probe, about at most the slots a report covers.
            MessageType::Progress => {
                assert!(matches!(transmit.recipient, Recipient::Worker(_)), "{repr:?}");
                assert!(repr.element_count as usize <= PROGRESS_SLOTS, "{repr:?}");
            }
            MessageType::Data | MessageType::Ack | MessageType::Probe => {
                panic!("the engine sent a worker's packet: {repr:?}")
            }
        }
        assert_eq!(repr.session, transmit.session.0, "{repr:?}");
        let rank = match transmit.recipient {
            Recipient::All => BROADCAST_RANK,
            Recipient::Worker(rank) => rank,
            Recipient::Upstream => panic!("no session of this engine has an upper switch: {repr:?}"),
        };
        assert_eq!(repr.rank, rank, "{repr:?} to {:?}", transmit.recipient);
    }
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let mut harness = Harness::new();
    while !u.is_empty() {
        let Ok(step) = Step::arbitrary(&mut u) else {
            break;
        };
        harness.step(step);
    }
});
