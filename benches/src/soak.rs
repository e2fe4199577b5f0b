//! What the `soak` binary's driver and its rank processes share: the jobs each session
//! runs and how their sums are checked, the lines a rank reports on, and the growth of a
//! resident-memory series after warm-up.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::data::Contents;
use crate::verify::Verification;

/// One kind of job: its element type and the fraction of its blocks that hold data.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JobKind {
    pub name: &'static str,
    pub float: bool,
    pub density: f64,
}

/// The jobs of a session, in turn: int32 and float32, dense and sparse.
pub const JOB_KINDS: [JobKind; 4] = [
    JobKind { name: "int32-dense", float: false, density: 1.0 },
    JobKind { name: "float32-dense", float: true, density: 1.0 },
    JobKind { name: "int32-sparse", float: false, density: 0.1 },
    JobKind { name: "float32-sparse", float: true, density: 0.1 },
];

/// What the tensors of job `job` of session `session` hold: random, with its own seed, in
/// blocks of a packet's elements, so that the zero blocks of sparse jobs are what the
/// workers skip.
pub fn job_contents(seed: u64, session: u64, job: u64, block_numel: usize) -> (JobKind, Contents) {
    let kind = JOB_KINDS[(job % JOB_KINDS.len() as u64) as usize];
    let seed = seed ^ (session << 32) ^ job.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (kind, Contents { seed, random: true, density: kind.density, block_numel })
}

/// Checks int32 sums of `workers` ranks' tensors: exact, wrapping as the switch's do.
pub fn check_int32(contents: &Contents, workers: u16, found: &[i32]) -> Verification {
    let expected = |i| (0..workers).fold(0i32, |sum, rank| sum.wrapping_add(contents.int32(rank, i))) as f64;
    Verification::check(found.len(), true, 0.0, expected, |i| found[i] as f64)
}

/// Checks float32 sums of `workers` ranks' tensors against the float64 sum: within
/// `workers` roundings of float32 (2^-24 each) of the sum of the magnitudes added, the
/// most that the switch's additions in any order can be off by.
pub fn check_float32(contents: &Contents, workers: u16, found: &[f32]) -> Verification {
    let reference = |i| {
        let inputs = (0..workers).map(|rank| f64::from(contents.float32(rank, i)));
        let (sum, magnitudes) = inputs.fold((0.0, 0.0), |(sum, mag), x: f64| (sum + x, mag + x.abs()));
        (sum, f64::from(workers) * 2f64.powi(-24) * magnitudes)
    };
    Verification::check_within(found.len(), f64::from(f32::MAX), reference, |i| f64::from(found[i]))
}

/// What a rank process tells the driver, one line each on its stdout.
#[derive(Debug, Clone, PartialEq)]
pub enum RankEvent {
    /// It starts registering for session `session`.
    Started { session: u64 },
    /// Job `job` of `session` ended: `wrong` elements of its sum were wrong.
    Job { session: u64, job: u64, kind: String, elements: u64, wrong: u64 },
    /// It ran every job of `session`; what its worker threads counted.
    Done { session: u64, counts: RankCounts },
    /// A job of `session` failed, for the reason given.
    Lost { session: u64, reason: String },
}

/// A rank's counters over one session.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankCounts {
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub retransmissions: u64,
    pub timeouts: u64,
    pub duplicates: u64,
    pub stale: u64,
}

impl RankCounts {
    /// Each count with its name, in the order the line gives them.
    fn fields(&mut self) -> [(&'static str, &mut u64); 6] {
        [
            ("bytes_sent", &mut self.bytes_sent),
            ("bytes_received", &mut self.bytes_received),
            ("retransmissions", &mut self.retransmissions),
            ("timeouts", &mut self.timeouts),
            ("duplicates", &mut self.duplicates),
            ("stale", &mut self.stale),
        ]
    }
}

impl std::ops::Add for RankCounts {
    type Output = RankCounts;
    fn add(mut self, mut other: RankCounts) -> RankCounts {
        for ((_, sum), (_, more)) in self.fields().into_iter().zip(other.fields()) {
            *sum += *more;
        }
        self
    }
}

impl fmt::Display for RankEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RankEvent::Started { session } => write!(f, "session {session} started"),
            RankEvent::Job { session, job, kind, elements, wrong } => {
                write!(f, "job {session} {job} {kind} elements {elements} wrong {wrong}")
            }
            RankEvent::Done { session, counts } => {
                write!(f, "session {session} done")?;
                let mut counts = *counts;
                for (name, value) in counts.fields() {
                    write!(f, " {name} {value}")?;
                }
                Ok(())
            }
            // One line: the reason's own line breaks would start lines of their own.
            RankEvent::Lost { session, reason } => {
                write!(f, "session {session} lost {}", reason.replace('\n', " "))
            }
        }
    }
}

impl FromStr for RankEvent {
    type Err = String;

    fn from_str(line: &str) -> Result<RankEvent, String> {
        let refused = || format!("not a rank's report: '{line}'");
        let words: Vec<&str> = line.split(' ').collect();
        let number = |index: usize| words.get(index).and_then(|w| w.parse::<u64>().ok()).ok_or_else(refused);
        match words.first().copied() {
            Some("job") if words.len() == 8 && words[4] == "elements" && words[6] == "wrong" => {
                Ok(RankEvent::Job {
                    session: number(1)?,
                    job: number(2)?,
                    kind: words[3].to_string(),
                    elements: number(5)?,
                    wrong: number(7)?,
                })
            }
            Some("session") => {
                let session = number(1)?;
                match words.get(2).copied() {
                    Some("started") if words.len() == 3 => Ok(RankEvent::Started { session }),
                    Some("lost") => Ok(RankEvent::Lost { session, reason: words[3..].join(" ") }),
                    Some("done") => {
                        let mut counts = RankCounts::default();
                        let values = words[3..].chunks(2);
                        if values.len() != counts.fields().len() {
                            return Err(refused());
                        }
                        for ((name, value), pair) in counts.fields().into_iter().zip(values) {
                            if pair.first() != Some(&name) {
                                return Err(refused());
                            }
                            *value = pair.get(1).and_then(|v| v.parse().ok()).ok_or_else(refused)?;
                        }
                        Ok(RankEvent::Done { session, counts })
                    }
                    _ => Err(refused()),
                }
            }
            _ => Err(refused()),
        }
    }
}

/// The samples of a scrape in Prometheus's text format, `name{labels}` to value; lines
/// that are not samples (comments, `# EOF`) are skipped.
pub fn parse_metrics(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            Some((series.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// How much a resident-memory series grew after warm-up.
///
/// A process's resident size climbs to a plateau over its first sessions (the allocator
/// keeps what freed sessions held, and its arenas fill as threads come and go) and dips
/// when it returns memory to the kernel, so "warm" is the plateau the warm-up reached (its
/// highest sample over the warm-up's last third), not a single sample that may fall in a
/// dip. A leak shows as the end above that plateau.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Growth {
    /// Bytes resident once warm: the largest sample in the last third of the warm-up.
    pub warm: u64,
    /// Bytes resident at the end: the median of the last [`Growth::SAMPLES`] samples.
    pub last: u64,
    /// The largest sample after warm-up.
    pub peak: u64,
}

impl Growth {
    /// Samples whose median stands for the end, so that one sample taken while a session
    /// opens or closes does not.
    pub const SAMPLES: usize = 3;

    /// The growth of `samples` (time since the start, bytes) after `warmup`; `None` without
    /// a sample in the warm-up's last third or with fewer than two [`Growth::SAMPLES`]
    /// after it.
    pub fn of(samples: &[(Duration, u64)], warmup: Duration) -> Option<Growth> {
        let plateau_from = warmup * 2 / 3;
        let warm = samples
            .iter()
            .filter(|(at, _)| (plateau_from..warmup).contains(at))
            .map(|&(_, bytes)| bytes)
            .max()?;
        let after: Vec<u64> =
            samples.iter().filter(|(at, _)| *at >= warmup).map(|&(_, bytes)| bytes).collect();
        if after.len() < 2 * Growth::SAMPLES {
            return None;
        }
        let mut end = after[after.len() - Growth::SAMPLES..].to_vec();
        end.sort_unstable();
        Some(Growth {
            warm,
            last: end[Growth::SAMPLES / 2],
            peak: after.iter().copied().max().unwrap_or_default(),
        })
    }

    /// The growth from warm to last, in percent of warm (negative if it shrank).
    pub fn percent(&self) -> f64 {
        (self.last as f64 - self.warm as f64) / self.warm.max(1) as f64 * 100.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_events_read_back_as_written_and_other_lines_are_refused() {
        let counts = RankCounts {
            bytes_sent: 10,
            bytes_received: 20,
            retransmissions: 3,
            timeouts: 4,
            duplicates: 5,
            stale: 6,
        };
        let events = [
            RankEvent::Started { session: 7 },
            RankEvent::Job { session: 7, job: 3, kind: "float32-sparse".into(), elements: 1000, wrong: 2 },
            RankEvent::Done { session: 7, counts },
            RankEvent::Lost { session: 7, reason: "session lost: rank 1 left session 'soak-7'".into() },
        ];
        for event in events {
            assert_eq!(event.to_string().parse::<RankEvent>(), Ok(event.clone()), "{event}");
        }
        assert_eq!(
            RankEvent::Lost { session: 1, reason: "two\nlines".into() }.to_string(),
            "session 1 lost two lines"
        );
        for line in ["", "job 1 2", "session x started", "session 1 done bytes_sent 1", "Signal handler"] {
            assert_eq!(line.parse::<RankEvent>(), Err(format!("not a rank's report: '{line}'")));
        }
        assert_eq!((counts + counts).retransmissions, 6);
    }

    #[test]
    fn sums_are_checked_exactly_for_int32_and_within_the_rounding_bound_for_float32() {
        let (kind, contents) = job_contents(5, 2, 1, 16);
        assert_eq!(kind.name, "float32-dense");
        let floats: Vec<f32> =
            (0..1000).map(|i| (0..3).map(|rank| contents.float32(rank, i)).sum::<f32>()).collect();
        assert!(check_float32(&contents, 3, &floats).passed());
        let mut off = floats.clone();
        off[10] += 1e-3;
        assert_eq!(check_float32(&contents, 3, &off).wrong, 1);

        let (kind, contents) = job_contents(5, 2, 2, 16);
        assert_eq!((kind.name, kind.density), ("int32-sparse", 0.1));
        let mut ints: Vec<i32> = (0..1000)
            .map(|i| (0..3).fold(0i32, |sum, rank| sum.wrapping_add(contents.int32(rank, i))))
            .collect();
        assert!(check_int32(&contents, 3, &ints).passed());
        assert!(ints.contains(&0), "sparse: some blocks are zero on every rank");
        ints[999] ^= 1;
        assert_eq!(check_int32(&contents, 3, &ints).wrong, 1);
        assert_ne!(job_contents(5, 2, 2, 16).1.seed, job_contents(5, 3, 2, 16).1.seed, "sessions differ");
    }

    #[test]
    fn metrics_samples_are_read_by_series_and_comments_skipped() {
        let text =
            "# HELP a_total A.\n# TYPE a counter\na_total{lane=\"0\",cause=\"x y\"} 12\nb 1.5\n# EOF\n";
        let samples = parse_metrics(text);
        assert_eq!(samples.len(), 2);
        assert_eq!(samples["a_total{lane=\"0\",cause=\"x y\"}"], 12.0);
        assert_eq!(samples["b"], 1.5);
    }

    #[test]
    fn growth_compares_the_warm_up_plateau_with_the_median_of_the_last_samples() {
        let at = |seconds: u64, megabytes: u64| (Duration::from_secs(seconds), megabytes << 20);
        // The warm-up climbs to a 100 MB plateau with a dip at its end (a CI run once took
        // such a dip for "warm" and called the return to the plateau growth); one spike
        // after it; then 1 MB more by the end.
        let samples = [
            at(0, 10),
            at(10, 90),
            at(20, 100),
            at(25, 100),
            at(29, 70),
            at(30, 95),
            at(35, 100),
            at(40, 180),
            at(45, 100),
            at(50, 101),
            at(55, 101),
            at(60, 101),
        ];
        let growth = Growth::of(&samples, Duration::from_secs(30)).unwrap();
        assert_eq!((growth.warm, growth.last, growth.peak), (100 << 20, 101 << 20, 180 << 20));
        assert!((growth.percent() - 1.0).abs() < 1e-9, "{}", growth.percent());

        // A leak: the end well above the plateau.
        let mut leaking = samples;
        leaking[9..].iter_mut().for_each(|(_, bytes)| *bytes = 130 << 20);
        assert!((Growth::of(&leaking, Duration::from_secs(30)).unwrap().percent() - 30.0).abs() < 1e-9);

        assert_eq!(Growth::of(&samples, Duration::from_secs(40)), None, "too few samples after warm-up");
        assert_eq!(
            Growth::of(&samples[..1], Duration::from_secs(3)),
            None,
            "no sample in the warm-up's last third"
        );
    }
}
