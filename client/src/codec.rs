//! Pre- and post-processing: how a tensor's elements become packet payloads and back.
//!
//! A [`Codec`] is chosen by `general.prepostprocessor` or passed to
//! [`Context::start_with_codec`](crate::Context::start_with_codec) to plug in one's own.
//! int32 always travels as is; float32 travels natively ([`Native`], summed as floats by
//! the switch) or as block floating point ([`BlockFloatingPoint`], int32 with a
//! per-packet exponent, as a switch ASIC needs).

use netagg_aggregator::sum::InstructionSet;
use netagg_wire::ElementType;

use crate::DataType;

/// Turns elements into payloads and sums back into elements (little-endian), each of its
/// own size: the tensor's [`DataType::size`] and the wire type's [`ElementType::size`].
pub trait Codec: Send + Sync + 'static {
    /// The element type the switch sums for a job of `data_type`.
    fn wire_type(&self, data_type: DataType) -> ElementType;

    /// Whether jobs of `data_type` agree a per-packet exponent first.
    fn uses_exponents(&self, data_type: DataType) -> bool {
        let _ = data_type;
        false
    }

    /// Whether a block whose elements are all zero bytes encodes to a zero payload, and a
    /// zero sum decodes to zero bytes: then such blocks may stay off the wire (sparse
    /// jobs, `general.sparse`). Own codecs are assumed not to, unless they say so.
    fn keeps_zero_blocks_zero(&self, data_type: DataType) -> bool {
        let _ = data_type;
        false
    }

    /// Checks a tensor on the submitting thread before its job is queued; an error refuses
    /// the job ([`Error::InvalidInput`](crate::Error::InvalidInput)) and leaves the
    /// buffers alone. A pass over the whole tensor here is serial: netagg's codecs check
    /// nothing, and block floating point carries non-finite blocks instead.
    fn check(&self, data_type: DataType, elements: &[u8]) -> Result<(), String> {
        let _ = (data_type, elements);
        Ok(())
    }

    /// This worker's exponent of `elements` (only asked when [`Codec::uses_exponents`]).
    fn exponent(&self, data_type: DataType, elements: &[u8]) -> i8 {
        let _ = (data_type, elements);
        i8::MIN
    }

    /// This worker's exponent of each block of `block_bytes` bytes in `elements` (the last
    /// may be shorter), appended to `exponents` in order: what [`Codec::exponent`] gives
    /// for each, found many blocks at a time (a worker thread asks for a run of blocks
    /// ahead of its packets).
    fn exponents(&self, data_type: DataType, elements: &[u8], block_bytes: usize, exponents: &mut Vec<i8>) {
        exponents.extend(elements.chunks(block_bytes).map(|block| self.exponent(data_type, block)));
    }

    /// Encodes `elements` into `payload` (as many elements, of the wire type);
    /// `exponent` is the agreed one.
    fn encode(&self, data_type: DataType, elements: &[u8], payload: &mut [u8], exponent: Option<i8>);

    /// Decodes the sum in `payload` into `elements` (as many elements, of the tensor's
    /// type). `elements` holds the output's old bytes, or zeros where the caller's
    /// memory may never have been written; neither is of use to the codec.
    fn decode(&self, data_type: DataType, payload: &[u8], elements: &mut [u8], exponent: Option<i8>);
}

/// Elements as they are: int32 summed with wrap-around, float32 summed as floats.
#[derive(Debug, Clone, Copy, Default)]
pub struct Native;

impl Codec for Native {
    fn wire_type(&self, data_type: DataType) -> ElementType {
        data_type.element_type()
    }

    fn keeps_zero_blocks_zero(&self, _: DataType) -> bool {
        true
    }

    fn encode(&self, _: DataType, elements: &[u8], payload: &mut [u8], _: Option<i8>) {
        payload.copy_from_slice(elements);
    }

    fn decode(&self, _: DataType, payload: &[u8], elements: &mut [u8], _: Option<i8>) {
        elements.copy_from_slice(payload);
    }
}

/// float32 as int32 scaled by a per-packet power of two that every worker agreed on, so
/// that a switch summing int32 sums floats (SwitchML's `cpu_exponent_quantizer`).
///
/// A packet's exponent byte is the IEEE exponent field of its largest magnitude, less 128
/// so that the switch's signed maximum orders it: `e` bounds the packet's elements by
/// `|x| < 2^(e+2)` (subnormals count as the smallest normal exponent). Each element is
/// sent as `round(x · 2^k)`, clamped to `±⌊(2^31 − 1) / n⌋`, with `2^k` the largest power
/// of two for which `n · 2^(e+2) · 2^k ≤ 2^31`. The clamp is part of the scheme, not only
/// a guard: rounding up can reach `2^(31 − ⌈log2 n⌉)`, whose `n`-fold sum overflows int32
/// when `n` is a power of two of 256 or more. A power of two keeps the product exact in
/// f32, so encoding is one rounding in vector f32 arithmetic; elements below half of
/// `2^(e+2) · 2^⌈log2 n⌉ / 2^31` round to zero: the precision of block floating point.
///
/// The two bytes the field leaves free mark what int32 cannot carry:
/// - `i8::MIN`: every element is zero (or the packet has none), sent as zeros;
/// - `i8::MAX`: some worker's block holds an infinity or a NaN. The maximum carries it
///   to every worker, whose whole block then comes back NaN, as a float sum with a NaN
///   or an infinity is not finite either: a mixed-precision loss scaler sees it on every
///   rank and skips the step, instead of one rank failing and the others timing out.
///
/// A worker thread's first window of packets shares one exponent (agreed by a single
/// header-only round); every later packet has its own (`docs/protocol.md` §4). int32
/// tensors travel as they are.
#[derive(Debug, Clone, Copy)]
pub struct BlockFloatingPoint {
    /// ⌈log2 n⌉ for `n` workers: the bits a sum of `n` contributions may need above one.
    sum_bits: u32,
    /// The largest f32 not above `i32::MAX / n`, the bound of each element's integer that
    /// keeps `n` of them from overflowing: needed where rounding reaches the power of two
    /// above (see above), and where an input broke the agreed exponent (changed by its
    /// owner mid-job, say).
    limit: f32,
    /// The vectors the scan and the conversions run in: the CPU's widest, unless chosen.
    instruction_set: InstructionSet,
}

/// The exponent byte of a packet with no element but zeros.
const ZERO_EXPONENT: i8 = i8::MIN;
/// The exponent byte of a packet some worker could not encode: an infinity or a NaN.
const NON_FINITE_EXPONENT: i8 = i8::MAX;

/// The f32 exponent field of all ones: infinities and NaN.
const NON_FINITE_FIELD: u32 = 0xFF;

/// The blocks [`BlockFloatingPoint`]'s `exponents` scans in one call of its kernel: the
/// room on the stack for their largest magnitudes.
const EXPONENTS_A_CALL: usize = 64;

/// The exponent byte of a block whose largest magnitude has the bits `largest`.
fn exponent_of(largest: u32) -> i8 {
    match largest >> 23 {
        _ if largest == 0 => ZERO_EXPONENT,
        NON_FINITE_FIELD => NON_FINITE_EXPONENT,
        // Subnormals (field 0) lie below the smallest normal number, 2^-126.
        field => (field.max(1) as i32 - 128) as i8,
    }
}

impl BlockFloatingPoint {
    /// A codec for sessions of `workers` workers.
    pub fn new(workers: u16) -> BlockFloatingPoint {
        let workers = workers.max(1) as u32;
        let largest = i32::MAX as u32 / workers;
        // `as f32` rounds to nearest, which may be above `largest`: step down once.
        let mut limit = largest as f32;
        if limit as u64 > largest as u64 {
            limit = f32::from_bits(limit.to_bits() - 1);
        }
        BlockFloatingPoint {
            sum_bits: workers.next_power_of_two().trailing_zeros(),
            limit,
            instruction_set: InstructionSet::best(),
        }
    }

    /// The same codec computing in the vectors of `set` (all give the same bytes).
    pub fn with_instruction_set(self, set: InstructionSet) -> BlockFloatingPoint {
        BlockFloatingPoint { instruction_set: set, ..self }
    }

    /// `2^k` for an agreed exponent, as [`factors`] (`k` spans -113 to 156).
    fn scale(&self, exponent: i8) -> (f32, f32) {
        factors(self.scale_exponent(exponent))
    }

    /// The inverse of [`BlockFloatingPoint::scale`], built the same way rather than
    /// divided out (two divisions a packet showed in profiles).
    fn unscale(&self, exponent: i8) -> (f32, f32) {
        factors(-self.scale_exponent(exponent))
    }

    fn scale_exponent(&self, exponent: i8) -> i32 {
        31 - self.sum_bits as i32 - (exponent as i32 + 2)
    }
}

/// `2^k` as two factors whose product is exact, even beyond f32's range: `2^k` and 1
/// where `2^k` and `2^-k` are normal f32 (the kernels then multiply once; symmetric, so
/// that the inverse of a scale is its factors' inverses), else two halves of `k`, each
/// normal for any `|k|` up to 252.
fn factors(k: i32) -> (f32, f32) {
    if (-126..=126).contains(&k) {
        (power_of_two(k), 1.0)
    } else {
        (power_of_two(k / 2), power_of_two(k - k / 2))
    }
}

/// `2^k` for `k` within the normal f32 exponents, -126 to 127.
fn power_of_two(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// An element's bits: one 4-byte load (built byte by byte, the scan below compiled to
/// gathers across its chunks instead of vector loads).
fn bits(element: &[u8]) -> u32 {
    u32::from_le_bytes(element.try_into().expect("4-byte elements"))
}

/// The largest magnitude of float32 `bytes`, as its bit pattern without the sign: as
/// unsigned integers these order as the magnitudes do, infinities and NaN above all.
/// An integer maximum, which vectorises (a float one does not, for NaN's sake): in the
/// vectors of `set`, or [`largest_magnitude_bits_portable`].
fn largest_magnitude_bits(set: InstructionSet, bytes: &[u8]) -> u32 {
    netagg_simd::largest_magnitude_bits(set, bytes).unwrap_or_else(|| largest_magnitude_bits_portable(bytes))
}

/// [`largest_magnitude_bits`] of each block of `block_bytes` bytes in `bytes`, into
/// `largest`: in one call of `set`'s kernel, or [`largest_magnitude_bits_portable`] a
/// block at a time.
fn largest_magnitude_bits_of_blocks(
    set: InstructionSet,
    bytes: &[u8],
    block_bytes: usize,
    largest: &mut [u32],
) {
    if !netagg_simd::largest_magnitude_bits_of_blocks(set, bytes, block_bytes, largest) {
        for (block, largest) in bytes.chunks(block_bytes).zip(largest) {
            *largest = largest_magnitude_bits_portable(block);
        }
    }
}

/// [`largest_magnitude_bits`] for any CPU, compiled for SSE4.1 beside baseline x86-64
/// (an unsigned maximum needs it to vectorise).
#[multiversion::multiversion(targets("x86_64+sse4.1"))]
fn largest_magnitude_bits_portable(bytes: &[u8]) -> u32 {
    bytes.chunks_exact(4).fold(0, |largest, element| largest.max(bits(element) & 0x7FFF_FFFF))
}

/// `round(x · low · high)` per element, ties to even, clamped to `±limit`: in the vectors
/// of `set`, or [`quantise_portable`].
fn quantise(set: InstructionSet, elements: &[u8], payload: &mut [u8], scale: (f32, f32), limit: f32) {
    if !netagg_simd::quantise(set, elements, payload, scale, limit) {
        quantise_portable(elements, payload, scale, limit);
    }
}

/// [`quantise`] for any CPU, compiled for SSE4.1 beside baseline x86-64 (whose rounding
/// to an integer is a library call per element without it).
#[multiversion::multiversion(targets("x86_64+sse4.1"))]
fn quantise_portable(elements: &[u8], payload: &mut [u8], (low, high): (f32, f32), limit: f32) {
    // A loop of its own for a scale of one factor, the usual case: a multiplication a
    // vector less, with the same results. The products differ only where the two-step
    // one rounds twice, into the subnormals: below 0.5, where both round to zero.
    if high == 1.0 {
        quantise_scaled(elements, payload, |x| x * low, limit);
    } else {
        quantise_scaled(elements, payload, |x| x * low * high, limit);
    }
}

/// [`quantise_portable`]'s loop. Always inlined, as `scale` is: a call out of the
/// per-instruction-set copies of `quantise_portable` would leave the loop scalar.
#[inline(always)]
fn quantise_scaled(elements: &[u8], payload: &mut [u8], scale: impl Fn(f32) -> f32, limit: f32) {
    for (out, x) in payload.chunks_exact_mut(4).zip(elements.chunks_exact(4)) {
        let scaled = scale(f32::from_bits(bits(x))).round_ties_even();
        // Comparisons rather than `f32::max` and `min`, whose care for NaN costs two
        // instructions a vector: these compile to `maxps` and `minps`, and still turn a
        // NaN (an input changed since its exponent was taken) into a bound.
        let at_least_low = if scaled > -limit { scaled } else { -limit };
        let clamped = if at_least_low < limit { at_least_low } else { limit };
        // SAFETY: `clamped` is an integer within ±i32::MAX, so it fits an i32; the
        // unchecked cast is what lets the loop vectorise (`as` saturates per element).
        let quantised: i32 = unsafe { clamped.to_int_unchecked() };
        out.copy_from_slice(&quantised.to_le_bytes());
    }
}

/// `sum · low · high` per element: one rounding, of the integer to f32; the powers of two
/// are exact (but where the result leaves f32's range: an overflowing sum is infinite).
/// In the vectors of `set`, or [`dequantise_portable`].
fn dequantise(set: InstructionSet, payload: &[u8], elements: &mut [u8], scale: (f32, f32)) {
    if !netagg_simd::dequantise(set, payload, elements, scale) {
        dequantise_portable(payload, elements, scale);
    }
}

/// [`dequantise`] for any CPU, compiled for SSE4.1 beside baseline x86-64 as
/// [`quantise_portable`] is.
#[multiversion::multiversion(targets("x86_64+sse4.1"))]
fn dequantise_portable(payload: &[u8], elements: &mut [u8], (low, high): (f32, f32)) {
    // As in `quantise`: one multiplication where the scale is one factor; a non-zero
    // integer times a scale within ±126 powers of two is never subnormal, so the
    // products are exact either way.
    if high == 1.0 {
        dequantise_scaled(payload, elements, |sum| sum * low);
    } else {
        dequantise_scaled(payload, elements, |sum| sum * low * high);
    }
}

/// [`dequantise_portable`]'s loop, always inlined as [`quantise_scaled`] is.
#[inline(always)]
fn dequantise_scaled(payload: &[u8], elements: &mut [u8], scale: impl Fn(f32) -> f32) {
    for (out, q) in elements.chunks_exact_mut(4).zip(payload.chunks_exact(4)) {
        let sum = bits(q) as i32;
        out.copy_from_slice(&scale(sum as f32).to_le_bytes());
    }
}

impl Codec for BlockFloatingPoint {
    fn wire_type(&self, data_type: DataType) -> ElementType {
        match data_type {
            DataType::Float32 => ElementType::Int32,
            other => other.element_type(),
        }
    }

    fn uses_exponents(&self, data_type: DataType) -> bool {
        data_type == DataType::Float32
    }

    /// All but float32, which alone it encodes: float32 blocks need an agreed exponent
    /// each, so their jobs stay dense.
    fn keeps_zero_blocks_zero(&self, data_type: DataType) -> bool {
        data_type != DataType::Float32
    }

    fn exponent(&self, _: DataType, elements: &[u8]) -> i8 {
        exponent_of(largest_magnitude_bits(self.instruction_set, elements))
    }

    fn exponents(&self, _: DataType, elements: &[u8], block_bytes: usize, exponents: &mut Vec<i8>) {
        let mut largest = [0; EXPONENTS_A_CALL];
        for run in elements.chunks(block_bytes * EXPONENTS_A_CALL) {
            let largest = &mut largest[..run.len().div_ceil(block_bytes)];
            largest_magnitude_bits_of_blocks(self.instruction_set, run, block_bytes, largest);
            exponents.extend(largest.iter().map(|&bits| exponent_of(bits)));
        }
    }

    fn encode(&self, data_type: DataType, elements: &[u8], payload: &mut [u8], exponent: Option<i8>) {
        match exponent {
            _ if data_type != DataType::Float32 => payload.copy_from_slice(elements),
            // What a non-finite block sends does not matter: it decodes to NaN.
            None | Some(ZERO_EXPONENT | NON_FINITE_EXPONENT) => payload.fill(0),
            Some(exponent) => {
                quantise(self.instruction_set, elements, payload, self.scale(exponent), self.limit)
            }
        }
    }

    fn decode(&self, data_type: DataType, payload: &[u8], elements: &mut [u8], exponent: Option<i8>) {
        match exponent {
            _ if data_type != DataType::Float32 => elements.copy_from_slice(payload),
            None | Some(ZERO_EXPONENT) => elements.fill(0),
            Some(NON_FINITE_EXPONENT) => {
                for out in elements.chunks_exact_mut(4) {
                    out.copy_from_slice(&f32::NAN.to_le_bytes());
                }
            }
            Some(exponent) => {
                dequantise(self.instruction_set, payload, elements, self.unscale(exponent));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn floats(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
        bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap()))
    }

    fn bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    /// Quantises every worker's values with their common exponent, sums as int32 the way
    /// the switch does, and decodes.
    fn round_trip(codec: &BlockFloatingPoint, workers: &[Vec<f32>]) -> Vec<f32> {
        let exponent = workers.iter().map(|w| codec.exponent(DataType::Float32, &bytes(w))).max();
        let mut sum = vec![0i32; workers[0].len()];
        for values in workers {
            let mut payload = vec![0u8; values.len() * 4];
            codec.encode(DataType::Float32, &bytes(values), &mut payload, exponent);
            for (s, q) in sum.iter_mut().zip(payload.chunks_exact(4)) {
                *s = s.wrapping_add(i32::from_le_bytes(q.try_into().unwrap()));
            }
        }
        let summed: Vec<u8> = sum.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut out = vec![0u8; summed.len()];
        codec.decode(DataType::Float32, &summed, &mut out, exponent);
        floats(&out).collect()
    }

    #[test]
    // Arithmetic over many thousands of values, minutes under Miri; the codec's memory
    // accesses are the other tests' too.
    #[cfg_attr(miri, ignore)]
    fn sums_stay_within_the_block_precision_across_the_whole_float_range() {
        // The largest magnitude keeps the exact sum of 64 workers within f32.
        for magnitude in [1e-30f32, 1e-3, 1.0, 3.5e5, 1e30, f32::MAX / 256.0] {
            for workers in [1u16, 2, 64] {
                let codec = BlockFloatingPoint::new(workers);
                let inputs: Vec<Vec<f32>> = (0..workers)
                    .map(|w| {
                        (0..50)
                            .map(|i| magnitude * ((i as f32 - 25.0) / 25.0) * (1.0 + w as f32 / 100.0))
                            .collect()
                    })
                    .collect();
                let got = round_trip(&codec, &inputs);
                let largest = inputs.iter().flatten().fold(0f64, |m, x| m.max(x.abs() as f64));
                // One quantisation step per worker, relative to the packet's largest value.
                let bound = 2.0 * largest * workers as f64 * workers as f64 / (i32::MAX as f64)
                    + f32::EPSILON as f64 * largest * workers as f64;
                for (i, g) in got.iter().enumerate() {
                    let exact: f64 = inputs.iter().map(|w| w[i] as f64).sum();
                    assert!(g.is_finite(), "magnitude {magnitude}, {workers} workers: element {i} is {g}");
                    assert!(
                        (*g as f64 - exact).abs() <= bound,
                        "magnitude {magnitude}, {workers} workers: {g} vs {exact}"
                    );
                }
            }
        }
    }

    #[test]
    fn zeros_subnormals_and_the_largest_float_are_handled() {
        let codec = BlockFloatingPoint::new(4);
        assert_eq!(round_trip(&codec, &[vec![0.0; 3], vec![0.0, -0.0, 0.0]]), vec![0.0; 3]);
        assert_eq!(codec.exponent(DataType::Float32, &bytes(&[0.0, -0.0])), ZERO_EXPONENT);
        assert_eq!(codec.exponent(DataType::Float32, &bytes(&[f32::MIN_POSITIVE / 2.0])), -127);
        assert_eq!(codec.exponent(DataType::Float32, &bytes(&[f32::MIN_POSITIVE])), -127);
        assert_eq!(codec.exponent(DataType::Float32, &bytes(&[1.0, -3.0])), 0);
        assert_eq!(codec.exponent(DataType::Float32, &bytes(&[f32::MAX])), 126);
        let got = round_trip(&codec, &[vec![f32::MAX / 8.0, 1.0], vec![f32::MAX / 8.0, 0.0]]);
        assert!((got[0] / (f32::MAX / 4.0) - 1.0).abs() < 1e-6, "{}", got[0]);
        // A sum beyond f32's range is infinite, as a float sum is.
        let codec = BlockFloatingPoint::new(2);
        assert_eq!(round_trip(&codec, &[vec![f32::MAX, -1.0], vec![f32::MAX, 1.0]]), [f32::INFINITY, 0.0]);
        let tiny = f32::from_bits(1);
        assert_eq!(round_trip(&codec, &[vec![tiny, 0.0], vec![tiny, -tiny]]), [2.0 * tiny, -tiny]);
    }

    #[test]
    fn an_element_at_the_bound_cannot_overflow_the_sum() {
        // The largest magnitude an exponent allows, from every worker. For 256 workers or
        // more (a power of two), it rounds up to 2^(31 - log2 n), whose n-fold sum is
        // 2^31: only the clamp keeps it within int32.
        for workers in [1u16, 2, 3, 4, 64, 256, 1024, 32768, 65535] {
            let codec = BlockFloatingPoint::new(workers);
            let largest = f32::from_bits(0x3FFF_FFFF); // just below 2
            let mut payload = [0u8; 8];
            codec.encode(DataType::Float32, &bytes(&[largest, -largest]), &mut payload, Some(-128 + 127));
            let q = i32::from_le_bytes(payload[..4].try_into().unwrap()) as i64;
            assert!(q * workers as i64 <= i32::MAX as i64, "{workers} workers: {q}");
            assert_eq!(i32::from_le_bytes(payload[4..].try_into().unwrap()) as i64, -q);
        }
    }

    #[test]
    // Arithmetic over many thousands of values, minutes under Miri; the codec's memory
    // accesses are the other tests' too.
    #[cfg_attr(miri, ignore)]
    fn the_scan_sees_every_element_in_the_lanes_and_the_rest() {
        // 4 rounds of 16 lanes, then 3 more: the value sought at every position.
        for set in InstructionSet::supported() {
            for position in 0..67 {
                let mut values = vec![0.5f32; 67];
                values[position] = -3.0;
                assert_eq!(
                    largest_magnitude_bits(set, &bytes(&values)),
                    3.0f32.to_bits(),
                    "{set}, at {position}"
                );
                let codec = BlockFloatingPoint::new(2).with_instruction_set(set);
                for special in [f32::NEG_INFINITY, f32::NAN, -f32::NAN] {
                    values[position] = special;
                    assert_eq!(
                        codec.exponent(DataType::Float32, &bytes(&values)),
                        NON_FINITE_EXPONENT,
                        "{set}"
                    );
                }
                values[position] = f32::MAX;
                assert_eq!(codec.exponent(DataType::Float32, &bytes(&values)), 126, "{set}");
            }
            assert_eq!(
                largest_magnitude_bits(set, &bytes(&[-0.0, f32::MIN_POSITIVE / 4.0])),
                (f32::MIN_POSITIVE / 4.0).to_bits()
            );
            assert_eq!(largest_magnitude_bits(set, &[]), 0);
        }
    }

    #[test]
    fn the_exponents_of_a_run_are_each_block_s_exponent() {
        // Blocks of 1 to 17 elements, runs past one call's room and with a short last
        // block; every block's largest magnitude at a different place and scale, some
        // blocks all zeros, one with a NaN and one with an infinity.
        let values: Vec<f32> = (0..2000u32)
            .map(|i| match i {
                _ if i % 97 < 9 => 0.0,
                333 => f32::NAN,
                1500 => f32::NEG_INFINITY,
                _ => {
                    ((i * 7919) % 1000) as f32
                        * 2f32.powi((i % 23) as i32 - 11)
                        * if i % 3 == 0 { -1.0 } else { 1.0 }
                }
            })
            .collect();
        for set in InstructionSet::supported() {
            let codec = BlockFloatingPoint::new(4).with_instruction_set(set);
            for block_elements in [1, 7, 8, 16, 17] {
                for elements in [0, 1, block_elements * 64, block_elements * 64 + 1, 2000] {
                    let bytes = bytes(&values[..elements]);
                    let block_bytes = block_elements * 4;
                    let expected: Vec<i8> = bytes
                        .chunks(block_bytes)
                        .map(|block| codec.exponent(DataType::Float32, block))
                        .collect();
                    let mut got = vec![5];
                    codec.exponents(DataType::Float32, &bytes, block_bytes, &mut got);
                    assert_eq!(got[0], 5, "{set}: appended, not overwritten");
                    assert_eq!(
                        got[1..],
                        expected,
                        "{set}: {elements} elements in blocks of {block_elements}"
                    );
                }
            }
        }
    }

    #[test]
    fn unscaling_inverts_scaling_exactly_for_every_exponent_and_cluster() {
        for workers in [1, 2, 3, 256, 32768] {
            let codec = BlockFloatingPoint::new(workers);
            for exponent in -127..=126i8 {
                let ((low, high), (inverse_low, inverse_high)) =
                    (codec.scale(exponent), codec.unscale(exponent));
                assert_eq!((low * inverse_low, high * inverse_high), (1.0, 1.0), "{workers}, {exponent}");
            }
        }
    }

    #[test]
    fn one_factor_and_two_factors_scale_alike() {
        let tiny = f32::from_bits(1);
        let inputs = [0.0, -0.0, tiny, -tiny, f32::MIN_POSITIVE, 1e-30, 0.3, -1.5, 7.0e5, 3e30, f32::MAX];
        let input_bytes = bytes(&inputs);
        let sums = [0, 1, -1, 3, 1 << 20, -(1 << 29), i32::MAX, i32::MIN];
        let sum_bytes: Vec<u8> = sums.iter().flat_map(|v| v.to_le_bytes()).collect();
        for (set, k) in InstructionSet::supported().flat_map(|set| (-126..=126).map(move |k| (set, k))) {
            let two = (power_of_two(k / 2), power_of_two(k - k / 2));
            assert_eq!(factors(k), (power_of_two(k), 1.0));
            let (mut one_factor, mut two_factors) =
                (vec![0u8; input_bytes.len()], vec![0u8; input_bytes.len()]);
            quantise(set, &input_bytes, &mut one_factor, factors(k), 1e9);
            quantise(set, &input_bytes, &mut two_factors, two, 1e9);
            assert_eq!(one_factor, two_factors, "{set}: quantising at 2^{k}");
            let (mut one_factor, mut two_factors) = (vec![0u8; sum_bytes.len()], vec![0u8; sum_bytes.len()]);
            dequantise(set, &sum_bytes, &mut one_factor, factors(k));
            dequantise(set, &sum_bytes, &mut two_factors, two);
            assert_eq!(one_factor, two_factors, "{set}: dequantising at 2^{k}");
        }
        for k in [-252, -127, 127, 252] {
            let (low, high) = factors(k);
            assert_eq!(
                (low.to_bits() >> 23, high.to_bits() >> 23),
                ((k / 2 + 127) as u32, (k - k / 2 + 127) as u32)
            );
        }
    }

    /// float32 bit patterns with the edge values over-represented: zeros of both signs,
    /// subnormals, the smallest normal, the largest finite, infinities, NaN, and values
    /// whose scaled form lies halfway between two integers (ties).
    fn element() -> impl Strategy<Value = u32> {
        prop_oneof![
            any::<u32>(),
            (-1000i32..1000).prop_map(|half_steps| (half_steps as f32 * 0.5).to_bits()),
            prop::sample::select(vec![
                0,
                0x8000_0000,
                1,
                0x8000_0001,
                0x007F_FFFF,
                0x0080_0000,
                0x7F7F_FFFF,
                0xFF7F_FFFF,
                0x7F80_0000,
                0xFF80_0000,
                0x7FC0_0000,
                0xFFC0_0001,
            ]),
        ]
    }

    proptest! {
        #[test]
        // Miri interprets none of the vector instructions beyond SSE2 that this compares,
        // and proptest reads the working folder, which Miri's isolation refuses.
        #[cfg_attr(miri, ignore)]
        fn every_instruction_set_codes_as_the_portable_loops(
            elements in prop::collection::vec(element(), 0..100),
            sums in prop::collection::vec(any::<i32>(), 0..100),
            workers in prop_oneof![Just(1u16), Just(2), Just(4), Just(256), 1u16..=u16::MAX],
            exponent in prop_oneof![-127i8..=126, Just(0)],
        ) {
            let elements: Vec<u8> = elements.iter().flat_map(|e| e.to_le_bytes()).collect();
            let sums: Vec<u8> = sums.iter().flat_map(|s| s.to_le_bytes()).collect();
            let portable = BlockFloatingPoint::new(workers).with_instruction_set(InstructionSet::PORTABLE);
            for set in InstructionSet::supported() {
                let codec = portable.with_instruction_set(set);
                let agreed = codec.exponent(DataType::Float32, &elements);
                prop_assert_eq!(agreed, portable.exponent(DataType::Float32, &elements), "{}", set);
                // Coded with the exponent of the elements, and with any other (one the
                // elements may exceed, as when changed by their owner mid-job).
                for exponent in [agreed, exponent] {
                    let (mut expected, mut got) = (vec![0x55; elements.len()], vec![0x55; elements.len()]);
                    portable.encode(DataType::Float32, &elements, &mut expected, Some(exponent));
                    codec.encode(DataType::Float32, &elements, &mut got, Some(exponent));
                    prop_assert_eq!(&got, &expected, "encoding, {}, exponent {}", set, exponent);
                    let (mut expected, mut got) = (vec![0x55; sums.len()], vec![0x55; sums.len()]);
                    portable.decode(DataType::Float32, &sums, &mut expected, Some(exponent));
                    codec.decode(DataType::Float32, &sums, &mut got, Some(exponent));
                    prop_assert_eq!(&got, &expected, "decoding, {}, exponent {}", set, exponent);
                }
            }
        }
    }

    #[test]
    fn an_element_beyond_its_agreed_exponent_is_clamped_to_the_bound() {
        // The tensor changed between the exponent scan and encoding (a misuse, but no
        // cause for undefined behaviour): NaN, infinities and too-large values clamp.
        let codec = BlockFloatingPoint::new(2);
        let exponent = Some(codec.exponent(DataType::Float32, &bytes(&[1.0, 2.0])));
        let changed = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e30, -1e30, 1.5];
        let mut payload = vec![0u8; changed.len() * 4];
        codec.encode(DataType::Float32, &bytes(&changed), &mut payload, exponent);
        // The bound: the largest float32 at most (2^31 - 1) / 2.
        let limit = 1_073_741_760;
        let got: Vec<i32> = payload.chunks(4).map(|q| i32::from_le_bytes(q.try_into().unwrap())).collect();
        assert_eq!(got[1..5], [limit, -limit, limit, -limit]);
        assert!(got[0] == limit || got[0] == -limit, "NaN becomes a bound: {}", got[0]);
    }

    #[test]
    fn a_non_finite_element_makes_its_block_nan_for_every_worker() {
        let codec = BlockFloatingPoint::new(2);
        for special in [f32::INFINITY, f32::NAN] {
            let got = round_trip(&codec, &[vec![1.0, 2.0], vec![special, 1.0]]);
            assert!(got.iter().all(|x| x.is_nan()), "{special}: {got:?}");
        }
        let ints: Vec<u8> = [7i32, -9].iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut payload = vec![0u8; 8];
        codec.encode(DataType::Int32, &ints, &mut payload, None);
        assert_eq!(payload, ints);
        assert!(!codec.uses_exponents(DataType::Int32));
    }
}
