//! Comparisons measured in rounds: each round measures one thing and its baseline back
//! to back, because the machines these run on drift by tens of percent within minutes,
//! and only figures measured together compare. The comparison programs
//! (`bench_compare`, `dpdk_compare`, `switchml_compare`) print their tables from these.

use crate::summary::median_of;

/// Each round's figure of one thing compared and of its baseline, in the order measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rounds {
    pairs: Vec<(f64, f64)>,
}

impl Rounds {
    /// Records one round: `ours` and its `baseline`, measured together.
    pub fn push(&mut self, ours: f64, baseline: f64) {
        self.pairs.push((ours, baseline));
    }

    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Our figure of each round.
    pub fn ours(&self) -> impl Iterator<Item = f64> + '_ {
        self.pairs.iter().map(|&(ours, _)| ours)
    }

    /// Ours over the baseline, in each round.
    pub fn ratios(&self) -> impl Iterator<Item = f64> + '_ {
        self.pairs.iter().map(|&(ours, baseline)| ours / baseline)
    }

    pub fn median_ours(&self) -> f64 {
        median_of(self.ours())
    }

    pub fn median_baseline(&self) -> f64 {
        median_of(self.pairs.iter().map(|&(_, baseline)| baseline))
    }

    /// The median of the rounds' ratios: not the ratio of the medians, which would pair
    /// figures of different rounds.
    pub fn median_ratio(&self) -> f64 {
        median_of(self.ratios())
    }
}

/// Figures as a table shows each round's beside their median: "1.02, 0.98, 1.10".
pub fn each_round(figures: impl Iterator<Item = f64>, decimals: usize) -> String {
    figures.map(|figure| format!("{figure:.decimals$}")).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_ratio_pairs_figures_of_the_same_round() {
        let mut rounds = Rounds::default();
        assert!(rounds.is_empty());
        // The machine slows down in the second round: both sides take twice as long.
        rounds.push(110.0, 100.0);
        rounds.push(220.0, 200.0);
        rounds.push(90.0, 100.0);
        assert!(!rounds.is_empty());
        assert_eq!(rounds.median_ours(), 110.0);
        assert_eq!(rounds.median_baseline(), 100.0);
        // Each round's ratio: 1.1, 1.1, 0.9.
        assert!((rounds.median_ratio() - 1.1).abs() < 1e-12);
        assert_eq!(each_round(rounds.ratios(), 2), "1.10, 1.10, 0.90");
        assert_eq!(each_round(rounds.ours(), 1), "110.0, 220.0, 90.0");
    }

    #[test]
    fn an_even_count_of_rounds_takes_the_mean_of_the_middle_two() {
        let mut rounds = Rounds::default();
        for (ours, baseline) in [(4.0, 1.0), (1.0, 1.0), (3.0, 1.0), (2.0, 1.0)] {
            rounds.push(ours, baseline);
        }
        assert_eq!(rounds.median_ours(), 2.5);
        assert_eq!(rounds.median_ratio(), 2.5);
        assert_eq!(each_round(rounds.ours(), 0), "4, 1, 3, 2");
    }
}
