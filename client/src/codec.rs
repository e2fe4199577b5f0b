//! Pre- and post-processing: how a tensor's elements become packet payloads and back.
//!
//! A [`Codec`] is chosen by `general.prepostprocessor` or passed to
//! [`Context::start_with_codec`](crate::Context::start_with_codec) to plug in one's own.
//! int32 always travels as is; float32 travels natively ([`Native`], summed as floats by
//! the switch) or as block floating point ([`BlockFloatingPoint`], int32 with a
//! per-packet exponent, as a switch ASIC needs).

use netagg_wire::ElementType;

use crate::DataType;

/// Turns elements into payloads and sums back into elements (little-endian, 4 bytes each).
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

    /// Checks a tensor before it is submitted; an error refuses the job.
    fn check(&self, data_type: DataType, elements: &[u8]) -> Result<(), String> {
        let _ = (data_type, elements);
        Ok(())
    }

    /// This worker's exponent of `elements` (only asked when [`Codec::uses_exponents`]).
    fn exponent(&self, data_type: DataType, elements: &[u8]) -> i8 {
        let _ = (data_type, elements);
        i8::MIN
    }

    /// Encodes `elements` into `payload` (as long); `exponent` is the agreed one.
    fn encode(&self, data_type: DataType, elements: &[u8], payload: &mut [u8], exponent: Option<i8>);

    /// Decodes the sum in `payload` into `elements` (as long).
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
/// The exponent `e` of a packet bounds its elements: `|x| < 2^(e+1)`. Each element is
/// sent as `round(x · s)` with `s = (2^31 − 1) / (n · 2^(e+1))` for `n` workers, so the
/// sum of `n` of them never overflows, whatever the inputs' range: the scale is computed
/// in f64 (SwitchML's float product overflows for large exponents and turns every result
/// into NaN). Elements below `2^(e+1) · n / 2^31` of their packet's largest round to zero:
/// the precision of block floating point. A worker thread's first window of packets
/// shares one exponent (agreed by a single header-only round); every later packet has its
/// own (`docs/protocol.md` §4). Infinities and NaN cannot be carried and are refused at
/// submission; int32 tensors travel as they are.
#[derive(Debug, Clone, Copy)]
pub struct BlockFloatingPoint {
    workers: u16,
}

impl BlockFloatingPoint {
    /// A codec for sessions of `workers` workers.
    pub fn new(workers: u16) -> BlockFloatingPoint {
        BlockFloatingPoint { workers: workers.max(1) }
    }

    /// The scale of an agreed exponent; `None` when every element is zero.
    fn scale(&self, exponent: Option<i8>) -> Option<f64> {
        let exponent = exponent.filter(|&e| e != i8::MIN)?;
        Some(i32::MAX as f64 / self.workers as f64 / 2f64.powi(exponent as i32 + 1))
    }
}

/// 1.5 · 2^52: for |v| < 2^51, `(v + this) - this` is `v` rounded to an integer, ties to
/// even (the FPU's default rounding).
const ROUND_TO_INTEGER: f64 = 6_755_399_441_055_744.0;

fn floats(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Lanes of the scans below: independent accumulators, so that the compiler vectorises
/// them (a single running maximum, or an early exit, keeps a loop scalar).
const LANES: usize = 8;

fn bits(element: &[u8]) -> u32 {
    u32::from_le_bytes([element[0], element[1], element[2], element[3]])
}

/// Whether float32 `bytes` hold an infinity or a NaN: an exponent field of all ones.
/// Adding 1 to that field carries into the sign bit only then, so one `or` over every
/// element tells (integer adds and ors vectorise on every x86-64).
fn any_non_finite(bytes: &[u8]) -> bool {
    let carry = |b: &[u8]| (bits(b) & 0x7F80_0000).wrapping_add(0x0080_0000);
    let mut lanes = [0u32; LANES];
    let mut chunks = bytes.chunks_exact(4 * LANES);
    for chunk in &mut chunks {
        for (lane, element) in lanes.iter_mut().zip(chunk.chunks_exact(4)) {
            *lane |= carry(element);
        }
    }
    let all = chunks.remainder().chunks_exact(4).map(carry).fold(0, |all, c| all | c);
    lanes.into_iter().fold(all, |all, lane| all | lane) & 0x8000_0000 != 0
}

/// The largest `|x|` of finite float32 `bytes`, as its bit pattern without the sign.
/// Compared as floats: `a > m ? a : m` is exactly x86's `maxps`, which integer maxima
/// lack before SSE4.1.
fn largest_magnitude_bits(bytes: &[u8]) -> u32 {
    let magnitude = |b: &[u8]| f32::from_bits(bits(b) & 0x7FFF_FFFF);
    let larger = |m: f32, a: f32| if a > m { a } else { m };
    let mut lanes = [0f32; LANES];
    let mut chunks = bytes.chunks_exact(4 * LANES);
    for chunk in &mut chunks {
        for (lane, element) in lanes.iter_mut().zip(chunk.chunks_exact(4)) {
            *lane = larger(*lane, magnitude(element));
        }
    }
    let rest = chunks.remainder().chunks_exact(4).map(magnitude).fold(0.0, larger);
    lanes.into_iter().fold(rest, larger).to_bits()
}

impl Codec for BlockFloatingPoint {
    fn wire_type(&self, _: DataType) -> ElementType {
        ElementType::Int32
    }

    fn uses_exponents(&self, data_type: DataType) -> bool {
        data_type == DataType::Float32
    }

    /// Only int32, which travels as is: float32 blocks need an agreed exponent each, so
    /// their jobs stay dense.
    fn keeps_zero_blocks_zero(&self, data_type: DataType) -> bool {
        data_type == DataType::Int32
    }

    fn check(&self, data_type: DataType, elements: &[u8]) -> Result<(), String> {
        if data_type != DataType::Float32 {
            return Ok(());
        }
        // One vectorised pass in the common case; the element is looked for only if any.
        if !any_non_finite(elements) {
            return Ok(());
        }
        match floats(elements).position(|x| !x.is_finite()) {
            None => Ok(()),
            Some(index) => Err(format!(
                "element {index} is {}: block floating point cannot carry infinities or NaN (prepostprocessor = native can)",
                floats(&elements[index * 4..]).next().unwrap_or(f32::NAN)
            )),
        }
    }

    fn exponent(&self, _: DataType, elements: &[u8]) -> i8 {
        let largest = largest_magnitude_bits(elements);
        if largest == 0 {
            return i8::MIN;
        }
        // floor(log2 |x|) for normal numbers; subnormals lie below 2^-126.
        let biased = ((largest >> 23) as i32).clamp(1, 254);
        (biased - 127) as i8
    }

    fn encode(&self, data_type: DataType, elements: &[u8], payload: &mut [u8], exponent: Option<i8>) {
        if data_type != DataType::Float32 {
            return payload.copy_from_slice(elements);
        }
        let Some(scale) = self.scale(exponent) else { return payload.fill(0) };
        // Clamped so that n contributions cannot overflow even if one exceeded the bound.
        let limit = (i32::MAX / self.workers as i32) as f64;
        for (out, x) in payload.chunks_exact_mut(4).zip(floats(elements)) {
            // Adding and subtracting 1.5 · 2^52 rounds to an integer (ties to even) with
            // plain vector adds; `f64::round` is a library call per element on baseline
            // x86-64, which made it the quantiser's largest cost.
            let rounded = (x as f64 * scale + ROUND_TO_INTEGER) - ROUND_TO_INTEGER;
            // `max` then `min` also turn NaN (impossible after `check`) into a bound.
            let clamped = rounded.max(-limit).min(limit);
            // SAFETY: `clamped` is finite and within ±i32::MAX, so it fits an i32; the
            // unchecked cast is what lets the loop vectorise (`as` saturates per element).
            let quantised: i32 = unsafe { clamped.to_int_unchecked() };
            out.copy_from_slice(&quantised.to_le_bytes());
        }
    }

    fn decode(&self, data_type: DataType, payload: &[u8], elements: &mut [u8], exponent: Option<i8>) {
        if data_type != DataType::Float32 {
            return elements.copy_from_slice(payload);
        }
        let Some(scale) = self.scale(exponent) else { return elements.fill(0) };
        // A multiplication per element rather than a division: several times faster, and
        // 1/scale is a power of two times (2^31 - 1)^-1, off by at most an f64 rounding.
        let inverse = 1.0 / scale;
        for (out, q) in elements.chunks_exact_mut(4).zip(payload.chunks_exact(4)) {
            let sum = i32::from_le_bytes([q[0], q[1], q[2], q[3]]);
            out.copy_from_slice(&((sum as f64 * inverse) as f32).to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(codec.exponent(DataType::Float32, &bytes(&[0.0, -0.0])), i8::MIN);
        assert_eq!(codec.exponent(DataType::Float32, &bytes(&[f32::MIN_POSITIVE / 2.0])), -126);
        assert_eq!(codec.exponent(DataType::Float32, &bytes(&[1.0, -3.0])), 1);
        assert_eq!(codec.exponent(DataType::Float32, &bytes(&[f32::MAX])), 127);
        let got = round_trip(&codec, &[vec![f32::MAX / 8.0, 1.0], vec![f32::MAX / 8.0, 0.0]]);
        assert!((got[0] / (f32::MAX / 4.0) - 1.0).abs() < 1e-6, "{}", got[0]);
    }

    #[test]
    fn the_scans_see_every_element_in_the_lanes_and_the_rest() {
        // 8 lanes of 8 elements, then 3 more: the value sought at every position.
        for position in 0..67 {
            let mut values = vec![0.5f32; 67];
            values[position] = -3.0;
            assert_eq!(largest_magnitude_bits(&bytes(&values)), 3.0f32.to_bits(), "at {position}");
            values[position] = f32::NEG_INFINITY;
            assert!(any_non_finite(&bytes(&values)), "at {position}");
            values[position] = f32::NAN;
            assert!(any_non_finite(&bytes(&values)), "at {position}");
            values[position] = f32::MAX;
            assert!(!any_non_finite(&bytes(&values)), "at {position}");
        }
        assert_eq!(
            largest_magnitude_bits(&bytes(&[-0.0, f32::MIN_POSITIVE / 4.0])),
            (f32::MIN_POSITIVE / 4.0).to_bits()
        );
        assert_eq!(largest_magnitude_bits(&[]), 0);
    }

    #[test]
    fn infinities_and_nan_are_refused_and_int32_passes_through() {
        let codec = BlockFloatingPoint::new(2);
        let error = codec.check(DataType::Float32, &bytes(&[1.0, f32::INFINITY])).unwrap_err();
        assert!(error.starts_with("element 1 is inf: block floating point cannot carry"), "{error}");
        assert!(codec.check(DataType::Float32, &bytes(&[f32::NAN])).is_err());
        assert!(codec.check(DataType::Int32, &[0xFF; 8]).is_ok());
        let ints: Vec<u8> = [7i32, -9].iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut payload = vec![0u8; 8];
        codec.encode(DataType::Int32, &ints, &mut payload, None);
        assert_eq!(payload, ints);
        assert!(!codec.uses_exponents(DataType::Int32));
    }
}
