//! netagg's element-wise kernels written with AVX2 and AVX-512 intrinsics, chosen at run
//! time: one x86-64 binary uses the widest vectors the CPU it runs on has.
//!
//! Each kernel does all the elements of its slices, a tail that fills no whole vector in
//! a masked one, and returns `true`; for [`InstructionSet::PORTABLE`] it does nothing and
//! returns `false`, and its caller's portable loop does the work. Those loops
//! (`netagg_aggregator::sum`,
//! `netagg::codec`) are the reference: every kernel's output equals theirs bit for bit,
//! which their tests check on random inputs and edge values for every set this CPU has.
//! Written by hand rather than left to the compiler's vectoriser, which left the AVX2
//! copies of these loops scalar under some build profiles (the workspace's `Cargo.toml`).
//!
//! All slices hold little-endian 32-bit elements (int32 or float32 bit patterns).

#[cfg(target_arch = "x86_64")]
mod x86;

use std::fmt;
use std::sync::OnceLock;

/// A set of vector instructions the kernels are written for, one this CPU has: a value
/// exists only for a set the CPU supports, which is what makes calling its kernels sound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct InstructionSet(Level);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Level {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 Foundation, which every AVX-512 CPU has and the kernels need alone.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl InstructionSet {
    /// No vector kernel: the callers' portable loops do all the work.
    pub const PORTABLE: InstructionSet = InstructionSet(Level::Portable);

    /// Every set this CPU has, narrowest first, the portable one included.
    pub fn supported() -> impl Iterator<Item = InstructionSet> {
        let levels = [
            Level::Portable,
            #[cfg(target_arch = "x86_64")]
            Level::Avx2,
            #[cfg(target_arch = "x86_64")]
            Level::Avx512,
        ];
        levels.into_iter().filter(|level| level.is_supported()).map(InstructionSet)
    }

    /// The set the kernels run with: AVX2 where the CPU has it, else the portable loops.
    /// Found once, then one load, as it is asked per packet (asking the CPU's features each
    /// time showed as 2 % of the client path's samples).
    ///
    /// Not the widest: on the AMD EPYC hosts this was measured on, which run a 512-bit
    /// operation as two halves, the AVX-512 kernels made the dummy client path 3-10 %
    /// slower than the AVX2 ones (benches/RESULTS.md, issue 29 item 2). They stay built
    /// and tested, and the `sum` and `codec` benches time them by name, so a host where
    /// they win can show it.
    #[inline]
    pub fn best() -> InstructionSet {
        static BEST: OnceLock<InstructionSet> = OnceLock::new();
        *BEST.get_or_init(|| {
            InstructionSet::supported()
                .filter(|set| !set.is_wider_than_avx2())
                .last()
                .unwrap_or(InstructionSet::PORTABLE)
        })
    }

    fn is_wider_than_avx2(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        return self.0 == Level::Avx512;
        #[cfg(not(target_arch = "x86_64"))]
        return false;
    }

    /// A short lower-case name: `portable`, `avx2` or `avx512`.
    pub fn name(self) -> &'static str {
        match self.0 {
            Level::Portable => "portable",
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => "avx512",
        }
    }
}

impl fmt::Display for InstructionSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Level {
    fn is_supported(self) -> bool {
        match self {
            Level::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => std::arch::is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
        }
    }
}

/// Calls `kernel` of `set`'s module with `args` and gives `Some` of its result, or
/// `None` for the portable set.
macro_rules! dispatch {
    ($set:expr, $kernel:ident($($arg:expr),*)) => {
        match $set.0 {
            Level::Portable => None,
            // SAFETY: an `InstructionSet` is only made for a set this CPU has
            // (`InstructionSet::supported` and `best`), which is all the kernels need
            // beyond their arguments' types.
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => Some(unsafe { x86::avx2::$kernel($($arg),*) }),
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => Some(unsafe { x86::avx512::$kernel($($arg),*) }),
        }
    };
}

/// `acc[i] += src[i]`, wrapping int32, for the elements both hold; `false` for the
/// portable set, which leaves it to the caller.
#[inline]
pub fn add_assign_i32(set: InstructionSet, acc: &mut [u8], src: &[u8]) -> bool {
    dispatch!(set, add_assign_i32(acc, src)).is_some()
}

/// `acc[i] += src[i]` in float32, as [`add_assign_i32`].
#[inline]
pub fn add_assign_f32(set: InstructionSet, acc: &mut [u8], src: &[u8]) -> bool {
    dispatch!(set, add_assign_f32(acc, src)).is_some()
}

/// `out[i] = a[i] + b[i]`, wrapping int32, for the elements all three hold; `false` for
/// the portable set, which leaves it to the caller.
#[inline]
pub fn add_i32(set: InstructionSet, out: &mut [u8], a: &[u8], b: &[u8]) -> bool {
    dispatch!(set, add_i32(out, a, b)).is_some()
}

/// `out[i] = a[i] + b[i]` in float32, as [`add_i32`].
#[inline]
pub fn add_f32(set: InstructionSet, out: &mut [u8], a: &[u8], b: &[u8]) -> bool {
    dispatch!(set, add_f32(out, a, b)).is_some()
}

/// `out[i] = src[i] · factor`, wrapping int32, for the elements both hold: the sum of
/// `factor` copies of `src` in one pass; `false` for the portable set, which leaves it to
/// the caller.
#[inline]
pub fn multiply_i32(set: InstructionSet, out: &mut [u8], src: &[u8], factor: i32) -> bool {
    dispatch!(set, multiply_i32(out, src, factor)).is_some()
}

/// The largest of `bits & 0x7FFF_FFFF` over the elements of `bytes` (0 if none): a
/// float32 block's largest magnitude, ordered as unsigned integers (infinities and NaN
/// above all finite values); `None` for the portable set.
#[inline]
pub fn largest_magnitude_bits(set: InstructionSet, bytes: &[u8]) -> Option<u32> {
    dispatch!(set, largest_magnitude_bits(bytes))
}

/// [`largest_magnitude_bits`] of each block of `block_bytes` bytes in `bytes` (the last
/// may be shorter), into `largest` in order, for as many blocks as it has room for: the
/// exponents of many packets in one call, where a call a packet cost more around the
/// loop than in it. `false` for the portable set.
///
/// # Panics
/// If `block_bytes` is 0.
#[inline]
pub fn largest_magnitude_bits_of_blocks(
    set: InstructionSet,
    bytes: &[u8],
    block_bytes: usize,
    largest: &mut [u32],
) -> bool {
    assert!(block_bytes > 0, "blocks of no bytes");
    dispatch!(set, largest_magnitude_bits_of_blocks(bytes, block_bytes, largest)).is_some()
}

/// Block floating point's encoding of float32 `elements` into int32 `payload`, for the
/// elements both hold: `x · low` (then `· high` unless `high` is 1) rounded to the
/// nearest integer, ties to even, clamped to `±limit` by `max(rounded, -limit)` and
/// `min(·, limit)` with x86's operand order (a NaN becomes `-limit`), then converted;
/// `limit` must be an integer below 2^31. `false` for the portable set.
#[inline]
pub fn quantise(
    set: InstructionSet,
    elements: &[u8],
    payload: &mut [u8],
    scale: (f32, f32),
    limit: f32,
) -> bool {
    dispatch!(set, quantise(elements, payload, scale, limit)).is_some()
}

/// Block floating point's decoding of int32 `payload` sums into float32 `elements`, for
/// the elements both hold: `sum as f32 · low` (then `· high` unless `high` is 1).
/// `false` for the portable set.
#[inline]
pub fn dequantise(set: InstructionSet, payload: &[u8], elements: &mut [u8], scale: (f32, f32)) -> bool {
    dispatch!(set, dequantise(payload, elements, scale)).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_best_set_is_supported_and_the_portable_one_always_is() {
        let supported: Vec<_> = InstructionSet::supported().collect();
        assert_eq!(supported[0], InstructionSet::PORTABLE);
        assert!(supported.contains(&InstructionSet::best()));
        let avx2 = supported.iter().find(|set| set.name() == "avx2");
        assert_eq!(InstructionSet::best(), *avx2.unwrap_or(&InstructionSet::PORTABLE), "AVX2 where present");
    }

    /// Runs `body` with the thread's MXCSR rounding toward zero, then restores it.
    #[cfg(target_arch = "x86_64")]
    fn rounding_toward_zero<T>(body: impl FnOnce() -> T) -> T {
        let mut saved = 0u32;
        // SAFETY: `stmxcsr` and `ldmxcsr` read and write the 4 bytes given and the
        // thread's MXCSR; the value loaded differs from a valid one in its rounding bits.
        unsafe { std::arch::asm!("stmxcsr [{}]", in(reg) &mut saved, options(nostack)) };
        let toward_zero = saved | 0x6000;
        // SAFETY: as above.
        unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &toward_zero, options(nostack)) };
        let result = body();
        // SAFETY: as above, restoring the value read.
        unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &saved, options(nostack)) };
        result
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    #[cfg_attr(miri, ignore)] // Miri runs no inline assembly
    fn quantise_rounds_ties_to_even_whatever_rounding_mode_a_host_set() {
        // Toward zero, 2.5 and 3.5 would become 2 and 3, 0.75 would become 0; 9 elements
        // leave one for a masked tail.
        let values = [2.5f32, -2.5, 3.5, -3.5, 0.75, 0.5, 1.5, -0.75, 2.5];
        let elements: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        for set in InstructionSet::supported().filter(|&set| set != InstructionSet::PORTABLE) {
            for scale in [(1.0, 1.0), (0.5, 2.0)] {
                let mut payload = vec![0u8; elements.len()];
                assert!(rounding_toward_zero(|| quantise(set, &elements, &mut payload, scale, 1e9)));
                let got: Vec<i32> =
                    payload.chunks(4).map(|q| i32::from_le_bytes(q.try_into().unwrap())).collect();
                assert_eq!(got, [2, -2, 4, -4, 1, 0, 2, -1, 2], "{set}, scale {scale:?}");
            }
        }
    }

    #[test]
    fn the_scan_sees_every_element_wherever_its_bytes_start() {
        // Starts at every byte offset of two vectors, so that some are aligned, some are
        // on elements, and some split them; each element in turn the largest.
        let mut buffer = vec![0u8; 4 * 64 + 128];
        for set in InstructionSet::supported().filter(|&set| set != InstructionSet::PORTABLE) {
            for offset in 0..128 {
                for elements in [0, 1, 15, 16, 17, 31, 32, 33, 47, 48, 64] {
                    for largest_at in 0..elements {
                        buffer.fill(0);
                        let bytes = &mut buffer[offset..offset + 4 * elements];
                        for (i, element) in bytes.chunks_exact_mut(4).enumerate() {
                            let bits = if i == largest_at { 0xC000_0000 } else { 0x8000_0000 | i as u32 };
                            element.copy_from_slice(&bits.to_le_bytes());
                        }
                        let found = largest_magnitude_bits(set, bytes);
                        assert_eq!(
                            found,
                            Some(0x4000_0000),
                            "{set}: offset {offset}, {elements}, at {largest_at}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn kernels_do_every_element_and_write_no_other() {
        for set in InstructionSet::supported() {
            // Lengths around each set's vectors of 8 and 16 lanes.
            for elements in [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 67] {
                let src: Vec<u8> = (1..=elements as u32).flat_map(|i| i.to_le_bytes()).collect();
                let mut acc = vec![0u8; src.len() + 4];
                let did = add_assign_i32(set, &mut acc, &src);
                assert_eq!(did, set != InstructionSet::PORTABLE, "{set}");
                if did {
                    assert_eq!(acc[..src.len()], src, "{set}, {elements} elements");
                }
                assert_eq!(acc[src.len()..], [0; 4], "{set}: beyond the source");
                let mut product = vec![0u8; src.len() + 4];
                assert_eq!(multiply_i32(set, &mut product, &src, -3), did, "{set}");
                if did {
                    let expected: Vec<u8> = (1..=elements).flat_map(|i| (-3i32 * i).to_le_bytes()).collect();
                    assert_eq!(product[..src.len()], expected, "{set}, {elements} elements");
                }
                assert_eq!(product[src.len()..], [0; 4], "{set}: beyond the source");
                // A byte beyond the last element is no element.
                let mut ragged = src.clone();
                ragged.push(0xFF);
                let largest = largest_magnitude_bits(set, &ragged);
                assert_eq!(largest, did.then_some(elements as u32), "{set}, {elements} elements");
                // Blocks of 5 elements, into room for all but the last: each block's
                // largest, the last left as it was.
                let blocks = src.len().div_ceil(20);
                let mut largest = vec![u32::MAX; blocks];
                let room = blocks.saturating_sub(1);
                assert_eq!(largest_magnitude_bits_of_blocks(set, &src, 20, &mut largest[..room]), did);
                if did {
                    let expected: Vec<u32> =
                        (0..room).map(|block| (block as u32 * 5 + 5).min(elements as u32)).collect();
                    assert_eq!(largest[..room], expected, "{set}, {elements} elements");
                }
                assert!(largest[room..].iter().all(|&bits| bits == u32::MAX), "{set}: beyond the room");
            }
        }
    }
}
