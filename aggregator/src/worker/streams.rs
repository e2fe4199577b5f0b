//! The stream of blocks each slot carries: which contribution a slot sends first, and
//! which one each result releases.
//!
//! - **Dense** jobs: each slot has one packet in flight; the result of round `r` releases
//!   the slot's next block as round `r + 1` (SwitchML's self-clocked window).
//! - **Sparse** jobs: each slot starts with one contribution from every worker (data if
//!   its first block is non-zero, an empty packet otherwise), naming the sender's next
//!   non-zero block. Afterwards a worker sends only when a result names its own next block;
//!   meanwhile it takes the results of the rounds others contribute to, and acknowledges
//!   them in batches so the aggregator can free its sets.

use netagg_wire::packet::END_OF_STREAM;
use netagg_wire::PacketRepr;

use super::job::JobSpec;
use super::{Contribution, WorkerProtocol, FIRST_SENDING};

/// Which blocks of a job hold a non-zero element.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockMask {
    words: Vec<u64>,
    blocks: u32,
}

impl BlockMask {
    /// A mask of `blocks` blocks, all zero.
    pub fn new(blocks: u32) -> BlockMask {
        BlockMask { words: vec![0; (blocks as usize).div_ceil(64)], blocks }
    }

    /// A mask whose block `b` is non-zero where `nonzero(b)` says so.
    pub fn from_fn(blocks: u32, mut nonzero: impl FnMut(u32) -> bool) -> BlockMask {
        let mut mask = BlockMask::new(blocks);
        for block in 0..blocks {
            if nonzero(block) {
                mask.insert(block);
            }
        }
        mask
    }

    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    pub fn insert(&mut self, block: u32) {
        if block < self.blocks {
            self.words[block as usize / 64] |= 1 << (block % 64);
        }
    }

    pub fn contains(&self, block: u32) -> bool {
        block < self.blocks && self.words[block as usize / 64] & (1 << (block % 64)) != 0
    }

    /// Non-zero blocks in the mask.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The first non-zero block of `from, from + stride, …`, or [`END_OF_STREAM`].
    fn next_in_stream(&self, from: u64, stride: u64) -> u32 {
        let mut block = from;
        while block < self.blocks as u64 {
            if self.contains(block as u32) {
                return block as u32;
            }
            block += stride;
        }
        END_OF_STREAM
    }
}

/// How a job's blocks travel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// Every block is sent.
    Dense,
    /// Only non-zero blocks are sent, OmniReduce-style.
    Sparse(BlockMask),
}

impl WorkerProtocol {
    /// Starts the streams of job `spec` on its first `active_slots` slots, queueing each
    /// slot's first contribution (in a block-floating-point job, only the exponent round's).
    pub(super) fn start_streams(&mut self, spec: &JobSpec, active_slots: u16) {
        let stride = self.config.slots as u64;
        for (index, slot) in self.slots.iter_mut().enumerate().take(active_slots as usize) {
            let block = index as u32;
            let next = match &spec.layout {
                Layout::Dense => END_OF_STREAM,
                Layout::Sparse(mask) => mask.next_in_stream(block as u64 + stride, stride),
            };
            slot.active = true;
            slot.have = slot.next_round.wrapping_sub(1);
            slot.ahead = 0;
            slot.my_next = next;
            slot.end_round = None;
            slot.deferred = false;
            slot.held = None;
            slot.backoff = 0;
            // In a block-floating-point job the first blocks wait for the exponent round.
            slot.outstanding = (!spec.exponents || index == 0).then_some(Contribution {
                round: slot.next_round,
                block,
                next,
                exponent: None,
                exponent_round: spec.exponents,
            });
            if slot.outstanding.is_some() {
                self.pending.push_back((index as u16, FIRST_SENDING));
            }
        }
    }

    /// Queues the contribution that the new result `repr` of slot `index` releases, if
    /// any, or marks the round that ends the slot's stream. `exponent_round`: the result
    /// is the exponent round's, which releases every slot's first block.
    // Inlined by force into its one caller, which runs per packet: a build of 16 codegen
    // units left it a call (callgrind).
    #[inline(always)]
    pub(super) fn release_next(&mut self, index: u16, repr: &PacketRepr, exponent_round: bool) {
        // Only a running job's results are taken.
        let Some(job) = &self.job else {
            return;
        };
        let stride = self.config.slots as u64;
        // The switch's maximum of the look-ahead exponents: what the next block uses.
        let agreed = job.spec.exponents.then_some(repr.exponent);
        let slot = &mut self.slots[index as usize];
        match &job.spec.layout {
            Layout::Dense if exponent_round => {
                // Every slot's first block goes out now, encoded with the agreed exponent.
                let first_window = job.blocks.min(self.config.slots as u32) as u16;
                for other in 0..first_window {
                    let slot = &mut self.slots[other as usize];
                    let round = slot.have.wrapping_add(1);
                    let block = other as u32;
                    slot.outstanding = Some(Contribution::data(round, block, END_OF_STREAM, agreed));
                    self.pending.push_back((other, FIRST_SENDING));
                }
            }
            Layout::Dense => {
                let next = repr.block as u64 + stride;
                if next < job.blocks as u64 {
                    let round = repr.round.wrapping_add(1);
                    let block = next as u32;
                    slot.outstanding = Some(Contribution::data(round, block, END_OF_STREAM, agreed));
                    self.pending.push_back((index, FIRST_SENDING));
                } else {
                    slot.end_round = Some(repr.round);
                }
            }
            Layout::Sparse(mask) => {
                // The round a silent turn waited for came, with or without it.
                slot.silent_turn = None;
                if repr.next_block == END_OF_STREAM {
                    slot.end_round = Some(repr.round);
                } else if repr.next_block == slot.my_next {
                    let block = slot.my_next;
                    let next = mask.next_in_stream(block as u64 + stride, stride);
                    let round = repr.round.wrapping_add(1);
                    slot.outstanding = Some(Contribution::data(round, block, next, None));
                    slot.my_next = next;
                    self.pending.push_back((index, FIRST_SENDING));
                } else {
                    self.queue_silent_turn(index, repr.round.wrapping_add(1));
                }
            }
        }
    }

    /// Whether slot `index`'s stream is over: the result that ended it, and every one
    /// before, is held, and nothing is outstanding.
    #[inline]
    pub(super) fn stream_ended(&self, index: u16) -> bool {
        let slot = &self.slots[index as usize];
        slot.end_round == Some(slot.have) && slot.outstanding.is_none()
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use netagg_wire::{ElementType, MessageType};

    use super::super::testing::{config, parsed, sent, sparse_result, Numbers};
    use super::super::JobStatus;
    use super::*;

    #[test]
    fn a_stream_skips_to_the_next_non_zero_block_of_its_slot() {
        let mask = BlockMask::from_fn(10, |block| block == 1 || block == 7);
        assert_eq!(mask.count(), 2);
        assert_eq!(mask.next_in_stream(1, 3), 1);
        assert_eq!(mask.next_in_stream(4, 3), 7);
        assert_eq!(mask.next_in_stream(2, 3), END_OF_STREAM, "blocks 2, 5 and 8 are zero");
        assert_eq!(mask.next_in_stream(10, 1), END_OF_STREAM);
    }

    #[test]
    fn a_sparse_worker_sends_a_block_only_when_a_result_names_it() {
        // One slot; this worker's non-zero blocks are 2 and 4 of 6.
        let start = Instant::now();
        let mut protocol = WorkerProtocol::new(config(1, Duration::from_millis(10)), start);
        let job = JobSpec {
            job: 1,
            element_type: ElementType::Int32,
            elements: 6,
            layout: Layout::Sparse(BlockMask::from_fn(6, |block| block == 2 || block == 4)),
            exponents: false,
        };
        protocol.start_job(start, job).unwrap();
        let first = sent(&mut protocol, start);
        let opening = parsed(&first[0]);
        assert_eq!((first.len(), opening.block, opening.element_count, opening.next_block), (1, 0, 0, 2));
        // Another worker's block 1 comes next: this worker's block 2 waits, and it only
        // acknowledges the result.
        protocol.handle_datagram(start, &sparse_result(0, 0, 0, 1, 0), &mut Numbers);
        let acks = sent(&mut protocol, start);
        let ack = parsed(&acks[0]);
        assert_eq!((acks.len(), ack.message_type, ack.ack_round), (1, MessageType::Ack, 0));
        protocol.handle_datagram(start, &sparse_result(0, 1, 1, 2, 1), &mut Numbers);
        let second = sent(&mut protocol, start);
        let data = parsed(&second[0]);
        assert_eq!((data.round, data.block, data.element_count, data.next_block), (2, 2, 1, 4));
        protocol.handle_datagram(start, &sparse_result(0, 2, 2, 4, 1), &mut Numbers);
        let third = sent(&mut protocol, start);
        let last = parsed(&third[0]);
        assert_eq!((last.block, last.next_block), (4, END_OF_STREAM));
        protocol.handle_datagram(start, &sparse_result(0, 3, 4, END_OF_STREAM, 1), &mut Numbers);
        assert_eq!(protocol.status(), &JobStatus::Done);
    }
}
