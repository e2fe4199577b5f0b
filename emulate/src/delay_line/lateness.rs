//! How late frames left: a fixed histogram of microseconds with eight buckets per power of
//! two, so that a percentile costs no allocation and is off by at most an eighth.

use std::time::Duration;

/// Values below this many microseconds have a bucket each.
const EXACT_BELOW: u64 = 16;
/// Buckets per power of two above `EXACT_BELOW`, as a number of bits.
const SUB_BUCKET_BITS: u32 = 3;
/// Powers of two covered above `EXACT_BELOW`: up to 2^34 µs, about 4.8 hours.
const OCTAVES: usize = 30;
const BUCKETS: usize = EXACT_BELOW as usize + (OCTAVES << SUB_BUCKET_BITS);

#[derive(Debug, Clone)]
pub(super) struct LatenessHistogram {
    counts: [u64; BUCKETS],
    recorded: u64,
    max: Duration,
}

impl Default for LatenessHistogram {
    fn default() -> Self {
        LatenessHistogram { counts: [0; BUCKETS], recorded: 0, max: Duration::ZERO }
    }
}

impl LatenessHistogram {
    pub fn record(&mut self, lateness: Duration) {
        let micros = u64::try_from(lateness.as_micros()).unwrap_or(u64::MAX);
        self.counts[bucket_of(micros)] += 1;
        self.recorded += 1;
        self.max = self.max.max(lateness);
    }

    /// The lateness that a `fraction` of the frames did not exceed, rounded up to its
    /// bucket's end but never past the largest recorded; zero when nothing was recorded.
    pub fn quantile(&self, fraction: f64) -> Duration {
        if self.recorded == 0 {
            return Duration::ZERO;
        }
        let rank = ((fraction * self.recorded as f64).ceil() as u64).clamp(1, self.recorded);
        let mut seen = 0;
        for (bucket, &count) in self.counts.iter().enumerate() {
            seen += count;
            if seen >= rank {
                return Duration::from_micros(bucket_end(bucket)).min(self.max);
            }
        }
        self.max
    }

    pub fn max(&self) -> Duration {
        self.max
    }
}

fn bucket_of(micros: u64) -> usize {
    if micros < EXACT_BELOW {
        return micros as usize;
    }
    let octave = micros.ilog2(); // at least ilog2(EXACT_BELOW) = 4
    let sub_bucket = (micros >> (octave - SUB_BUCKET_BITS)) & ((1 << SUB_BUCKET_BITS) - 1);
    let index = EXACT_BELOW as usize
        + (((octave - EXACT_BELOW.ilog2()) as usize) << SUB_BUCKET_BITS)
        + sub_bucket as usize;
    index.min(BUCKETS - 1)
}

/// The first microsecond value past a bucket.
fn bucket_end(bucket: usize) -> u64 {
    if bucket < EXACT_BELOW as usize {
        return bucket as u64 + 1;
    }
    let above = bucket - EXACT_BELOW as usize;
    let octave = (above >> SUB_BUCKET_BITS) as u32 + EXACT_BELOW.ilog2();
    let sub_bucket = (above & ((1 << SUB_BUCKET_BITS) - 1)) as u64;
    let width = 1u64 << (octave - SUB_BUCKET_BITS);
    (1u64 << octave) + (sub_bucket + 1) * width
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_falls_in_the_bucket_that_ends_after_it() {
        let mut previous_bucket = 0;
        for micros in (0..100_000).chain([1 << 33, (1 << 34) - 1]) {
            let bucket = bucket_of(micros);
            assert!(bucket >= previous_bucket, "buckets out of order at {micros}");
            assert!(micros < bucket_end(bucket), "{micros} past its bucket's end");
            assert!(bucket == 0 || micros >= bucket_end(bucket - 1), "{micros} before its bucket");
            // Relative error at most an eighth: a bucket is at most an eighth of its start wide.
            assert!(bucket_end(bucket) - micros <= micros / 8 + 1);
            previous_bucket = bucket;
        }
        assert_eq!(bucket_of(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn quantiles_of_a_known_spread() {
        let mut histogram = LatenessHistogram::default();
        assert_eq!(histogram.quantile(0.5), Duration::ZERO);
        for micros in 1..=1000 {
            histogram.record(Duration::from_micros(micros));
        }
        let median = histogram.quantile(0.5).as_micros();
        assert!((500..=500 + 500 / 8 + 1).contains(&median), "median {median}");
        let p99 = histogram.quantile(0.99).as_micros();
        assert!((990..=1000).contains(&p99), "p99 {p99} (capped at the max)");
        assert_eq!(histogram.max(), Duration::from_micros(1000));
        assert_eq!(histogram.quantile(1.0), Duration::from_micros(1000));
    }
}
