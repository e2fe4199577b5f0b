//! 16-bit floats (float16, bfloat16): summed in float32, converted on the way in and out.
//!
//! The switch holds each slot's sum of a 16-bit type in float32, 4 bytes an element like
//! the other types' sums: each contribution is widened exactly and added in float32, and
//! the sum is rounded once, to nearest even, as the result leaves ([`narrow`]). A 16-bit
//! accumulator would round after every addition, and a 16-bit block floating point
//! would lose the small elements of a block beside its largest (`docs/protocol.md` §2,
//! *float16 and bfloat16*, compares them); float32 sums n contributions with an error of about n·2⁻²⁴ of their
//! magnitudes, far below one 16-bit rounding. NaN and infinities behave as float32's do,
//! and a sum beyond float16's largest finite value (65504) rounds to infinity, as IEEE
//! conversion does.
//!
//! The same conversions serve the client, which narrows float32 tensors to 16 bits on the
//! wire (`general.wire_precision`). For the 32-bit types [`widen`] and [`narrow`] copy, so
//! that the engine treats every type alike.
//!
//! Conversions go through small aligned arrays on the stack, a chunk at a time: payload
//! bytes have no alignment, and the `half` crate's slice conversions, which use the
//! processor's F16C instructions where it has them (chosen at run time), need typed slices.

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};
use netagg_wire::ElementType;

/// Elements converted at a time: 1 KiB of float32 on the stack, a packet of the default
/// 256 elements in one go.
const CHUNK: usize = 256;

/// The 16-bit formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Half {
    Float16,
    BFloat16,
}

impl Half {
    fn of(element_type: ElementType) -> Option<Half> {
        match element_type {
            ElementType::Float16 => Some(Half::Float16),
            ElementType::BFloat16 => Some(Half::BFloat16),
            ElementType::Int32 | ElementType::Float32 => None,
        }
    }

    /// Each element's float32 value (exact: both formats are subsets of float32).
    fn widen(self, bits: &[u16], floats: &mut [f32]) {
        match self {
            Half::Float16 => bits.reinterpret_cast::<f16>().convert_to_f32_slice(floats),
            // bfloat16 is float32's upper half.
            Half::BFloat16 => {
                for (float, bits) in floats.iter_mut().zip(bits) {
                    *float = f32::from_bits(u32::from(*bits) << 16);
                }
            }
        }
    }

    /// Each float32 rounded to the format, to nearest even; NaN stays NaN (quiet).
    fn narrow(self, floats: &[f32], bits: &mut [u16]) {
        match self {
            Half::Float16 => bits.reinterpret_cast_mut::<f16>().convert_from_f32_slice(floats),
            Half::BFloat16 => bits.reinterpret_cast_mut::<bf16>().convert_from_f32_slice(floats),
        }
    }
}

/// Calls `each` with the float32 values of successive chunks of the 16-bit little-endian
/// elements in `narrow`, and the index of each chunk's first element.
fn for_each_widened_chunk(format: Half, narrow: &[u8], mut each: impl FnMut(usize, &[f32])) {
    let (mut bits, mut floats) = ([0u16; CHUNK], [0f32; CHUNK]);
    for (index, chunk) in narrow.chunks(CHUNK * 2).enumerate() {
        let count = chunk.len() / 2;
        for (bits, bytes) in bits.iter_mut().zip(chunk.chunks_exact(2)) {
            *bits = u16::from_le_bytes([bytes[0], bytes[1]]);
        }
        format.widen(&bits[..count], &mut floats[..count]);
        each(index * CHUNK, &floats[..count]);
    }
}

/// Writes into `wide` the float32 value of each 16-bit element of `narrow`, for as many
/// elements as both hold; for a 32-bit `element_type`, copies `narrow` into `wide`.
pub fn widen(element_type: ElementType, wide: &mut [u8], narrow: &[u8]) {
    let Some(format) = Half::of(element_type) else {
        let len = wide.len().min(narrow.len());
        wide[..len].copy_from_slice(&narrow[..len]);
        return;
    };
    let count = (wide.len() / 4).min(narrow.len() / 2);
    for_each_widened_chunk(format, &narrow[..count * 2], |first, floats| {
        for (out, float) in wide[first * 4..].chunks_exact_mut(4).zip(floats) {
            out.copy_from_slice(&float.to_le_bytes());
        }
    });
}

/// Writes into `narrow` each float32 element of `wide` rounded to `element_type`'s 16
/// bits, to nearest even, for as many elements as both hold; for a 32-bit `element_type`,
/// copies `wide` into `narrow`.
pub fn narrow(element_type: ElementType, narrow: &mut [u8], wide: &[u8]) {
    let Some(format) = Half::of(element_type) else {
        let len = wide.len().min(narrow.len());
        narrow[..len].copy_from_slice(&wide[..len]);
        return;
    };
    let count = (wide.len() / 4).min(narrow.len() / 2);
    let (mut floats, mut bits) = ([0f32; CHUNK], [0u16; CHUNK]);
    for (wide, narrow) in wide[..count * 4].chunks(CHUNK * 4).zip(narrow[..count * 2].chunks_mut(CHUNK * 2)) {
        let count = wide.len() / 4;
        for (float, bytes) in floats.iter_mut().zip(wide.chunks_exact(4)) {
            *float = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        }
        format.narrow(&floats[..count], &mut bits[..count]);
        for (out, bits) in narrow.chunks_exact_mut(2).zip(&bits[..count]) {
            out.copy_from_slice(&bits.to_le_bytes());
        }
    }
}

/// `acc[i] += src[i]` in float32: `acc` holds float32 sums (4 bytes an element), `src`
/// the 16-bit elements of a contribution; as many elements as both hold are added.
pub(crate) fn add_assign_widened(format: Half, acc: &mut [u8], src: &[u8]) {
    let count = (acc.len() / 4).min(src.len() / 2);
    for_each_widened_chunk(format, &src[..count * 2], |first, floats| {
        for (sum, float) in acc[first * 4..].chunks_exact_mut(4).zip(floats) {
            let total = f32::from_le_bytes([sum[0], sum[1], sum[2], sum[3]]) + float;
            sum.copy_from_slice(&total.to_le_bytes());
        }
    });
}

/// `out[i] = a[i] + b[i]` in float32: `out` receives float32 sums, `a` and `b` hold 16-bit
/// elements.
pub(crate) fn add_widened(format: Half, out: &mut [u8], a: &[u8], b: &[u8]) {
    let count = (out.len() / 4).min(a.len() / 2);
    for_each_widened_chunk(format, &a[..count * 2], |first, floats| {
        for (out, float) in out[first * 4..].chunks_exact_mut(4).zip(floats) {
            out.copy_from_slice(&float.to_le_bytes());
        }
    });
    add_assign_widened(format, &mut out[..count * 4], b);
}

/// Writes into `out` the sum of `workers` contributions of the 16-bit elements `src`, as
/// the switch would return it: each element times `workers` in float32, rounded once. The
/// product is what the switch's float32 additions give: exact, as every partial sum is,
/// up to 2¹³ workers for float16 and 2¹⁶ for bfloat16 (a 16-bit significand times a
/// count within float32's 24 bits). For the dummy backend, which sums one worker's data as
/// if every worker had sent it. For a 32-bit `element_type`, copies.
pub fn scale(element_type: ElementType, out: &mut [u8], src: &[u8], workers: u16) {
    let Some(format) = Half::of(element_type) else {
        let len = out.len().min(src.len());
        out[..len].copy_from_slice(&src[..len]);
        return;
    };
    let count = (out.len() / 2).min(src.len() / 2);
    let mut bits = [0u16; CHUNK];
    let factor = f32::from(workers);
    for_each_widened_chunk(format, &src[..count * 2], |first, floats| {
        let mut scaled = [0f32; CHUNK];
        for (scaled, float) in scaled.iter_mut().zip(floats) {
            *scaled = float * factor;
        }
        format.narrow(&scaled[..floats.len()], &mut bits[..floats.len()]);
        for (out, bits) in out[first * 2..].chunks_exact_mut(2).zip(&bits[..floats.len()]) {
            out.copy_from_slice(&bits.to_le_bytes());
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| f16::from_f32(*v).to_bits().to_le_bytes()).collect()
    }

    fn bf16_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes()).collect()
    }

    fn f32_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn floats(bytes: &[u8]) -> Vec<f32> {
        bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
    }

    fn halves(bytes: &[u8]) -> Vec<u16> {
        bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect()
    }

    #[test]
    fn widening_is_exact_and_narrowing_rounds_to_nearest_even() {
        // 1 + 2^-11 lies halfway between float16's 1 and 1 + 2^-10: even is 1. 1 + 3·2^-11
        // lies halfway between 1 + 2^-10 and 1 + 2^-9: even is 1 + 2^-9.
        let wide = f32_bytes(&[1.0 + 2f32.powi(-11), 1.0 + 3.0 * 2f32.powi(-11), -2.5, 65504.0, 65520.0]);
        let mut narrow = vec![0u8; 10];
        super::narrow(ElementType::Float16, &mut narrow, &wide);
        assert_eq!(halves(&narrow), [0x3C00, 0x3C02, 0xC100, 0x7BFF, 0x7C00], "65520 rounds to infinity");
        let mut back = vec![0u8; 20];
        widen(ElementType::Float16, &mut back, &narrow);
        assert_eq!(floats(&back), [1.0, 1.0 + 2f32.powi(-9), -2.5, 65504.0, f32::INFINITY]);
        // bfloat16: 1 + 2^-8 is halfway between 1 and 1 + 2^-7.
        let wide = f32_bytes(&[1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), 3.0e38, f32::NEG_INFINITY]);
        let mut narrow = vec![0u8; 8];
        super::narrow(ElementType::BFloat16, &mut narrow, &wide);
        assert_eq!(halves(&narrow), [0x3F80, 0x3F82, 0x7F62, 0xFF80]);
        widen(ElementType::BFloat16, &mut back[..16], &narrow);
        assert_eq!(floats(&back[..16])[..2], [1.0, 1.0 + 2f32.powi(-6)]);
    }

    #[test]
    fn nan_stays_nan_both_ways() {
        for element_type in [ElementType::Float16, ElementType::BFloat16] {
            let mut narrow = vec![0u8; 4];
            super::narrow(element_type, &mut narrow, &f32_bytes(&[f32::NAN, -f32::NAN]));
            let mut wide = vec![0u8; 8];
            widen(element_type, &mut wide, &narrow);
            assert!(floats(&wide).iter().all(|x| x.is_nan()), "{element_type:?}");
        }
    }

    #[test]
    fn sums_accumulate_in_float32_across_chunks() {
        // 600 elements: two whole chunks and a part. float16's 2048 + 1 is 2048, but the
        // float32 sum keeps the 1 until the final rounding, where 2049 + 1 = 2050 exists.
        let count = 600;
        let first: Vec<f32> = (0..count).map(|i| if i % 2 == 0 { 2048.0 } else { i as f32 }).collect();
        let mut acc = vec![0u8; count * 4];
        widen(ElementType::Float16, &mut acc, &f16_bytes(&first));
        for _ in 0..2 {
            add_assign_widened(Half::Float16, &mut acc, &f16_bytes(&vec![1.0; count]));
        }
        let sums = floats(&acc);
        for (i, sum) in sums.iter().enumerate() {
            let expected = f32::from(f16::from_f32(first[i])) + 2.0;
            assert_eq!(*sum, expected, "element {i}");
        }
        let mut result = vec![0u8; count * 2];
        super::narrow(ElementType::Float16, &mut result, &acc);
        assert_eq!(halves(&result)[0], f16::from_f32(2050.0).to_bits());
        let mut three_operand = vec![0u8; count * 4];
        add_widened(Half::BFloat16, &mut three_operand, &bf16_bytes(&first), &bf16_bytes(&first));
        assert_eq!(floats(&three_operand)[..3], [4096.0, 2.0, 4096.0]);
    }

    #[test]
    fn thirty_two_bit_types_are_copied() {
        let bytes = f32_bytes(&[1.5, -7.0]);
        for element_type in [ElementType::Int32, ElementType::Float32] {
            let (mut wide, mut narrow) = (vec![0u8; 8], vec![0u8; 8]);
            widen(element_type, &mut wide, &bytes);
            super::narrow(element_type, &mut narrow, &bytes);
            let mut scaled = vec![0u8; 8];
            scale(element_type, &mut scaled, &bytes, 3);
            assert_eq!((&wide, &narrow, &scaled), (&bytes, &bytes, &bytes));
        }
    }

    #[test]
    fn scaling_matches_the_sum_of_identical_contributions() {
        let values: Vec<f32> = (0..300).map(|i| (i as f32 - 150.0) * 0.37 + 1e-3).collect();
        for (element_type, bytes) in
            [(ElementType::Float16, f16_bytes(&values)), (ElementType::BFloat16, bf16_bytes(&values))]
        {
            for workers in [1u16, 2, 3, 7, 100] {
                let mut acc = vec![0u8; values.len() * 4];
                widen(element_type, &mut acc, &bytes);
                for _ in 1..workers {
                    add_assign_widened(Half::of(element_type).unwrap(), &mut acc, &bytes);
                }
                let mut summed = vec![0u8; bytes.len()];
                super::narrow(element_type, &mut summed, &acc);
                let mut scaled = vec![0u8; bytes.len()];
                scale(element_type, &mut scaled, &bytes, workers);
                assert_eq!(scaled, summed, "{element_type:?}, {workers} workers");
            }
        }
    }
}
