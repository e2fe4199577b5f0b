//! float32 tensors sent as 16-bit floats: half the bytes on the wire, as PyTorch DDP's
//! `fp16_compress_hook` and `bf16_compress_hook` send (`general.wire_precision`).
//!
//! The worker threads round each element to 16 bits as they fill a packet and widen the
//! sums as they store them: no pass over the tensor of its own, where a compress hook
//! writes a 16-bit copy of the bucket first and reads it back after. The switch sums the
//! 16-bit contributions in float32 and rounds once, so a sum's error is each input's
//! rounding plus that one rounding; the hook divides by the world size in 16 bits and
//! rounds after every addition of its ring as well.

use netagg_aggregator::sum16;
use netagg_config::WirePrecision;
use netagg_wire::ElementType;

use crate::codec::Codec;
use crate::DataType;

/// float32 tensors narrowed to float16 or bfloat16 on the wire; other types travel as
/// they are (as [`Native`](crate::Native)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Float32As16Bit {
    /// [`ElementType::Float16`] or [`ElementType::BFloat16`].
    wire: ElementType,
}

impl Float32As16Bit {
    /// The codec of `precision`; `None` for [`WirePrecision::Float32`], which needs none.
    pub fn new(precision: WirePrecision) -> Option<Float32As16Bit> {
        let wire = match precision {
            WirePrecision::Float32 => return None,
            WirePrecision::Float16 => ElementType::Float16,
            WirePrecision::BFloat16 => ElementType::BFloat16,
        };
        Some(Float32As16Bit { wire })
    }
}

impl Codec for Float32As16Bit {
    fn wire_type(&self, data_type: DataType) -> ElementType {
        match data_type {
            DataType::Float32 => self.wire,
            other => other.element_type(),
        }
    }

    /// Zero float32 bytes round to zero 16-bit bytes, and back.
    fn keeps_zero_blocks_zero(&self, _: DataType) -> bool {
        true
    }

    fn encode(&self, data_type: DataType, elements: &[u8], payload: &mut [u8], _: Option<i8>) {
        // For the other types, `narrow` copies.
        sum16::narrow(self.wire_type(data_type), payload, elements);
    }

    fn decode(&self, data_type: DataType, payload: &[u8], elements: &mut [u8], _: Option<i8>) {
        sum16::widen(self.wire_type(data_type), elements, payload);
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;

    fn bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn float32_travels_as_16_bits_and_other_types_as_they_are() {
        assert_eq!(Float32As16Bit::new(WirePrecision::Float32), None);
        let codec = Float32As16Bit::new(WirePrecision::Float16).unwrap();
        assert_eq!(codec.wire_type(DataType::Float32), ElementType::Float16);
        assert_eq!(codec.wire_type(DataType::Int32), ElementType::Int32);
        assert_eq!(codec.wire_type(DataType::BFloat16), ElementType::BFloat16);
        let values = [1.0f32, -0.333_333, 70000.0, 0.0];
        let mut payload = vec![0u8; 8];
        codec.encode(DataType::Float32, &bytes(&values), &mut payload, None);
        let expected: Vec<u8> =
            values.iter().flat_map(|v| f16::from_f32(*v).to_bits().to_le_bytes()).collect();
        assert_eq!(payload, expected, "rounded to nearest, 70000 to infinity");
        let mut decoded = vec![0u8; 16];
        codec.decode(DataType::Float32, &payload, &mut decoded, None);
        assert_eq!(decoded, bytes(&[1.0, f16::from_f32(-0.333_333).to_f32(), f32::INFINITY, 0.0]));

        let codec = Float32As16Bit::new(WirePrecision::BFloat16).unwrap();
        codec.encode(DataType::Float32, &bytes(&values), &mut payload, None);
        codec.decode(DataType::Float32, &payload, &mut decoded, None);
        let expected: Vec<f32> = values.iter().map(|v| bf16::from_f32(*v).to_f32()).collect();
        assert_eq!(decoded, bytes(&expected));
        let ints: Vec<u8> = [7i32, -9].iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut payload = vec![0u8; 8];
        codec.encode(DataType::Int32, &ints, &mut payload, None);
        assert_eq!(payload, ints);
    }
}
