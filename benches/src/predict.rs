//! Predicted allreduce times from the in-memory simulator (`netagg_aggregator::sim`):
//! netagg's real protocol cores through one switch, and the ring's discrete model, on
//! the same simulated links, beside the analytic model ([`crate::model`]). The simulator
//! reaches sizes one machine cannot emulate; where both run, it is checked against the
//! emulator (`benches/tests/agreement.rs`).
//!
//! A [`Setup`] describes a network as `netagg-run --link` shapes it (every worker's link
//! at one rate, delay and loss each way, behind `tbf`'s queue and bucket, frames counted
//! with their Ethernet, IPv4 and UDP headers; with `--racks R --uplink rate=...`, racks
//! behind uplinks of their own, their switches summing first or, `--flat`, one switch at
//! the core) and a workload as `allreduce_benchmark`
//! runs it (one warm-up job, then timed jobs; the default packets and window; a late
//! rank as `--late`). Two simplifications against the library: a worker's window is one
//! protocol core of all its slots where the library runs it as 2 threads of half as
//! many, sharing one pacer; and the tensor is int32 (the simulator's cores pass payloads
//! through, so a float32 tensor of the same bytes takes the same time).

use std::time::{Duration, Instant};

use netagg_aggregator::sim::{
    Cluster, ClusterConfig, LinkFaults, Racks, RateLimit, Ring, TcpSegments, Tensor,
};

use netagg_emulate::link::{parse_duration, parse_rate};

use crate::model::{Aggregators, Link, RackNetwork, Scenario, UDP_OVERHEAD_BYTES};
use crate::plot::Verdict;
use crate::summary::median_of;

/// A network and a workload to predict.
#[derive(Debug, Clone, PartialEq)]
pub struct Setup {
    pub workers: u16,
    /// Every link's rate, each way.
    pub bits_per_second: u64,
    /// Every link's one-way delay, each way.
    pub delay: Duration,
    /// Share of frames every link loses, each way.
    pub loss: f64,
    /// A rank that starts every job this much after the others.
    pub late: Option<(u16, Duration)>,
    pub tensor_bytes: u64,
    /// Elements of 4 bytes in a packet (`packet_numel`).
    pub packet_elements: u16,
    /// Packets a worker keeps in flight (`max_outstanding_packets`).
    pub window_packets: u16,
    /// How long a frame may wait in a link's queue, and the bucket's bytes (`tbf`).
    pub queue: Duration,
    pub burst_bytes: u64,
    /// Timed jobs, after one warm-up job.
    pub jobs: usize,
    pub seed: u64,
    /// The switch runs on a server behind a link like the workers' (a switch process, as
    /// netagg deploys without a programmable switch), not as the network itself; on a
    /// network of racks, every switch does.
    pub switch_on_server: bool,
    /// Switches sharing the session's slots (`general.switches`), each on a server of its
    /// own when `switch_on_server`, as `netagg-run --switches K` runs them; 1: one. Not on
    /// a network of racks.
    pub shards: u16,
    /// The racks the workers sit in, on a network of racks.
    pub racks: Option<RackSetup>,
}

/// A network of racks as `netagg-run --racks R --uplink rate=...` builds it: racks of
/// contiguous ranks, each behind an uplink of its own to the core.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RackSetup {
    pub count: u16,
    /// Each uplink's rate each way, behind the queue and bucket of the workers' links;
    /// `None`: unlimited.
    pub uplink_bits_per_second: Option<u64>,
    /// Each uplink's one-way delay (the emulator's uplinks have none).
    pub uplink_delay: Duration,
    /// Each rack's switch sums its rack first (a two-level tree); else one switch at the
    /// core takes every worker's packets (`--flat`).
    pub tree: bool,
}

impl Setup {
    /// `workers` behind links of `bits_per_second` and `delay`, with netagg-run's and
    /// allreduce_benchmark's defaults: no loss, 100 ms queues with 64 KiB buckets,
    /// 256-element packets, a window of 256, 3 timed jobs.
    pub fn new(workers: u16, bits_per_second: u64, delay: Duration, tensor_bytes: u64) -> Setup {
        Setup {
            workers,
            bits_per_second,
            delay,
            loss: 0.0,
            late: None,
            tensor_bytes,
            packet_elements: 256,
            window_packets: 256,
            queue: Duration::from_millis(100),
            burst_bytes: 64 * 1024,
            jobs: 3,
            seed: 1,
            switch_on_server: false,
            shards: 1,
            racks: None,
        }
    }

    /// The simulated cluster's configuration.
    pub fn cluster(&self) -> ClusterConfig {
        let limit = RateLimit::new(self.bits_per_second, self.queue).with_burst(self.burst_bytes);
        let mut config =
            ClusterConfig::new(self.workers, self.window_packets, self.packet_elements).with_rate(limit);
        for link in [&mut config.uplink, &mut config.downlink] {
            link.latency = self.delay;
            link.drop = self.loss;
        }
        config.frame_overhead_bytes = UDP_OVERHEAD_BYTES;
        config.switch_link = self.switch_on_server.then_some(limit);
        config.shards = self.shards;
        config.racks = self.racks.map(|racks| {
            let rate = racks.uplink_bits_per_second;
            let uplink = LinkFaults {
                rate: rate.map(|rate| RateLimit::new(rate, self.queue).with_burst(self.burst_bytes)),
                ..LinkFaults::perfect(racks.uplink_delay)
            };
            Racks { count: racks.count, uplink, tree: racks.tree }
        });
        // The library's defaults (general.timeout, and 64 times it).
        config.retransmit_timeout = Duration::from_millis(10);
        config.max_retransmit_timeout = Duration::from_millis(640);
        config.seed = self.seed;
        config.max_steps = u64::MAX;
        if let Some((rank, late)) = self.late {
            config.start_delays = vec![Duration::ZERO; usize::from(self.workers)];
            if let Some(delay) = config.start_delays.get_mut(usize::from(rank)) {
                *delay = late;
            }
        }
        config
    }

    /// The analytic model's scenario for the same network and workload.
    pub fn scenario(&self) -> Scenario {
        let link = Link { bits_per_second: self.bits_per_second as f64, delay: self.delay };
        let switch_link = self.switch_on_server.then_some(link);
        let aggregators = match (self.racks, switch_link) {
            (Some(racks), switch_link) if racks.tree => Aggregators::Tree { switch_link },
            (_, Some(link)) => Aggregators::Dedicated { count: usize::from(self.shards), link },
            (_, None) => Aggregators::Ideal,
        };
        let racks = self.racks.map(|racks| RackNetwork {
            count: usize::from(racks.count),
            uplink: Link {
                bits_per_second: racks.uplink_bits_per_second.map_or(f64::INFINITY, |rate| rate as f64),
                delay: racks.uplink_delay,
            },
        });
        Scenario {
            aggregators,
            racks,
            ..Scenario::uniform(
                usize::from(self.workers),
                link,
                self.tensor_bytes,
                u64::from(self.packet_elements) * 4,
                u64::from(self.window_packets),
            )
        }
    }

    /// netagg in the simulator: the median of the timed jobs' virtual times, every job's
    /// sums checked exact.
    pub fn netagg(&self) -> Result<Simulated, String> {
        let wall = Instant::now();
        let mut cluster = Cluster::new(self.cluster()).map_err(|e| format!("{self}: {e}"))?;
        let elements = (self.tensor_bytes / 4) as usize;
        let inputs: Vec<Tensor> = (0..self.workers)
            .map(|rank| Tensor::Int32((0..elements as i32).map(|i| i ^ i32::from(rank)).collect()))
            .collect();
        let expected: Vec<i32> = (0..elements as i32)
            .map(|i| (0..i32::from(self.workers)).fold(0i32, |sum, rank| sum.wrapping_add(i ^ rank)))
            .collect();
        let expected = Tensor::Int32(expected);
        let mut times = Vec::with_capacity(self.jobs);
        for job in 0..=self.jobs {
            let report = cluster.allreduce(&inputs, false).map_err(|e| format!("{self}, job {job}: {e}"))?;
            if let Some(rank) = report.outputs.iter().position(|output| *output != expected) {
                return Err(format!("{self}, job {job}: rank {rank}'s sums are wrong"));
            }
            if job > 0 {
                times.push(report.elapsed);
            }
        }
        Ok(Simulated { time: median(times), wall: wall.elapsed() })
    }

    /// The ring on the same simulated links: the median of the timed jobs.
    pub fn ring(&self) -> Simulated {
        let wall = Instant::now();
        let mut ring = Ring::new(self.cluster(), TcpSegments::ETHERNET);
        ring.allreduce(self.tensor_bytes);
        let times = (0..self.jobs).map(|_| ring.allreduce(self.tensor_bytes).elapsed).collect();
        Simulated { time: median(times), wall: wall.elapsed() }
    }
}

impl Setup {
    /// The network, in words: `10gbit, 5µs, 1 % loss, rank 3 50ms late`.
    pub fn network(&self) -> String {
        let mut name = format!("{}, {:?}", rate_name(self.bits_per_second), self.delay);
        if self.loss > 0.0 {
            name += &format!(", {} % loss", self.loss * 100.0);
        }
        if let Some((rank, late)) = self.late {
            name += &format!(", rank {rank} {late:?} late");
        }
        if let Some(racks) = self.racks {
            let uplink = racks.uplink_bits_per_second.map_or("unlimited".to_string(), rate_name);
            let plural = if racks.count == 1 { "" } else { "s" };
            name += &format!(", {} rack{plural} behind {uplink}", racks.count);
            if !racks.uplink_delay.is_zero() {
                name += &format!(", {:?}", racks.uplink_delay);
            }
            name += if racks.tree { " uplinks, a tree" } else { " uplinks, one switch at the core" };
        }
        if self.switch_on_server {
            name += &match (self.racks, self.shards) {
                (Some(_), _) => ", switches on servers".to_string(),
                (None, 1) => ", the switch on a server".to_string(),
                (None, shards) => format!(", {shards} switches on servers"),
            };
        }
        name
    }
}

impl std::fmt::Display for Setup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "N = {}, {}", self.workers, self.network())
    }
}

/// One emulated run's network, workload and medians, as `emulated_compare --csv` records
/// them: a line of `workers,rate,delay,loss,late,tensor_numel,netagg_s,ring_s,pace,source`
/// (loss a share such as 0.01; late `RANK:DELAY` or `-`; ring_s `-` when MPI did not run;
/// pace netagg-run's verdicts, netagg / MPI; source where the figures were published).
#[derive(Debug, Clone, PartialEq)]
pub struct EmulatedRun {
    pub workers: u16,
    pub bits_per_second: u64,
    pub delay: Duration,
    pub loss: f64,
    pub late: Option<(u16, Duration)>,
    /// Float32 elements of the tensor.
    pub tensor_numel: u64,
    pub netagg_s: f64,
    pub ring_s: Option<f64>,
    pub pace: String,
    pub source: String,
}

/// The columns of a recorded emulated run, in order.
pub const EMULATED_RUN_COLUMNS: &str =
    "workers,rate,delay,loss,late,tensor_numel,netagg_s,ring_s,pace,source";

impl EmulatedRun {
    /// The runs of a file of them: one a line after the header, `#` starting a comment.
    pub fn parse_all(text: &str) -> Result<Vec<EmulatedRun>, String> {
        let mut lines =
            text.lines().enumerate().filter(|(_, line)| !line.trim().is_empty() && !line.starts_with('#'));
        match lines.next() {
            Some((_, header)) if header.trim() == EMULATED_RUN_COLUMNS => {}
            _ => return Err(format!("the first line must be the header {EMULATED_RUN_COLUMNS}")),
        }
        lines
            .map(|(index, line)| EmulatedRun::parse(line).map_err(|e| format!("line {}: {e}", index + 1)))
            .collect()
    }

    fn parse(line: &str) -> Result<EmulatedRun, String> {
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let [workers, rate, delay, loss, late, numel, netagg, ring, pace, source] = fields[..] else {
            return Err(format!("{} fields where {EMULATED_RUN_COLUMNS} are 10", fields.len()));
        };
        let number = |name: &str, text: &str| {
            text.parse::<f64>().map_err(|_| format!("{name} '{text}' is not a number"))
        };
        let late = match late {
            "-" => None,
            text => {
                let (rank, delay) =
                    text.split_once(':').ok_or(format!("late '{text}': expected RANK:DELAY"))?;
                let rank = rank.parse().map_err(|_| format!("late '{text}': '{rank}' is not a rank"))?;
                Some((rank, parse_duration(delay).map_err(|e| e.to_string())?))
            }
        };
        Ok(EmulatedRun {
            workers: workers.parse().map_err(|_| format!("workers '{workers}' is not a count"))?,
            bits_per_second: parse_rate(rate).map_err(|e| e.to_string())? as u64,
            delay: parse_duration(delay).map_err(|e| e.to_string())?,
            loss: number("loss", loss)?,
            late,
            tensor_numel: numel.parse().map_err(|_| format!("tensor_numel '{numel}' is not a count"))?,
            netagg_s: number("netagg_s", netagg)?,
            ring_s: if ring == "-" { None } else { Some(number("ring_s", ring)?) },
            pace: pace.to_string(),
            source: source.to_string(),
        })
    }

    /// Whether the links set each side's pace in every run (netagg, the ring): where the
    /// emulator was faithful.
    pub fn faithful(&self) -> (bool, bool) {
        let mut sides = self.pace.split('/').map(|side| side.trim() == "links");
        let netagg = sides.next().unwrap_or(false);
        (netagg, self.ring_s.is_some() && sides.next().unwrap_or(false))
    }

    /// The run as a line of a file of them.
    pub fn line(&self) -> String {
        let late =
            self.late.map_or("-".to_string(), |(rank, delay)| format!("{rank}:{}us", delay.as_micros()));
        let ring = self.ring_s.map_or("-".to_string(), |ring| format!("{ring:.3}"));
        format!(
            "{},{},{}us,{},{late},{},{:.3},{ring},{},{}",
            self.workers,
            rate_name(self.bits_per_second),
            self.delay.as_micros(),
            self.loss,
            self.tensor_numel,
            self.netagg_s,
            self.pace.replace(',', ";"),
            self.source.replace(',', ";"),
        )
    }

    /// The simulator's setup for the same network and workload.
    pub fn setup(&self) -> Setup {
        Setup {
            loss: self.loss,
            late: self.late,
            ..Setup::new(self.workers, self.bits_per_second, self.delay, self.tensor_numel * 4)
        }
    }
}

/// Each network of `runs` with a delay line in its path (the emulator's limit), lossless
/// and on time, by workers and rate: faithful if the links set both sides' pace in every
/// run on it.
pub fn faithful_region(runs: &[EmulatedRun]) -> Vec<Verdict> {
    let mut verdicts: Vec<Verdict> = Vec::new();
    let delayed = runs.iter().filter(|run| run.loss == 0.0 && run.late.is_none() && !run.delay.is_zero());
    for run in delayed {
        let (workers, megabits_per_second) = (f64::from(run.workers), run.bits_per_second as f64 / 1e6);
        let faithful = run.faithful() == (true, true);
        match verdicts
            .iter_mut()
            .find(|v| (v.workers, v.megabits_per_second) == (workers, megabits_per_second))
        {
            Some(verdict) => verdict.faithful &= faithful,
            None => verdicts.push(Verdict { workers, megabits_per_second, faithful }),
        }
    }
    verdicts
}

/// A rate in tc's words: `100mbit`, `10gbit`.
pub fn rate_name(bits_per_second: u64) -> String {
    match bits_per_second {
        rate if rate >= 1_000_000_000 && rate % 1_000_000_000 == 0 => format!("{}gbit", rate / 1_000_000_000),
        rate if rate >= 1_000_000 && rate % 1_000_000 == 0 => format!("{}mbit", rate / 1_000_000),
        rate => format!("{rate}bit"),
    }
}

/// A simulated time, and how long the simulation took.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Simulated {
    pub time: Duration,
    pub wall: Duration,
}

fn median(times: Vec<Duration>) -> Duration {
    Duration::from_secs_f64(median_of(times.iter().map(Duration::as_secs_f64)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Within the round trip and the buckets' first bursts, which the model leaves out.
    #[test]
    fn a_link_bound_run_lands_on_the_model() {
        let setup = Setup { jobs: 1, ..Setup::new(2, 100_000_000, Duration::from_millis(1), 1 << 20) };
        let netagg = setup.netagg().unwrap().time.as_secs_f64();
        let model = setup.scenario().netagg().unwrap().time.as_secs_f64();
        assert!((netagg / model - 1.0).abs() < 0.03, "{netagg} against {model}");
        let ring = setup.ring().time.as_secs_f64();
        let ring_model = setup.scenario().ring().unwrap().as_secs_f64();
        assert!((ring / ring_model - 1.0).abs() < 0.02, "{ring} against {ring_model}");
    }

    /// A tensor of 4 packets: at 1 Mbit/s its bytes at the link's rate set the time, at
    /// 10 Gbit/s and 1 ms the round trip does; on links without a bucket both land on
    /// the model.
    #[test]
    fn a_tiny_tensor_lands_on_the_model() {
        for (rate, delay) in
            [(1_000_000, Duration::from_micros(5)), (10_000_000_000, Duration::from_millis(1))]
        {
            for workers in [2, 16] {
                let setup = Setup { jobs: 1, burst_bytes: 0, ..Setup::new(workers, rate, delay, 4096) };
                let netagg = setup.netagg().unwrap().time.as_secs_f64();
                let model = setup.scenario().netagg().unwrap().time.as_secs_f64();
                assert!((netagg / model - 1.0).abs() < 0.05, "{setup}: {netagg} against {model}");
            }
        }
    }

    /// netagg-run's 64 KiB bucket holds the whole of a 4 KiB job's traffic: it takes a
    /// round trip alone, whatever the rate.
    #[test]
    fn a_bucket_lets_a_tiny_tensor_through_at_once() {
        let delay = Duration::from_micros(5);
        let setup = Setup { jobs: 1, ..Setup::new(2, 1_000_000, delay, 4096) };
        assert_eq!(setup.netagg().unwrap().time, 2 * delay);
    }

    #[test]
    fn emulated_runs_read_back_as_written() {
        let text = format!("# a comment\n{EMULATED_RUN_COLUMNS}\n4,50mbit,1ms,0.01,3:50ms,1048576,0.946,1.306,links / links,RESULTS issue 14\n");
        let runs = EmulatedRun::parse_all(&text).unwrap();
        let run = &runs[0];
        assert_eq!((run.workers, run.bits_per_second, run.delay), (4, 50_000_000, Duration::from_millis(1)));
        assert_eq!(
            (run.loss, run.late, run.ring_s),
            (0.01, Some((3, Duration::from_millis(50))), Some(1.306))
        );
        assert_eq!(EmulatedRun::parse_all(&format!("{EMULATED_RUN_COLUMNS}\n{}", run.line())).unwrap(), runs);
        assert_eq!(run.setup().tensor_bytes, 4 << 20);
        assert_eq!(run.faithful(), (true, true));
        let bound = EmulatedRun { pace: "links / CPU; links".into(), ..run.clone() };
        assert_eq!(bound.faithful(), (true, false));
        let error = EmulatedRun::parse_all(&format!("{EMULATED_RUN_COLUMNS}\n4,50mbit,1ms")).unwrap_err();
        assert!(error.starts_with("line 2: 3 fields"), "{error}");
        assert!(EmulatedRun::parse_all("workers\n").unwrap_err().contains("header"));

        let cpu_bound = EmulatedRun { pace: "CPU / links".into(), ..run.clone() };
        let lossless = EmulatedRun { loss: 0.0, late: None, ..run.clone() };
        let region = faithful_region(&[lossless.clone(), run.clone()]);
        assert_eq!(region, [Verdict { workers: 4.0, megabits_per_second: 50.0, faithful: true }]);
        let region = faithful_region(&[lossless, EmulatedRun { loss: 0.0, late: None, ..cpu_bound }]);
        assert!(!region[0].faithful, "one run the CPU bound makes the network unfaithful");
    }

    #[test]
    fn a_rack_setup_reaches_the_simulator_and_the_model_as_netagg_run_builds_it() {
        let racks = RackSetup {
            count: 2,
            uplink_bits_per_second: Some(20_000_000),
            uplink_delay: Duration::ZERO,
            tree: true,
        };
        let setup = Setup { racks: Some(racks), ..Setup::new(4, 40_000_000, Duration::ZERO, 1 << 20) };
        assert_eq!(setup.to_string(), "N = 4, 40mbit, 0ns, 2 racks behind 20mbit uplinks, a tree");
        let cluster = setup.cluster().racks.unwrap();
        assert_eq!((cluster.count, cluster.tree), (2, true));
        assert_eq!(cluster.uplink.rate, Some(RateLimit::new(20_000_000, setup.queue).with_burst(64 * 1024)));
        let scenario = setup.scenario();
        assert_eq!(scenario.aggregators, Aggregators::Tree { switch_link: None });
        assert_eq!(scenario.racks.unwrap().uplink.bits_per_second, 20e6);
        let flat = Setup { racks: Some(RackSetup { tree: false, ..racks }), switch_on_server: true, ..setup };
        assert!(matches!(flat.scenario().aggregators, Aggregators::Dedicated { count: 1, .. }));
        assert!(flat.to_string().ends_with("uplinks, one switch at the core, switches on servers"), "{flat}");
    }

    #[test]
    fn setups_read_as_a_launcher_writes_them() {
        let setup = Setup {
            loss: 0.01,
            late: Some((3, Duration::from_millis(50))),
            ..Setup::new(4, 10_000_000_000, Duration::from_micros(5), 1 << 20)
        };
        assert_eq!(setup.to_string(), "N = 4, 10gbit, 5µs, 1 % loss, rank 3 50ms late");
        assert_eq!(rate_name(50_000_000), "50mbit");
        assert_eq!(setup.cluster().start_delays[3], Duration::from_millis(50));
    }
}
