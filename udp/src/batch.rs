//! Datagrams laid back to back for one segmentation-offload (GSO) send.
//!
//! The kernel splits such a buffer into datagrams of `segment` bytes, the last one
//! possibly shorter, so a window of packets to one destination costs one system call.
//! This is only the layout; the socket call is the caller's.

use netagg_wire::MAX_DATAGRAM_LEN;

/// Equal-sized datagrams back to back; a shorter one can only come last.
#[derive(Debug, Clone)]
pub struct SegmentBatch {
    bytes: Vec<u8>,
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
                && self.bytes.len() + len <= MAX_DATAGRAM_LEN)
    }

    /// Appends a datagram; call only when [`SegmentBatch::accepts`] says so.
    pub fn push(&mut self, datagram: &[u8]) {
        debug_assert!(self.accepts(datagram.len()));
        if self.count == 0 {
            self.segment = datagram.len();
        }
        self.closed = datagram.len() < self.segment;
        self.bytes.extend_from_slice(datagram);
        self.count += 1;
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    pub fn len(&self) -> usize {
        self.count
    }

    /// The bytes to send.
    pub fn contents(&self) -> &[u8] {
        &self.bytes
    }

    /// The segment size to give the kernel, or `None` for a single datagram.
    pub fn segment_size(&self) -> Option<usize> {
        (self.count > 1).then_some(self.segment)
    }

    pub fn clear(&mut self) {
        self.bytes.clear();
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
        batch.clear();
        assert!(batch.accepts(500));
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
