//! A simulated worker thread's share of a tensor, as the client's slices are: its blocks'
//! bytes in and the sums out.

use crate::worker::BlockIo;

/// One thread's share of one rank's tensor in the job it runs.
pub(super) struct TensorIo {
    pub(super) input: Vec<u8>,
    pub(super) output: Vec<u8>,
    pub(super) block_bytes: usize,
    /// The exponent each block was loaded with; `store` must be given the same.
    pub(super) exponents: Vec<Option<i8>>,
}

impl TensorIo {
    /// The io of a thread that has run no job yet.
    pub(super) fn empty() -> TensorIo {
        TensorIo { input: Vec::new(), output: Vec::new(), block_bytes: 0, exponents: Vec::new() }
    }

    fn block(&self, block: u32) -> &[u8] {
        let start = block as usize * self.block_bytes;
        &self.input[start..(start + self.block_bytes).min(self.input.len())]
    }
}

impl BlockIo for TensorIo {
    /// Passes elements through unchanged; exponents are only recorded and checked, so the
    /// protocol's agreement on them is tested apart from any quantiser.
    fn load(&mut self, block: u32, payload: &mut [u8], exponent: Option<i8>) {
        let start = block as usize * self.block_bytes;
        payload.copy_from_slice(&self.input[start..start + payload.len()]);
        self.exponents[block as usize] = exponent;
    }

    /// The number of significant bits of the block's largest magnitude.
    fn exponent(&mut self, block: u32) -> i8 {
        let largest = self
            .block(block)
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]).unsigned_abs())
            .max();
        (32 - largest.unwrap_or(0).leading_zeros()) as i8
    }

    fn store(&mut self, block: u32, payload: &[u8], exponent: Option<i8>) {
        assert_eq!(
            exponent, self.exponents[block as usize],
            "block {block} stored with another exponent than it was loaded with"
        );
        let start = block as usize * self.block_bytes;
        let end = (start + self.block_bytes).min(self.output.len());
        if payload.is_empty() {
            self.output[start..end].fill(0);
        } else {
            self.output[start..start + payload.len()].copy_from_slice(payload);
        }
    }
}
