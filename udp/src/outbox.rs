//! Datagrams queued for the next send, written straight into the batches they leave in.
//!
//! Both ends use it: the switch's data path queues each result for its group of
//! recipients (a session's broadcasts for one worker thread's slots, or resends to one
//! rank's thread), a worker thread each packet for the switch endpoint that takes it.
//! Each group keeps [`SegmentBatch`]es in the order they leave; a GSO batch holds
//! datagrams of one size (a shorter one only last), and a sparse job's datagrams take
//! turns in size (full data packets, header-only acks and empty contributions), so a
//! datagram may also join an earlier batch of its own size, as long as it overtakes only
//! shorter datagrams on the way. A shorter datagram thus never leaves before a longer one
//! queued earlier (a probe's id counts the datagrams sent before it, so data it overtook
//! would look lost), and sizes taking turns cost one batch each, not one per change.
//! A group whose datagrams are numbered in the order they are queued (the switch's
//! broadcasts, in which a worker takes a number three others overtook for lost) keeps
//! that order instead: each of its datagrams joins only the group's last batch.
//!
//! The caller lends room before it knows where a datagram goes: [`Outbox::room`] names
//! the group it most likely goes to, and the datagram is written into the batch of that
//! group's longest datagrams. Committed to that batch, it stays where it was written;
//! anywhere else it is copied, so the copies are mostly of short datagrams.

use std::hash::Hash;

use netagg_wire::MAX_DATAGRAM_LEN;
use rustc_hash::FxHashMap;

use crate::SegmentBatch;

/// Batches of a group looked back over for one of a datagram's size: enough for the
/// sizes of a sparse job (data, a stream's shorter last block, headers) to take turns.
const LOOKBACK: usize = 4;

/// One group's recipients and its batches, in the order they leave: at least one, so
/// that there is always one to lend room.
#[derive(Debug)]
struct Group<A> {
    destinations: Vec<A>,
    batches: Vec<SegmentBatch>,
    /// The batch whose room the next datagram predicted for this group is written into.
    lender: usize,
    /// The datagrams leave in the order they were queued: none overtakes another.
    in_order: bool,
}

impl<A> Group<A> {
    /// A group with one empty batch, to lend room from.
    fn new(
        destinations: Vec<A>,
        in_order: bool,
        spare: &mut Vec<SegmentBatch>,
        max_segments: usize,
    ) -> Group<A> {
        let batch = spare.pop().unwrap_or_else(|| SegmentBatch::new(max_segments));
        Group { destinations, batches: vec![batch], lender: 0, in_order }
    }

    /// The batch a datagram of `len` bytes joins: the latest of its size among the last
    /// few (only the last, in a group that keeps its order), if every batch after it
    /// holds shorter datagrams; else the last if empty. Not a batch of longer ones as its
    /// shorter last datagram: that would close the batch to the next datagram of their
    /// size.
    fn target(&self, len: usize) -> Option<usize> {
        let last = self.batches.len().checked_sub(1)?;
        let lookback = if self.in_order { 0 } else { LOOKBACK };
        for index in (last.saturating_sub(lookback)..=last).rev() {
            let batch = &self.batches[index];
            if batch.segment() == len && batch.accepts(len) {
                return Some(index);
            }
            if batch.segment() >= len {
                break;
            }
        }
        self.batches[last].is_empty().then_some(last)
    }
}

/// Datagrams queued by group of recipients `K`, each recipient named by its address `A`.
#[derive(Debug)]
pub struct Outbox<K, A> {
    groups: FxHashMap<K, Group<A>>,
    /// Where a datagram is written that no group was named for (bytes too short to name
    /// their session, say).
    scratch: Vec<u8>,
    /// Emptied batches, kept to be reused rather than allocated again.
    spare: Vec<SegmentBatch>,
    max_segments: usize,
    /// Which groups keep their datagrams in the order they were queued.
    in_order: fn(&K) -> bool,
}

/// Where [`Outbox::room`] lent room: a group's batch, or the scratch space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lent<K>(Option<K>);

impl<K> Lent<K> {
    /// The scratch space, lent for no group.
    pub const SCRATCH: Lent<K> = Lent(None);
}

impl<K: Copy + Eq + Hash, A> Outbox<K, A> {
    /// An outbox whose batches hold up to `max_segments` datagrams each.
    pub fn new(max_segments: usize) -> Outbox<K, A> {
        Outbox::keeping_order(max_segments, |_| false)
    }

    /// An outbox whose batches hold up to `max_segments` datagrams each, and whose groups
    /// that `in_order` names send theirs in the order they were queued.
    pub fn keeping_order(max_segments: usize, in_order: fn(&K) -> bool) -> Outbox<K, A> {
        Outbox {
            groups: FxHashMap::default(),
            scratch: vec![0; MAX_DATAGRAM_LEN],
            spare: Vec::new(),
            max_segments: max_segments.max(1),
            in_order,
        }
    }

    /// Room for a datagram of up to [`MAX_DATAGRAM_LEN`] bytes, in `group`'s lending
    /// batch (the group made with `destinations` if new), or in scratch space for `None`.
    pub fn room(&mut self, group: Option<K>, destinations: impl FnOnce() -> Vec<A>) -> (Lent<K>, &mut [u8]) {
        let Some(key) = group else { return (Lent(None), &mut self.scratch[..]) };
        let (spare, max_segments, in_order) = (&mut self.spare, self.max_segments, self.in_order);
        let group = self
            .groups
            .entry(key)
            .or_insert_with_key(|key| Group::new(destinations(), in_order(key), spare, max_segments));
        (Lent(Some(key)), group.batches[group.lender].room(MAX_DATAGRAM_LEN))
    }

    /// Queues the first `len` bytes written into the room `lent` as a datagram for
    /// `group` (made with `destinations` if new): where it was written if that batch is
    /// the one it joins, else as a copy.
    pub fn commit(&mut self, lent: Lent<K>, len: usize, group: K, destinations: impl FnOnce() -> Vec<A>) {
        if lent == Lent(Some(group)) {
            let group = self.groups.get_mut(&group).expect("room was lent from this group");
            if group.target(len) == Some(group.lender) {
                group.batches[group.lender].commit(len);
                return;
            }
        }
        // Lent from scratch space, the datagram is in `copy` already.
        let mut copy = std::mem::take(&mut self.scratch);
        if lent != Lent::SCRATCH {
            copy[..len].copy_from_slice(self.written(lent, len));
        }
        let (spare, max_segments, in_order) = (&mut self.spare, self.max_segments, self.in_order);
        let target = self
            .groups
            .entry(group)
            .or_insert_with_key(|key| Group::new(destinations(), in_order(key), spare, max_segments));
        let joins = match target.target(len) {
            Some(index) => index,
            None => {
                target.batches.push(spare.pop().unwrap_or_else(|| SegmentBatch::new(max_segments)));
                target.batches.len() - 1
            }
        };
        target.batches[joins].push(&copy[..len]);
        // The next datagram is written into the batch of the longest ones, which it
        // most likely joins; and into a newer batch of theirs once the older is full. In a
        // group that keeps its order only the last batch takes datagrams: into that one.
        let lender = &target.batches[target.lender];
        if target.in_order
            || len > lender.segment()
            || (joins > target.lender && !lender.accepts(lender.segment()))
        {
            target.lender = joins;
        }
        self.scratch = copy;
    }

    /// The first `len` bytes written into the room `lent`, before they are committed.
    pub fn written(&mut self, lent: Lent<K>, len: usize) -> &[u8] {
        let Lent(Some(key)) = lent else { return &self.scratch[..len] };
        let group = self.groups.get_mut(&key).expect("room was lent from this group");
        &group.batches[group.lender].room(len)[..len]
    }

    /// Every batch queued, with its group's recipients: each group's in the order they
    /// leave.
    pub fn batches(&self) -> impl Iterator<Item = (&[A], &SegmentBatch)> {
        self.groups.values().flat_map(|group| {
            group
                .batches
                .iter()
                .filter(|batch| !batch.is_empty())
                .map(|batch| (&group.destinations[..], batch))
        })
    }

    /// Empties every batch, once sent, and keeps them for reuse.
    pub fn clear(&mut self) {
        for group in self.groups.values_mut() {
            for mut batch in group.batches.drain(1..) {
                batch.clear();
                self.spare.push(batch);
            }
            group.batches[0].clear();
            group.lender = 0;
        }
    }

    /// Drops the groups `keep` says no to, with what they queued.
    pub fn retain(&mut self, mut keep: impl FnMut(&K) -> bool) {
        self.groups.retain(|key, _| keep(key));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A group key as the switch's: a worker thread, of every rank (`None`) or of one.
    type Key = (u16, Option<u16>);

    /// What an outbox would send: each batch's recipients, datagrams and the address of
    /// its bytes (to tell a batch written in place from a copy), sorted by recipients.
    fn sent(outbox: &Outbox<Key, u8>) -> Vec<(Vec<u8>, Vec<Vec<u8>>, usize)> {
        let mut sent: Vec<_> = outbox
            .batches()
            .map(|(destinations, batch)| {
                let datagrams = batch.datagrams().map(<[u8]>::to_vec).collect();
                (destinations.to_vec(), datagrams, batch.contents().as_ptr() as usize)
            })
            .collect();
        sent.sort_by_key(|(destinations, ..)| destinations.clone());
        sent
    }

    /// Writes `bytes` into room lent for `predicted` and commits them for `group`;
    /// returns where the room was.
    fn write(outbox: &mut Outbox<Key, u8>, predicted: Key, group: Key, bytes: &[u8]) -> usize {
        let (lent, room) = outbox.room(Some(predicted), || vec![10, 20]);
        room[..bytes.len()].copy_from_slice(bytes);
        let at = room.as_ptr() as usize;
        outbox.commit(lent, bytes.len(), group, || vec![group.1.map_or(10, |rank| rank as u8)]);
        at
    }

    /// The datagrams of one group's batches, in the order they leave, as (length, first
    /// byte).
    fn order(outbox: &Outbox<Key, u8>) -> Vec<(usize, u8)> {
        outbox.batches().flat_map(|(_, batch)| batch.datagrams().map(|d| (d.len(), d[0]))).collect()
    }

    const BROADCAST: Key = (1, None);

    #[test]
    fn broadcasts_stay_where_they_were_written_and_resends_are_copied_to_their_rank() {
        let mut outbox = Outbox::new(64);
        let first = write(&mut outbox, BROADCAST, BROADCAST, &[1; 8]);
        write(&mut outbox, BROADCAST, BROADCAST, &[2; 8]);
        write(&mut outbox, BROADCAST, (1, Some(3)), &[3; 8]);
        let [(one, resent, _), (both, broadcasts, at)] = &sent(&outbox)[..] else {
            panic!("{:?}", sent(&outbox))
        };
        assert_eq!((one, resent), (&vec![3], &vec![vec![3; 8]]));
        assert_eq!((both, broadcasts), (&vec![10, 20], &vec![vec![1; 8], vec![2; 8]]));
        assert_eq!(*at, first, "the broadcasts leave from where they were written");
        let (lent, room) = outbox.room(None, Vec::new);
        room[..4].fill(9);
        outbox.commit(lent, 4, (2, None), || vec![30]);
        assert_eq!(sent(&outbox)[2].1, [vec![9; 4]], "scratch space is copied to its group");
    }

    #[test]
    fn data_and_headers_taking_turns_leave_in_a_batch_or_two_each_the_data_in_place() {
        // A sparse job's datagrams: data packets and header-only acks interleaved.
        let mut outbox = Outbox::new(64);
        let mut places = Vec::new();
        for i in 0..20u8 {
            write(&mut outbox, BROADCAST, BROADCAST, &[i; 48]);
            places.push(write(&mut outbox, BROADCAST, BROADCAST, &[100 + i; 1072]));
        }
        // The first header stays ahead of the data; the others follow it, since a header
        // cannot overtake data.
        let headers: Vec<Vec<u8>> = (1..20).map(|i| vec![i; 48]).collect();
        let data: Vec<Vec<u8>> = (0..20).map(|i| vec![100 + i; 1072]).collect();
        let batches: Vec<Vec<Vec<u8>>> =
            outbox.batches().map(|(_, batch)| batch.datagrams().map(<[u8]>::to_vec).collect()).collect();
        assert!(
            batches == [vec![vec![0; 48]], data, headers],
            "three batches, in order: {:?}",
            order(&outbox)
        );
        let data_at = outbox.batches().nth(1).unwrap().1.contents().as_ptr() as usize;
        assert_eq!(places[19], data_at + 19 * 1072, "data after the first is written in place");
    }

    #[test]
    fn a_shorter_datagram_never_overtakes_a_longer_one_queued_earlier() {
        // Data joins the first batch of data, overtaking headers and a shorter last block;
        // the headers after that block wait for it in a batch of their own.
        let mut outbox = Outbox::new(64);
        for (len, mark) in [(1072, 1), (48, 2), (1072, 3), (600, 4), (48, 5), (1072, 6), (48, 7)] {
            write(&mut outbox, BROADCAST, BROADCAST, &vec![mark; len]);
        }
        assert_eq!(order(&outbox), [(1072, 1), (1072, 3), (1072, 6), (48, 2), (600, 4), (48, 5), (48, 7)]);
    }

    #[test]
    fn a_group_that_keeps_its_order_sends_its_datagrams_as_queued() {
        // The same datagrams as above: the broadcasts keep their order, a batch per run
        // of one size; another group may still reorder.
        let mut outbox = Outbox::keeping_order(64, |&(_, rank): &Key| rank.is_none());
        let datagrams = [(1072, 1), (1072, 2), (48, 3), (1072, 4), (600, 5), (48, 6), (1072, 7), (1072, 8)];
        for (len, mark) in datagrams {
            write(&mut outbox, BROADCAST, BROADCAST, &vec![mark; len]);
        }
        assert_eq!(order(&outbox), datagrams);
        let runs: Vec<usize> = outbox.batches().map(|(_, batch)| batch.len()).collect();
        assert_eq!(runs, [2, 1, 1, 1, 1, 2]);
        outbox.clear();
        let resent = (1, Some(3));
        for (len, mark) in [(1072, 1), (48, 2), (1072, 3)] {
            write(&mut outbox, resent, resent, &vec![mark; len]);
        }
        assert_eq!(order(&outbox), [(1072, 1), (1072, 3), (48, 2)]);
    }

    #[test]
    fn a_full_batch_starts_another_and_clear_and_retain_empty_the_outbox() {
        let mut outbox = Outbox::new(2);
        for value in 0..5 {
            write(&mut outbox, BROADCAST, BROADCAST, &[value; 8]);
        }
        let sizes: Vec<usize> = outbox.batches().map(|(_, batch)| batch.len()).collect();
        assert_eq!(sizes, [2, 2, 1]);
        assert_eq!(order(&outbox), [(8, 0), (8, 1), (8, 2), (8, 3), (8, 4)]);
        outbox.clear();
        assert_eq!(outbox.batches().count(), 0);
        let at = write(&mut outbox, BROADCAST, BROADCAST, &[7; 8]);
        assert_eq!(sent(&outbox)[0].2, at, "a cleared group lends room again");
        outbox.retain(|&(thread, _)| thread != 1);
        assert_eq!(outbox.batches().count(), 0);
    }
}
