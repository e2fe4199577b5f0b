//! Element-wise sums over little-endian payload bytes.
//!
//! Written in AVX2 and AVX-512 by `netagg-simd`, chosen at run time, with a portable loop
//! for other CPUs, which the vector kernels must match (`benches/benches/sum.rs`
//! compares each set with a plain `a[i] += b[i]` over `i32` slices, built for baseline
//! x86-64). The `_with` functions take the instruction set: callers on the per-packet
//! path choose it once ([`InstructionSet::best`]) and keep it, and tests and benches
//! name each set.

pub use netagg_simd::InstructionSet;
use netagg_wire::ElementType;

use crate::sum16::{self, Half};

/// `acc[i] += src[i]` for every element, in the arithmetic of `element_type`: int32 wraps
/// as switch hardware does, float32 adds natively, and the 16-bit floats add in float32:
/// their `acc` holds float32 sums ([`crate::sum16`]).
///
/// Both slices hold little-endian elements; `src` may be shorter than `acc` (a packet's
/// tail), in which case only its elements are added.
pub fn add_assign(element_type: ElementType, acc: &mut [u8], src: &[u8]) {
    add_assign_with(InstructionSet::best(), element_type, acc, src);
}

/// [`add_assign`] in the vectors of `set`.
#[inline]
pub fn add_assign_with(set: InstructionSet, element_type: ElementType, acc: &mut [u8], src: &[u8]) {
    match element_type {
        ElementType::Int32 => add_assign_i32_with(set, acc, src),
        ElementType::Float32 => add_assign_f32_with(set, acc, src),
        ElementType::Float16 => sum16::add_assign_widened(Half::Float16, acc, src),
        ElementType::BFloat16 => sum16::add_assign_widened(Half::BFloat16, acc, src),
    }
}

/// `out[i] = a[i] + b[i]` for every element the three slices all hold, in the
/// arithmetic of `element_type` (as [`add_assign`], `out` of float32 for the 16-bit
/// types) and the vectors of `set`: a copy and a sum in one pass.
#[inline]
pub fn add_with(set: InstructionSet, element_type: ElementType, out: &mut [u8], a: &[u8], b: &[u8]) {
    match element_type {
        ElementType::Int32 => add_i32_with(set, out, a, b),
        ElementType::Float32 => add_f32_with(set, out, a, b),
        ElementType::Float16 => sum16::add_widened(Half::Float16, out, a, b),
        ElementType::BFloat16 => sum16::add_widened(Half::BFloat16, out, a, b),
    }
}

/// Wrapping int32 sum of little-endian elements.
#[inline]
pub fn add_assign_i32(acc: &mut [u8], src: &[u8]) {
    add_assign_i32_with(InstructionSet::best(), acc, src);
}

/// float32 sum of little-endian elements.
#[inline]
pub fn add_assign_f32(acc: &mut [u8], src: &[u8]) {
    add_assign_f32_with(InstructionSet::best(), acc, src);
}

/// [`add_assign_i32`] in the vectors of `set`.
#[inline]
pub fn add_assign_i32_with(set: InstructionSet, acc: &mut [u8], src: &[u8]) {
    if !netagg_simd::add_assign_i32(set, acc, src) {
        for (a, b) in acc.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
            a.copy_from_slice(&sum_i32(a, b));
        }
    }
}

/// [`add_assign_f32`] in the vectors of `set`.
#[inline]
pub fn add_assign_f32_with(set: InstructionSet, acc: &mut [u8], src: &[u8]) {
    if !netagg_simd::add_assign_f32(set, acc, src) {
        for (a, b) in acc.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
            a.copy_from_slice(&sum_f32(a, b));
        }
    }
}

/// [`add`] of int32 in the vectors of `set`.
#[inline]
pub fn add_i32_with(set: InstructionSet, out: &mut [u8], a: &[u8], b: &[u8]) {
    if !netagg_simd::add_i32(set, out, a, b) {
        for (out, (a, b)) in out.chunks_exact_mut(4).zip(a.chunks_exact(4).zip(b.chunks_exact(4))) {
            out.copy_from_slice(&sum_i32(a, b));
        }
    }
}

/// [`add`] of float32 in the vectors of `set`.
#[inline]
pub fn add_f32_with(set: InstructionSet, out: &mut [u8], a: &[u8], b: &[u8]) {
    if !netagg_simd::add_f32(set, out, a, b) {
        for (out, (a, b)) in out.chunks_exact_mut(4).zip(a.chunks_exact(4).zip(b.chunks_exact(4))) {
            out.copy_from_slice(&sum_f32(a, b));
        }
    }
}

/// `out[i] = src[i] · factor`, wrapping, for the int32 elements both hold, in the vectors
/// of `set`: the sum of `factor` copies of `src` in one pass, equal to `factor` wrapping
/// additions (the integers modulo 2³² are a ring), where the additions take one pass
/// each. For the dummy backend, which sums one worker's data as if every worker had sent
/// it; float32 sums round at every addition, and have no such shortcut.
#[inline]
pub fn multiply_i32_with(set: InstructionSet, out: &mut [u8], src: &[u8], factor: i32) {
    if !netagg_simd::multiply_i32(set, out, src, factor) {
        for (out, src) in out.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
            let element = i32::from_le_bytes([src[0], src[1], src[2], src[3]]);
            out.copy_from_slice(&element.wrapping_mul(factor).to_le_bytes());
        }
    }
}

/// The wrapping sum of two little-endian int32 elements. Always inlined: a call out of
/// the loops above would keep the compiler from vectorising them for baseline x86-64.
#[inline(always)]
fn sum_i32(a: &[u8], b: &[u8]) -> [u8; 4] {
    let (a, b) = (i32::from_le_bytes([a[0], a[1], a[2], a[3]]), i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    a.wrapping_add(b).to_le_bytes()
}

/// The sum of two little-endian float32 elements; inlined as [`sum_i32`].
#[inline(always)]
fn sum_f32(a: &[u8], b: &[u8]) -> [u8; 4] {
    let (a, b) = (f32::from_le_bytes([a[0], a[1], a[2], a[3]]), f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    (a + b).to_le_bytes()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn bytes_i32(values: &[i32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn bytes(bits: &[u32]) -> Vec<u8> {
        bits.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn int32_sum_wraps() {
        let mut acc = bytes_i32(&[i32::MAX, -5, 7]);
        add_assign(ElementType::Int32, &mut acc, &bytes_i32(&[1, 5, -10]));
        assert_eq!(acc, bytes_i32(&[i32::MIN, 0, -3]));
    }

    #[test]
    fn float32_sum_is_native() {
        let mut acc: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let src: Vec<u8> = [0.25f32, f32::INFINITY].iter().flat_map(|v| v.to_le_bytes()).collect();
        add_assign(ElementType::Float32, &mut acc, &src);
        let got: Vec<f32> = acc.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
        assert_eq!(got, [1.75, f32::INFINITY]);
    }

    #[test]
    fn three_operand_sums_match_the_in_place_ones() {
        let a = bytes_i32(&[i32::MAX, -5, 7, 1 << 20, 3, 4, 5, 6, 7, 8, 9]);
        let b = bytes_i32(&[1, 5, -10, 1 << 30, -3, 2, 1, 0, -1, -2, -3]);
        for set in InstructionSet::supported() {
            for element_type in [ElementType::Int32, ElementType::Float32] {
                let mut expected = a.clone();
                add_assign_with(set, element_type, &mut expected, &b);
                let mut out = vec![0xAA; a.len()];
                add_with(set, element_type, &mut out, &a, &b);
                assert_eq!(out, expected, "{element_type:?}, {set}");
            }
            let mut out = vec![0x11; 8];
            add_with(set, ElementType::Int32, &mut out, &a, &b[..4]);
            assert_eq!(out, bytes_i32(&[i32::MIN, 0x1111_1111]), "only the elements all three hold, {set}");
        }
    }

    /// Element bit patterns with the edge values over-represented: the int32 extremes,
    /// float32 zeros of both signs, subnormals, the largest finite, infinities and NaN.
    fn element() -> impl Strategy<Value = u32> {
        prop_oneof![
            any::<u32>(),
            prop::sample::select(vec![
                0,
                0x8000_0000,
                0x7FFF_FFFF,
                0xFFFF_FFFF,
                1,
                0x8000_0001,
                0x007F_FFFF,
                0x7F7F_FFFF,
                0xFF7F_FFFF,
                0x7F80_0000,
                0xFF80_0000,
                0x7FC0_0000,
                0xFFC0_0001,
            ]),
        ]
    }

    /// Equal bit for bit, but that any NaN equals any NaN: which payload a float sum of
    /// two NaN keeps is not specified, in Rust or between x86's scalar and vector adds.
    fn same_floats(a: &[u8], b: &[u8]) -> bool {
        let nan = |bits: &[u8]| f32::from_le_bytes(bits.try_into().unwrap()).is_nan();
        a.len() == b.len() && a.chunks(4).zip(b.chunks(4)).all(|(x, y)| x == y || (nan(x) && nan(y)))
    }

    proptest! {
        #[test]
        fn every_instruction_set_sums_as_the_portable_loop(
            acc in prop::collection::vec(element(), 0..100),
            src in prop::collection::vec(element(), 0..100),
        ) {
            let (acc, src) = (bytes(&acc), bytes(&src));
            let portable = InstructionSet::PORTABLE;
            for set in InstructionSet::supported() {
                let (mut expected, mut got) = (acc.clone(), acc.clone());
                add_assign_i32_with(portable, &mut expected, &src);
                add_assign_i32_with(set, &mut got, &src);
                prop_assert_eq!(&got, &expected, "add_assign_i32, {}", set);
                let (mut expected, mut got) = (acc.clone(), acc.clone());
                add_assign_f32_with(portable, &mut expected, &src);
                add_assign_f32_with(set, &mut got, &src);
                prop_assert!(same_floats(&got, &expected), "add_assign_f32, {}", set);
                let (mut expected, mut got) = (vec![0x55; acc.len()], vec![0x55; acc.len()]);
                add_i32_with(portable, &mut expected, &acc, &src);
                add_i32_with(set, &mut got, &acc, &src);
                prop_assert_eq!(&got, &expected, "add_i32, {}", set);
                let (mut expected, mut got) = (vec![0x55; acc.len()], vec![0x55; acc.len()]);
                add_f32_with(portable, &mut expected, &acc, &src);
                add_f32_with(set, &mut got, &acc, &src);
                prop_assert!(same_floats(&got, &expected), "add_f32, {}", set);
            }
        }

        #[test]
        fn every_instruction_set_multiplies_as_the_portable_loop(
            src in prop::collection::vec(element(), 0..100),
            factor in any::<i32>(),
        ) {
            let src = bytes(&src);
            let mut expected = vec![0x55; src.len() + 4];
            multiply_i32_with(InstructionSet::PORTABLE, &mut expected, &src, factor);
            for set in InstructionSet::supported() {
                let mut got = vec![0x55; src.len() + 4];
                multiply_i32_with(set, &mut got, &src, factor);
                prop_assert_eq!(&got, &expected, "times {}, {}", factor, set);
            }
            prop_assert_eq!(&expected[src.len()..], &[0x55; 4][..], "beyond the source");
        }

        #[test]
        fn a_product_is_the_wrapping_sum_of_as_many_copies(
            src in prop::collection::vec(element(), 0..100),
            factor in 0..40i32,
        ) {
            let src = bytes(&src);
            let mut sum = vec![0; src.len()];
            for _ in 0..factor {
                add_assign_i32_with(InstructionSet::PORTABLE, &mut sum, &src);
            }
            let mut product = vec![0x55; src.len()];
            multiply_i32_with(InstructionSet::PORTABLE, &mut product, &src, factor);
            prop_assert_eq!(product, sum, "{} copies", factor);
        }
    }

    #[test]
    fn shorter_source_adds_only_its_elements() {
        let mut acc = bytes_i32(&[1, 2, 3]);
        add_assign(ElementType::Int32, &mut acc, &bytes_i32(&[10]));
        assert_eq!(acc, bytes_i32(&[11, 2, 3]));
    }
}
