//! The packets the slots queued to send, in order.

/// A first-in, first-out queue: a ring whose length is a power of two, grown when full.
///
/// A ring of its own rather than a `VecDeque`, whose push a build of 16 codegen units
/// left a call that takes the item through memory: written to the stack a field at a
/// time and read back in wider loads, which wait for those stores. The one push each
/// result makes took 2.4-2.7 % of the dummy client path's CPU samples (perf, float32
/// BFP), nearly all of them there.
#[derive(Debug)]
pub(super) struct SendQueue<T> {
    ring: Vec<T>,
    /// Where the oldest item is.
    head: usize,
    len: usize,
}

impl<T: Copy> SendQueue<T> {
    pub(super) fn new() -> SendQueue<T> {
        SendQueue { ring: Vec::new(), head: 0, len: 0 }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn clear(&mut self) {
        self.len = 0;
    }

    /// Puts `item` behind every other.
    // Inlined by force: with the hint alone a build of 16 codegen units left it a call
    // that takes the item through memory again.
    #[inline(always)]
    pub(super) fn push_back(&mut self, item: T) {
        if self.len == self.ring.len() {
            self.grow(item);
        }
        let at = (self.head + self.len) & (self.ring.len() - 1);
        self.ring[at] = item;
        self.len += 1;
    }

    /// Takes the oldest item.
    #[inline]
    pub(super) fn pop_front(&mut self) -> Option<T> {
        if self.len == 0 {
            return None;
        }
        let item = self.ring[self.head];
        self.head = (self.head + 1) & (self.ring.len() - 1);
        self.len -= 1;
        Some(item)
    }

    /// Doubles the ring (to 16 items at first), the items kept in their order; `fill`
    /// stands in the places not yet taken.
    #[cold]
    fn grow(&mut self, fill: T) {
        let mut ring = vec![fill; (self.ring.len() * 2).max(16)];
        for (n, item) in ring.iter_mut().enumerate().take(self.len) {
            *item = self.ring[(self.head + n) & (self.ring.len() - 1)];
        }
        self.ring = ring;
        self.head = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_come_out_in_the_order_they_went_in_across_wraps_and_growth() {
        let mut queue = SendQueue::new();
        let mut expected = std::collections::VecDeque::new();
        let mut next = 0u32;
        // Pushes outrun pops, so the ring wraps at each size before it grows.
        for step in 0..2000u32 {
            for _ in 0..=(step % 3) {
                queue.push_back(next);
                expected.push_back(next);
                next += 1;
            }
            for _ in 0..=(step % 2) {
                assert_eq!(queue.pop_front(), expected.pop_front());
            }
            assert_eq!(queue.len(), expected.len());
        }
        queue.clear();
        assert_eq!((queue.len(), queue.pop_front()), (0, None));
        queue.push_back(7);
        assert_eq!(queue.pop_front(), Some(7));
    }
}
