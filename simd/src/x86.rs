//! The kernels, written once over [`Lanes`] and compiled for AVX2 and for AVX-512.

use std::arch::x86_64::*;

/// One instruction set's vectors of 32-bit lanes, and the operations the kernels use.
///
/// # Safety
/// Every method may only be called where the CPU has the set's instructions; `load` and
/// `store` also need their pointer valid for [`Lanes::BYTES`] bytes (of any alignment),
/// `load_first` and `store_first` for `count` elements.
trait Lanes {
    /// The bytes of one vector.
    const BYTES: usize;
    type Int: Copy;
    type Float: Copy;

    unsafe fn load(from: *const u8) -> Self::Int;
    unsafe fn store(to: *mut u8, value: Self::Int);
    /// The first `count` elements at `from` (fewer than a vector holds), zeros in the
    /// other lanes: a masked load, which reads nothing of the lanes masked off.
    unsafe fn load_first(from: *const u8, count: usize) -> Self::Int;
    /// Writes the first `count` elements of `value` to `to`, and nothing else.
    unsafe fn store_first(to: *mut u8, value: Self::Int, count: usize);
    unsafe fn splat(value: u32) -> Self::Int;
    unsafe fn splat_f32(value: f32) -> Self::Float;
    unsafe fn as_f32(value: Self::Int) -> Self::Float;
    unsafe fn as_i32(value: Self::Float) -> Self::Int;
    unsafe fn add_i32(a: Self::Int, b: Self::Int) -> Self::Int;
    /// The low 32 bits of each lane's product: wrapping int32 multiplication.
    unsafe fn mul_i32(a: Self::Int, b: Self::Int) -> Self::Int;
    unsafe fn and(a: Self::Int, b: Self::Int) -> Self::Int;
    unsafe fn max_u32(a: Self::Int, b: Self::Int) -> Self::Int;
    unsafe fn reduce_max_u32(value: Self::Int) -> u32;
    unsafe fn add_f32(a: Self::Float, b: Self::Float) -> Self::Float;
    unsafe fn mul_f32(a: Self::Float, b: Self::Float) -> Self::Float;
    /// `if a > b { a } else { b }` per lane: `b` where either is NaN.
    unsafe fn max_f32(a: Self::Float, b: Self::Float) -> Self::Float;
    /// `if a < b { a } else { b }` per lane: `b` where either is NaN.
    unsafe fn min_f32(a: Self::Float, b: Self::Float) -> Self::Float;
    /// Ties to even, whatever rounding mode the thread's MXCSR holds.
    unsafe fn round_ties_even(value: Self::Float) -> Self::Float;
    unsafe fn truncate_to_i32(value: Self::Float) -> Self::Int;
    /// Whether [`Lanes::to_nearest_i32`] rounds to nearest, ties to even, and raises no
    /// exception a host may have unmasked.
    unsafe fn converts_to_nearest() -> bool;
    /// Each lane converted to int32, rounded as [`Lanes::converts_to_nearest`] says when
    /// it is true: one instruction where rounding and then converting took two.
    unsafe fn to_nearest_i32(value: Self::Float) -> Self::Int;
    /// Rounded as the thread's MXCSR says, as Rust's `i32 as f32` is.
    unsafe fn i32_to_f32(value: Self::Int) -> Self::Float;
}

/// Where in a slice a kernel's step works: a whole vector at a byte offset, or the
/// elements left after the last whole vector.
#[derive(Clone, Copy)]
struct Step {
    offset: usize,
    /// `None` for a whole vector, else the elements left (fewer than a vector holds).
    tail: Option<usize>,
}

impl Step {
    /// Loads the step's elements from `base`, zeros beyond a tail.
    ///
    /// # Safety
    /// As [`Lanes`], with `base` valid for the step's elements from its offset.
    #[inline(always)]
    unsafe fn load<V: Lanes>(self, base: *const u8) -> V::Int {
        // SAFETY: as the caller guarantees.
        unsafe {
            match self.tail {
                None => V::load(base.add(self.offset)),
                Some(count) => V::load_first(base.add(self.offset), count),
            }
        }
    }

    /// Stores the step's elements of `value` at `base`.
    ///
    /// # Safety
    /// As [`Step::load`].
    #[inline(always)]
    unsafe fn store<V: Lanes>(self, base: *mut u8, value: V::Int) {
        // SAFETY: as the caller guarantees.
        unsafe {
            match self.tail {
                None => V::store(base.add(self.offset), value),
                Some(count) => V::store_first(base.add(self.offset), value, count),
            }
        }
    }
}

/// Runs `body` with `step` bound to every whole vector in the whole elements of `bytes`
/// bytes, four to a turn of the loop and then one at a time, and then to the elements
/// left, in one masked vector. Unrolled by hand: left to the compiler, the loops took a
/// fifth more instructions than the vectorised portable ones (callgrind), in turns of one
/// or two vectors; with the tail here, a packet's kernel is one call with nothing around
/// it. A macro rather than a function taking a closure: the closure, compiled without
/// the set's target features, was not inlined, and every step became a call.
macro_rules! each_step {
    ($lanes:ty, $bytes:expr, |$step:ident| $body:block) => {{
        let bytes: usize = $bytes;
        let vectors = bytes / <$lanes>::BYTES;
        let whole = |vector: usize| Step { offset: vector * <$lanes>::BYTES, tail: None };
        let mut vector = 0;
        // Counted turns: a loop on `vector + 4 <= vectors` spent six instructions a turn on
        // its control, a count three.
        for _ in 0..vectors / 4 {
            for $step in [whole(vector), whole(vector + 1), whole(vector + 2), whole(vector + 3)] $body
            vector += 4;
        }
        for _ in 0..vectors % 4 {
            let $step = whole(vector);
            $body
            vector += 1;
        }
        let left = bytes % <$lanes>::BYTES / 4;
        if left > 0 {
            let $step = Step { offset: vectors * <$lanes>::BYTES, tail: Some(left) };
            $body
        }
    }};
}

// Every kernel is always inlined into its per-set copy below, whose target features let
// the intrinsics inline in turn; the SAFETY argument of each `unsafe` block in them is
// the same: the copy runs only where the CPU has the set (the caller's contract), and
// [`each_step`] gives only steps within the shortest of the kernel's slices.

#[inline(always)]
unsafe fn add_assign_i32<V: Lanes>(acc: &mut [u8], src: &[u8]) {
    let (len, acc, src) = (acc.len().min(src.len()), acc.as_mut_ptr(), src.as_ptr());
    each_step!(V, len, |step| {
        // SAFETY: see above.
        unsafe { step.store::<V>(acc, V::add_i32(step.load::<V>(acc), step.load::<V>(src))) }
    });
}

#[inline(always)]
unsafe fn add_assign_f32<V: Lanes>(acc: &mut [u8], src: &[u8]) {
    let (len, acc, src) = (acc.len().min(src.len()), acc.as_mut_ptr(), src.as_ptr());
    each_step!(V, len, |step| {
        // SAFETY: see above.
        unsafe {
            let sum = V::add_f32(V::as_f32(step.load::<V>(acc)), V::as_f32(step.load::<V>(src)));
            step.store::<V>(acc, V::as_i32(sum));
        }
    });
}

#[inline(always)]
unsafe fn add_i32<V: Lanes>(out: &mut [u8], a: &[u8], b: &[u8]) {
    let len = out.len().min(a.len()).min(b.len());
    let (out, a, b) = (out.as_mut_ptr(), a.as_ptr(), b.as_ptr());
    each_step!(V, len, |step| {
        // SAFETY: see above.
        unsafe { step.store::<V>(out, V::add_i32(step.load::<V>(a), step.load::<V>(b))) }
    });
}

#[inline(always)]
unsafe fn add_f32<V: Lanes>(out: &mut [u8], a: &[u8], b: &[u8]) {
    let len = out.len().min(a.len()).min(b.len());
    let (out, a, b) = (out.as_mut_ptr(), a.as_ptr(), b.as_ptr());
    each_step!(V, len, |step| {
        // SAFETY: see above.
        unsafe {
            let sum = V::add_f32(V::as_f32(step.load::<V>(a)), V::as_f32(step.load::<V>(b)));
            step.store::<V>(out, V::as_i32(sum));
        }
    });
}

#[inline(always)]
unsafe fn multiply_i32<V: Lanes>(out: &mut [u8], src: &[u8], factor: i32) {
    let len = out.len().min(src.len());
    let (out, src) = (out.as_mut_ptr(), src.as_ptr());
    // SAFETY: see above.
    unsafe {
        let factor = V::splat(factor as u32);
        each_step!(V, len, |step| {
            step.store::<V>(out, V::mul_i32(step.load::<V>(src), factor));
        });
    }
}

#[inline(always)]
unsafe fn largest_magnitude_bits<V: Lanes>(bytes: &[u8]) -> u32 {
    let len = bytes.len() / 4 * 4;
    let start = bytes.as_ptr();
    // Bytes to the first address a vector may be loaded from without crossing a cache
    // line (or `usize::MAX`, no multiple of 4, where that cannot be told).
    let skip = start.align_offset(V::BYTES);
    // SAFETY: see above; a tail's zeros leave the maximum as it is, and every load below
    // lies within the `len` bytes.
    unsafe {
        let magnitude = V::splat(0x7FFF_FFFF);
        let mut largest = V::splat(0);
        if skip % 4 == 0 && len >= 2 * V::BYTES {
            // A maximum may see an element twice: one vector at the start, aligned ones
            // from the first aligned element, one ending at the last element. A load that
            // crosses a cache line costs about two, and a tensor's blocks lie where its
            // allocator put it (a glibc allocation this large, 16 bytes past a line).
            let aligned = start.add(skip);
            largest = V::max_u32(largest, V::and(V::load(start), magnitude));
            largest = V::max_u32(largest, V::and(V::load(start.add(len - V::BYTES)), magnitude));
            let whole = (len - skip) / V::BYTES * V::BYTES;
            each_step!(V, whole, |step| {
                largest = V::max_u32(largest, V::and(step.load::<V>(aligned), magnitude));
            });
        } else {
            each_step!(V, len, |step| {
                largest = V::max_u32(largest, V::and(step.load::<V>(start), magnitude));
            });
        }
        V::reduce_max_u32(largest)
    }
}

#[inline(always)]
unsafe fn largest_magnitude_bits_of_blocks<V: Lanes>(bytes: &[u8], block_bytes: usize, largest: &mut [u32]) {
    for (block, largest) in bytes.chunks(block_bytes).zip(largest) {
        // SAFETY: see above.
        *largest = unsafe { largest_magnitude_bits::<V>(block) };
    }
}

#[inline(always)]
unsafe fn quantise<V: Lanes>(elements: &[u8], payload: &mut [u8], (low, high): (f32, f32), limit: f32) {
    // A loop of its own for a scale of one factor, the usual case, as the portable one.
    // SAFETY: see above.
    unsafe {
        let one_factor = |x| V::mul_f32(x, V::splat_f32(low));
        let two_factors = |x| V::mul_f32(V::mul_f32(x, V::splat_f32(low)), V::splat_f32(high));
        let to_nearest = |x| V::to_nearest_i32(x);
        match (V::converts_to_nearest(), high == 1.0) {
            (true, true) => quantise_scaled::<V>(elements, payload, limit, one_factor, to_nearest),
            (true, false) => quantise_scaled::<V>(elements, payload, limit, two_factors, to_nearest),
            // A host changed the rounding mode: rounded first, in a rare loop that needs no
            // copy of its own for one factor, whose products two factors equal.
            (false, _) => quantise_scaled::<V>(elements, payload, limit, two_factors, |x| {
                V::truncate_to_i32(V::round_ties_even(x))
            }),
        }
    }
}

#[inline(always)]
unsafe fn quantise_scaled<V: Lanes>(
    elements: &[u8],
    payload: &mut [u8],
    limit: f32,
    scale: impl Fn(V::Float) -> V::Float,
    to_nearest_i32: impl Fn(V::Float) -> V::Int,
) {
    let len = elements.len().min(payload.len());
    let (elements, payload) = (elements.as_ptr(), payload.as_mut_ptr());
    // SAFETY: see above.
    unsafe {
        let (upper, lower) = (V::splat_f32(limit), V::splat_f32(-limit));
        // Clamped before it is rounded, which gives the same integers as after, the bounds
        // being integers: NaN still becomes the lower one, and the rounding is the
        // conversion's own.
        each_step!(V, len, |step| {
            let scaled = scale(V::as_f32(step.load::<V>(elements)));
            let clamped = V::min_f32(V::max_f32(scaled, lower), upper);
            step.store::<V>(payload, to_nearest_i32(clamped));
        });
    }
}

#[inline(always)]
unsafe fn dequantise<V: Lanes>(payload: &[u8], elements: &mut [u8], (low, high): (f32, f32)) {
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
) {
    let len = elements.len().min(payload.len());
    let (payload, elements) = (payload.as_ptr(), elements.as_mut_ptr());
    each_step!(V, len, |step| {
        // SAFETY: see above.
        unsafe { step.store::<V>(elements, V::as_i32(scale(V::i32_to_f32(step.load::<V>(payload))))) }
    });
}

/// `_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC`: ties to even, no exceptions, whatever
/// MXCSR says.
const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

/// MXCSR's rounding control: 0 rounds to nearest, ties to even.
const MXCSR_ROUNDING: u32 = 0x6000;
/// MXCSR's mask of the precision exception, which a conversion of a fraction raises:
/// set, it raises none a program sees.
const MXCSR_PRECISION_MASKED: u32 = 0x1000;

/// 256-bit vectors of AVX2.
struct Avx2;

/// The mask of AVX2's masked loads and stores for the first `count` of 8 lanes: all ones
/// in a lane taken, whose sign bit is what the instructions read.
///
/// # Safety
/// As [`Lanes`], for AVX2.
#[inline(always)]
unsafe fn first_lanes(count: usize) -> __m256i {
    // SAFETY: as the caller guarantees.
    unsafe { _mm256_cmpgt_epi32(_mm256_set1_epi32(count as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)) }
}

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
    unsafe fn load_first(from: *const u8, count: usize) -> __m256i {
        // SAFETY: as the trait requires of the caller: the mask covers `count` lanes.
        unsafe { _mm256_maskload_epi32(from.cast(), first_lanes(count)) }
    }
    #[inline(always)]
    unsafe fn store_first(to: *mut u8, value: __m256i, count: usize) {
        // SAFETY: as the trait requires of the caller: the mask covers `count` lanes.
        unsafe { _mm256_maskstore_epi32(to.cast(), first_lanes(count), value) }
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
    unsafe fn mul_i32(a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm256_mullo_epi32(a, b) }
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
    unsafe fn round_ties_even(value: __m256) -> __m256 {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm256_round_ps::<NEAREST>(value) }
    }
    #[inline(always)]
    unsafe fn truncate_to_i32(value: __m256) -> __m256i {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm256_cvttps_epi32(value) }
    }
    /// AVX2's conversion rounds as MXCSR says, which a host may have changed: the
    /// default rounds to nearest and masks every exception. Read once a kernel call.
    #[inline(always)]
    unsafe fn converts_to_nearest() -> bool {
        let mut mxcsr = 0u32;
        // SAFETY: `stmxcsr` stores the thread's MXCSR into the 4 bytes given and changes
        // nothing else (`std::arch`'s `_mm_getcsr` is deprecated for this).
        unsafe {
            std::arch::asm!("stmxcsr [{}]", in(reg) &mut mxcsr, options(nostack, preserves_flags));
        }
        mxcsr & (MXCSR_ROUNDING | MXCSR_PRECISION_MASKED) == MXCSR_PRECISION_MASKED
    }
    #[inline(always)]
    unsafe fn to_nearest_i32(value: __m256) -> __m256i {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm256_cvtps_epi32(value) }
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
    unsafe fn load_first(from: *const u8, count: usize) -> __m512i {
        // SAFETY: as the trait requires of the caller: the mask covers `count` lanes.
        unsafe { _mm512_maskz_loadu_epi32((1 << count) - 1, from.cast()) }
    }
    #[inline(always)]
    unsafe fn store_first(to: *mut u8, value: __m512i, count: usize) {
        // SAFETY: as the trait requires of the caller: the mask covers `count` lanes.
        unsafe { _mm512_mask_storeu_epi32(to.cast(), (1 << count) - 1, value) }
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
    unsafe fn mul_i32(a: __m512i, b: __m512i) -> __m512i {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_mullo_epi32(a, b) }
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
    unsafe fn round_ties_even(value: __m512) -> __m512 {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_roundscale_ps::<NEAREST>(value) }
    }
    #[inline(always)]
    unsafe fn truncate_to_i32(value: __m512) -> __m512i {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_cvttps_epi32(value) }
    }
    /// The conversion's rounding is encoded in the instruction, whatever MXCSR says.
    #[inline(always)]
    unsafe fn converts_to_nearest() -> bool {
        true
    }
    #[inline(always)]
    unsafe fn to_nearest_i32(value: __m512) -> __m512i {
        // SAFETY: as the trait requires of the caller.
        unsafe { _mm512_cvt_roundps_epi32::<NEAREST>(value) }
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
            pub(crate) unsafe fn add_assign_i32(acc: &mut [u8], src: &[u8]) {
                // SAFETY: as this module requires of the caller.
                unsafe { super::add_assign_i32::<$lanes>(acc, src) }
            }

            #[target_feature(enable = $feature)]
            pub(crate) unsafe fn add_assign_f32(acc: &mut [u8], src: &[u8]) {
                // SAFETY: as this module requires of the caller.
                unsafe { super::add_assign_f32::<$lanes>(acc, src) }
            }

            #[target_feature(enable = $feature)]
            pub(crate) unsafe fn add_i32(out: &mut [u8], a: &[u8], b: &[u8]) {
                // SAFETY: as this module requires of the caller.
                unsafe { super::add_i32::<$lanes>(out, a, b) }
            }

            #[target_feature(enable = $feature)]
            pub(crate) unsafe fn add_f32(out: &mut [u8], a: &[u8], b: &[u8]) {
                // SAFETY: as this module requires of the caller.
                unsafe { super::add_f32::<$lanes>(out, a, b) }
            }

            #[target_feature(enable = $feature)]
            pub(crate) unsafe fn multiply_i32(out: &mut [u8], src: &[u8], factor: i32) {
                // SAFETY: as this module requires of the caller.
                unsafe { super::multiply_i32::<$lanes>(out, src, factor) }
            }

            #[target_feature(enable = $feature)]
            pub(crate) unsafe fn largest_magnitude_bits(bytes: &[u8]) -> u32 {
                // SAFETY: as this module requires of the caller.
                unsafe { super::largest_magnitude_bits::<$lanes>(bytes) }
            }

            #[target_feature(enable = $feature)]
            pub(crate) unsafe fn largest_magnitude_bits_of_blocks(
                bytes: &[u8],
                block_bytes: usize,
                largest: &mut [u32],
            ) {
                // SAFETY: as this module requires of the caller.
                unsafe { super::largest_magnitude_bits_of_blocks::<$lanes>(bytes, block_bytes, largest) }
            }

            #[target_feature(enable = $feature)]
            pub(crate) unsafe fn quantise(elements: &[u8], payload: &mut [u8], scale: (f32, f32), limit: f32) {
                // SAFETY: as this module requires of the caller.
                unsafe { super::quantise::<$lanes>(elements, payload, scale, limit) }
            }

            #[target_feature(enable = $feature)]
            pub(crate) unsafe fn dequantise(payload: &[u8], elements: &mut [u8], scale: (f32, f32)) {
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
