//! Summaries of timed runs, printed as SwitchML's benchmark prints them.

use std::time::Duration;

/// A number as C++'s `std::cout << double` prints it (`%g`: 6 significant digits, no
/// trailing zeros), so lines compare with SwitchML's character for character.
pub fn cpp_double(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x < 0.0 { "-inf" } else { "inf" }.into();
    }
    if x == 0.0 {
        return "0".into();
    }
    // The exponent after rounding to 6 digits, which may carry into the next power of
    // ten (999999.5 prints as 1e+06).
    let rounded = format!("{x:.5e}");
    let (mantissa, exp) = rounded.split_once('e').unwrap_or((&rounded, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if !(-4..6).contains(&exp) {
        let mantissa = trim_zeros(mantissa);
        return format!("{mantissa}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    trim_zeros(&format!("{:.*}", (5 - exp).max(0) as usize, x)).to_string()
}

fn trim_zeros(number: &str) -> &str {
    if number.contains('.') {
        number.trim_end_matches('0').trim_end_matches('.')
    } else {
        number
    }
}

/// Gbit/s of `elements` 4-byte elements in `duration`, SwitchML's goodput.
pub fn goodput_gbps(elements: u64, duration: Duration) -> f64 {
    (elements * 32) as f64 / duration.as_nanos().max(1) as f64
}

/// Order statistics of a run: the duration of each sync group and its goodput.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Summary {
    pub min_ns: u64,
    pub max_ns: u64,
    pub median_ns: u64,
    pub mean_ns: u64,
    pub std_dev_ns: u64,
    /// Goodput of the fastest group, the slowest, the median and the mean of all groups.
    pub max_gbps: f64,
    pub min_gbps: f64,
    pub median_gbps: f64,
    pub mean_gbps: f64,
}

impl Summary {
    /// Summarises groups of (elements reduced, duration); `None` for no groups.
    pub fn of(groups: &[(u64, Duration)]) -> Option<Summary> {
        if groups.is_empty() {
            return None;
        }
        let mut nanos: Vec<f64> = groups.iter().map(|(_, d)| d.as_nanos() as f64).collect();
        let mut rates: Vec<f64> = groups.iter().map(|&(elements, d)| goodput_gbps(elements, d)).collect();
        nanos.sort_by(f64::total_cmp);
        rates.sort_by(f64::total_cmp);
        let mean = nanos.iter().sum::<f64>() / nanos.len() as f64;
        let variance = if nanos.len() > 1 {
            nanos.iter().map(|n| (n - mean).powi(2)).sum::<f64>() / (nanos.len() - 1) as f64
        } else {
            0.0
        };
        Some(Summary {
            min_ns: nanos[0] as u64,
            max_ns: nanos[nanos.len() - 1] as u64,
            median_ns: median(&nanos) as u64,
            mean_ns: mean as u64,
            std_dev_ns: variance.sqrt() as u64,
            max_gbps: rates[rates.len() - 1],
            min_gbps: rates[0],
            median_gbps: median(&rates),
            mean_gbps: rates.iter().sum::<f64>() / rates.len() as f64,
        })
    }

    /// SwitchML's closing lines: the shortest duration beside the highest goodput, and
    /// so on.
    pub fn lines(&self) -> Vec<String> {
        vec![
            format!("Min {} ns {} Gbps", self.min_ns, cpp_double(self.max_gbps)),
            format!("Max {} ns {} Gbps", self.max_ns, cpp_double(self.min_gbps)),
            format!("Median {} ns {} Gbps", self.median_ns, cpp_double(self.median_gbps)),
            format!("Mean {} ns {} Gbps", self.mean_ns, cpp_double(self.mean_gbps)),
            format!("Std dev {} ns", self.std_dev_ns),
        ]
    }

    /// Aggregated tensor elements per second at the median goodput (the unit of
    /// SwitchML's paper: Gbit/s · 10^9 / 32).
    pub fn median_ate_per_second(&self) -> f64 {
        self.median_gbps * 1e9 / 32.0
    }
}

/// The median of sorted values: the mean of the middle two for an even count.
pub fn median(sorted: &[f64]) -> f64 {
    let middle = sorted.len() / 2;
    if sorted.len() % 2 == 1 {
        sorted[middle]
    } else {
        (sorted[middle - 1] + sorted[middle]) / 2.0
    }
}

/// The median of values in any order (see [`median`]).
pub fn median_of(values: impl IntoIterator<Item = f64>) -> f64 {
    let mut sorted: Vec<f64> = values.into_iter().collect();
    sorted.sort_by(f64::total_cmp);
    median(&sorted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_print_as_cpp_prints_them() {
        let cases = [
            (0.0, "0"),
            (12.345678, "12.3457"),
            (100.0, "100"),
            (0.5, "0.5"),
            (123456.7, "123457"),
            (999999.7, "1e+06"),
            (1234567.0, "1.23457e+06"),
            (0.0001234, "0.0001234"),
            (0.00001234, "1.234e-05"),
            (-2.5, "-2.5"),
            (f64::NAN, "nan"),
        ];
        for (x, expected) in cases {
            assert_eq!(cpp_double(x), expected, "{x}");
        }
    }

    #[test]
    fn summaries_pair_the_shortest_duration_with_the_highest_goodput() {
        let groups = [
            (1_000_000, Duration::from_millis(4)),
            (1_000_000, Duration::from_millis(1)),
            (1_000_000, Duration::from_millis(2)),
            (1_000_000, Duration::from_millis(3)),
        ];
        let summary = Summary::of(&groups).unwrap();
        assert_eq!((summary.min_ns, summary.max_ns, summary.median_ns), (1_000_000, 4_000_000, 2_500_000));
        assert_eq!(summary.max_gbps, 32.0);
        assert_eq!(summary.min_gbps, 8.0);
        assert_eq!(
            summary.lines(),
            [
                "Min 1000000 ns 32 Gbps",
                "Max 4000000 ns 8 Gbps",
                "Median 2500000 ns 13.3333 Gbps",
                "Mean 2500000 ns 16.6667 Gbps",
                "Std dev 1290994 ns"
            ]
        );
        assert!((summary.median_ate_per_second() - 13.333333333e9 / 32.0).abs() < 1.0);
        assert_eq!(Summary::of(&[]), None);
    }

    #[test]
    fn medians_of_unsorted_values() {
        assert_eq!(median_of([3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median_of([4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median_of([7.5]), 7.5);
    }
}
