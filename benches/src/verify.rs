//! Checking results: SwitchML's absolute error measure made sound.
//!
//! SwitchML's benchmark computes a signed relative error, so any result smaller than
//! expected passes, and compares with `>`, so NaN passes too. Here the error is absolute
//! and relative, NaN or an infinity where a finite value was expected always fails, and
//! int32 sums, which the switch computes exactly, must be exact.

/// How far `found` is from `expected`, in percent of `expected`: 0 when equal, infinite
/// when either is NaN, or when `expected` is zero and `found` is not.
pub fn error_percent(expected: f64, found: f64) -> f64 {
    if found == expected {
        0.0
    } else if found.is_nan() || expected.is_nan() || expected == 0.0 {
        f64::INFINITY
    } else {
        ((expected - found) / expected).abs() * 100.0
    }
}

/// One wrong element.
#[derive(Debug, Clone, PartialEq)]
pub struct Mismatch {
    pub index: usize,
    pub expected: f64,
    pub found: f64,
    pub error_percent: f64,
}

/// The outcome of checking a buffer: how many elements are wrong and the first few.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Verification {
    pub wrong: usize,
    pub first: Vec<Mismatch>,
}

impl Verification {
    /// SwitchML prints at most this many errors.
    pub const SHOWN: usize = 10;

    pub fn passed(&self) -> bool {
        self.wrong == 0
    }

    /// Checks `len` elements: element `i` must be within `max_error_percent` of
    /// `expected(i)` (or equal, when `exact`).
    pub fn check(
        len: usize,
        exact: bool,
        max_error_percent: f64,
        expected: impl Fn(usize) -> f64,
        found: impl Fn(usize) -> f64,
    ) -> Verification {
        let mut verification = Verification::default();
        for index in 0..len {
            let (expected, found) = (expected(index), found(index));
            let error = error_percent(expected, found);
            // `error_percent` is never NaN: a NaN anywhere makes it infinite.
            let wrong = if exact { error != 0.0 } else { error > max_error_percent };
            if wrong {
                verification.wrong += 1;
                if verification.first.len() < Verification::SHOWN {
                    verification.first.push(Mismatch { index, expected, found, error_percent: error });
                }
            }
        }
        verification
    }

    /// Checks `len` elements against an absolute bound: element `i` must lie within
    /// `bound` of `expected`, where `(expected, bound) = reference(i)`, or, where that
    /// interval reaches `overflow` in magnitude, may be the infinity of `expected`'s
    /// sign, and beyond it must be (what IEEE rounding gives a sum past the largest
    /// finite value of a format).
    pub fn check_within(
        len: usize,
        overflow: f64,
        reference: impl Fn(usize) -> (f64, f64),
        found: impl Fn(usize) -> f64,
    ) -> Verification {
        let mut verification = Verification::default();
        for index in 0..len {
            let ((expected, bound), found) = (reference(index), found(index));
            let infinite = found.is_infinite() && found.is_sign_positive() == expected.is_sign_positive();
            let right = if expected.abs() - bound >= overflow {
                infinite
            } else {
                (found - expected).abs() <= bound || (infinite && expected.abs() + bound >= overflow)
            };
            if !right {
                verification.wrong += 1;
                if verification.first.len() < Verification::SHOWN {
                    let error_percent = error_percent(expected, found);
                    verification.first.push(Mismatch { index, expected, found, error_percent });
                }
            }
        }
        verification
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_error_is_absolute_and_nan_never_passes() {
        assert_eq!(error_percent(200.0, 198.0), 1.0);
        assert_eq!(error_percent(200.0, 202.0), 1.0, "too large counts as too small does");
        assert_eq!(error_percent(-4.0, -4.0), 0.0);
        assert_eq!(error_percent(0.0, 1e-30), f64::INFINITY);
        assert_eq!(error_percent(5.0, f64::NAN), f64::INFINITY);
        assert_eq!(error_percent(f64::INFINITY, f64::INFINITY), 0.0);
        assert_eq!(error_percent(5.0, f64::INFINITY), f64::INFINITY);
    }

    #[test]
    fn checks_count_every_wrong_element_and_keep_the_first_ten() {
        let found = |i: usize| match i {
            3 => f64::NAN,
            7 => 7.0 * 0.98,
            i if i >= 100 => -(i as f64),
            i => i as f64 * 1.005,
        };
        let check = Verification::check(120, false, 1.0, |i| i as f64, found);
        // Element 0 is exact (0 · 1.005 = 0); 3 is NaN; 7 is 2% off; 100..120 flip sign.
        assert_eq!(check.wrong, 22);
        assert!(!check.passed());
        assert_eq!(check.first.len(), Verification::SHOWN);
        assert_eq!((check.first[0].index, check.first[1].index, check.first[2].index), (3, 7, 100));
        assert!((check.first[1].error_percent - 2.0).abs() < 1e-9);

        let exact =
            Verification::check(120, true, 50.0, |i| i as f64, |i| if i == 9 { 9.5 } else { i as f64 });
        assert_eq!(exact.wrong, 1, "int32 sums must be exact whatever the allowed error");
        assert!(Verification::check(5, false, 1.0, |i| i as f64, |i| i as f64).passed());
    }

    #[test]
    fn bounded_checks_take_the_bound_and_infinity_only_past_the_overflow() {
        let found = [10.5, 11.5, f64::INFINITY, 100.0, f64::INFINITY, f64::NEG_INFINITY, f64::NAN];
        let reference = |i: usize| match i {
            0 | 1 => (10.0, 1.0),
            2 | 3 => (99.0, 2.0),
            4 => (50.0, 1.0),
            _ => (-200.0, 1.0),
        };
        let check = Verification::check_within(found.len(), 100.0, reference, |i| found[i]);
        // 1 is beyond its bound; 2 and 3 straddle the overflow (either passes); 4 is
        // infinite below it; 5 is past it and infinite; 6 is NaN.
        let wrong: Vec<usize> = check.first.iter().map(|m| m.index).collect();
        assert_eq!(wrong, [1, 4, 6]);
    }
}
