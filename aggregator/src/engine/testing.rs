//! What the engine's tests share: one small session, and the packets its workers send.

use std::time::Instant;

use netagg_wire::packet::{datagram_len, MAX_ELEMENTS};
use netagg_wire::{ElementType, Flags, MessageType, PacketRepr};

use super::{Engine, EngineLimits, SessionId, SessionSpec};

/// A dense contribution to slot 0 of one element, the round's number.
pub(super) fn contribution(session: SessionId, rank: u16, round: u32, ack_round: u32) -> Vec<u8> {
    let repr = PacketRepr {
        rank,
        round,
        ack_round,
        ..PacketRepr::new(MessageType::Data, ElementType::Int32, session.0, 7, 1)
    };
    let mut buffer = vec![0; repr.buffer_len()];
    let mut packet = repr.emit(&mut buffer).unwrap();
    packet.payload_mut().copy_from_slice(&(round as i32).to_le_bytes());
    packet.seal();
    buffer
}

/// An engine with one session of 2 workers and one slot of `depth` sets, the time,
/// and a buffer for results.
pub(super) fn one_slot(depth: u8) -> (Engine, SessionId, Instant, Vec<u8>) {
    let mut engine = Engine::new(EngineLimits::default());
    let now = Instant::now();
    let spec = SessionSpec { workers: 2, slots: 1, packet_elements: 4, depth };
    let session = engine.open_session(now, spec, 7).unwrap();
    (engine, session, now, vec![0; datagram_len(MAX_ELEMENTS)])
}

/// The slot's sets that hold a round (aggregating or retained), by index.
pub(super) fn sets_in_use(engine: &mut Engine, session: SessionId) -> Vec<u32> {
    let slot = &engine.session_mut(session).unwrap().slots[0];
    let retained = (0..64).filter(|i| slot.retained & (1 << i) != 0);
    retained.chain(slot.open_set.map(u32::from)).collect()
}

/// A header-only request for a round's result (`WANT_RESULT`) of slot 0, or a probe
/// (`probe`) about the slots from 0, sent with `round` awaited.
pub(super) fn ask(session: SessionId, rank: u16, round: u32, probe: bool) -> Vec<u8> {
    let (message_type, flags) =
        if probe { (MessageType::Probe, Flags::NONE) } else { (MessageType::Ack, Flags::WANT_RESULT) };
    let repr = PacketRepr {
        rank,
        round,
        ack_round: round.wrapping_sub(1),
        flags,
        ..PacketRepr::new(message_type, ElementType::Int32, session.0, 7, 0)
    };
    let mut buffer = vec![0; repr.buffer_len()];
    repr.emit(&mut buffer).unwrap().seal();
    buffer
}

/// A sparse contribution to `block` of slot 0, whose stream goes on at `next`.
pub(super) fn sparse(session: SessionId, rank: u16, round: u32, block: u32, next: u32) -> Vec<u8> {
    let repr = PacketRepr {
        rank,
        round,
        ack_round: round.wrapping_sub(1),
        flags: Flags::SPARSE,
        block,
        next_block: next,
        ..PacketRepr::new(MessageType::Data, ElementType::Int32, session.0, 7, 1)
    };
    let mut buffer = vec![0; repr.buffer_len()];
    repr.emit(&mut buffer).unwrap().seal();
    buffer
}
