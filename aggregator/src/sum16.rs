//! 16-bit floats (float16, bfloat16): summed in float32, converted on the way in and out.
//!
//! The switch holds each slot's sum of a 16-bit type in float32, 4 bytes an element like
//! the other types' sums: each contribution is widened exactly and added in float32, and
//! the sum is rounded once, to nearest even, as the result leaves ([`narrow`]). A 16-bit
//! accumulator would round after every addition, and a 16-bit block floating point
//! would lose the small elements of a block beside its largest (`docs/protocol.md` §2,
//! *float16 and bfloat16*, compares them); float32 sums n contributions with an error
//! of about n·2⁻²⁴ of their magnitudes, far below one 16-bit rounding. NaN and infinities behave as float32's do,
//! and a sum beyond float16's largest finite value (65504) rounds to infinity, as IEEE
//! conversion does.
//!
//! The same conversions serve the client, which narrows float32 tensors to 16 bits on the
//! wire (`general.wire_precision`). For the 32-bit types [`widen`] and [`narrow`] copy, so
//! that the engine treats every type alike.
//!
//! The conversions are branch-free integer and float arithmetic on each element's bits,
//! read straight from the payload's bytes, in loops the compiler turns into vector
//! instructions (compiled for AVX2 beside baseline x86-64, chosen at run time, as
//! [`crate::sum`]'s are). They round as IEEE conversion does, to nearest even, and a test
//! checks them against the `half` crate's on every 16-bit value and a sweep of float32
//! ones. The `half` crate's slice conversions, which need aligned typed slices and so
//! copies of the unaligned payloads, were a third to a quarter as fast for bfloat16 (it
//! converts those one at a time); for float16, where it uses the F16C instructions, its
//! sum was slower and its narrowing faster (`benches/RESULTS.md`, issue 30).

use netagg_wire::ElementType;

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
}

/// The float32 bits of a float16, exactly.
#[inline(always)]
fn float16_to_float32(half: u16) -> u32 {
    let half = u32::from(half);
    let sign = (half & 0x8000) << 16;
    let magnitude = half & 0x7FFF;
    // A normal float16 is a float32 with the exponent rebiased by +112, and infinities
    // and NaN keep their mantissa under float32's all-ones exponent.
    let shifted = magnitude << 13;
    let normal = shifted + (112 << 23);
    let special = shifted | 0x7F80_0000;
    // A subnormal is its mantissa times 2^-24: converted from the integer (a signed one,
    // which vector instructions convert), with no subnormal float32 on the way, which a
    // host's denormals-are-zero mode would flush.
    let subnormal = (magnitude as i32 as f32 * f32::from_bits((127 - 24) << 23)).to_bits();
    sign | if magnitude >= 0x7C00 {
        special
    } else if magnitude < 0x400 {
        subnormal
    } else {
        normal
    }
}

/// The float16 bits of a float32, rounded to nearest even; from 65520 on (half a step
/// past the largest float16, 65504) infinite, and NaN a quiet NaN.
#[inline(always)]
fn float32_to_float16(float: u32) -> u16 {
    let sign = (float >> 16) & 0x8000;
    let magnitude = float & 0x7FFF_FFFF;
    let nan = 0x7E00 | (magnitude >> 13 & 0x3FF);
    // Normal results: the exponent rebiased by -112, then the 13 bits float16 lacks
    // rounded off, ties to the even neighbour (a carry into the exponent is right).
    let rebiased = magnitude.wrapping_sub(112 << 23);
    let normal = rebiased.wrapping_add(0xFFF + (rebiased >> 13 & 1)) >> 13;
    // Below 2^-14, float16's subnormals are multiples of 2^-24, the spacing of float32
    // in [0.5, 1): adding 0.5 rounds the value to one (ties to even, by the FPU), and the
    // bits past 0.5's are its float16 encoding (0x400, the smallest normal, if it rounds up).
    let half = f32::from_bits(126 << 23);
    let subnormal = (f32::from_bits(magnitude) + half).to_bits().wrapping_sub(half.to_bits());
    let bits = if magnitude > 0x7F80_0000 {
        nan
    } else if magnitude >= 0x477F_F000 {
        0x7C00
    } else if magnitude < 0x3880_0000 {
        subnormal
    } else {
        normal
    };
    (sign | bits) as u16
}

/// The float32 bits of a bfloat16: its upper half.
#[inline(always)]
fn bfloat16_to_float32(half: u16) -> u32 {
    u32::from(half) << 16
}

/// The bfloat16 bits of a float32, rounded to nearest even (past the largest bfloat16,
/// infinite); NaN a quiet NaN.
#[inline(always)]
fn float32_to_bfloat16(float: u32) -> u16 {
    let rounded = float.wrapping_add(0x7FFF + (float >> 16 & 1)) >> 16;
    let nan = float >> 16 | 0x40;
    (if float & 0x7FFF_FFFF > 0x7F80_0000 { nan } else { rounded }) as u16
}

/// An element's 16 or 32 bits from its little-endian bytes. Always inlined, as every
/// helper of the loops below: a call out of them would leave them scalar.
#[inline(always)]
fn bits16(bytes: &[u8]) -> u16 {
    u16::from_le_bytes([bytes[0], bytes[1]])
}

#[inline(always)]
fn bits32(bytes: &[u8]) -> u32 {
    u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}

#[inline(always)]
fn widen_each(wide: &mut [u8], narrow: &[u8], convert: impl Fn(u16) -> u32) {
    for (out, half) in wide.chunks_exact_mut(4).zip(narrow.chunks_exact(2)) {
        out.copy_from_slice(&convert(bits16(half)).to_le_bytes());
    }
}

#[inline(always)]
fn narrow_each(narrow: &mut [u8], wide: &[u8], convert: impl Fn(u32) -> u16) {
    for (out, float) in narrow.chunks_exact_mut(2).zip(wide.chunks_exact(4)) {
        out.copy_from_slice(&convert(bits32(float)).to_le_bytes());
    }
}

#[inline(always)]
fn add_each(acc: &mut [u8], src: &[u8], convert: impl Fn(u16) -> u32) {
    for (sum, half) in acc.chunks_exact_mut(4).zip(src.chunks_exact(2)) {
        let total = f32::from_bits(bits32(sum)) + f32::from_bits(convert(bits16(half)));
        sum.copy_from_slice(&total.to_le_bytes());
    }
}

#[inline(always)]
fn scale_each(
    out: &mut [u8],
    src: &[u8],
    factor: f32,
    widen: impl Fn(u16) -> u32,
    narrow: impl Fn(u32) -> u16,
) {
    for (out, half) in out.chunks_exact_mut(2).zip(src.chunks_exact(2)) {
        let product = f32::from_bits(widen(bits16(half))) * factor;
        out.copy_from_slice(&narrow(product.to_bits()).to_le_bytes());
    }
}

#[multiversion::multiversion(targets("x86_64+avx2"))]
fn widen_float16(wide: &mut [u8], narrow: &[u8]) {
    widen_each(wide, narrow, float16_to_float32);
}

#[multiversion::multiversion(targets("x86_64+avx2"))]
fn widen_bfloat16(wide: &mut [u8], narrow: &[u8]) {
    widen_each(wide, narrow, bfloat16_to_float32);
}

#[multiversion::multiversion(targets("x86_64+avx2"))]
fn narrow_float16(narrow: &mut [u8], wide: &[u8]) {
    narrow_each(narrow, wide, float32_to_float16);
}

#[multiversion::multiversion(targets("x86_64+avx2"))]
fn narrow_bfloat16(narrow: &mut [u8], wide: &[u8]) {
    narrow_each(narrow, wide, float32_to_bfloat16);
}

#[multiversion::multiversion(targets("x86_64+avx2"))]
fn add_float16(acc: &mut [u8], src: &[u8]) {
    add_each(acc, src, float16_to_float32);
}

#[multiversion::multiversion(targets("x86_64+avx2"))]
fn add_bfloat16(acc: &mut [u8], src: &[u8]) {
    add_each(acc, src, bfloat16_to_float32);
}

#[multiversion::multiversion(targets("x86_64+avx2"))]
fn scale_float16(out: &mut [u8], src: &[u8], factor: f32) {
    scale_each(out, src, factor, float16_to_float32, float32_to_float16);
}

#[multiversion::multiversion(targets("x86_64+avx2"))]
fn scale_bfloat16(out: &mut [u8], src: &[u8], factor: f32) {
    scale_each(out, src, factor, bfloat16_to_float32, float32_to_bfloat16);
}

/// Writes into `wide` the float32 value of each 16-bit element of `narrow`, for as many
/// elements as both hold; for a 32-bit `element_type`, copies `narrow` into `wide`.
pub fn widen(element_type: ElementType, wide: &mut [u8], narrow: &[u8]) {
    match Half::of(element_type) {
        Some(Half::Float16) => widen_float16(wide, narrow),
        Some(Half::BFloat16) => widen_bfloat16(wide, narrow),
        None => {
            let len = wide.len().min(narrow.len());
            wide[..len].copy_from_slice(&narrow[..len]);
        }
    }
}

/// Writes into `narrow` each float32 element of `wide` rounded to `element_type`'s 16
/// bits, to nearest even, for as many elements as both hold; for a 32-bit `element_type`,
/// copies `wide` into `narrow`.
pub fn narrow(element_type: ElementType, narrow: &mut [u8], wide: &[u8]) {
    match Half::of(element_type) {
        Some(Half::Float16) => narrow_float16(narrow, wide),
        Some(Half::BFloat16) => narrow_bfloat16(narrow, wide),
        None => {
            let len = wide.len().min(narrow.len());
            narrow[..len].copy_from_slice(&wide[..len]);
        }
    }
}

/// `acc[i] += src[i]` in float32: `acc` holds float32 sums (4 bytes an element), `src`
/// the 16-bit elements of a contribution; as many elements as both hold are added.
pub(crate) fn add_assign_widened(format: Half, acc: &mut [u8], src: &[u8]) {
    match format {
        Half::Float16 => add_float16(acc, src),
        Half::BFloat16 => add_bfloat16(acc, src),
    }
}

/// `out[i] = a[i] + b[i]` in float32: `out` receives float32 sums, `a` and `b` hold 16-bit
/// elements.
pub(crate) fn add_widened(format: Half, out: &mut [u8], a: &[u8], b: &[u8]) {
    let count = (out.len() / 4).min(a.len() / 2);
    let out = &mut out[..count * 4];
    match format {
        Half::Float16 => widen_float16(out, a),
        Half::BFloat16 => widen_bfloat16(out, a),
    }
    add_assign_widened(format, out, b);
}

/// Writes into `out` the sum of `workers` contributions of the 16-bit elements `src`, as
/// the switch would return it: each element times `workers` in float32, rounded once. The
/// product is what the switch's float32 additions give: exact, as every partial sum is,
/// up to 2¹³ workers for float16 and 2¹⁶ for bfloat16 (a 16-bit significand times a
/// count within float32's 24 bits). For the dummy backend, which sums one worker's data as
/// if every worker had sent it. For a 32-bit `element_type`, copies.
pub fn scale(element_type: ElementType, out: &mut [u8], src: &[u8], workers: u16) {
    let factor = f32::from(workers);
    match Half::of(element_type) {
        Some(Half::Float16) => scale_float16(out, src, factor),
        Some(Half::BFloat16) => scale_bfloat16(out, src, factor),
        None => {
            let len = out.len().min(src.len());
            out[..len].copy_from_slice(&src[..len]);
        }
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;

    /// Float32 bit patterns: a sweep of the whole range, every power of two and the ties
    /// just below and above every rounding point of both formats, and the specials.
    fn float32_patterns() -> impl Iterator<Item = u32> {
        let sweep = (0..=u32::MAX).step_by(4099);
        let around = (0..512u32).flat_map(|exponent_and_sign| {
            let base = exponent_and_sign << 23;
            [0, 1, 0xFFF, 0x1000, 0x1001, 0x3000, 0x7FFF, 0x8000, 0x8001, 0x1_8000, 0x7F_FFFF]
                .map(move |mantissa| base | mantissa)
        });
        sweep.chain(around).chain([
            0x7F80_0000,
            0xFF80_0000,
            0x7FC0_0000,
            0x7F80_0001,
            0x477F_F000,
            0x477F_EFFF,
        ])
    }

    #[test]
    fn conversions_agree_with_the_half_crate_on_every_16_bit_value_and_a_float32_sweep() {
        for bits in 0..=u16::MAX {
            let (ours, theirs) = (f32::from_bits(float16_to_float32(bits)), f16::from_bits(bits).to_f32());
            assert!(
                ours.to_bits() == theirs.to_bits() || ours.is_nan() && theirs.is_nan(),
                "float16 {bits:#06x}"
            );
            let (ours, theirs) = (f32::from_bits(bfloat16_to_float32(bits)), bf16::from_bits(bits).to_f32());
            assert!(
                ours.to_bits() == theirs.to_bits() || ours.is_nan() && theirs.is_nan(),
                "bfloat16 {bits:#06x}"
            );
        }
        for bits in float32_patterns() {
            let float = f32::from_bits(bits);
            let (ours, theirs) = (float32_to_float16(bits), f16::from_f32(float).to_bits());
            let nan = f16::from_bits(ours).is_nan() && f16::from_bits(theirs).is_nan();
            assert!(
                ours == theirs || nan,
                "float32 {bits:#010x} to float16: {ours:#06x}, half says {theirs:#06x}"
            );
            let (ours, theirs) = (float32_to_bfloat16(bits), bf16::from_f32(float).to_bits());
            let nan = bf16::from_bits(ours).is_nan() && bf16::from_bits(theirs).is_nan();
            assert!(
                ours == theirs || nan,
                "float32 {bits:#010x} to bfloat16: {ours:#06x}, half says {theirs:#06x}"
            );
        }
    }

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
