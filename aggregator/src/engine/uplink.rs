//! A lower switch's session in an aggregation tree: its group of workers (a rack) sums
//! at this switch, and takes part in an upper switch's session as one member.
//!
//! A round whose group contributions are all in does not complete here: the group's
//! partial sum goes up as this switch's data packet for the same slot and round of the
//! upper session ([`Recipient::Upstream`]), and the round stays open for the group's
//! workers, who are told their contribution is in if they ask. When the upper switch's
//! result for that round arrives, it is this session's result: it takes the round's set,
//! and goes to every worker of the group, who acknowledge it as any result. So each slot
//! streams, round by round, and the upper session's rounds are this session's.
//!
//! Sparse streams: the partial sum names the group's lowest next block, and the upper
//! switch's result names the block every group goes on at. A group with no stream at that
//! block is silent at the upper switch, as a worker is; its workers expect nothing, and
//! the upper switch's result completes the round here.
//!
//! Towards the upper switch this session is a worker, and recovers its losses as one
//! (`docs/protocol.md` §3): a round sent up and unanswered is asked after (header only,
//! as a silent round's result is), and the upper switch answers with its result, or with
//! a pending notice saying whether it holds the partial sum, which is sent again only if
//! it does not: a round waiting for a slower rack costs its slot a request per timeout,
//! not a packet of data. When a round counts as unanswered is [`waits`]'s: overtaken by a
//! later round's answer, or silent for a timeout after the upper switch's latest answer,
//! so that rounds only queued at a slower uplink are not asked after. A silent stretch is
//! acknowledged every `depth / 2` results. It does not probe: a rack's switch has no job
//! whose tail it could lose, and each slot's timer finds its own loss. Towards its
//! workers nothing changes: a worker's resend of a round this switch holds the result of
//! is answered from it.

use std::time::{Duration, Instant};

use netagg_wire::packet::{datagram_len, ELEMENT_LEN};
use netagg_wire::{ElementType, Flags, MessageType, PacketRepr};

use super::session::{Session, SessionError, SessionId};
use super::{DropReason, Engine, Recipient, Transmit, Verdict};
use crate::sum16;
use waits::{WaitKind, Waits};

mod waits;

/// The rank a shell's source check is asked about for a packet from the upper switch.
pub const UPSTREAM_RANK: u16 = u16::MAX;

/// A lower switch's place in an upper switch's session, from the upper switch's accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Upstream {
    /// The upper session's id and token.
    pub session: u32,
    pub token: u64,
    /// This switch's rank in the upper session.
    pub rank: u16,
    /// The rank in the whole tree of this session's worker 0: a group's workers register
    /// and send their ranks in the whole tree (so that block floating point scales by the
    /// whole tree's worker count), and the session numbers them from 0.
    pub first_rank: u16,
    /// How long a round sent up waits at least for the upper switch's answer before it is
    /// asked after (the measured round trips set it above that); it doubles on every
    /// timeout of a slot, up to the maximum.
    pub retransmit_timeout: Duration,
    pub max_retransmit_timeout: Duration,
}

counters! {
    /// What a lower switch's session exchanged with its upper switch.
    pub struct UplinkCounters {
        /// Partial sums sent up, first sendings.
        pub sent_up: u64,
        /// Partial sums sent up again after a timeout or a pending notice that lacked them.
        pub resent_up: u64,
        /// Requests for a round's result (header only), and plain acknowledgements.
        pub requests: u64,
        pub acks: u64,
        /// Bytes of every datagram sent up, headers included.
        pub bytes_up: u64,
        /// Results of the upper switch taken, each sent down to every worker of the group.
        pub results_down: u64,
        /// Bytes of those results as they arrived, headers included.
        pub bytes_down: u64,
        /// Results, notices and reports from the upper switch that changed nothing.
        pub ignored: u64,
        /// Rounds asked after because a round sent up after them was answered first
        /// (each a request).
        pub overtaken: u64,
        /// Rounds asked after because their wait timed out (each a request).
        pub timed_out: u64,
    }
}

/// A lower switch's session's state towards its upper switch.
#[derive(Debug)]
pub(super) struct Uplink {
    upstream: Upstream,
    /// Per slot: its wait for the upper switch's answer.
    waits: Waits,
    /// Per slot: the latest `ack round` sent up.
    acked: Box<[u32]>,
    /// Slots that owe the upper switch a plain acknowledgement.
    acks_due: Vec<u16>,
    counters: UplinkCounters,
}

/// Whether a packet of this type comes from a switch, not a worker.
pub(super) fn is_from_switch(message_type: MessageType) -> bool {
    matches!(message_type, MessageType::Result | MessageType::Pending | MessageType::Progress)
}

impl Engine {
    /// Makes session `id` a lower switch's: its workers' ranks count from
    /// `upstream.first_rank`, and its rounds complete at the upper switch. Call it right
    /// after opening the session, before its packets come.
    pub fn attach_upstream(&mut self, id: SessionId, upstream: Upstream) -> Result<(), SessionError> {
        let session = self.session_mut(id).ok_or(SessionError::Unknown(id.0))?;
        if upstream.first_rank.checked_add(session.spec.workers).is_none() {
            return Err(SessionError::Rank { rank: upstream.first_rank, workers: session.spec.workers });
        }
        let slots = session.spec.slots as usize;
        let attached = session.uplink.replace(Box::new(Uplink {
            upstream,
            waits: Waits::new(slots, upstream.retransmit_timeout, upstream.max_retransmit_timeout),
            acked: vec![u32::MAX; slots].into_boxed_slice(),
            acks_due: Vec::new(),
            counters: UplinkCounters::default(),
        }));
        session.rank_base = upstream.first_rank;
        self.uplinked += attached.is_none() as usize;
        Ok(())
    }

    /// What session `id` exchanged with its upper switch, if it has one.
    pub fn uplink_counters(&self, id: SessionId) -> Option<UplinkCounters> {
        let session = self.sessions.get(id.index())?.as_ref().filter(|s| s.id == id)?;
        Some(session.uplink.as_ref()?.counters)
    }

    /// What every session, open or closed, exchanged with its upper switch.
    pub fn uplink_totals(&self) -> UplinkCounters {
        let open = self.sessions.iter().flatten().filter_map(|s| Some(s.uplink.as_ref()?.counters));
        open.fold(self.closed_uplinks, |total, session| total + session)
    }

    /// The next packet for an upper switch that a timer or an acknowledgement calls for,
    /// written into `out` (as [`Engine::handle_datagram`]'s results are); call until
    /// `None` after each batch of datagrams and whenever time has passed.
    pub fn poll_upstream(&mut self, now: Instant, out: &mut [u8]) -> Option<Transmit> {
        if self.uplinked == 0 {
            return None;
        }
        self.sessions.iter_mut().flatten().find_map(|session| session.poll_upstream(now, out))
    }

    /// When [`Engine::poll_upstream`] may next have a timer's packet to send: not
    /// before; polled then, it may find the timer was stopped, and this moves on.
    pub fn upstream_timeout(&self) -> Option<Instant> {
        if self.uplinked == 0 {
            return None;
        }
        self.sessions.iter().flatten().filter_map(|session| session.uplink.as_ref()?.waits.next_due()).min()
    }

    /// A result, pending notice or progress report: from the upper switch of the session
    /// that holds its upper session's id.
    pub(super) fn handle_from_upstream(
        &mut self,
        now: Instant,
        repr: &PacketRepr,
        payload: &[u8],
        out: &mut [u8],
        from_its_rank: impl FnOnce(SessionId, u16, u16) -> bool,
    ) -> Verdict {
        let session = self
            .sessions
            .iter_mut()
            .flatten()
            .find(|s| s.uplink.as_ref().is_some_and(|uplink| uplink.upstream.session == repr.session));
        match session {
            Some(session) => session.handle_from_upstream(now, repr, payload, out, from_its_rank),
            None => {
                self.counters.unknown_session += 1;
                Verdict::Dropped(DropReason::UnknownSession)
            }
        }
    }
}

impl Session {
    fn handle_from_upstream(
        &mut self,
        now: Instant,
        repr: &PacketRepr,
        payload: &[u8],
        out: &mut [u8],
        from_its_rank: impl FnOnce(SessionId, u16, u16) -> bool,
    ) -> Verdict {
        self.counters.packets_in += 1;
        let Some(uplink) = self.uplink.as_ref() else { return Verdict::Dropped(DropReason::UnknownSession) };
        if repr.token != uplink.upstream.token {
            self.counters.forged += 1;
            return Verdict::Dropped(DropReason::WrongToken);
        }
        if out.len() < datagram_len(self.spec.packet_elements as usize) {
            return Verdict::Dropped(DropReason::OutputTooSmall);
        }
        if repr.slot >= self.spec.slots {
            return self.reject(DropReason::SlotOutOfRange);
        }
        if !from_its_rank(self.id, UPSTREAM_RANK, repr.slot) {
            self.counters.forged += 1;
            return Verdict::Dropped(DropReason::WrongSource);
        }
        self.last_activity = now;
        let open_round = self.slots[repr.slot as usize].open_round;
        let forwarded = self.forwarded(repr.slot);
        match repr.message_type {
            MessageType::Result if repr.round == open_round => self.take_result(now, repr, payload, out),
            MessageType::Pending if repr.round == open_round && forwarded.is_some() => {
                let uplink = self.uplink_mut();
                uplink.waits.noticed(repr.slot, now);
                if repr.flags.contains(Flags::CONTRIBUTED) {
                    // The upper switch waits for another group: nothing to send.
                    uplink.waits.held(repr.slot, now);
                    uplink.counters.ignored += 1;
                    return Verdict::Consumed;
                }
                self.forward(now, repr.slot, true, out)
            }
            _ => {
                self.uplink_mut().counters.ignored += 1;
                Verdict::Consumed
            }
        }
    }

    fn uplink_mut(&mut self) -> &mut Uplink {
        // Only sessions with an uplink get here.
        self.uplink.as_mut().expect("a lower switch's session has an uplink")
    }

    /// The set of `slot`'s open round if every contribution it expects is in: the round
    /// went up, and waits for the upper switch.
    fn forwarded(&self, slot: u16) -> Option<usize> {
        let state = &self.slots[slot as usize];
        let index = self.set_index(slot, state.open_set? as u32);
        let complete =
            self.sets[index].contributions as usize >= state.expected_contributions(self.spec.workers);
        complete.then_some(index)
    }

    /// Sends `slot`'s open round, complete in the group, up to the upper switch, and
    /// starts its wait.
    pub(super) fn forward(&mut self, now: Instant, slot: u16, again: bool, out: &mut [u8]) -> Verdict {
        let Some(index) = self.forwarded(slot) else { return Verdict::Consumed };
        let state = &self.slots[slot as usize];
        let set = &self.sets[index];
        let uplink = self.uplink.as_deref().expect("a lower switch's session has an uplink");
        let mut flags = if set.sparse { Flags::SPARSE } else { Flags::NONE };
        if again {
            flags = flags | Flags::RETRANSMISSION;
        }
        let ack_round = state.open_round.wrapping_sub(1);
        let repr = PacketRepr {
            flags,
            job: set.job,
            packet_id: set.packet_id,
            rank: uplink.upstream.rank,
            slot,
            exponent: set.exponent,
            round: set.round,
            block: set.block,
            next_block: if set.sparse { state.lowest_next_block() } else { set.next_block },
            ack_round,
            ..PacketRepr::new(
                MessageType::Data,
                set.element_type,
                uplink.upstream.session,
                uplink.upstream.token,
                set.element_count,
            )
        };
        let Ok(mut packet) = repr.emit(out) else { return Verdict::Dropped(DropReason::OutputTooSmall) };
        let sum = &self.payloads[index * self.payload_len..][..set.element_count as usize * ELEMENT_LEN];
        // 16-bit sums go up rounded to their type, as a worker's data would: one rounding
        // more per level of the tree.
        sum16::narrow(set.element_type, packet.payload_mut(), sum);
        let len = packet.seal();
        let uplink = self.uplink_mut();
        uplink.acked[slot as usize] = ack_round;
        if again {
            uplink.counters.resent_up += 1;
            uplink.waits.sent_again(slot, now);
        } else {
            uplink.counters.sent_up += 1;
            uplink.waits.sent_first(slot, now);
        }
        uplink.counters.bytes_up += len as u64;
        Verdict::Send(Transmit { session: self.id, recipient: Recipient::Upstream, len })
    }

    /// The upper switch's result of `slot`'s open round: the round's result here, to
    /// every worker of the group.
    fn take_result(&mut self, now: Instant, repr: &PacketRepr, payload: &[u8], out: &mut [u8]) -> Verdict {
        if repr.element_count > repr.element_type.per_packet(self.spec.packet_elements) {
            return self.reject(DropReason::TooManyElements);
        }
        let slot = repr.slot as usize;
        let forwarded = self.forwarded(repr.slot);
        let own_set = match forwarded {
            Some(index) => {
                if let Err(field) = self.sets[index].agrees_with(repr) {
                    return self.reject(DropReason::Mismatch(field));
                }
                let local = self.sets[index].completed_by;
                let ours = repr.completed_by() == Some(self.uplink_mut().upstream.rank);
                // Only a round this group completed measures its workers' paths.
                self.sets[index].completed_by = local.filter(|_| ours);
                self.slots[slot].open_set.expect("a forwarded round has a set")
            }
            None if self.slots[slot].expects_no_one()
                && self.slots[slot].continuation == Some(repr.block) =>
            {
                let free = self.free_sets(repr.slot);
                if free == 0 {
                    // Asked for again once the group's workers acknowledge.
                    self.counters.stalled += 1;
                    return Verdict::Dropped(DropReason::Stalled);
                }
                let own_set = free.trailing_zeros() as u8;
                let index = self.set_index(repr.slot, own_set as u32);
                self.sets[index].start(repr);
                own_set
            }
            None => {
                return self.reject(DropReason::Mismatch("round (the group's contributions are not all in)"))
            }
        };
        let index = self.set_index(repr.slot, own_set as u32);
        let set = &mut self.sets[index];
        set.element_count = repr.element_count;
        set.exponent = repr.exponent;
        let sum = &mut self.payloads[index * self.payload_len..][..repr.element_count as usize * ELEMENT_LEN];
        sum16::widen(set.element_type, sum, payload);
        set.unacked.fill(self.spec.workers);
        let state = &mut self.slots[slot];
        state.open_set = None;
        state.retained |= 1 << own_set;
        state.open_round = repr.round.wrapping_add(1);
        if set.sparse {
            state.continue_at(repr.next_block);
            set.next_block = repr.next_block;
        } else {
            state.continuation = None;
        }
        let silent_next = state.expects_no_one();
        let half_depth = u32::from(self.spec.depth / 2);
        let uplink = self.uplink_mut();
        uplink.counters.results_down += 1;
        uplink.counters.bytes_down += repr.buffer_len() as u64;
        uplink.waits.answered(repr.slot, now);
        if silent_next {
            uplink.waits.held(repr.slot, now);
        }
        // A group silent at the upper switch acknowledges nothing with data: as a silent
        // worker, it acknowledges every `depth / 2` results it took.
        let owes_ack = forwarded.is_none() && repr.round.wrapping_sub(uplink.acked[slot]) >= half_depth;
        if owes_ack && !uplink.acks_due.contains(&repr.slot) {
            uplink.acks_due.push(repr.slot);
        }
        self.counters.results_broadcast += 1;
        self.emit_result(index, repr.slot, Recipient::All, out)
    }

    /// The next acknowledgement owed, or the next slot whose wait has run out: its
    /// round's result asked for (the round sent up, or one this group is silent in).
    fn poll_upstream(&mut self, now: Instant, out: &mut [u8]) -> Option<Transmit> {
        let uplink = self.uplink.as_mut()?;
        if let Some(slot) = uplink.acks_due.pop() {
            return self.ask_upstream(slot, false, out);
        }
        loop {
            let (slot, kind) = self.uplink_mut().waits.expired(now)?;
            if self.forwarded(slot).is_some() {
                // The request goes up behind the uplink's queue, as the round did.
                self.uplink_mut().waits.sent_again(slot, now);
            } else if self.slots[slot as usize].expects_no_one() {
                self.uplink_mut().waits.held(slot, now);
            } else {
                // Waiting for its own workers, not for the upper switch.
                continue;
            }
            let counters = &mut self.uplink_mut().counters;
            match kind {
                WaitKind::Overtaken => counters.overtaken += 1,
                WaitKind::Queued | WaitKind::Held => counters.timed_out += 1,
            }
            return self.ask_upstream(slot, true, out);
        }
    }

    /// A header-only packet for the upper switch about `slot`: a request for its open
    /// round's result (`want_result`), or a plain acknowledgement of the results held.
    fn ask_upstream(&mut self, slot: u16, want_result: bool, out: &mut [u8]) -> Option<Transmit> {
        let open_round = self.slots[slot as usize].open_round;
        let uplink = self.uplink_mut();
        let repr = PacketRepr {
            flags: if want_result { Flags::WANT_RESULT } else { Flags::NONE },
            rank: uplink.upstream.rank,
            slot,
            round: open_round,
            ack_round: open_round.wrapping_sub(1),
            ..PacketRepr::new(
                MessageType::Ack,
                ElementType::Int32,
                uplink.upstream.session,
                uplink.upstream.token,
                0,
            )
        };
        let len = repr.emit(out).ok()?.seal();
        uplink.acked[slot as usize] = repr.ack_round;
        if want_result {
            uplink.counters.requests += 1;
        } else {
            uplink.counters.acks += 1;
        }
        uplink.counters.bytes_up += len as u64;
        Some(Transmit { session: self.id, recipient: Recipient::Upstream, len })
    }
}

impl Uplink {
    pub(super) fn counters(&self) -> UplinkCounters {
        self.counters
    }
}

#[cfg(test)]
mod tests {
    use netagg_wire::packet::{BROADCAST_RANK, END_OF_STREAM, MAX_ELEMENTS};
    use netagg_wire::Packet;

    use super::super::{EngineLimits, SessionSpec};
    use super::*;

    const TIMEOUT: Duration = Duration::from_millis(10);
    const LOWER_TOKEN: u64 = 7;

    /// Two racks of two workers (ranks 0-1 and 2-3) under one upper switch, on one slot.
    struct Tree {
        upper: Engine,
        lowers: [Engine; 2],
        sessions: [SessionId; 2],
        upper_session: SessionId,
        now: Instant,
        out: Vec<u8>,
    }

    /// What a datagram handed to an engine made it send: (recipient, packet).
    type Sent = (Recipient, Vec<u8>);

    impl Tree {
        fn new(depth: u8) -> Tree {
            let now = Instant::now();
            let spec = SessionSpec { workers: 2, slots: 1, packet_elements: 4, depth };
            let mut upper = Engine::new(EngineLimits::default());
            let upper_session = upper.open_session(now, spec, 99).unwrap();
            let lowers = [0u16, 1].map(|rack| {
                let mut lower = Engine::new(EngineLimits::default());
                let id = lower.open_session(now, spec, LOWER_TOKEN).unwrap();
                let upstream = Upstream {
                    session: upper_session.0,
                    token: 99,
                    rank: rack,
                    first_rank: 2 * rack,
                    retransmit_timeout: TIMEOUT,
                    max_retransmit_timeout: 4 * TIMEOUT,
                };
                lower.attach_upstream(id, upstream).unwrap();
                (lower, id)
            });
            let [(a, a_id), (b, b_id)] = lowers;
            let out = vec![0; datagram_len(MAX_ELEMENTS)];
            Tree { upper, lowers: [a, b], sessions: [a_id, b_id], upper_session, now, out }
        }

        /// Hands `datagram` to rack `rack`'s switch: what it made that switch send.
        fn deliver_down(&mut self, rack: usize, datagram: &[u8]) -> Option<Sent> {
            let verdict = self.lowers[rack].handle_datagram(self.now, datagram, &mut self.out);
            self.sent(verdict)
        }

        /// Hands `datagram` to the upper switch: what it made the upper switch send.
        fn deliver_up(&mut self, datagram: &[u8]) -> Option<Sent> {
            let verdict = self.upper.handle_datagram(self.now, datagram, &mut self.out);
            self.sent(verdict)
        }

        fn sent(&self, verdict: Verdict) -> Option<Sent> {
            match verdict {
                Verdict::Send(transmit) => Some((transmit.recipient, self.out[..transmit.len].to_vec())),
                _ => None,
            }
        }

        /// Rack `rack`'s timers, polled at the current time.
        fn poll(&mut self, rack: usize) -> Vec<Vec<u8>> {
            let mut sent = Vec::new();
            while let Some(transmit) = self.lowers[rack].poll_upstream(self.now, &mut self.out) {
                assert_eq!(transmit.recipient, Recipient::Upstream);
                sent.push(self.out[..transmit.len].to_vec());
            }
            sent
        }

        /// Worker `rank`'s packets of one round of slot 0 go to its rack: what they made
        /// its switch send.
        fn contribute(&mut self, rank: u16, repr: PacketRepr, values: &[i32]) -> Option<Sent> {
            self.deliver_down(rank as usize / 2, &worker_packet(rank, repr, values))
        }

        fn counters(&self, rack: usize) -> UplinkCounters {
            self.lowers[rack].uplink_counters(self.sessions[rack]).unwrap()
        }
    }

    fn worker_packet(rank: u16, repr: PacketRepr, values: &[i32]) -> Vec<u8> {
        let repr = PacketRepr { rank, element_count: values.len() as u16, token: LOWER_TOKEN, ..repr };
        let mut buffer = vec![0; repr.buffer_len()];
        let mut packet = repr.emit(&mut buffer).unwrap();
        for (bytes, value) in packet.payload_mut().chunks_exact_mut(4).zip(values) {
            bytes.copy_from_slice(&value.to_le_bytes());
        }
        packet.seal();
        buffer
    }

    fn dense(session: SessionId, round: u32) -> PacketRepr {
        PacketRepr {
            round,
            ack_round: round.wrapping_sub(1),
            ..PacketRepr::new(MessageType::Data, ElementType::Int32, session.0, 0, 0)
        }
    }

    fn sparse(session: SessionId, round: u32, block: u32, next: u32) -> PacketRepr {
        PacketRepr { flags: Flags::SPARSE, block, next_block: next, ..dense(session, round) }
    }

    fn values(packet: &[u8]) -> Vec<i32> {
        let packet = Packet::new_checked(packet).unwrap();
        packet.payload().chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().unwrap())).collect()
    }

    fn header(packet: &[u8]) -> PacketRepr {
        PacketRepr::parse(&Packet::new_checked(packet).unwrap())
    }

    #[test]
    fn a_rack_sends_its_partial_sum_up_once_and_its_workers_get_the_whole_sum() {
        let mut tree = Tree::new(2);
        for round in 0..3u32 {
            let base = round as i32 * 10;
            let mut up = Vec::new();
            for rank in 0..4u16 {
                let session = tree.sessions[rank as usize / 2];
                let sent = tree.contribute(rank, dense(session, round), &[base + rank as i32, 1]);
                if rank % 2 == 0 {
                    assert_eq!(sent, None, "rank {rank}: the rack's round waits for its other worker");
                } else {
                    let (recipient, packet) = sent.unwrap();
                    assert_eq!(recipient, Recipient::Upstream);
                    let repr = header(&packet);
                    assert_eq!(
                        (repr.message_type, repr.rank, repr.round),
                        (MessageType::Data, rank / 2, round)
                    );
                    assert_eq!((repr.session, repr.token), (tree.upper_session.0, 99));
                    assert_eq!(values(&packet), [2 * base + 2 * rank as i32 - 1, 2]);
                    up.push(packet);
                }
            }
            assert_eq!(tree.deliver_up(&up[0]), None);
            let (recipient, result) = tree.deliver_up(&up[1]).unwrap();
            assert_eq!(recipient, Recipient::All);
            for rack in 0..2 {
                let (recipient, down) = tree.deliver_down(rack, &result).unwrap();
                assert_eq!(recipient, Recipient::All);
                let repr = header(&down);
                assert_eq!(
                    (repr.session, repr.token, repr.rank),
                    (tree.sessions[rack].0, LOWER_TOKEN, BROADCAST_RANK)
                );
                assert_eq!((repr.round, values(&down)), (round, vec![4 * base + 6, 4]));
            }
        }
        for rack in 0..2 {
            let counters = tree.counters(rack);
            assert_eq!((counters.sent_up, counters.results_down, counters.resent_up), (3, 3, 0));
        }
        assert!(tree.poll(0).is_empty(), "nothing is owed upstream");
    }

    #[test]
    fn the_union_of_the_racks_blocks_goes_up_and_a_rack_without_a_block_stays_silent() {
        let mut tree = Tree::new(4);
        let [a, b] = tree.sessions;
        // Start round (block 0): rack 0's streams go on at 3 and 6, rack 1's at 5 and END.
        tree.contribute(0, sparse(a, 0, 0, 3), &[1]);
        let (_, up_a) = tree.contribute(1, sparse(a, 0, 0, 6), &[]).unwrap();
        tree.contribute(2, sparse(b, 0, 0, 5), &[]);
        let (_, up_b) = tree.contribute(3, sparse(b, 0, 0, END_OF_STREAM), &[]).unwrap();
        assert_eq!(header(&up_a).next_block, 3, "the rack's lowest next block");
        assert_eq!((header(&up_b).next_block, header(&up_b).element_count), (5, 0));
        tree.deliver_up(&up_a);
        let (_, result) = tree.deliver_up(&up_b).unwrap();
        assert_eq!((header(&result).next_block, values(&result)), (3, vec![1]));
        tree.deliver_down(0, &result).unwrap();
        tree.deliver_down(1, &result).unwrap();

        // Block 3 is rank 0's alone: rack 1 is silent, and gets the result all the same.
        let (_, up) = tree.contribute(0, sparse(a, 1, 3, END_OF_STREAM), &[30]).unwrap();
        assert_eq!(header(&up).next_block, 6, "rank 1's stream goes on at 6");
        let (_, result) = tree.deliver_up(&up).unwrap();
        assert_eq!((header(&result).block, header(&result).next_block), (3, 5));
        tree.deliver_down(0, &result).unwrap();
        let (_, down) = tree.deliver_down(1, &result).unwrap();
        assert_eq!((header(&down).block, values(&down)), (3, vec![30]));

        // Block 5 is rank 2's alone; block 6 rank 1's; then the stream ends everywhere.
        let (_, up) = tree.contribute(2, sparse(b, 2, 5, END_OF_STREAM), &[50]).unwrap();
        let (_, result) = tree.deliver_up(&up).unwrap();
        assert_eq!(header(&result).next_block, 6);
        tree.deliver_down(1, &result).unwrap();
        tree.deliver_down(0, &result).unwrap();
        let (_, up) = tree.contribute(1, sparse(a, 3, 6, END_OF_STREAM), &[60]).unwrap();
        let (_, result) = tree.deliver_up(&up).unwrap();
        assert_eq!(header(&result).next_block, END_OF_STREAM);
        let (_, down) = tree.deliver_down(1, &result).unwrap();
        assert_eq!(
            (header(&down).block, header(&down).next_block, values(&down)),
            (6, END_OF_STREAM, vec![60])
        );
        tree.deliver_down(0, &result).unwrap();
        // Rack 0 sent blocks 0, 3 and 6 up, rack 1 blocks 0 and 5: no block twice.
        assert_eq!((tree.counters(0).sent_up, tree.counters(1).sent_up), (3, 2));
        assert_eq!((tree.counters(0).results_down, tree.counters(1).results_down), (4, 4));
    }

    #[test]
    fn losses_between_the_switches_are_recovered_by_the_lower_switch_s_timers() {
        let mut tree = Tree::new(2);
        let [a, b] = tree.sessions;
        tree.contribute(0, dense(a, 0), &[1]);
        let (_, lost) = tree.contribute(1, dense(a, 0), &[2]).unwrap();
        tree.contribute(2, dense(b, 0), &[3]);
        let (_, up_b) = tree.contribute(3, dense(b, 0), &[4]).unwrap();
        assert_eq!(tree.deliver_up(&up_b), None);
        drop(lost);
        // A worker asking meanwhile hears its contribution is in.
        let (recipient, notice) = tree.contribute(1, dense(a, 0), &[2]).unwrap();
        assert_eq!((recipient, header(&notice).message_type), (Recipient::Worker(1), MessageType::Pending));
        assert!(header(&notice).flags.contains(Flags::CONTRIBUTED));
        assert!(tree.poll(0).is_empty(), "no timeout yet");

        // Both timers ask, header only. The upper switch holds rack 1's sum: rack 1 waits.
        tree.now += TIMEOUT;
        let asked = tree.poll(1);
        let request = header(&asked[0]);
        assert_eq!((request.message_type, request.round, request.rank), (MessageType::Ack, 0, 1));
        assert!(request.flags.contains(Flags::WANT_RESULT), "not the sum again: {request:?}");
        let (recipient, notice) = tree.deliver_up(&asked[0]).unwrap();
        assert_eq!((recipient, header(&notice).message_type), (Recipient::Worker(1), MessageType::Pending));
        assert_eq!(tree.deliver_down(1, &notice), None);

        // It lacks rack 0's: rack 0 sends its partial sum again; the result to rack 1 is
        // lost.
        let asked = tree.poll(0);
        let (_, notice) = tree.deliver_up(&asked[0]).unwrap();
        assert!(!header(&notice).flags.contains(Flags::CONTRIBUTED));
        let (recipient, resent) = tree.deliver_down(0, &notice).unwrap();
        assert_eq!(recipient, Recipient::Upstream);
        assert!(header(&resent).flags.contains(Flags::RETRANSMISSION));
        assert_eq!(values(&resent), [3]);
        let (_, result) = tree.deliver_up(&resent).unwrap();
        let (_, down) = tree.deliver_down(0, &result).unwrap();
        assert_eq!(values(&down), [10]);

        // Rack 1's timer asks again; the upper switch answers it alone with the result.
        tree.now += 2 * TIMEOUT;
        let asked = tree.poll(1);
        let (recipient, again) = tree.deliver_up(&asked[0]).unwrap();
        assert_eq!(recipient, Recipient::Worker(1));
        let (_, down) = tree.deliver_down(1, &again).unwrap();
        assert_eq!((header(&down).rank, values(&down)), (BROADCAST_RANK, vec![10]));

        // Rank 3 lost that result: its resend is answered by rack 1's switch, to it alone,
        // by its rank in the whole tree.
        let (recipient, answer) = tree.contribute(3, dense(b, 0), &[4]).unwrap();
        assert_eq!((recipient, header(&answer).rank, values(&answer)), (Recipient::Worker(1), 3, vec![10]));
        assert_eq!((tree.counters(0).resent_up, tree.counters(1).resent_up), (1, 0));
        assert_eq!((tree.counters(0).requests, tree.counters(1).requests), (1, 2));
        assert!(tree.poll(1).is_empty(), "the result stopped the timer");
    }

    #[test]
    fn a_silent_rack_asks_for_a_lost_result_and_acknowledges_what_it_took() {
        let mut tree = Tree::new(2);
        let [a, b] = tree.sessions;
        tree.contribute(0, sparse(a, 0, 0, 2), &[1]);
        let (_, up_a) = tree.contribute(1, sparse(a, 0, 0, END_OF_STREAM), &[]).unwrap();
        tree.contribute(2, sparse(b, 0, 0, END_OF_STREAM), &[]);
        let (_, up_b) = tree.contribute(3, sparse(b, 0, 0, END_OF_STREAM), &[]).unwrap();
        tree.deliver_up(&up_a);
        let (_, result) = tree.deliver_up(&up_b).unwrap();
        tree.deliver_down(0, &result);
        tree.deliver_down(1, &result);
        // Rack 1 is silent at block 2, whose result it never gets.
        let (_, up) = tree.contribute(0, sparse(a, 1, 2, END_OF_STREAM), &[5]).unwrap();
        tree.deliver_up(&up).unwrap();
        assert!(tree.poll(1).is_empty(), "no timeout yet");
        tree.now += TIMEOUT;
        let asked = tree.poll(1);
        assert_eq!(asked.len(), 1);
        let request = header(&asked[0]);
        assert!(request.flags.contains(Flags::WANT_RESULT));
        assert_eq!((request.round, request.rank), (1, 1));
        let (_, answer) = tree.deliver_up(&asked[0]).unwrap();
        let (_, down) = tree.deliver_down(1, &answer).unwrap();
        assert_eq!((header(&down).block, values(&down)), (2, vec![5]));
        let owed = tree.poll(1);
        assert_eq!(owed.len(), 1, "an acknowledgement of the result taken silently");
        assert_eq!((header(&owed[0]).message_type, header(&owed[0]).ack_round), (MessageType::Ack, 1));
        assert!(!header(&owed[0]).flags.contains(Flags::WANT_RESULT));
        assert_eq!((tree.counters(1).requests, tree.counters(1).acks), (1, 1));
    }

    #[test]
    fn results_of_another_upper_session_or_without_its_token_are_dropped() {
        let mut tree = Tree::new(2);
        let forged = PacketRepr {
            round: 0,
            ..PacketRepr::new(MessageType::Result, ElementType::Int32, tree.upper_session.0, 98, 1)
        };
        let mut buffer = vec![0; forged.buffer_len()];
        forged.emit(&mut buffer).unwrap().seal();
        let verdict = tree.lowers[0].handle_datagram(tree.now, &buffer, &mut tree.out);
        assert_eq!(verdict, Verdict::Dropped(DropReason::WrongToken));
        let other = PacketRepr { session: tree.upper_session.0 + 1, token: 99, ..forged };
        other.emit(&mut buffer).unwrap().seal();
        let verdict = tree.lowers[0].handle_datagram(tree.now, &buffer, &mut tree.out);
        assert_eq!(verdict, Verdict::Dropped(DropReason::UnknownSession));
        // A result of a round the rack has not finished changes nothing.
        let early = PacketRepr { token: 99, ..forged };
        early.emit(&mut buffer).unwrap().seal();
        let verdict = tree.lowers[0].handle_datagram(tree.now, &buffer, &mut tree.out);
        assert!(matches!(verdict, Verdict::Dropped(DropReason::Mismatch(_))), "{verdict:?}");
    }
}
