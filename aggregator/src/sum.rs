//! Element-wise sums over little-endian payload bytes.
//!
//! Loops without per-element branches over `chunks_exact(4)`, which the compiler turns
//! into vector loads and adds, compiled for AVX2 beside baseline x86-64 and chosen at run
//! time (`benches/benches/sum.rs` compares them with a plain `a[i] += b[i]` over `i32`
//! slices, built for baseline x86-64).

use netagg_wire::ElementType;

/// `acc[i] += src[i]` for every element, in the arithmetic of `element_type`: int32 wraps
/// as switch hardware does, float32 adds natively.
///
/// Both slices hold little-endian elements; `src` may be shorter than `acc` (a packet's
/// tail), in which case only its elements are added.
pub fn add_assign(element_type: ElementType, acc: &mut [u8], src: &[u8]) {
    match element_type {
        ElementType::Int32 => add_assign_i32(acc, src),
        ElementType::Float32 => add_assign_f32(acc, src),
    }
}

/// Wrapping int32 sum of little-endian elements.
#[multiversion::multiversion(targets("x86_64+avx2"))]
pub fn add_assign_i32(acc: &mut [u8], src: &[u8]) {
    for (a, b) in acc.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
        let sum = i32::from_le_bytes([a[0], a[1], a[2], a[3]])
            .wrapping_add(i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        a.copy_from_slice(&sum.to_le_bytes());
    }
}

/// float32 sum of little-endian elements.
#[multiversion::multiversion(targets("x86_64+avx2"))]
pub fn add_assign_f32(acc: &mut [u8], src: &[u8]) {
    for (a, b) in acc.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
        let sum = f32::from_le_bytes([a[0], a[1], a[2], a[3]]) + f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        a.copy_from_slice(&sum.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_i32(values: &[i32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
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
    fn shorter_source_adds_only_its_elements() {
        let mut acc = bytes_i32(&[1, 2, 3]);
        add_assign(ElementType::Int32, &mut acc, &bytes_i32(&[10]));
        assert_eq!(acc, bytes_i32(&[11, 2, 3]));
    }
}
