//! What the worker core's tests share: a switch's answers built from the worker's own
//! packets, and a thread of one-element blocks.

use std::sync::Arc;
use std::time::{Duration, Instant};

use netagg_wire::packet::BROADCAST_RANK;
use netagg_wire::{ElementType, Flags, Integrity, MessageType, Packet, PacketRepr};

use super::{BlockIo, BlockMask, JobSpec, Layout, SessionKey, SessionKeys, WorkerConfig, WorkerProtocol};
use crate::pacer::{DeliveryBatch, LinkPacer, LossRuns, PacingConfig, OVERFLOW_RUN};

/// Blocks of int32 elements, each element being the block's number.
pub(super) struct Numbers;

impl BlockIo for Numbers {
    fn load(&mut self, block: u32, payload: &mut [u8], _: Option<i8>) {
        for element in payload.chunks_exact_mut(4) {
            element.copy_from_slice(&(block as i32).to_le_bytes());
        }
    }
    fn store(&mut self, _: u32, _: &[u8], _: Option<i8>) {}
}

/// The switch's result for a data packet, the sum being the packet itself; rank 1's
/// contribution completed the round.
pub(super) fn result_of(packet: &[u8]) -> Vec<u8> {
    let mut result = packet.to_vec();
    let mut view = Packet::new_unchecked(&mut result[..]);
    view.set_message_type(MessageType::Result);
    view.set_rank(BROADCAST_RANK);
    view.set_ack_round(2);
    view.seal();
    result
}

/// The switch's result of round `round` of slot `slot`'s sparse stream: the sum of
/// `block`, whose stream goes on at `next` (payload left zero).
pub(super) fn sparse_result(slot: u16, round: u32, block: u32, next: u32, elements: u16) -> Vec<u8> {
    let repr = PacketRepr {
        flags: Flags::SPARSE,
        job: 1,
        rank: BROADCAST_RANK,
        slot,
        round,
        block,
        next_block: next,
        ..PacketRepr::new(MessageType::Result, ElementType::Int32, 1, 2, elements)
    };
    let mut bytes = vec![0; repr.buffer_len()];
    repr.emit(&mut bytes[..]).unwrap().seal();
    bytes
}

/// The switch's broadcast `result`, numbered `number`.
pub(super) fn numbered(mut result: Vec<u8>, number: u8) -> Vec<u8> {
    let mut view = Packet::new_unchecked(&mut result[..]);
    view.set_sequence(number);
    view.seal();
    result
}

/// The switch's pending notice answering a request: the round is still aggregating,
/// and the asker's contribution is in it or not.
pub(super) fn pending_of(request: &[u8], contributed: bool) -> Vec<u8> {
    let asked = PacketRepr::parse(&Packet::new_checked(request).unwrap());
    let notice = PacketRepr {
        flags: if contributed { Flags::CONTRIBUTED } else { Flags::NONE },
        job: asked.job,
        rank: asked.rank,
        slot: asked.slot,
        round: asked.round,
        ..PacketRepr::new(MessageType::Pending, asked.element_type, asked.session, asked.token, 0)
    };
    let mut bytes = vec![0; notice.buffer_len()];
    notice.emit(&mut bytes[..]).unwrap().seal();
    bytes
}

/// The switch's progress report answering a probe: the open rounds of the slots from the
/// probed one, and the map of those holding the prober's contribution.
pub(super) fn progress_of(probe: &[u8], open_rounds: &[u32], contributions: u64) -> Vec<u8> {
    let asked = PacketRepr::parse(&Packet::new_checked(probe).unwrap());
    assert_eq!(asked.message_type, MessageType::Probe);
    let mut report = PacketRepr {
        job: asked.job,
        packet_id: asked.packet_id,
        rank: asked.rank,
        slot: asked.slot,
        round: asked.round,
        ..PacketRepr::new(
            MessageType::Progress,
            asked.element_type,
            asked.session,
            asked.token,
            open_rounds.len() as u16,
        )
    };
    report.set_contributions(contributions);
    let mut bytes = vec![0; report.buffer_len()];
    let mut packet = report.emit(&mut bytes[..]).unwrap();
    let rounds: Vec<u8> = open_rounds.iter().flat_map(|round| round.to_le_bytes()).collect();
    packet.payload_mut().copy_from_slice(&rounds);
    packet.seal();
    bytes
}

/// Rank 0's thread of `slots` slots of one int32 element each, in session 1 (token 2);
/// retransmission timeout `timeout`.
pub(super) fn config(slots: u16, timeout: Duration) -> WorkerConfig {
    WorkerConfig {
        keys: SessionKeys::one(SessionKey { session: 1, token: 2 }),
        rank: 0,
        slot_base: 0,
        slots,
        packet_elements: 1,
        depth: 2,
        retransmit_timeout: timeout,
        max_retransmit_timeout: timeout * 8,
        job_timeout: Duration::from_secs(10),
        pacing: PacingConfig::DEFAULT,
        integrity: Integrity::Checksummed,
    }
}

/// A protocol of `slots` slots of one int32 element each, running a dense job of
/// `elements`; retransmission timeout `timeout`.
pub(super) fn running(start: Instant, slots: u16, elements: u64, timeout: Duration) -> WorkerProtocol {
    running_on(config(slots, timeout), start, elements)
}

/// A path paced at a measured rate: an overflow at `now` after `results` results of 1 000
/// bytes, all come at `now` (handed in with a round trip), starts it up at twice
/// `results` kB over the 4 ms a seed is timed over at least, a sending booked as a mean
/// result (1 000 bytes until others come).
pub(super) fn measured_path(now: Instant, results: u32) -> Arc<LinkPacer> {
    let pacer = LinkPacer::new(PacingConfig::DEFAULT);
    let mut batch = DeliveryBatch::default();
    for _ in 0..results {
        batch.add(&pacer, now, 1_000);
    }
    pacer.sample(now, Duration::from_millis(1), true, &mut batch);
    let mut runs = LossRuns::default();
    let numbers: Vec<u64> = (0..OVERFLOW_RUN).map(|_| runs.first_sending()).collect();
    for number in numbers {
        pacer.lost(now, &mut runs, number, 1_000);
    }
    assert!(pacer.rate().is_some(), "measured");
    pacer
}

/// A protocol of `config` running a dense int32 job of `elements`.
pub(super) fn running_on(config: WorkerConfig, start: Instant, elements: u64) -> WorkerProtocol {
    let mut protocol = WorkerProtocol::new(config, start);
    let job = JobSpec {
        job: 1,
        element_type: ElementType::Int32,
        elements,
        layout: Layout::Dense,
        exponents: false,
    };
    protocol.start_job(start, job).unwrap();
    protocol
}

/// A thread of 2 slots running a sparse job of 12 one-element blocks, of which this
/// worker holds blocks 3, 4, 5, 7 and 9 (slot 0's stream is the even blocks, slot 1's
/// the odd), with its two opening contributions sent at `start`; retransmission timeout
/// `timeout`.
pub(super) fn running_sparse(start: Instant, timeout: Duration) -> WorkerProtocol {
    let mut protocol = WorkerProtocol::new(config(2, timeout), start);
    let job = JobSpec {
        job: 1,
        element_type: ElementType::Int32,
        elements: 12,
        layout: Layout::Sparse(BlockMask::from_fn(12, |block| [3, 4, 5, 7, 9].contains(&block))),
        exponents: false,
    };
    protocol.start_job(start, job).unwrap();
    assert_eq!(sent(&mut protocol, start).len(), 2);
    protocol
}

/// Every packet the protocol has to send at `now`.
pub(super) fn sent(protocol: &mut WorkerProtocol, now: Instant) -> Vec<Vec<u8>> {
    let mut buffer = vec![0; netagg_wire::MAX_DATAGRAM_LEN];
    std::iter::from_fn(|| {
        protocol.poll_transmit(now, &mut buffer, &mut Numbers).map(|len| buffer[..len].to_vec())
    })
    .collect()
}

/// The header of a packet the protocol sent.
pub(super) fn parsed(packet: &[u8]) -> PacketRepr {
    PacketRepr::parse(&Packet::new_checked(packet).unwrap())
}
