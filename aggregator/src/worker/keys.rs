//! The keys a worker thread's packets carry: the session's id and token as the switch
//! that owns each slot knows them.
//!
//! One switch hands out one id and token per session. A session spread over several
//! switches (shards) has one from each, since each opened it on its own: a slot's packets
//! carry its owner's, and a result counts only with its slot's owner's. Each range also
//! bounds what a probe may ask one endpoint about (its progress report covers only that
//! endpoint's slots), so a switch with several data-path threads gives a range per lane.

use std::ops::Range;

/// A session's id and secret token, as one switch knows them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionKey {
    pub session: u32,
    /// The secret from the switch's accept: sent in every packet, and a result without it
    /// is not from that switch's session.
    pub token: u64,
}

/// The key of every slot of a session: contiguous ranges of slots, each owned by one
/// endpoint of one switch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionKeys {
    /// The first slot of each range and its key, first slots ascending from 0.
    ranges: Vec<(u16, SessionKey)>,
}

impl SessionKeys {
    /// Every slot owned by one switch.
    pub fn one(key: SessionKey) -> SessionKeys {
        SessionKeys { ranges: vec![(0, key)] }
    }

    /// Slots owned by several switches: `ranges` are the slots of each with its key, in
    /// slot order. Slots before the first range take the first range's key, and a range
    /// that is empty is skipped; `None` if every range is.
    pub fn sharded(ranges: impl IntoIterator<Item = (Range<u16>, SessionKey)>) -> Option<SessionKeys> {
        let mut keys: Vec<(u16, SessionKey)> = Vec::new();
        for (slots, key) in ranges.into_iter().filter(|(slots, _)| !slots.is_empty()) {
            keys.push((if keys.is_empty() { 0 } else { slots.start }, key));
        }
        (!keys.is_empty()).then_some(SessionKeys { ranges: keys })
    }

    /// The key of `slot`'s owner.
    pub fn key(&self, slot: u16) -> SessionKey {
        self.ranges[self.owner(slot)].1
    }

    /// The first slot past `slot` that another endpoint owns (65 536 where none does).
    pub fn owner_end(&self, slot: u16) -> usize {
        self.ranges.get(self.owner(slot) + 1).map_or(1 << 16, |&(first, _)| usize::from(first))
    }

    /// How many endpoints own the session's slots: one per range.
    pub(super) fn endpoints(&self) -> usize {
        self.ranges.len()
    }

    /// The index, among [`SessionKeys::endpoints`], of the endpoint that owns `slot`.
    pub(super) fn owner(&self, slot: u16) -> usize {
        // The first range starts at 0, so the partition point is at least 1.
        self.ranges.partition_point(|&(first, _)| first <= slot) - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(session: u32) -> SessionKey {
        SessionKey { session, token: u64::from(session) << 32 }
    }

    #[test]
    fn each_slot_takes_its_owners_key_and_ranges_end_where_the_owner_changes() {
        let keys = SessionKeys::sharded([(0..3, key(7)), (3..3, key(8)), (3..8, key(9))]).unwrap();
        let owners: Vec<u32> = (0..9).map(|slot| keys.key(slot).session).collect();
        assert_eq!(owners, [7, 7, 7, 9, 9, 9, 9, 9, 9]);
        assert_eq!((keys.owner_end(0), keys.owner_end(2), keys.owner_end(3)), (3, 3, 1 << 16));
        let one = SessionKeys::one(key(1));
        assert_eq!((one.key(65535), one.owner_end(12)), (key(1), 1 << 16));
        // Slots before the first range belong to it.
        assert_eq!(SessionKeys::sharded([(4..6, key(2)), (6..9, key(3))]).unwrap().key(1), key(2));
        assert_eq!(SessionKeys::sharded([(4..4, key(2))]), None);
    }
}
