//! The kernels, written once over [`Lanes`] and compiled for AVX2 and for AVX-512.

use std::arch::x86_64::*;

/// One instruction set's vectors of 32-bit lanes, and the operations the kernels use.
///
/// # Safety
/// Every method may only be called where the CPU has the set's instructions; `load` and
/// `store` also need their pointer valid for [`Lanes::BYTES`] bytes (of any alignment).
trait Lanes {
    /// The bytes of one vector.
    const BYTES: usize;
    type Int: Copy;
    type Float: Copy;

    unsafe fn load(from: *const u8) -> Self::Int;
    unsafe fn store(to: *mut u8, value: Self::Int);
    unsafe fn splat(value: u32) -> Self::Int;
    unsafe fn splat_f32(value: f32) -> Self::Float;
    unsafe fn as_f32(value: Self::Int) -> Self::Float;
    unsafe fn as_i32(value: Self::Float) -> Self::Int;
    unsafe fn add_i32(a: Self::Int, b: Self::Int) -> Self::Int;
    unsafe fn and(a: Self::Int, b: Self::Int) -> Self::Int;
    unsafe fn max_u32(a: Self::Int, b: Self::Int) -> Self::Int;
    unsafe fn reduce_max_u32(value: Self::Int) -> u32;
    unsafe fn add_f32(a: Self::Float, b: Self::Float) -> Self::Float;
    unsafe fn mul_f32(a: Self::Float, b: Self::Float) -> Self::Float;
    /// Ties to even, whatever rounding mode the thread's MXCSR holds.
    unsafe fn round_ties_even(value: Self::Float) -> Self::Float;
    /// `if a > b { a } else { b }` per lane: `b` where either is NaN.
    unsafe fn max_f32(a: Self::Float, b: Self::Float) -> Self::Float;
    /// `if a < b { a } else { b }` per lane: `b` where either is NaN.
    unsafe fn min_f32(a: Self::Float, b: Self::Float) -> Self::Float;
    unsafe fn truncate_to_i32(value: Self::Float) -> Self::Int;
    /// Rounded as the thread's MXCSR says, as Rust's `i32 as f32` is.
    unsafe fn i32_to_f32(value: Self::Int) -> Self::Float;
}

/// The elements of whole vectors in `bytes` bytes.
fn vector_elements<V: Lanes>(bytes: usize) -> usize {
    bytes / V::BYTES * V::BYTES / 4
}

// Every kernel is always inlined into its per-set copy below, whose target features let
// the intrinsics inline in turn; the SAFETY argument of each `unsafe` block in them is
// the same: the copy runs only where the CPU has the set (the caller's contract), and
// every pointer is to a chunk of exactly `V::BYTES` bytes.

#[inline(always)]
unsafe fn add_assign_i32<V: Lanes>(acc: &mut [u8], src: &[u8]) -> usize {
    for (a, b) in acc.chunks_exact_mut(V::BYTES).zip(src.chunks_exact(V::BYTES)) {
        // SAFETY: see above.
        unsafe { V::store(a.as_mut_ptr(), V::add_i32(V::load(a.as_ptr()), V::load(b.as_ptr()))) };
    }
    vector_elements::<V>(acc.len().min(src.len()))
}

#[inline(always)]
unsafe fn add_assign_f32<V: Lanes>(acc: &mut [u8], src: &[u8]) -> usize {
    for (a, b) in acc.chunks_exact_mut(V::BYTES).zip(src.chunks_exact(V::BYTES)) {
        // SAFETY: see above.
        unsafe {
            let sum = V::add_f32(V::as_f32(V::load(a.as_ptr())), V::as_f32(V::load(b.as_ptr())));
            V::store(a.as_mut_ptr(), V::as_i32(sum));
        }
    }
    vector_elements::<V>(acc.len().min(src.len()))
}

#[inline(always)]
unsafe fn add_i32<V: Lanes>(out: &mut [u8], a: &[u8], b: &[u8]) -> usize {
    for (out, (a, b)) in
        out.chunks_exact_mut(V::BYTES).zip(a.chunks_exact(V::BYTES).zip(b.chunks_exact(V::BYTES)))
    {
        // SAFETY: see above.
        unsafe { V::store(out.as_mut_ptr(), V::add_i32(V::load(a.as_ptr()), V::load(b.as_ptr()))) };
    }
    vector_elements::<V>(out.len().min(a.len()).min(b.len()))
}

#[inline(always)]
unsafe fn add_f32<V: Lanes>(out: &mut [u8], a: &[u8], b: &[u8]) -> usize {
    for (out, (a, b)) in
        out.chunks_exact_mut(V::BYTES).zip(a.chunks_exact(V::BYTES).zip(b.chunks_exact(V::BYTES)))
    {
        // SAFETY: see above.
        unsafe {
            let sum = V::add_f32(V::as_f32(V::load(a.as_ptr())), V::as_f32(V::load(b.as_ptr())));
            V::store(out.as_mut_ptr(), V::as_i32(sum));
        }
    }
    vector_elements::<V>(out.len().min(a.len()).min(b.len()))
}

#[inline(always)]
unsafe fn largest_magnitude_bits<V: Lanes>(bytes: &[u8]) -> (u32, usize) {
    // SAFETY: see above.
    unsafe {
        let magnitude = V::splat(0x7FFF_FFFF);
        let mut largest = V::splat(0);
        for element in bytes.chunks_exact(V::BYTES) {
            largest = V::max_u32(largest, V::and(V::load(element.as_ptr()), magnitude));
        }
        (V::reduce_max_u32(largest), vector_elements::<V>(bytes.len()))
    }
}

#[inline(always)]
unsafe fn quantise<V: Lanes>(
    elements: &[u8],
    payload: &mut [u8],
    (low, high): (f32, f32),
    limit: f32,
) -> usize {
    // A loop of its own for a scale of one factor, the usual case, as the portable one.
    // SAFETY: see above.
    unsafe {
        if high == 1.0 {
            quantise_scaled::<V>(elements, payload, limit, |x| V::mul_f32(x, V::splat_f32(low)))
        } else {
            quantise_scaled::<V>(elements, payload, limit, |x| {
                V::mul_f32(V::mul_f32(x, V::splat_f32(low)), V::splat_f32(high))
            })
        }
    }
}

#[inline(always)]
unsafe fn quantise_scaled<V: Lanes>(
    elements: &[u8],
    payload: &mut [u8],
    limit: f32,
    scale: impl Fn(V::Float) -> V::Float,
) -> usize {
    // SAFETY: see above.
    unsafe {
        let (upper, lower) = (V::splat_f32(limit), V::splat_f32(-limit));
        for (out, x) in payload.chunks_exact_mut(V::BYTES).zip(elements.chunks_exact(V::BYTES)) {
            let rounded = V::round_ties_even(scale(V::as_f32(V::load(x.as_ptr()))));
            let clamped = V::min_f32(V::max_f32(rounded, lower), upper);
            V::store(out.as_mut_ptr(), V::truncate_to_i32(clamped));
        }
    }
    vector_elements::<V>(elements.len().min(payload.len()))
}

#[inline(always)]
unsafe fn dequantise<V: Lanes>(payload: &[u8], elements: &mut [u8], (low, high): (f32, f32)) -> usize {
    // SAFETY: see above.
    unsafe {
        if high == 1.0 {
            dequantise_scaled::<V>(payload, elements, |sum| V::mul_f32(sum, V::splat_f32(low)))
        } else {
            dequantise_scaled::<V>(payload, elements, |sum| {
                V::mul_f32(V::mul_f32(sum, V::splat_f32(low)), V::splat_f32(high))
            })
        }
    }
}

#[inline(always)]
unsafe fn dequantise_scaled<V: Lanes>(
    payload: &[u8],
    elements: &mut [u8],
    scale: impl Fn(V::Float) -> V::Float,
) -> usize {
    for (out, sum) in elements.chunks_exact_mut(V::BYTES).zip(payload.chunks_exact(V::BYTES)) {
        // SAFETY: see above.
        unsafe { V::store(out.as_mut_ptr(), V::as_i32(scale(V::i32_to_f32(V::load(sum.as_ptr()))))) };
    }
    vector_elements::<V>(elements.len().min(payload.len()))
}

/// `_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC`: ties to even, no exceptions, whatever
/// MXCSR says.
const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

/// 256-bit vectors of AVX2.
struct Avx2;

impl Lanes for Avx2 {
    const BYTES: usize = 32;
    type Int = __m256i;
    type Float = __m256;

    #[inline(always)]
    unsafe fn load(from: *const u8) -> __m256i {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm256_loadu_si256(from.cast()) }
    }
    #[inline(always)]
    unsafe fn store(to: *mut u8, value: __m256i) {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm256_storeu_si256(to.cast(), value) }
    }
    #[inline(always)]
    unsafe fn splat(value: u32) -> __m256i {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm256_set1_epi32(value as i32) }
    }
    #[inline(always)]
    unsafe fn splat_f32(value: f32) -> __m256 {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm256_set1_ps(value) }
    }
    #[inline(always)]
    unsafe fn as_f32(value: __m256i) -> __m256 {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm256_castsi256_ps(value) }
    }
    #[inline(always)]
    unsafe fn as_i32(value: __m256) -> __m256i {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm256_castps_si256(value) }
    }
    #[inline(always)]
    unsafe fn add_i32(a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm256_add_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn and(a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm256_and_si256(a, b) }
    }
    #[inline(always)]
    unsafe fn max_u32(a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm256_max_epu32(a, b) }
    }
    #[inline(always)]
    unsafe fn reduce_max_u32(value: __m256i) -> u32 {
        // SAFETY: as the trait requires of the caller (AVX2 implies SSE4.1).
        unsafe {
            let halves = _mm_max_epu32(_mm256_castsi256_si128(value), _mm256_extracti128_si256::<1>(value));
            let pairs = _mm_max_epu32(halves, _mm_shuffle_epi32::<0b01_00_11_10>(halves));
            let largest = _mm_max_epu32(pairs, _mm_shuffle_epi32::<0b10_11_00_01>(pairs));
            _mm_cvtsi128_si32(largest) as u32
        }
    }
    #[inline(always)]
    unsafe fn add_f32(a: __m256, b: __m256) -> __m256 {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul_f32(a: __m256, b: __m256) -> __m256 {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn round_ties_even(value: __m256) -> __m256 {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm256_round_ps::<NEAREST>(value) }
    }
    #[inline(always)]
    unsafe fn max_f32(a: __m256, b: __m256) -> __m256 {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm256_max_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn min_f32(a: __m256, b: __m256) -> __m256 {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm256_min_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn truncate_to_i32(value: __m256) -> __m256i {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm256_cvttps_epi32(value) }
    }
    #[inline(always)]
    unsafe fn i32_to_f32(value: __m256i) -> __m256 {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm256_cvtepi32_ps(value) }
    }
}

/// 512-bit vectors of AVX-512 Foundation.
struct Avx512;

impl Lanes for Avx512 {
    const BYTES: usize = 64;
    type Int = __m512i;
    type Float = __m512;

    #[inline(always)]
    unsafe fn load(from: *const u8) -> __m512i {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_loadu_si512(from.cast()) }
    }
    #[inline(always)]
    unsafe fn store(to: *mut u8, value: __m512i) {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_storeu_si512(to.cast(), value) }
    }
    #[inline(always)]
    unsafe fn splat(value: u32) -> __m512i {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_set1_epi32(value as i32) }
    }
    #[inline(always)]
    unsafe fn splat_f32(value: f32) -> __m512 {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_set1_ps(value) }
    }
    #[inline(always)]
    unsafe fn as_f32(value: __m512i) -> __m512 {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_castsi512_ps(value) }
    }
    #[inline(always)]
    unsafe fn as_i32(value: __m512) -> __m512i {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_castps_si512(value) }
    }
    #[inline(always)]
    unsafe fn add_i32(a: __m512i, b: __m512i) -> __m512i {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_add_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn and(a: __m512i, b: __m512i) -> __m512i {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_and_si512(a, b) }
    }
    #[inline(always)]
    unsafe fn max_u32(a: __m512i, b: __m512i) -> __m512i {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_max_epu32(a, b) }
    }
    #[inline(always)]
    unsafe fn reduce_max_u32(value: __m512i) -> u32 {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_reduce_max_epu32(value) }
    }
    #[inline(always)]
    unsafe fn add_f32(a: __m512, b: __m512) -> __m512 {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul_f32(a: __m512, b: __m512) -> __m512 {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn round_ties_even(value: __m512) -> __m512 {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_roundscale_ps::<NEAREST>(value) }
    }
    #[inline(always)]
    unsafe fn max_f32(a: __m512, b: __m512) -> __m512 {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_max_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn min_f32(a: __m512, b: __m512) -> __m512 {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_min_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn truncate_to_i32(value: __m512) -> __m512i {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_cvttps_epi32(value) }
    }
    #[inline(always)]
    unsafe fn i32_to_f32(value: __m512i) -> __m512 {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_cvtepi32_ps(value) }
    }
}

/// The kernels of one instruction set: each compiled with its target features, which is
/// what lets the intrinsics inline into one loop.
macro_rules! instruction_set {
    ($(#[$meta:meta])* $module:ident, $lanes:ty, $feature:literal) => {
        $(#[$meta])*
        ///
        /// # Safety
        /// Each function may only be called where the CPU has the set.
        pub(crate) mod $module {
            use super::*;

            #[target_feature(enable = $feature)]
            pub(crate) unsafe fn add_assign_i32(acc: &mut [u8], src: &[u8]) -> usize {
                // SAFETY: as this module requires of the caller.
                unsafe { super::add_assign_i32::<$lanes>(acc, src) }
            }

            #[target_feature(enable = $feature)]
            pub(crate) unsafe fn add_assign_f32(acc: &mut [u8], src: &[u8]) -> usize {
                // SAFETY: as this module requires of the caller.
                unsafe { super::add_assign_f32::<$lanes>(acc, src) }
            }

            #[target_feature(enable = $feature)]
            pub(crate) unsafe fn add_i32(out: &mut [u8], a: &[u8], b: &[u8]) -> usize {
                // SAFETY: as this module requires of the caller.
                unsafe { super::add_i32::<$lanes>(out, a, b) }
            }

            #[target_feature(enable = $feature)]
            pub(crate) unsafe fn add_f32(out: &mut [u8], a: &[u8], b: &[u8]) -> usize {
                // SAFETY: as this module requires of the caller.
                unsafe { super::add_f32::<$lanes>(out, a, b) }
            }

            #[target_feature(enable = $feature)]
            pub(crate) unsafe fn largest_magnitude_bits(bytes: &[u8]) -> (u32, usize) {
                // SAFETY: as this module requires of the caller.
                unsafe { super::largest_magnitude_bits::<$lanes>(bytes) }
            }

            #[target_feature(enable = $feature)]
            pub(crate) unsafe fn quantise(elements: &[u8], payload: &mut [u8], scale: (f32, f32), limit: f32) -> usize {
                // SAFETY: as this module requires of the caller.
                unsafe { super::quantise::<$lanes>(elements, payload, scale, limit) }
            }

            #[target_feature(enable = $feature)]
            pub(crate) unsafe fn dequantise(payload: &[u8], elements: &mut [u8], scale: (f32, f32)) -> usize {
                // SAFETY: as this module requires of the caller.
                unsafe { super::dequantise::<$lanes>(payload, elements, scale) }
            }
        }
    };
}

instruction_set!(
    /// The kernels in 256-bit AVX2 vectors.
    avx2, Avx2, "avx2"
);
instruction_set!(
    /// The kernels in 512-bit AVX-512 Foundation vectors.
    avx512, Avx512, "avx512f"
);
