//! Packets per second the engine aggregates in memory, with no sockets in the way.
//!
//! One dense session of 64 slots, 256-element packets and depth 2, fed every worker's
//! contribution to a run of rounds in the order a lossless network delivers them. The
//! packets are built beforehand, so only `Engine::handle_datagram` is timed.

use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use netagg_aggregator::engine::{Engine, EngineLimits, SessionId, SessionSpec, Verdict};
use netagg_wire::{ElementType, MessageType, PacketRepr, MAX_DATAGRAM_LEN};

const SLOTS: u16 = 64;
const PACKET_ELEMENTS: u16 = 256;
const DEPTH: u8 = 2;
/// Rounds of every slot per iteration: several times the depth, so each set is reused
/// and the acknowledgements that free it are on the timed path too.
const ROUNDS: u32 = 8;

/// The benched session's token.
const TOKEN: u64 = 0xB0B0_CAFE_D00D_F00D;

/// A fresh engine holding one open session of `workers`.
///
/// A fresh engine gives its first session the same id every time, so packets built for
/// one such session are valid for all of them.
fn open_session(workers: u16, now: Instant) -> (Engine, SessionId) {
    let mut engine = Engine::new(EngineLimits::default());
    let spec = SessionSpec { workers, slots: SLOTS, packet_elements: PACKET_ELEMENTS, depth: DEPTH };
    let session = engine.open_session(now, spec, TOKEN).expect("the session fits the limits");
    (engine, session)
}

/// Every worker's data packet for `ROUNDS` rounds of every slot, round by round, so that
/// each round finds the round before it complete and acknowledged by every worker.
fn data_packets(session: SessionId, workers: u16) -> Vec<Vec<u8>> {
    let mut packets = Vec::new();
    for round in 0..ROUNDS {
        for slot in 0..SLOTS {
            for rank in 0..workers {
                let repr = PacketRepr {
                    rank,
                    slot,
                    round,
                    // A worker's contribution acknowledges the slot's previous result,
                    // which lets the engine reuse that result's set two rounds later.
                    ack_round: round.wrapping_sub(1),
                    ..PacketRepr::new(
                        MessageType::Data,
                        ElementType::Int32,
                        session.0,
                        TOKEN,
                        PACKET_ELEMENTS,
                    )
                };
                let mut bytes = vec![0; repr.buffer_len()];
                let mut packet = repr.emit(&mut bytes).expect("buffer_len fits the packet");
                for (i, element) in packet.payload_mut().chunks_exact_mut(4).enumerate() {
                    element.copy_from_slice(&(rank as i32 + i as i32).to_le_bytes());
                }
                packet.seal();
                packets.push(bytes);
            }
        }
    }
    packets
}

/// Feeds every packet; returns how many results the engine sent.
fn feed(engine: &mut Engine, now: Instant, packets: &[Vec<u8>], out: &mut [u8]) -> usize {
    packets
        .iter()
        .filter(|packet| matches!(engine.handle_datagram(now, packet, out), Verdict::Send(_)))
        .count()
}

/// Feeds the packets once, outside any timing, and panics unless the engine took every
/// one: a benchmark of packets it drops would measure nothing but its checks.
fn assert_all_taken(workers: u16, now: Instant, packets: &[Vec<u8>], out: &mut [u8]) {
    let (mut engine, session) = open_session(workers, now);
    for packet in packets {
        let verdict = engine.handle_datagram(now, packet, out);
        assert!(
            matches!(verdict, Verdict::Consumed | Verdict::Send(_)),
            "{workers} workers: a packet was not taken: {verdict:?}"
        );
    }
    let (_, counters) = engine.session(session).expect("the session is open");
    assert_eq!(counters.contributions, packets.len() as u64);
    assert_eq!(counters.results_broadcast, ROUNDS as u64 * SLOTS as u64);
}

fn dense_rounds(c: &mut Criterion) {
    let now = Instant::now();
    let mut out = vec![0; MAX_DATAGRAM_LEN];
    let mut group = c.benchmark_group("engine_dense");
    for workers in [2, 4, 8] {
        let (_, session) = open_session(workers, now);
        let packets = data_packets(session, workers);
        assert_all_taken(workers, now, &packets, &mut out);

        // Criterion's "elem/s" in this group are packets per second.
        group.throughput(Throughput::Elements(packets.len() as u64));
        group.bench_function(BenchmarkId::new("workers", workers), |b| {
            // Rounds cannot be replayed into a session that has passed them, so every
            // iteration starts from a newly opened one, built outside the timing.
            b.iter_batched_ref(
                || open_session(workers, now).0,
                |engine| black_box(feed(engine, now, black_box(&packets), &mut out)),
                BatchSize::LargeInput,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, dense_rounds);
criterion_main!(benches);
