//! The results of one receive call, written by the engine straight into the batches they
//! leave in.
//!
//! Results go out in [`SegmentBatch`]es, one batch list per group of recipients: a
//! session's broadcasts for the slots of one worker thread (to that thread of every rank),
//! or resends to one rank's thread. Before the engine sees a datagram, the data path names
//! the group its result would most likely go to (the broadcast group of its session and
//! slot) and lends the engine room in that group's batch; a broadcast is then kept where
//! it was written, and the port sends the batch as it is (UDP: one GSO send per
//! recipient). Only a resend to one rank, or a result that ends a batch's run of equal
//! sizes, is copied into its own group.

use netagg_aggregator::SessionId;
use netagg_udp::SegmentBatch;
use netagg_wire::MAX_DATAGRAM_LEN;
use rustc_hash::FxHashMap;

use crate::port::DataPort;

/// Who a group's results go to: a session's worker thread `thread`, of every rank
/// (`rank` none) or of one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GroupKey {
    pub session: SessionId,
    pub thread: u16,
    pub rank: Option<u16>,
}

/// One group's recipients and the batches of its results, the last one open.
struct Group<A> {
    destinations: Vec<A>,
    batches: Vec<SegmentBatch>,
}

pub struct Outbox<A> {
    groups: FxHashMap<GroupKey, Group<A>>,
    /// Where a result is written that no group was named for (bytes too short to name
    /// their session, say: the engine answers none of those).
    scratch: Vec<u8>,
    /// Emptied batches, kept to be reused rather than allocated again.
    spare: Vec<SegmentBatch>,
    max_segments: usize,
}

/// Where [`Outbox::room`] lent room: a group's open batch, or the scratch buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lent(Option<GroupKey>);

impl<A: Copy + PartialEq> Outbox<A> {
    /// An outbox for a port that takes batches of up to `max_segments` datagrams.
    pub fn new(max_segments: usize) -> Outbox<A> {
        Outbox {
            groups: FxHashMap::default(),
            scratch: vec![0; MAX_DATAGRAM_LEN],
            spare: Vec::new(),
            max_segments: max_segments.max(1),
        }
    }

    /// Room for a result of up to [`MAX_DATAGRAM_LEN`] bytes, in the open batch of
    /// `group` (made with `destinations` if new), or in scratch space for `None`.
    pub fn room(
        &mut self,
        group: Option<GroupKey>,
        destinations: impl FnOnce() -> Vec<A>,
    ) -> (Lent, &mut [u8]) {
        let Some(key) = group else { return (Lent(None), &mut self.scratch[..]) };
        let (spare, max_segments) = (&mut self.spare, self.max_segments);
        let group = self
            .groups
            .entry(key)
            .or_insert_with(|| Group { destinations: destinations(), batches: Vec::new() });
        // A batch that cannot take a datagram of any size is left for a fresh one.
        if group.batches.last().is_none_or(|open| open.len() >= max_segments) {
            group.batches.push(spare.pop().unwrap_or_else(|| SegmentBatch::new(max_segments)));
        }
        let open = group.batches.last_mut().expect("a batch was just made open");
        (Lent(Some(key)), open.room(MAX_DATAGRAM_LEN))
    }

    /// Keeps the first `len` bytes written into the room `lent` as a result for `group`
    /// (made with `destinations` if new): where it was written if that is its group and
    /// its batch takes it, else as a copy.
    pub fn commit(&mut self, lent: Lent, len: usize, group: GroupKey, destinations: impl FnOnce() -> Vec<A>) {
        if lent == Lent(Some(group)) {
            let open = self.open_batch(group);
            if open.accepts(len) {
                open.commit(len);
                return;
            }
        }
        // Lent from scratch space, the result is in `copy` already.
        let mut copy = std::mem::take(&mut self.scratch);
        if let Lent(Some(key)) = lent {
            let open = self.open_batch(key);
            copy[..len].copy_from_slice(&open.room(len)[..len]);
        }
        let (spare, max_segments) = (&mut self.spare, self.max_segments);
        let target = self
            .groups
            .entry(group)
            .or_insert_with(|| Group { destinations: destinations(), batches: Vec::new() });
        match target.batches.last_mut() {
            Some(open) if open.accepts(len) => open.push(&copy[..len]),
            _ => {
                let mut batch = spare.pop().unwrap_or_else(|| SegmentBatch::new(max_segments));
                batch.push(&copy[..len]);
                target.batches.push(batch);
            }
        }
        self.scratch = copy;
    }

    fn open_batch(&mut self, key: GroupKey) -> &mut SegmentBatch {
        // `room` made the group and its open batch.
        self.groups.get_mut(&key).and_then(|group| group.batches.last_mut()).expect("room was lent here")
    }

    /// Hands every batch to the port, and keeps the emptied ones for reuse.
    pub fn send(&mut self, port: &mut impl DataPort<Address = A>) {
        for group in self.groups.values_mut() {
            for mut batch in group.batches.drain(..) {
                if !batch.is_empty() {
                    port.send_batch(&group.destinations, &batch);
                }
                batch.clear();
                self.spare.push(batch);
            }
        }
    }

    /// Drops a closed session's groups.
    pub fn forget(&mut self, session: SessionId) {
        self.groups.retain(|key, _| key.session != session);
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::net::IpAddr;
    use std::time::Duration;

    use netagg_wire::Endpoint;

    use super::*;
    use crate::port::ThreadLink;

    /// A port that records each batch it is handed: its destinations, its datagrams and
    /// the address of its bytes, to tell a batch written in place from a copy.
    #[derive(Default)]
    struct Recorder {
        batches: Vec<(Vec<u8>, Vec<Vec<u8>>, usize)>,
    }

    impl DataPort for Recorder {
        type Address = u8;
        fn endpoint(&self) -> Endpoint {
            Endpoint::Udp(([127, 0, 0, 1], 1).into())
        }
        fn resolve(&mut self, _: &Endpoint, _: IpAddr, _: ThreadLink) -> Result<u8, String> {
            Err("not used".into())
        }
        fn recv(&mut self, _: Duration, _: &mut dyn FnMut(u8, &[u8])) -> io::Result<usize> {
            Ok(0)
        }
        fn send(&mut self, _: u8, _: &[u8]) {
            unreachable!("batches only")
        }
        fn send_batch(&mut self, destinations: &[u8], batch: &SegmentBatch) {
            let datagrams = batch.datagrams().map(<[u8]>::to_vec).collect();
            self.batches.push((destinations.to_vec(), datagrams, batch.contents().as_ptr() as usize));
        }
        fn flush(&mut self) {}
    }

    const SESSION: SessionId = SessionId(0x0001_0001);

    fn broadcast(thread: u16) -> GroupKey {
        GroupKey { session: SESSION, thread, rank: None }
    }

    /// Writes `bytes` as the engine would into room lent for `predicted`, and commits it
    /// for `group`; returns where the room was.
    fn write(outbox: &mut Outbox<u8>, predicted: GroupKey, group: GroupKey, bytes: &[u8]) -> usize {
        let (lent, room) = outbox.room(Some(predicted), || vec![10, 20]);
        room[..bytes.len()].copy_from_slice(bytes);
        let at = room.as_ptr() as usize;
        outbox.commit(lent, bytes.len(), group, || vec![20]);
        at
    }

    #[test]
    fn broadcasts_stay_where_they_were_written_and_resends_are_copied_to_their_rank() {
        let mut outbox = Outbox::new(64);
        let first = write(&mut outbox, broadcast(1), broadcast(1), &[1; 8]);
        write(&mut outbox, broadcast(1), broadcast(1), &[2; 8]);
        let resend = GroupKey { rank: Some(1), ..broadcast(1) };
        write(&mut outbox, broadcast(1), resend, &[3; 8]);
        let mut port = Recorder::default();
        outbox.send(&mut port);
        port.batches.sort_by_key(|(destinations, ..)| destinations.len());
        let [(one, resent, _), (both, broadcasts, at)] = &port.batches[..] else {
            panic!("{:?}", port.batches)
        };
        assert_eq!((one, resent), (&vec![20], &vec![vec![3; 8]]));
        assert_eq!((both, broadcasts), (&vec![10, 20], &vec![vec![1; 8], vec![2; 8]]));
        assert_eq!(*at, first, "the broadcasts were sent from where the engine wrote them");
    }

    #[test]
    fn a_full_batch_or_a_shorter_result_starts_another_and_sessions_are_forgotten() {
        let mut outbox = Outbox::new(2);
        for value in 0..3 {
            write(&mut outbox, broadcast(0), broadcast(0), &[value; 8]);
        }
        // Shorter: the batch it was written into ends with it; the next starts anew.
        write(&mut outbox, broadcast(1), broadcast(1), &[7; 8]);
        write(&mut outbox, broadcast(1), broadcast(1), &[8; 4]);
        write(&mut outbox, broadcast(1), broadcast(1), &[9; 8]);
        let mut port = Recorder::default();
        outbox.send(&mut port);
        let mut sizes: Vec<Vec<usize>> =
            port.batches.iter().map(|(_, datagrams, _)| datagrams.iter().map(Vec::len).collect()).collect();
        sizes.sort();
        assert_eq!(sizes, [vec![8], vec![8], vec![8, 4], vec![8, 8]]);
        write(&mut outbox, broadcast(0), broadcast(0), &[1; 8]);
        outbox.forget(SESSION);
        let mut port = Recorder::default();
        outbox.send(&mut port);
        assert!(port.batches.is_empty());
    }
}
