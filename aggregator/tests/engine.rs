//! The engine, packet by packet: SwitchML's dense semantics, sparse streams, sessions and
//! limits, checked on the bytes that come out.

use std::time::{Duration, Instant};

use netagg_aggregator::engine::{
    Departure, DropReason, Engine, EngineLimits, Recipient, SessionError, SessionId, SessionSpec, Transmit,
    Verdict,
};
use netagg_wire::packet::{BROADCAST_RANK, END_OF_STREAM};
use netagg_wire::{ElementType, Flags, MessageType, Packet, PacketRepr, MAX_DATAGRAM_LEN};

/// The token of the sessions `Switch::open` opens.
const TOKEN: u64 = 0x7E57_0000_C0DE_0001;

/// A worker → switch packet under construction.
#[derive(Clone)]
struct Contribution {
    repr: PacketRepr,
    payload: Vec<u8>,
}

fn data(session: SessionId, rank: u16, slot: u16, round: u32, values: &[i32]) -> Contribution {
    Contribution {
        repr: PacketRepr {
            job: 1,
            packet_id: 100 + slot as u32,
            rank,
            slot,
            round,
            block: slot as u32,
            ack_round: round.wrapping_sub(1),
            ..PacketRepr::new(MessageType::Data, ElementType::Int32, session.0, TOKEN, values.len() as u16)
        },
        payload: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

fn ack(session: SessionId, rank: u16, slot: u16, ack_round: u32) -> Contribution {
    let mut packet = data(session, rank, slot, ack_round.wrapping_add(1), &[]);
    packet.repr.message_type = MessageType::Ack;
    packet.repr.ack_round = ack_round;
    packet
}

impl Contribution {
    fn bytes(&self) -> Vec<u8> {
        let mut buffer = vec![0; self.repr.buffer_len()];
        let mut packet = self.repr.emit(&mut buffer).unwrap();
        packet.payload_mut().copy_from_slice(&self.payload);
        packet.seal();
        buffer
    }
    fn with(mut self, change: impl FnOnce(&mut PacketRepr)) -> Self {
        change(&mut self.repr);
        self
    }
    fn sparse(self, block: u32, next_block: u32) -> Self {
        self.with(|r| {
            r.flags = Flags::SPARSE;
            r.block = block;
            r.packet_id = block;
            r.next_block = next_block;
        })
    }
}

struct Switch {
    engine: Engine,
    now: Instant,
    out: Vec<u8>,
}

impl Switch {
    fn new() -> Switch {
        Switch::with_limits(EngineLimits::default())
    }
    fn with_limits(limits: EngineLimits) -> Switch {
        Switch { engine: Engine::new(limits), now: Instant::now(), out: vec![0; MAX_DATAGRAM_LEN] }
    }
    fn open(&mut self, workers: u16, slots: u16, depth: u8) -> SessionId {
        let spec = SessionSpec { workers, slots, packet_elements: 64, depth };
        self.engine.open_session(self.now, spec, TOKEN).unwrap()
    }
    fn feed(&mut self, packet: &Contribution) -> Verdict {
        self.engine.handle_datagram(self.now, &packet.bytes(), &mut self.out)
    }
    /// Feeds a packet that must produce a result; returns its header and values.
    fn result(&mut self, packet: &Contribution) -> (Recipient, PacketRepr, Vec<i32>) {
        match self.feed(packet) {
            Verdict::Send(Transmit { recipient, len, .. }) => {
                let packet = Packet::new_checked(&self.out[..len]).unwrap();
                let values = packet
                    .payload()
                    .chunks_exact(4)
                    .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                (recipient, PacketRepr::parse(&packet), values)
            }
            other => panic!("expected a result, got {other:?}"),
        }
    }
    /// Feeds a packet that must be answered with a pending notice; returns whether it
    /// says the sender's contribution is in.
    fn pending(&mut self, packet: &Contribution) -> bool {
        let (recipient, repr, values) = self.result(packet);
        assert_eq!(repr.message_type, MessageType::Pending);
        assert_eq!((recipient, repr.rank), (Recipient::Worker(packet.repr.rank), packet.repr.rank));
        assert_eq!((repr.slot, repr.round, repr.job), (packet.repr.slot, packet.repr.round, packet.repr.job));
        assert!(values.is_empty());
        repr.flags.contains(Flags::CONTRIBUTED)
    }
}

#[test]
fn last_contribution_broadcasts_the_sum() {
    let mut switch = Switch::new();
    let session = switch.open(3, 4, 2);
    assert_eq!(switch.feed(&data(session, 0, 2, 0, &[1, 2, 3]).with(|r| r.exponent = -3)), Verdict::Consumed);
    assert_eq!(
        switch.feed(&data(session, 2, 2, 0, &[10, 20, 30]).with(|r| r.exponent = 5)),
        Verdict::Consumed
    );
    let (recipient, repr, values) =
        switch.result(&data(session, 1, 2, 0, &[100, 200, 300]).with(|r| r.exponent = 1));
    assert_eq!(recipient, Recipient::All);
    assert_eq!(values, [111, 222, 333]);
    assert_eq!(repr.message_type, MessageType::Result);
    assert_eq!(repr.rank, BROADCAST_RANK);
    assert_eq!((repr.session, repr.job, repr.packet_id, repr.slot, repr.round), (session.0, 1, 102, 2, 0));
    assert_eq!(repr.exponent, 5, "exponents are max-reduced");
    assert_eq!(repr.completed_by(), Some(1), "rank 1's contribution completed the round");
    let (_, counters) = switch.engine.session(session).unwrap();
    assert_eq!((counters.contributions, counters.results_broadcast), (3, 1));
    // A result sent again, in answer to a request, says the same.
    let request = ack(session, 0, 2, u32::MAX).with(|r| r.flags = Flags::WANT_RESULT);
    let (recipient, repr, values) = switch.result(&request);
    assert_eq!((recipient, repr.round, values), (Recipient::Worker(0), 0, vec![111, 222, 333]));
    assert_eq!(repr.completed_by(), Some(1));
}

#[test]
fn int32_sums_wrap_like_the_hardware() {
    let mut switch = Switch::new();
    let session = switch.open(2, 1, 2);
    switch.feed(&data(session, 0, 0, 0, &[i32::MAX, i32::MIN]));
    let (_, _, values) = switch.result(&data(session, 1, 0, 0, &[1, -1]));
    assert_eq!(values, [i32::MIN, i32::MAX]);
}

#[test]
fn float32_is_summed_natively() {
    let mut switch = Switch::new();
    let session = switch.open(2, 1, 2);
    let floats = |values: &[f32]| {
        let mut packet = data(session, 0, 0, 0, &[0; 2]).with(|r| r.element_type = ElementType::Float32);
        packet.payload = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        packet
    };
    switch.feed(&floats(&[0.5, -1.25]));
    let (_, repr, values) = switch.result(&floats(&[0.25, 3.0]).with(|r| r.rank = 1));
    assert_eq!(repr.element_type, ElementType::Float32);
    let values: Vec<f32> = values.iter().map(|v| f32::from_bits(*v as u32)).collect();
    assert_eq!(values, [0.75, 1.75]);
}

#[test]
fn duplicate_to_an_aggregating_round_changes_nothing_and_is_told_it_is_in() {
    let mut switch = Switch::new();
    let session = switch.open(2, 1, 2);
    switch.feed(&data(session, 0, 0, 0, &[5]));
    assert!(switch.pending(&data(session, 0, 0, 0, &[5])), "rank 0's contribution is in");
    let (_, _, values) = switch.result(&data(session, 1, 0, 0, &[1]));
    assert_eq!(values, [6], "the duplicate was not added");
    assert_eq!(switch.engine.session(session).unwrap().1.duplicates, 1);
}

#[test]
fn duplicate_to_a_complete_round_returns_the_result_to_its_sender_alone() {
    let mut switch = Switch::new();
    let session = switch.open(2, 1, 2);
    switch.feed(&data(session, 0, 0, 0, &[5]));
    switch.result(&data(session, 1, 0, 0, &[1]));
    let (recipient, repr, values) =
        switch.result(&data(session, 1, 0, 0, &[1]).with(|r| r.flags = Flags::RETRANSMISSION));
    assert_eq!(recipient, Recipient::Worker(1));
    assert_eq!(repr.rank, 1);
    assert_eq!(values, [6], "read only: the duplicate was not added again");
    // The shadow copy survives the next round too, until the worker moves past it.
    switch.feed(&data(session, 0, 0, 1, &[7]));
    let (recipient, _, values) = switch.result(&data(session, 1, 0, 0, &[1]));
    assert_eq!((recipient, values), (Recipient::Worker(1), vec![6]));
    let (_, counters) = switch.engine.session(session).unwrap();
    assert_eq!((counters.results_resent, counters.duplicates), (2, 2));
}

#[test]
fn rounds_alternate_sets_and_stale_rounds_cannot_contribute() {
    let mut switch = Switch::new();
    let session = switch.open(2, 1, 2);
    for round in 0..4u32 {
        switch.feed(&data(session, 0, 0, round, &[round as i32]));
        let (_, repr, values) = switch.result(&data(session, 1, 0, round, &[10]));
        assert_eq!((repr.round, values), (round, vec![round as i32 + 10]));
    }
    // A late copy of round 1 (an earlier job, say) reaches the set round 3 used and
    // round 5 will use: SwitchML would count it; rounds make it stale.
    assert_eq!(switch.feed(&data(session, 0, 0, 1, &[999])), Verdict::Dropped(DropReason::Stale));
    switch.feed(&data(session, 0, 0, 4, &[1]));
    let (_, _, values) = switch.result(&data(session, 1, 0, 4, &[1]));
    assert_eq!(values, [2]);
    assert_eq!(switch.feed(&data(session, 0, 0, 9, &[1])), Verdict::Dropped(DropReason::TooEarly));
}

#[test]
fn a_set_is_reused_only_when_every_worker_acknowledged_its_result() {
    let mut switch = Switch::new();
    let session = switch.open(2, 1, 2);
    let no_ack = |packet: Contribution| packet.with(|r| r.ack_round = u32::MAX);
    switch.feed(&data(session, 0, 0, 0, &[1]));
    switch.result(&data(session, 1, 0, 0, &[1]));
    switch.feed(&no_ack(data(session, 0, 0, 1, &[1])));
    switch.result(&no_ack(data(session, 1, 0, 1, &[1])));
    // Round 2 needs set 0, whose result no worker has acknowledged.
    let round_two = no_ack(data(session, 0, 0, 2, &[3]));
    assert_eq!(switch.feed(&round_two), Verdict::Dropped(DropReason::Stalled));
    assert_eq!(switch.feed(&ack(session, 0, 0, 1)), Verdict::Consumed);
    assert_eq!(switch.feed(&round_two), Verdict::Dropped(DropReason::Stalled), "rank 1 has not acknowledged");
    // Rank 1's contribution acknowledges round 1, and with it round 0, and takes a set:
    // rank 0, refused one, is told at once (a pending notice) to send its contribution again.
    let told = switch.feed(&data(session, 1, 0, 2, &[4]));
    assert!(matches!(told, Verdict::Send(Transmit { recipient: Recipient::Worker(0), .. })), "{told:?}");
    let (_, _, values) = switch.result(&round_two);
    assert_eq!(values, [7]);
    assert_eq!(switch.engine.session(session).unwrap().1.stalled, 2);
}

#[test]
fn sixteen_bit_packets_fill_the_session_s_payload_bytes_with_twice_the_elements() {
    let mut switch = Switch::new();
    // Packets of 64 4-byte elements: 256 payload bytes, which hold 128 float16 ones.
    let session = switch.open(2, 1, 2);
    let float16 = |rank: u16, count: usize, value: f32| {
        let mut packet = data(session, rank, 0, 0, &[]);
        packet.repr.element_type = ElementType::Float16;
        packet.repr.element_count = count as u16;
        packet.payload = half::f16::from_f32(value).to_le_bytes().repeat(count);
        packet
    };
    assert_eq!(switch.feed(&float16(0, 129, 1.0)), Verdict::Dropped(DropReason::TooManyElements));
    assert_eq!(switch.feed(&float16(0, 128, 1.5)), Verdict::Consumed);
    let result = match switch.feed(&float16(1, 128, 2.25)) {
        Verdict::Send(Transmit { len, .. }) => switch.out[..len].to_vec(),
        other => panic!("expected a result, got {other:?}"),
    };
    assert_eq!(result.len(), 48 + 256 + 4);
    let packet = Packet::new_checked(&result[..]).unwrap();
    assert_eq!((packet.element_type(), packet.element_count()), (ElementType::Float16, 128));
    assert_eq!(packet.payload(), half::f16::from_f32(3.75).to_le_bytes().repeat(128));
}

#[test]
fn contributions_that_disagree_with_the_round_are_rejected() {
    let mut switch = Switch::new();
    let session = switch.open(2, 1, 2);
    switch.feed(&data(session, 0, 0, 0, &[1, 1]));
    let wrong: [(Contribution, DropReason); 7] = [
        (data(session, 1, 0, 0, &[1, 1]).with(|r| r.job = 2), DropReason::Mismatch("job")),
        (data(session, 1, 0, 0, &[1, 1]).with(|r| r.packet_id = 7), DropReason::Mismatch("packet id")),
        (data(session, 1, 0, 0, &[1]), DropReason::Mismatch("element count")),
        (
            data(session, 1, 0, 0, &[1, 1]).with(|r| r.element_type = ElementType::Float32),
            DropReason::Mismatch("element type"),
        ),
        (data(session, 1, 0, 0, &[1, 1]).with(|r| r.block = 5), DropReason::Mismatch("block")),
        (
            data(session, 1, 0, 0, &[1, 1]).with(|r| {
                r.flags = Flags::SPARSE;
                r.next_block = 1;
            }),
            DropReason::Mismatch("mode"),
        ),
        (data(session, 1, 0, 0, &[0; 65]), DropReason::TooManyElements),
    ];
    for (packet, reason) in wrong {
        assert_eq!(switch.feed(&packet), Verdict::Dropped(reason));
    }
    let (_, _, values) = switch.result(&data(session, 1, 0, 0, &[2, 2]));
    assert_eq!(values, [3, 3], "no rejected packet changed the sum");
    assert_eq!(switch.engine.session(session).unwrap().1.rejected, 7);
}

#[test]
fn out_of_range_and_misdirected_packets_are_dropped() {
    let mut switch = Switch::new();
    let session = switch.open(2, 4, 2);
    let cases = [
        (data(session, 2, 0, 0, &[1]), DropReason::RankOutOfRange),
        (data(session, 0, 4, 0, &[1]), DropReason::SlotOutOfRange),
        (
            data(session, 0, 0, 0, &[1]).with(|r| r.message_type = MessageType::Result),
            DropReason::NotForSwitch,
        ),
        (data(SessionId(session.0 ^ 0x10000), 0, 0, 0, &[1]), DropReason::UnknownSession),
    ];
    for (packet, reason) in cases {
        assert_eq!(switch.feed(&packet), Verdict::Dropped(reason));
    }
    let malformed = switch.engine.handle_datagram(switch.now, &[1, 2, 3], &mut switch.out);
    assert!(matches!(malformed, Verdict::Dropped(DropReason::Malformed(_))));
    let counters = switch.engine.counters();
    assert_eq!((counters.malformed, counters.unknown_session), (1, 1));
    let mut short = [0u8; 100];
    let verdict =
        switch.engine.handle_datagram(switch.now, &data(session, 0, 0, 0, &[1]).bytes(), &mut short);
    assert_eq!(verdict, Verdict::Dropped(DropReason::OutputTooSmall));
}

#[test]
fn sessions_are_isolated() {
    let mut switch = Switch::new();
    let a = switch.open(2, 1, 2);
    let b = switch.open(2, 1, 2);
    assert_ne!(a, b);
    switch.feed(&data(a, 0, 0, 0, &[1]));
    switch.feed(&data(b, 0, 0, 0, &[1000]));
    let (_, repr_b, values_b) = switch.result(&data(b, 1, 0, 0, &[2000]));
    let (_, repr_a, values_a) = switch.result(&data(a, 1, 0, 0, &[2]));
    assert_eq!((repr_a.session, values_a), (a.0, vec![3]));
    assert_eq!((repr_b.session, values_b), (b.0, vec![3000]));
    // A closed session's id is not reused: its stale packets cannot reach its successor.
    switch.engine.close_session(a).unwrap();
    let c = switch.open(2, 1, 2);
    assert_ne!(a, c);
    assert_eq!(switch.feed(&data(a, 0, 0, 1, &[1])), Verdict::Dropped(DropReason::UnknownSession));
}

#[test]
fn more_than_64_workers_aggregate() {
    let mut switch = Switch::new();
    let session = switch.open(100, 1, 2);
    for rank in 0..99 {
        assert_eq!(switch.feed(&data(session, rank, 0, 0, &[rank as i32, 1])), Verdict::Consumed);
    }
    let (_, _, values) = switch.result(&data(session, 99, 0, 0, &[99, 1]));
    assert_eq!(values, [(0..100).sum::<i32>(), 100]);
}

#[test]
fn limits_reject_sessions_before_allocating() {
    let limits = EngineLimits {
        max_sessions: 2,
        max_workers: 8,
        max_slots: 16,
        max_depth: 8,
        max_packet_elements: 256,
        max_bytes: 100_000,
        max_session_bytes: 60_000,
        session_idle_timeout: Duration::from_secs(1),
    };
    let mut switch = Switch::with_limits(limits);
    let now = switch.now;
    let spec = SessionSpec { workers: 4, slots: 8, packet_elements: 64, depth: 2 };
    let open = |engine: &mut Engine, spec| engine.open_session(now, spec, TOKEN);
    assert_eq!(
        open(&mut switch.engine, SessionSpec { workers: 9, ..spec }),
        Err(SessionError::Workers { requested: 9, max: 8 })
    );
    assert_eq!(
        open(&mut switch.engine, SessionSpec { workers: 0, ..spec }),
        Err(SessionError::Workers { requested: 0, max: 8 })
    );
    assert_eq!(
        open(&mut switch.engine, SessionSpec { slots: 17, ..spec }),
        Err(SessionError::Slots { requested: 17, max: 16 })
    );
    assert_eq!(
        open(&mut switch.engine, SessionSpec { depth: 3, ..spec }),
        Err(SessionError::Depth { requested: 3, max: 8 })
    );
    assert_eq!(
        open(&mut switch.engine, SessionSpec { depth: 16, ..spec }),
        Err(SessionError::Depth { requested: 16, max: 8 })
    );
    assert_eq!(
        open(&mut switch.engine, SessionSpec { packet_elements: 257, ..spec }),
        Err(SessionError::PacketElements { requested: 257, max: 256 })
    );
    let big = SessionSpec { workers: 8, slots: 16, packet_elements: 256, depth: 8 };
    assert_eq!(
        open(&mut switch.engine, big),
        Err(SessionError::SessionMemory { needed: big.state_bytes(), max: 60_000 })
    );
    // Each fits one session's share, but two overrun the engine's budget.
    let medium = SessionSpec { workers: 8, slots: 16, packet_elements: 96, depth: 4 };
    assert!((50_001..=60_000).contains(&medium.state_bytes()), "{}", medium.state_bytes());
    let first = open(&mut switch.engine, medium).unwrap();
    assert_eq!(
        open(&mut switch.engine, medium),
        Err(SessionError::Memory { needed: medium.state_bytes(), available: 100_000 - medium.state_bytes() })
    );
    switch.engine.close_session(first).unwrap();
    assert_eq!(switch.engine.bytes_in_use(), 0);
    let first = open(&mut switch.engine, spec).unwrap();
    open(&mut switch.engine, spec).unwrap();
    assert_eq!(open(&mut switch.engine, spec), Err(SessionError::TooManySessions { open: 2, max: 2 }));
    assert_eq!(switch.engine.bytes_in_use(), 2 * spec.state_bytes());
    switch.engine.close_session(first).unwrap();
    assert_eq!(switch.engine.close_session(first), Err(SessionError::Unknown(first.0)));
    open(&mut switch.engine, spec).unwrap();
}

#[test]
fn idle_sessions_expire_and_free_their_memory() {
    let mut switch = Switch::with_limits(EngineLimits {
        session_idle_timeout: Duration::from_secs(5),
        ..EngineLimits::default()
    });
    let quiet = switch.open(2, 1, 2);
    switch.now += Duration::from_secs(3);
    let busy = switch.open(2, 1, 2);
    assert_eq!(switch.engine.poll_timeout(), Some(switch.now + Duration::from_secs(2)));
    switch.now += Duration::from_secs(2);
    switch.feed(&data(busy, 0, 0, 0, &[1]));
    assert_eq!(switch.engine.handle_timeout(switch.now), vec![quiet]);
    assert_eq!(switch.engine.sessions().collect::<Vec<_>>(), vec![busy]);
    assert_eq!(switch.engine.bytes_in_use(), switch.engine.session(busy).unwrap().0.state_bytes());
    assert_eq!(switch.engine.counters().sessions_expired, 1);
}

#[test]
fn activity_seen_by_another_engine_keeps_a_session_from_expiring() {
    let limits = EngineLimits { session_idle_timeout: Duration::from_secs(5), ..EngineLimits::default() };
    let mut switch = Switch::with_limits(limits);
    let session = switch.open(2, 2, 2);
    let elsewhere = switch.now + Duration::from_secs(4);
    switch.engine.note_activity(session, elsewhere);
    // Older activity changes nothing: the latest counts.
    switch.engine.note_activity(session, switch.now);
    assert_eq!(switch.engine.last_activity(session), Some(elsewhere));
    assert_eq!(switch.engine.handle_timeout(switch.now + Duration::from_secs(8)), vec![]);
    assert_eq!(switch.engine.handle_timeout(elsewhere + Duration::from_secs(5)), vec![session]);
    assert_eq!(switch.engine.last_activity(session), None);
}

#[test]
fn a_session_opened_under_another_engine_s_id_takes_that_id_s_packets() {
    let mut first = Switch::new();
    let mut second = Switch::new();
    let earlier = first.open(1, 1, 2);
    first.engine.close_session(earlier).unwrap();
    let id = first.open(2, 2, 2);
    let spec = first.engine.session(id).unwrap().0;
    assert_eq!(second.engine.open_session_as(second.now, id, spec, TOKEN), Ok(id));
    let taken = second.engine.open_session_as(second.now, id, spec, TOKEN).unwrap_err();
    assert_eq!(taken, SessionError::Taken { id: id.0, open: id.0 });
    assert_eq!(
        taken.to_string(),
        format!("session id {0:#010x} is taken: session {0:#010x} is open at its index", id.0)
    );
    // Each engine sums the slots it is sent, under the one id.
    second.feed(&data(id, 0, 1, 0, &[7, -2]));
    let (_, repr, values) = second.result(&data(id, 1, 1, 0, &[1, 1]));
    assert_eq!((repr.session, repr.slot, values), (id.0, 1, vec![8, -1]));
    // Its own next session does not collide with the id it was given.
    let own = second.open(1, 1, 2);
    assert_ne!(own, id);
    assert_eq!(
        second.engine.bytes_in_use(),
        spec.state_bytes() + second.engine.session(own).unwrap().0.state_bytes()
    );
}

#[test]
fn a_sparse_stream_expects_only_the_workers_holding_its_next_block() {
    let mut switch = Switch::new();
    let session = switch.open(3, 1, 4);
    // Start round: every worker reports, with data only where its block 0 is non-zero.
    assert_eq!(switch.feed(&data(session, 0, 0, 0, &[5]).sparse(0, 8)), Verdict::Consumed);
    assert_eq!(switch.feed(&data(session, 1, 0, 0, &[]).sparse(0, 4)), Verdict::Consumed);
    let (_, repr, values) = switch.result(&data(session, 2, 0, 0, &[]).sparse(0, END_OF_STREAM));
    assert_eq!((repr.block, repr.next_block, values), (0, 4, vec![5]));
    assert!(repr.flags.contains(Flags::SPARSE));

    // Round 1 aggregates block 4: only rank 1 named it.
    assert_eq!(
        switch.feed(&data(session, 0, 0, 1, &[1]).sparse(4, 8)),
        Verdict::Dropped(DropReason::NotExpected)
    );
    assert_eq!(
        switch.feed(&data(session, 1, 0, 1, &[1]).sparse(5, 8)),
        Verdict::Dropped(DropReason::Mismatch("block"))
    );
    let (_, repr, values) = switch.result(&data(session, 1, 0, 1, &[7]).sparse(4, 8));
    assert_eq!((repr.round, repr.block, repr.next_block, values), (1, 4, 8, vec![7]));

    // Round 2 aggregates block 8, which ranks 0 and 1 both hold.
    assert_eq!(switch.feed(&data(session, 0, 0, 2, &[2]).sparse(8, END_OF_STREAM)), Verdict::Consumed);
    let (_, repr, values) = switch.result(&data(session, 1, 0, 2, &[3]).sparse(8, END_OF_STREAM));
    assert_eq!((repr.block, repr.next_block, values), (8, END_OF_STREAM, vec![5]));

    // The stream ended: round 3 is a start round again, open to every worker.
    for rank in 0..2 {
        switch.feed(&data(session, rank, 0, 3, &[1]).sparse(0, END_OF_STREAM).with(|r| r.job = 2));
    }
    let (_, repr, values) =
        switch.result(&data(session, 2, 0, 3, &[1]).sparse(0, END_OF_STREAM).with(|r| r.job = 2));
    assert_eq!((repr.job, values), (2, vec![3]));
}

#[test]
fn an_empty_dense_round_agrees_an_exponent() {
    let mut switch = Switch::new();
    let session = switch.open(2, 1, 2);
    switch.feed(&data(session, 0, 0, 0, &[]).with(|r| r.exponent = -7));
    let (_, repr, values) = switch.result(&data(session, 1, 0, 0, &[]).with(|r| r.exponent = 12));
    assert_eq!((repr.exponent, repr.element_count), (12, 0));
    assert!(values.is_empty());
}

#[test]
fn a_round_where_every_worker_is_zero_returns_an_empty_result() {
    let mut switch = Switch::new();
    let session = switch.open(2, 1, 2);
    switch.feed(&data(session, 0, 0, 0, &[]).sparse(0, END_OF_STREAM));
    let (_, repr, values) = switch.result(&data(session, 1, 0, 0, &[]).sparse(0, END_OF_STREAM));
    assert_eq!((repr.element_count, repr.next_block), (0, END_OF_STREAM));
    assert!(values.is_empty());
}

#[test]
fn workers_that_did_not_contribute_can_ask_for_a_result() {
    let mut switch = Switch::new();
    let session = switch.open(2, 1, 4);
    switch.feed(&data(session, 0, 0, 0, &[1]).sparse(0, 4));
    switch.result(&data(session, 1, 0, 0, &[2]).sparse(0, END_OF_STREAM));
    let want = |round: u32| {
        ack(session, 1, 0, round.wrapping_sub(1)).with(|r| r.flags = Flags::WANT_RESULT | Flags::SPARSE)
    };
    // Round 1 (block 4, rank 0 alone) has not completed, and rank 1 is not in it.
    assert!(!switch.pending(&want(1)));
    let (recipient, _, values) = switch.result(&data(session, 0, 0, 1, &[9]).sparse(4, END_OF_STREAM));
    assert_eq!((recipient, values), (Recipient::All, vec![9]));
    // Rank 1 contributed nothing to round 1 but may fetch it again; it may not claim it
    // as a duplicate contribution.
    let (recipient, repr, values) = switch.result(&want(1));
    assert_eq!((recipient, repr.round, values), (Recipient::Worker(1), 1, vec![9]));
    let claim = data(session, 1, 0, 1, &[9]).sparse(4, END_OF_STREAM);
    assert_eq!(switch.feed(&claim), Verdict::Dropped(DropReason::NotExpected));
    assert_eq!(switch.feed(&want(7)), Verdict::Dropped(DropReason::TooEarly));
}

#[test]
fn a_request_for_an_aggregating_round_says_whose_contribution_is_in() {
    let mut switch = Switch::new();
    let session = switch.open(3, 2, 2);
    let want =
        |rank: u16, slot: u16| ack(session, rank, slot, u32::MAX).with(|r| r.flags = Flags::WANT_RESULT);
    // Nothing has arrived for slot 1; rank 0's contribution to slot 0 is in.
    assert!(!switch.pending(&want(0, 1)));
    switch.feed(&data(session, 0, 0, 0, &[5]));
    assert!(switch.pending(&want(0, 0)));
    assert!(!switch.pending(&want(1, 0)), "rank 1's contribution is not");
    let counters = switch.engine.session(session).unwrap().1;
    assert_eq!((counters.not_ready, counters.duplicates, counters.contributions), (3, 0, 1));
    // Once complete, the request is answered with the result.
    switch.feed(&data(session, 1, 0, 0, &[1]));
    switch.result(&data(session, 2, 0, 0, &[1]));
    let (recipient, repr, values) = switch.result(&want(0, 0));
    assert_eq!((recipient, repr.message_type, values), (Recipient::Worker(0), MessageType::Result, vec![7]));
}

#[test]
fn a_probe_is_answered_with_each_slots_open_round_and_where_the_prober_contributed() {
    let mut switch = Switch::new();
    let session = switch.open(2, 70, 2);
    // Slot 1 completes round 0 (a result rank 0 may have lost); rank 0 is in slot 2's
    // open round, rank 1 alone in slot 3's.
    switch.feed(&data(session, 0, 1, 0, &[1]));
    switch.result(&data(session, 1, 1, 0, &[2]));
    switch.feed(&data(session, 0, 2, 0, &[1]));
    switch.feed(&data(session, 1, 3, 0, &[1]));
    let probe = |slot: u16| {
        ack(session, 0, slot, u32::MAX).with(|r| {
            r.message_type = MessageType::Probe;
            r.packet_id = 0xABCD;
        })
    };
    let (recipient, report, open_rounds) = switch.result(&probe(1));
    assert_eq!(recipient, Recipient::Worker(0));
    assert_eq!(
        (report.message_type, report.rank, report.slot, report.job, report.packet_id),
        (MessageType::Progress, 0, 1, 1, 0xABCD),
        "echoes what the prober needs to read it"
    );
    assert_eq!(open_rounds.len(), 64, "64 slots from the probed one");
    assert_eq!(open_rounds[..4], [1, 0, 0, 0]);
    assert_eq!(report.contributions(), 0b10, "slot 2 alone holds rank 0's contribution");
    // Near the session's end the report stops at its last slot.
    let (_, report, open_rounds) = switch.result(&probe(66));
    assert_eq!((open_rounds.len(), report.contributions()), (4, 0));
    let counters = switch.engine.session(session).unwrap().1;
    assert_eq!((counters.rejected, counters.not_ready, counters.results_resent), (0, 0, 0));
}

#[test]
fn a_progress_report_fits_the_sessions_packets() {
    // Packets of 8 elements: a report covers 8 slots, so that it fits any buffer one of
    // the session's packets fits.
    let mut switch = Switch::new();
    let spec = SessionSpec { workers: 2, slots: 16, packet_elements: 8, depth: 2 };
    let session = switch.engine.open_session(switch.now, spec, TOKEN).unwrap();
    let probe = ack(session, 1, 0, u32::MAX).with(|r| r.message_type = MessageType::Probe);
    let mut out = vec![0; netagg_wire::packet::datagram_len(8)];
    let verdict = switch.engine.handle_datagram(switch.now, &probe.bytes(), &mut out);
    let Verdict::Send(Transmit { len, .. }) = verdict else { panic!("{verdict:?}") };
    assert_eq!(len, out.len());
    assert_eq!(Packet::new_checked(&out[..len]).unwrap().element_count(), 8);
}

#[test]
fn packets_without_the_token_or_from_another_rank_s_address_change_nothing() {
    let mut switch = Switch::new();
    let session = switch.open(2, 1, 2);
    let other = switch
        .engine
        .open_session(switch.now, SessionSpec { workers: 2, slots: 1, packet_elements: 64, depth: 2 }, !TOKEN)
        .unwrap();
    assert_eq!(switch.feed(&data(session, 0, 0, 0, &[1, 2])), Verdict::Consumed);
    // Another session's token, a guessed one, and the right one from the wrong address.
    let forged = data(session, 1, 0, 0, &[1000, 1000]);
    let wrong_token = forged.clone().with(|r| r.token = !TOKEN);
    assert_eq!(switch.feed(&wrong_token), Verdict::Dropped(DropReason::WrongToken));
    assert_eq!(switch.feed(&forged.clone().with(|r| r.token = 1)), Verdict::Dropped(DropReason::WrongToken));
    assert_eq!(switch.feed(&data(other, 1, 0, 0, &[5, 5])), Verdict::Dropped(DropReason::WrongToken));
    let (now, mut out) = (switch.now, vec![0; MAX_DATAGRAM_LEN]);
    let mut asked = Vec::new();
    let verdict = switch.engine.handle_datagram_from(now, &forged.bytes(), &mut out, |id, rank, slot| {
        asked.push((id, rank, slot));
        false
    });
    assert_eq!(verdict, Verdict::Dropped(DropReason::WrongSource));
    assert_eq!(asked, [(session, 1, 0)]);
    assert_eq!(switch.engine.session(session).unwrap().1.forged, 3);
    assert_eq!(switch.engine.session(session).unwrap().1.contributions, 1);
    // The genuine packet still completes the round with the genuine sums.
    let (_, repr, values) = switch.result(&data(session, 1, 0, 0, &[10, 20]));
    assert_eq!(values, [11, 22]);
    assert_eq!(repr.token, TOKEN, "results carry the token back");
    assert_eq!(switch.engine.session(other).unwrap().1.contributions, 0);
}

/// Feeds rank 0's first sendings, numbered `numbers`, to rounds 0, 1, … of slot 0, the
/// other ranks of the session's `workers` coming first in each round so that rank 0's
/// completes it.
fn numbered_rounds(switch: &mut Switch, session: SessionId, workers: u16, numbers: &[u8]) {
    for (round, &number) in (0..).zip(numbers) {
        for rank in 1..workers {
            switch.feed(&data(session, rank, 0, round, &[1]));
        }
        switch.result(&data(session, 0, 0, round, &[1]).with(|r| r.sequence = number));
    }
}

/// The slot and number of the LOST notice to rank 0 that `poll_notice` gives.
fn polled_lost_notice(switch: &mut Switch) -> Option<(u16, u8)> {
    let transmit = switch.engine.poll_notice(&mut switch.out)?;
    assert_eq!(transmit.recipient, Recipient::Worker(0));
    let notice = PacketRepr::parse(&Packet::new_checked(&switch.out[..transmit.len]).unwrap());
    assert_eq!((notice.message_type, notice.flags), (MessageType::Pending, Flags::LOST));
    Some((notice.slot, notice.sequence))
}

#[test]
fn a_lost_notice_behind_a_drop_for_a_departed_rank_still_orphans_the_session() {
    let mut switch = Switch::new();
    let session = switch.open(2, 1, 4);
    // Rank 0 numbers rounds 0-2 as 1, 3 and 4: number 2 is missing. Rank 1 then leaves
    // with every round it took part in complete.
    numbered_rounds(&mut switch, session, 2, &[1, 3, 4]);
    assert_eq!(switch.engine.depart(session, 1), Ok(Departure::Lingers));
    // Number 5 shows number 2 lost, on a contribution to round 3, which needs rank 1: the
    // drop's reason reaches the caller and orphans the session, and the notice waits.
    let verdict = switch.feed(&data(session, 0, 0, 3, &[1]).with(|r| r.sequence = 5));
    assert_eq!(verdict, Verdict::Dropped(DropReason::Departed(1)));
    assert_eq!(switch.engine.take_orphaned(), [(session, 1)]);
    assert_eq!(polled_lost_notice(&mut switch), Some((0, 2)));
    assert_eq!(polled_lost_notice(&mut switch), None);
}

#[test]
fn a_lost_notice_that_its_full_queue_cannot_take_is_counted() {
    let mut switch = Switch::new();
    // One rank of one thread: every contribution completes its round, so each notice
    // queues behind a result, and the queue holds one.
    let session = switch.open(1, 1, 2);
    // Number 2 is lost, then, past the spacing of notices, number 41: nobody polls between.
    let numbers: Vec<u8> = (1..=44).filter(|&n| n != 2 && n != 41).collect();
    numbered_rounds(&mut switch, session, 1, &numbers);
    let counters = switch.engine.session(session).unwrap().1;
    assert_eq!((counters.lost_notices, counters.lost_notices_dropped), (0, 1));
    assert_eq!(polled_lost_notice(&mut switch), Some((0, 2)), "the first kept its place");
    assert_eq!(polled_lost_notice(&mut switch), None);
    let counters = switch.engine.session(session).unwrap().1;
    assert_eq!((counters.lost_notices, counters.lost_notices_dropped), (1, 1));
}
