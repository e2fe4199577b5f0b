//! Round numbers, which both cores compare: each slot counts its rounds from 0 and the
//! count wraps at 2^32, so rounds are ordered as serial numbers (RFC 1982), not as
//! integers.

/// Whether round `a` comes after round `b`: `a` is less than 2^31 rounds ahead of `b`.
/// Of two rounds exactly 2^31 apart, neither comes after the other.
pub fn is_after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_is_after_those_less_than_half_the_numbers_behind_it() {
        assert!(is_after(1, 0));
        assert!(is_after(1 << 31, 1));
        assert!(!is_after(1, 1 << 31));
        assert!(!is_after(5, 5));
        assert!(!is_after(0, 1));
    }

    #[test]
    fn the_order_survives_the_wrap() {
        assert!(is_after(0, u32::MAX));
        assert!(is_after(3, u32::MAX - 3));
        assert!(!is_after(u32::MAX, 0));
    }

    #[test]
    fn rounds_half_the_numbers_apart_are_unordered() {
        for b in [0, 7, u32::MAX] {
            let a = b.wrapping_add(1 << 31);
            assert!(!is_after(a, b) && !is_after(b, a), "{a} and {b}");
            assert!(is_after(a.wrapping_sub(1), b), "{a} - 1 and {b}");
        }
    }
}
