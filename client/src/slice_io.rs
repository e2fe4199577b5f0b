//! Slice I/O: the one place where the caller's raw buffers become byte slices.
//!
//! A job holds raw pointers to its caller's input and output ([`JobShared`]), valid for
//! the job's elements until it ends: the submitter's contract (`Context::submit_raw`).
//! The job is cut into slices of whole blocks, each moved by one worker thread alone,
//! so every slice made here lies within the job's buffers and no two threads write the
//! same bytes. That is the SAFETY argument of every `unsafe` block below.
//!
//! The input is initialised memory (the submitter's contract); the output may not be
//! (C's `malloc`, NumPy's `empty`), and a `&mut [u8]` must not cover bytes never written:
//! output is written through raw pointers, and a block is zeroed before a codec gets it
//! as a slice, unless the job says its output is initialised ([`OutputMemory`]).

use std::sync::Arc;

use netagg_aggregator::{BlockIo, Layout};
use netagg_config::SparseMode;

use crate::codec::Codec;
use crate::job::{DataType, JobShared, OutputMemory};

/// The `len` bytes of a job's input at `input`, for checking before the job is queued.
///
/// # Safety
/// `input` must be readable for `len` bytes, which nobody writes while the slice lives
/// (the submitter's contract).
pub(crate) unsafe fn input_bytes<'a>(input: *const u8, len: usize) -> &'a [u8] {
    // SAFETY: as the caller guarantees.
    unsafe { std::slice::from_raw_parts(input, len) }
}

/// Blocks whose exponents one look-up finds together: a run of 32 KiB at 256-element
/// packets, read in one sequential pass, where a block at a time, between the other work
/// of a packet, waits on memory for each. Each look-up also prefetches one block of the
/// next run, so that the run finds its blocks in cache.
const EXPONENT_RUN: usize = 32;

/// How many blocks ahead a store prefetches the output: a few packets' time, as the
/// memory system takes to answer.
const STORE_PREFETCH_DISTANCE: usize = 16;

/// How many blocks ahead a load prefetches the input, as a store does the output.
const LOAD_PREFETCH_DISTANCE: usize = 16;

/// The longest block [`SliceIo`] prefetches: 1024 float32 elements.
const PREFETCH_MAX_BLOCK_BYTES: usize = 4096;

/// Moves a slice's blocks between the caller's buffers and packets through the codec.
pub(crate) struct SliceIo<'a> {
    input: *const u8,
    output: *mut u8,
    /// Whether output blocks must be zeroed before a codec writes them as a slice.
    output_uninitialised: bool,
    /// Whether a store prefetches the output ahead: not in place, where a block's output
    /// is its input, read into the cache when its packet was sent, a round trip before
    /// its result comes (prefetching it again cost about 50 instructions a result).
    prefetches_output: bool,
    bytes: usize,
    block_bytes: usize,
    data_type: DataType,
    /// Bytes of an element in the caller's buffers and in a payload, as powers of two
    /// (every type takes 2 or 4 bytes): they differ where the codec narrows float32 to 16
    /// bits. Shifts, as this converts lengths twice a packet, where a division costs.
    element_size_log2: u32,
    wire_element_size_log2: u32,
    codec: Arc<dyn Codec>,
    /// The exponents of the slice's first blocks, found [`EXPONENT_RUN`] at a time; the
    /// worker thread's buffer, empty at the start of a slice.
    exponents: &'a mut Vec<i8>,
}

impl<'a> SliceIo<'a> {
    /// The I/O of the slice of `job` that starts at block `first_block` and holds
    /// `elements` elements, of blocks of `block_bytes`; `exponents` is the worker
    /// thread's buffer for exponents, cleared here.
    pub fn new(
        job: &JobShared,
        first_block: usize,
        elements: usize,
        block_bytes: usize,
        codec: Arc<dyn Codec>,
        exponents: &'a mut Vec<i8>,
    ) -> SliceIo<'a> {
        let offset = first_block * block_bytes;
        exponents.clear();
        let in_place = std::ptr::eq(job.buffers.input, job.buffers.output);
        SliceIo {
            // SAFETY: the slice lies within the job's buffers (split in `submit_raw`),
            // so the offset stays inside them.
            input: unsafe { job.buffers.input.add(offset) },
            // SAFETY: as for the input.
            output: unsafe { job.buffers.output.add(offset) },
            output_uninitialised: job.buffers.output_memory == OutputMemory::MaybeUninitialised,
            prefetches_output: !in_place && prefetches(block_bytes),
            bytes: elements * job.data_type.size(),
            block_bytes,
            data_type: job.data_type,
            element_size_log2: job.data_type.size().ilog2(),
            wire_element_size_log2: codec.wire_type(job.data_type).size().ilog2(),
            codec,
            exponents,
        }
    }
}

impl SliceIo<'_> {
    fn range(&self, block: u32, len: usize) -> std::ops::Range<usize> {
        let start = block as usize * self.block_bytes;
        start..(start + len).min(self.bytes)
    }

    /// Whether the slice has a block `block` (a multiplication: this runs per packet).
    fn has_block(&self, block: usize) -> bool {
        block * self.block_bytes < self.bytes
    }

    /// Bytes in the caller's buffers of the elements of `payload_len` payload bytes.
    fn memory_len(&self, payload_len: usize) -> usize {
        payload_len >> self.wire_element_size_log2 << self.element_size_log2
    }

    /// Payload bytes of the elements of `memory_len` bytes in the caller's buffers.
    fn payload_len(&self, memory_len: usize) -> usize {
        memory_len >> self.element_size_log2 << self.wire_element_size_log2
    }

    fn input(&self, block: u32, len: usize) -> &[u8] {
        let range = self.range(block, len);
        // SAFETY: the protocol only asks for blocks of this slice, whose bytes lie within
        // the job's input (the submitter's contract); `range` clamps to the slice.
        unsafe { std::slice::from_raw_parts(self.input.add(range.start), range.len()) }
    }
}

#[cfg(target_endian = "big")]
compile_error!("netagg's wire format is little-endian; big-endian hosts need a byte-swapping codec");

impl BlockIo for SliceIo<'_> {
    #[inline]
    fn load(&mut self, block: u32, payload: &mut [u8], exponent: Option<i8>) {
        let elements = self.input(block, self.memory_len(payload.len()));
        let len = self.payload_len(elements.len());
        self.codec.encode(self.data_type, elements, &mut payload[..len], exponent);
        // Blocks go out about in order: the input a later one reads is fetched now, unless
        // the codec's exponent runs read ahead already.
        let ahead = block as usize + LOAD_PREFETCH_DISTANCE;
        if exponent.is_none() && prefetches(self.block_bytes) && self.has_block(ahead) {
            let ahead = self.input(ahead as u32, self.block_bytes);
            prefetch(ahead.as_ptr(), ahead.len());
        }
    }

    // Inlined by force into the receive path, its one caller per result: with the hint
    // alone a build of 16 codegen units left it a call (callgrind).
    #[inline(always)]
    fn store(&mut self, block: u32, payload: &[u8], exponent: Option<i8>) {
        let len = if payload.is_empty() { self.block_bytes } else { self.memory_len(payload.len()) };
        let range = self.range(block, len);
        // SAFETY: as in `input`; this thread alone writes this slice's bytes.
        let target = unsafe { self.output.add(range.start) };
        if payload.is_empty() || self.output_uninitialised {
            // SAFETY: as above; raw writes, which need no initialised bytes.
            unsafe { std::ptr::write_bytes(target, 0, range.len()) };
        }
        if !payload.is_empty() {
            // SAFETY: as above, and the bytes are initialised: the caller's, or zeroed.
            let target = unsafe { std::slice::from_raw_parts_mut(target, range.len()) };
            let len = self.payload_len(target.len());
            self.codec.decode(self.data_type, &payload[..len], target, exponent);
        }
        // Results come back about in block order: the output a later one writes is
        // fetched now, so that its store finds the lines in cache.
        let ahead = block as usize + STORE_PREFETCH_DISTANCE;
        if self.prefetches_output && self.has_block(ahead) {
            let range = self.range(ahead as u32, self.block_bytes);
            // SAFETY: as in `input`: the range lies within the slice.
            prefetch(unsafe { self.output.add(range.start) }, range.len());
        }
    }

    // Inlined by force into the send path, as `store` is into the receive path: a call
    // of about 15 instructions a packet at 16 codegen units.
    #[inline(always)]
    fn exponent(&mut self, block: u32) -> i8 {
        let block = block as usize;
        if block >= self.exponents.len() {
            // Out of `self` while the codec fills it, as the input it reads borrows `self`.
            let mut exponents = std::mem::take(&mut *self.exponents);
            let first = exponents.len();
            let end = (block + EXPONENT_RUN).min(self.bytes.div_ceil(self.block_bytes));
            let elements = self.input(first as u32, (end - first) * self.block_bytes);
            self.codec.exponents(self.data_type, elements, self.block_bytes, &mut exponents);
            *self.exponents = exponents;
        }
        // One block of the next run per look-up: its reads from memory then overlap the
        // packets' work instead of stalling the run that scans them.
        let ahead = block + EXPONENT_RUN;
        if prefetches(self.block_bytes) && self.has_block(ahead) {
            let ahead = self.input(ahead as u32, self.block_bytes);
            prefetch(ahead.as_ptr(), ahead.len());
        }
        self.exponents[block]
    }
}

/// Whether blocks of `block_bytes` are short enough to prefetch: a long block is a
/// sequential run the hardware prefetcher streams by itself, and prefetching blocks of 16
/// KiB (those of `configs/large-packets.cfg`) ran a fifth slower.
fn prefetches(block_bytes: usize) -> bool {
    block_bytes <= PREFETCH_MAX_BLOCK_BYTES
}

/// Asks the processor to bring the `len` bytes at `start` into its caches, without
/// waiting for them. A pointer, not a slice: an output buffer may hold uninitialised
/// bytes, which no slice may cover.
fn prefetch(start: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for offset in (0..len).step_by(64) {
        // SAFETY: the caller passes bytes of one allocation, so the offset stays within
        // it; a prefetch reads nothing the program sees, and never faults.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(start.add(offset).cast())
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, len);
}

impl SliceIo<'_> {
    /// How the slice travels ([`crate::sparse::layout`]); out of place, clears the
    /// outputs of the blocks it leaves off the wire, which no result will overwrite.
    pub fn layout(&self, mode: SparseMode) -> Layout {
        let (output, in_place) = (self.output, std::ptr::eq(self.input, self.output));
        let input = self.input(0, self.bytes);
        crate::sparse::layout(mode, self.codec.as_ref(), self.data_type, input, self.block_bytes, |range| {
            if !in_place {
                // SAFETY: `range` lies within the slice (it indexes `input`, of the same
                // length), which this thread alone writes.
                unsafe { std::ptr::write_bytes(output.add(range.start), 0, range.len()) }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::mem::MaybeUninit;

    use super::*;
    use crate::codec::Native;
    use crate::job::JobBuffers;

    /// Output memory as C's `malloc` or NumPy's `empty` give it: never written.
    fn uninitialised(bytes: usize) -> Vec<MaybeUninit<u8>> {
        (0..bytes).map(|_| MaybeUninit::uninit()).collect()
    }

    #[test]
    fn sums_are_stored_into_output_memory_never_written_before() {
        let input: Vec<u8> = (0..32).collect();
        let mut output = uninitialised(32);
        let buffers = JobBuffers {
            input: input.as_ptr(),
            output: output.as_mut_ptr().cast(),
            output_memory: OutputMemory::MaybeUninitialised,
        };
        let job = JobShared::new(1, DataType::Int32, 8, buffers, None, 1);
        let mut exponents = Vec::new();
        let mut io = SliceIo::new(&job, 0, 8, 16, Arc::new(Native), &mut exponents);
        let sums: Vec<u8> = (100..116).collect();
        io.store(0, &sums, None);
        io.store(1, &[], None);
        // SAFETY: both blocks were stored: every byte is written.
        let output: Vec<u8> = output.iter().map(|byte| unsafe { byte.assume_init() }).collect();
        assert_eq!(output[..16], sums[..]);
        assert_eq!(output[16..], [0; 16], "a block whose result is empty stores zeros");
    }
}
