//! Datagrams laid back to back for one segmentation-offload (GSO) send.
//!
//! The kernel splits such a buffer into datagrams of `segment` bytes, the last one
//! possibly shorter, so a window of packets to one destination costs one system call.
//! This is only the layout; the socket call is the caller's. A datagram joins either as
//! a copy ([`SegmentBatch::push`]) or written in place into room the batch lends
//! ([`SegmentBatch::room`], then [`SegmentBatch::commit`]).

use netagg_wire::MAX_DATAGRAM_LEN;

/// Equal-sized datagrams back to back; a shorter one can only come last.
#[derive(Debug, Clone)]
pub struct SegmentBatch {
    /// The datagrams in `bytes[..filled]`; beyond, room lent for the next one. The
    /// buffer only grows, so it is neither allocated nor zeroed per datagram.
    bytes: Vec<u8>,
    filled: usize,
    segment: usize,
    count: usize,
    max_segments: usize,
    closed: bool,
}

impl SegmentBatch {
    /// A batch of at most `max_segments` datagrams (1: no coalescing).
    pub fn new(max_segments: usize) -> SegmentBatch {
        SegmentBatch {
            bytes: Vec::new(),
            filled: 0,
            segment: 0,
            count: 0,
            max_segments: max_segments.max(1),
            closed: false,
        }
    }

    /// Whether a datagram of `len` bytes can join the batch.
    pub fn accepts(&self, len: usize) -> bool {
        self.count == 0
            || (!self.closed
                && len <= self.segment
                && self.count < self.max_segments
                && self.filled + len <= MAX_DATAGRAM_LEN)
    }

    /// Appends a datagram; call only when [`SegmentBatch::accepts`] says so.
    pub fn push(&mut self, datagram: &[u8]) {
        self.room(datagram.len()).copy_from_slice(datagram);
        self.commit(datagram.len());
    }

    /// Lends `capacity` bytes after the datagrams held, to write the next one into.
    pub fn room(&mut self, capacity: usize) -> &mut [u8] {
        let end = self.filled + capacity;
        if self.bytes.len() < end {
            self.bytes.resize(end, 0);
        }
        &mut self.bytes[self.filled..end]
    }

    /// Appends the first `len` bytes of the last [`SegmentBatch::room`] as a datagram;
    /// call only when [`SegmentBatch::accepts`] says so.
    pub fn commit(&mut self, len: usize) {
        debug_assert!(self.accepts(len) && self.filled + len <= self.bytes.len());
        if self.count == 0 {
            self.segment = len;
        }
        self.closed = len < self.segment;
        self.filled += len;
        self.count += 1;
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The length of the batch's datagrams (but a shorter last one); 0 when empty.
    pub fn segment(&self) -> usize {
        if self.count == 0 {
            0
        } else {
            self.segment
        }
    }

    /// Datagrams in the batch.
    pub fn len(&self) -> usize {
        self.count
    }

    /// The bytes to send.
    pub fn contents(&self) -> &[u8] {
        &self.bytes[..self.filled]
    }

    /// The datagrams, one by one: for a sender without segmentation offload.
    pub fn datagrams(&self) -> impl Iterator<Item = &[u8]> {
        self.contents().chunks(self.segment.max(1))
    }

    /// The segment size to give the kernel, or `None` for a single datagram.
    pub fn segment_size(&self) -> Option<usize> {
        (self.count > 1).then_some(self.segment)
    }

    pub fn clear(&mut self) {
        self.filled = 0;
        self.count = 0;
        self.closed = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_datagrams_share_a_batch_and_a_shorter_one_closes_it() {
        let mut batch = SegmentBatch::new(3);
        assert!(batch.is_empty() && batch.accepts(100));
        batch.push(&[1; 100]);
        assert_eq!(batch.segment_size(), None);
        batch.push(&[2; 100]);
        assert!(!batch.accepts(101), "a longer datagram cannot follow");
        batch.push(&[3; 60]);
        assert!(!batch.accepts(60), "a shorter datagram ends the batch");
        assert_eq!((batch.len(), batch.segment_size(), batch.contents().len()), (3, Some(100), 260));
        let datagrams: Vec<&[u8]> = batch.datagrams().collect();
        assert_eq!(datagrams, [&[1; 100][..], &[2; 100], &[3; 60]]);
        batch.clear();
        assert_eq!(batch.datagrams().count(), 0);
        assert!(batch.accepts(500));
    }

    #[test]
    fn datagrams_written_in_place_join_as_copies_do() {
        let mut batch = SegmentBatch::new(4);
        assert_eq!(batch.segment(), 0);
        batch.room(1500)[..100].fill(1);
        batch.commit(100);
        batch.push(&[2; 100]);
        batch.room(1500)[..120].fill(3);
        assert!(!batch.accepts(120), "a longer datagram cannot follow");
        assert_eq!((batch.segment(), batch.contents()), (100, &[[1; 100], [2; 100]].concat()[..]));
    }

    #[test]
    fn batches_stop_at_the_segment_limit_and_the_datagram_size() {
        let mut batch = SegmentBatch::new(2);
        batch.push(&[0; 10]);
        batch.push(&[0; 10]);
        assert!(!batch.accepts(10));
        let mut big = SegmentBatch::new(64);
        big.push(&vec![0; 40_000]);
        assert!(!big.accepts(40_000));
    }
}
