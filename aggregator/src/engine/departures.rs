//! Ranks that leave a session after their last job, and the rounds that then cannot
//! complete.
//!
//! A rank that leaves keeps its results retained for the others, so that they can still
//! recover the results they lost. A round that later needs its contribution cannot
//! complete: the engine drops what it receives for that round and names the session to
//! the shell, which closes it and tells its ranks.

use super::session::{Session, SessionError, SessionId};
use super::Engine;

/// What a rank's leaving means for its session ([`Engine::depart`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Departure {
    /// Every round the rank contributes to is complete: the session stays open, so that
    /// the other ranks can still recover the results they lost, until they leave too or
    /// a round needs the rank (then [`Engine::take_orphaned`] names the session).
    Lingers,
    /// A round in progress waits for the rank's contribution: the session cannot
    /// complete it and must close.
    Needed,
    /// Every rank has left: the session may close.
    AllGone,
}

impl Engine {
    /// Records that `rank` left the session after its last job. Its results stay
    /// retained for the others; a round that would need its contribution later is
    /// dropped, and the session named by [`Engine::take_orphaned`].
    pub fn depart(&mut self, id: SessionId, rank: u16) -> Result<Departure, SessionError> {
        let session = self.session_mut(id).ok_or(SessionError::Unknown(id.0))?;
        if rank >= session.spec.workers {
            return Err(SessionError::Rank { rank, workers: session.spec.workers });
        }
        if (0..session.spec.slots).any(|slot| session.waits_for(slot, rank)) {
            return Ok(Departure::Needed);
        }
        session.departed.insert(rank);
        Ok(if session.departed.len() == session.spec.workers as usize {
            Departure::AllGone
        } else {
            Departure::Lingers
        })
    }

    /// Sessions that a round needing a departed rank has made unable to progress since
    /// the last call, with that rank: the caller closes them and tells their ranks.
    pub fn take_orphaned(&mut self) -> Vec<(SessionId, u16)> {
        std::mem::take(&mut self.orphaned)
    }

    /// Whether [`Engine::take_orphaned`] has anything: cheap, for a loop that asks after
    /// every batch.
    pub fn has_orphaned(&self) -> bool {
        !self.orphaned.is_empty()
    }

    /// Names session `id`, which a round needing departed `rank` stopped, to
    /// [`Engine::take_orphaned`], once until taken.
    pub(super) fn orphan(&mut self, id: SessionId, rank: u16) {
        if !self.orphaned.iter().any(|(orphaned, _)| *orphaned == id) {
            self.orphaned.push((id, rank));
        }
    }
}

impl Session {
    /// Whether the open round of `slot`, begun or not, cannot complete without
    /// `rank`'s contribution: it expects the rank (a start round expects every rank, a
    /// sparse continuation those whose streams have its block) and has not had it.
    fn round_needs(&self, slot: u16, rank: u16) -> bool {
        let state = &self.slots[slot as usize];
        let expects = state.continuation.is_none() || state.expected.contains(rank);
        expects && !self.contributed(slot, rank)
    }

    /// Whether `rank` has contributed to the open round of `slot`.
    pub(super) fn contributed(&self, slot: u16, rank: u16) -> bool {
        let open_set = self.slots[slot as usize].open_set;
        open_set.is_some_and(|set| self.sets[self.set_index(slot, set as u32)].contributed.contains(rank))
    }

    /// Whether the open round of `slot` is under way (a contribution is in, or a sparse
    /// stream has scheduled it) and waits for `rank`.
    pub(super) fn waits_for(&self, slot: u16, rank: u16) -> bool {
        let state = &self.slots[slot as usize];
        let under_way = state.continuation.is_some() || state.open_set.is_some();
        under_way && self.round_needs(slot, rank)
    }

    /// A rank that has left and that the open round of `slot`, under way, waits for: a
    /// worker asking after that round must hear that the session cannot go on, not wait.
    pub(super) fn departed_awaited(&self, slot: u16) -> Option<u16> {
        self.departed.iter().find(|&rank| self.waits_for(slot, rank))
    }

    /// A rank that has left and that the open round of `slot` needs, if any.
    #[inline]
    pub(super) fn departed_needed(&self, slot: u16) -> Option<u16> {
        if self.departed.is_empty() {
            return None;
        }
        self.departed.iter().find(|&rank| self.round_needs(slot, rank))
    }
}

#[cfg(test)]
mod tests {
    use netagg_wire::packet::END_OF_STREAM;

    use super::super::testing::{ask, contribution, one_slot, sparse};
    use super::super::{DropReason, Recipient, Transmit, Verdict};
    use super::*;

    #[test]
    fn a_rank_that_left_after_its_last_round_leaves_its_results_to_the_others() {
        let (mut engine, session, now, mut out) = one_slot(4);
        // Rounds 0 and 1 complete; rank 1 holds both results and leaves; rank 0 lost
        // round 1's result.
        for round in 0..2u32 {
            engine.handle_datagram(now, &contribution(session, 0, round, round.wrapping_sub(1)), &mut out);
            engine.handle_datagram(now, &contribution(session, 1, round, round.wrapping_sub(1)), &mut out);
        }
        assert_eq!(engine.depart(session, 1), Ok(Departure::Lingers));
        // Rank 0's retransmission still gets the result back.
        let resent = engine.handle_datagram(now, &contribution(session, 0, 1, 0), &mut out);
        assert!(
            matches!(resent, Verdict::Send(Transmit { recipient: Recipient::Worker(0), .. })),
            "{resent:?}"
        );
        assert!(!engine.has_orphaned());
        // A new round would need rank 1: dropped, and the session named once.
        for _ in 0..2 {
            let verdict = engine.handle_datagram(now, &contribution(session, 0, 2, 1), &mut out);
            assert_eq!(verdict, Verdict::Dropped(DropReason::Departed(1)));
        }
        assert_eq!(engine.take_orphaned(), [(session, 1)]);
        assert!(!engine.has_orphaned());
        assert_eq!(engine.depart(session, 0), Ok(Departure::AllGone));
    }

    #[test]
    fn a_rank_that_leaves_while_a_round_waits_for_it_is_needed() {
        let (mut engine, session, now, mut out) = one_slot(4);
        engine.handle_datagram(now, &contribution(session, 0, 0, u32::MAX), &mut out);
        assert_eq!(engine.depart(session, 1), Ok(Departure::Needed));
        // Rank 0 has contributed to the open round: its leaving would not be.
        assert_eq!(engine.depart(session, 0), Ok(Departure::Lingers));
        assert_eq!(engine.depart(SessionId(99), 0), Err(SessionError::Unknown(99)));
        assert_eq!(engine.depart(session, 2), Err(SessionError::Rank { rank: 2, workers: 2 }));
    }

    #[test]
    fn a_request_or_probe_for_a_round_a_departed_rank_must_complete_orphans_the_session() {
        for probe in [false, true] {
            // Rank 1 sends block 0 of its sparse stream, saying block 5 comes next, and
            // stops mid-job: no round waits for it yet, so its leaving lingers.
            let (mut engine, session, now, mut out) = one_slot(4);
            engine.handle_datagram(now, &sparse(session, 1, 0, 0, 5), &mut out);
            assert_eq!(engine.depart(session, 1), Ok(Departure::Lingers));
            // Rank 0's block 0 completes the round, whose continuation (block 5) only
            // rank 1 has: rank 0 then waits for it, and asking after it learns the
            // session is over.
            let completed = engine.handle_datagram(now, &sparse(session, 0, 0, 0, END_OF_STREAM), &mut out);
            assert!(matches!(completed, Verdict::Send(_)), "{completed:?}");
            assert!(!engine.has_orphaned());
            let asked = engine.handle_datagram(now, &ask(session, 0, 1, probe), &mut out);
            assert_eq!(asked, Verdict::Dropped(DropReason::Departed(1)), "probe {probe}");
            assert_eq!(engine.take_orphaned(), [(session, 1)]);
        }
    }
}
