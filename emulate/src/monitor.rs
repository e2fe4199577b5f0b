//! Whether the emulated links or the host set the pace of a run.
//!
//! Times measured on emulated links predict a real network only while the links bind:
//! if the host's CPU is saturated while the links run below their rate, the run
//! measured this machine. A [`Monitor`] samples, every 100 ms, the bytes each worker's,
//! switch host's and rack uplink's link carried each way (the fabric namespace's device
//! counters) and the machine's busy CPU time (`/proc/stat`); [`judge`] then reads the
//! intervals in which the links carried traffic.

use crate::link::Link;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const PERIOD: Duration = Duration::from_millis(100);
/// A link at 80 % of its rate or more over an interval is running at its rate: tbf's
/// bucket and the gaps between jobs keep a busy link from reaching 100 % over 100 ms.
const LINK_BUSY: f64 = 0.8;
/// The machine's CPU at 90 % or more is saturated: the rest is other tenants' noise.
const CPU_SATURATED: f64 = 0.9;
/// An interval in which no link reached this share of its rate (or, unlimited, this
/// many bytes) carried no job's traffic: start-up, verification, teardown.
const LINK_IN_USE: f64 = 0.05;
const BYTES_IN_USE: u64 = 64 * 1024;

/// One reading: when, every link's bytes (up, down) so far, and the machine's CPU
/// ticks (busy, all) so far.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub at: Duration,
    pub links: Vec<(u64, u64)>,
    pub cpu: (u64, u64),
}

/// Samples a fabric's links and the CPU on a thread of its own until finished.
pub struct Monitor {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<std::io::Result<Vec<Sample>>>,
}

impl Monitor {
    /// Samples the links of `workers` workers, `switch_hosts` switch hosts and `uplinks`
    /// racks' uplinks.
    pub fn start(
        fabric_namespace: &str,
        workers: usize,
        switch_hosts: usize,
        uplinks: usize,
    ) -> std::io::Result<Monitor> {
        let stop = Arc::new(AtomicBool::new(false));
        let namespace = fabric_namespace.to_string();
        let (started, ready) = std::sync::mpsc::channel();
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new().name("link-monitor".into()).spawn(move || {
                // In the fabric's namespace, this thread's /proc/thread-self/net/dev
                // lists the fabric's devices.
                let entered = crate::netns::enter_by_name(&namespace);
                let failed = entered.as_ref().err().map(|e| std::io::Error::new(e.kind(), e.to_string()));
                let _ = started.send(entered);
                if let Some(error) = failed {
                    return Err(error);
                }
                let start = Instant::now();
                let mut samples = Vec::new();
                loop {
                    let links = std::fs::read_to_string("/proc/thread-self/net/dev")
                        .map(|text| link_bytes(&text, workers, switch_hosts, uplinks))?;
                    let cpu = std::fs::read_to_string("/proc/stat").map(|text| cpu_ticks(&text))?;
                    samples.push(Sample { at: start.elapsed(), links, cpu });
                    if stop.load(Ordering::Relaxed) {
                        return Ok(samples);
                    }
                    std::thread::sleep(PERIOD);
                }
            })?
        };
        match ready.recv() {
            Ok(Ok(())) => Ok(Monitor { stop, thread }),
            Ok(Err(error)) => Err(error),
            Err(_) => Err(std::io::Error::other("the link monitor's thread ended before it started")),
        }
    }

    /// Stops sampling (after one last sample) and returns the samples.
    pub fn finish(self) -> std::io::Result<Vec<Sample>> {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.join() {
            Ok(samples) => samples,
            Err(_) => Err(std::io::Error::other("the link monitor's thread panicked")),
        }
    }
}

/// Every worker's link bytes (up, down) from the fabric's `/proc/net/dev`, then every
/// switch host's, then every rack's uplink's: the fabric's end `w<rank>` (`s<host>`, and
/// the core's end `u<rack>`) received what went up and sent what went down.
pub fn link_bytes(
    proc_net_dev: &str,
    workers: usize,
    switch_hosts: usize,
    uplinks: usize,
) -> Vec<(u64, u64)> {
    let mut bytes = vec![(0, 0); workers + switch_hosts + uplinks];
    for line in proc_net_dev.lines().skip(2) {
        let Some((name, counters)) = line.split_once(':') else { continue };
        let name = name.trim();
        let index = |prefix: char| name.strip_prefix(prefix).and_then(|number| number.parse::<usize>().ok());
        let rank = match (index('w'), index('s')) {
            (Some(rank), _) => rank,
            (_, Some(host)) if host < switch_hosts => workers + host,
            _ => match index('u') {
                Some(rack) if rack < uplinks => workers + switch_hosts + rack,
                _ => continue,
            },
        };
        let fields: Vec<u64> = counters.split_whitespace().filter_map(|field| field.parse().ok()).collect();
        // Receive: bytes packets errs drop fifo frame compressed multicast; then transmit.
        if let (Some(slot), Some(&received), Some(&sent)) =
            (bytes.get_mut(rank), fields.first(), fields.get(8))
        {
            *slot = (received, sent);
        }
    }
    bytes
}

/// The machine's CPU ticks (busy, all) from `/proc/stat`'s first line; iowait counts
/// as idle. Of its fields (user nice system idle iowait irq softirq steal guest
/// guest_nice), the last two are already counted in user and nice.
pub fn cpu_ticks(proc_stat: &str) -> (u64, u64) {
    let fields: Vec<u64> = proc_stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .take(8)
        .filter_map(|field| field.parse().ok())
        .collect();
    let all: u64 = fields.iter().sum();
    let idle = fields.get(3).unwrap_or(&0) + fields.get(4).unwrap_or(&0);
    (all.saturating_sub(idle), all)
}

/// What set a run's pace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pace {
    /// Some link ran at its rate most of the time the links were in use.
    Links,
    /// The CPU was saturated while no link ran at its rate for a fifth of that time or
    /// more: the times measure this machine.
    Cpu,
    /// Neither: round trips (delay, window) or losses, as on a real network.
    Protocol,
    /// No interval carried traffic.
    Idle,
}

/// A run's reading.
#[derive(Debug, Clone, PartialEq)]
pub struct Judgement {
    pub pace: Pace,
    /// Time the links carried traffic.
    pub in_use: Duration,
    /// Of that time, with some link at its rate, and with the CPU saturated and no
    /// link at its rate.
    pub link_bound: Duration,
    pub cpu_bound: Duration,
    /// The machine's busy share over the time in use.
    pub cpu_busy: f64,
    /// Each link's mean rate over the time in use, bits per second, (up, down).
    pub mean_rates: Vec<(f64, f64)>,
    /// Each link's bytes over the whole run, (up, down).
    pub bytes: Vec<(u64, u64)>,
}

pub fn judge(samples: &[Sample], links: &[Link]) -> Judgement {
    let mut judgement = Judgement {
        pace: Pace::Idle,
        in_use: Duration::ZERO,
        link_bound: Duration::ZERO,
        cpu_bound: Duration::ZERO,
        cpu_busy: 0.0,
        mean_rates: vec![(0.0, 0.0); links.len()],
        bytes: vec![(0, 0); links.len()],
    };
    if let (Some(first), Some(last)) = (samples.first(), samples.last()) {
        for (rank, total) in judgement.bytes.iter_mut().enumerate() {
            let (up, down) = (first.links.get(rank), last.links.get(rank));
            if let (Some(start), Some(end)) = (up, down) {
                *total = (end.0.saturating_sub(start.0), end.1.saturating_sub(start.1));
            }
        }
    }
    let (mut busy_ticks, mut all_ticks) = (0u64, 0u64);
    let mut bytes_in_use = vec![(0u64, 0u64); links.len()];
    for pair in samples.windows(2) {
        let (before, after) = (&pair[0], &pair[1]);
        let seconds = after.at.saturating_sub(before.at).as_secs_f64();
        if seconds <= 0.0 {
            continue;
        }
        let mut in_use = false;
        let mut at_rate = false;
        let moved: Vec<(u64, u64)> = (0..links.len())
            .map(|rank| {
                let (start, end) = (before.links.get(rank).copied(), after.links.get(rank).copied());
                let (start, end) = (start.unwrap_or_default(), end.unwrap_or_default());
                (end.0.saturating_sub(start.0), end.1.saturating_sub(start.1))
            })
            .collect();
        for (link, &(up, down)) in links.iter().zip(&moved) {
            for bytes in [up, down] {
                match link.rate {
                    Some(rate) => {
                        let share = bytes as f64 * 8.0 / seconds / rate as f64;
                        in_use |= share >= LINK_IN_USE;
                        at_rate |= share >= LINK_BUSY;
                    }
                    None => in_use |= bytes >= BYTES_IN_USE,
                }
            }
        }
        if !in_use {
            continue;
        }
        let busy = after.cpu.0.saturating_sub(before.cpu.0);
        let all = after.cpu.1.saturating_sub(before.cpu.1);
        let saturated = all > 0 && busy as f64 / all as f64 >= CPU_SATURATED;
        let interval = after.at.saturating_sub(before.at);
        judgement.in_use += interval;
        if at_rate {
            judgement.link_bound += interval;
        } else if saturated {
            judgement.cpu_bound += interval;
        }
        busy_ticks += busy;
        all_ticks += all;
        for (total, (up, down)) in bytes_in_use.iter_mut().zip(moved) {
            total.0 += up;
            total.1 += down;
        }
    }
    if judgement.in_use.is_zero() {
        return judgement;
    }
    let seconds = judgement.in_use.as_secs_f64();
    judgement.cpu_busy = if all_ticks > 0 { busy_ticks as f64 / all_ticks as f64 } else { 0.0 };
    judgement.mean_rates = bytes_in_use
        .iter()
        .map(|&(up, down)| (up as f64 * 8.0 / seconds, down as f64 * 8.0 / seconds))
        .collect();
    judgement.pace = if judgement.cpu_bound.as_secs_f64() >= 0.2 * seconds {
        Pace::Cpu
    } else if judgement.link_bound.as_secs_f64() >= 0.5 * seconds {
        Pace::Links
    } else {
        Pace::Protocol
    };
    judgement
}

impl Judgement {
    /// The verdict in a sentence.
    pub fn verdict(&self) -> String {
        let share = |part: Duration| 100.0 * part.as_secs_f64() / self.in_use.as_secs_f64().max(1e-9);
        match self.pace {
            Pace::Idle => "no interval carried traffic: nothing to judge".into(),
            Pace::Links => format!(
                "the links set the pace: some link ran at its rate {:.0}% of the {:.1} s the links were in \
                 use (CPU {:.0}% busy); these times are the links'",
                share(self.link_bound),
                self.in_use.as_secs_f64(),
                100.0 * self.cpu_busy
            ),
            Pace::Cpu => format!(
                "CPU-BOUND: for {:.0}% of the {:.1} s the links were in use, the CPU was saturated while no \
                 link ran at its rate; these times measure this machine, not the emulated network, and do \
                 not predict a real one (use slower links, fewer workers, or larger packets)",
                share(self.cpu_bound),
                self.in_use.as_secs_f64()
            ),
            Pace::Protocol => format!(
                "neither the links nor the CPU set the pace: the links ran below their rate {:.0}% of the \
                 {:.1} s they were in use with the CPU {:.0}% busy, so round trips (delay, window) or \
                 losses did, as they would on a real network",
                100.0 - share(self.link_bound),
                self.in_use.as_secs_f64(),
                100.0 * self.cpu_busy
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(mbit: u64) -> Link {
        Link { rate: Some(mbit * 1_000_000), ..Link::default() }
    }

    /// Samples 100 ms apart, each interval moving `mbit_up` on each link and using the
    /// CPU `busy` of the time.
    fn run(intervals: &[(u64, f64)], workers: usize) -> Vec<Sample> {
        let mut samples = vec![Sample { at: Duration::ZERO, links: vec![(0, 0); workers], cpu: (0, 0) }];
        for (i, &(mbit, busy)) in intervals.iter().enumerate() {
            let last = samples.last().unwrap().clone();
            let bytes = mbit * 1_000_000 / 8 / 10;
            samples.push(Sample {
                at: Duration::from_millis(100 * (i as u64 + 1)),
                links: last.links.iter().map(|&(up, down)| (up + bytes, down + bytes)).collect(),
                cpu: (last.cpu.0 + (busy * 100.0) as u64, last.cpu.1 + 100),
            });
        }
        samples
    }

    #[test]
    fn links_at_their_rate_set_the_pace() {
        let samples = run(&[(0, 0.1), (195, 0.95), (190, 0.5), (200, 0.6), (0, 0.1)], 2);
        let judgement = judge(&samples, &[link(200), link(200)]);
        assert_eq!(judgement.pace, Pace::Links);
        assert_eq!(judgement.in_use, Duration::from_millis(300));
        assert_eq!(judgement.bytes[0].0, (195 + 190 + 200) * 1_000_000 / 80);
        assert!((judgement.mean_rates[1].1 / 1e6 - 195.0).abs() < 0.5);
        assert!(judgement.verdict().starts_with("the links set the pace"));
    }

    #[test]
    fn a_saturated_cpu_below_the_links_rate_is_called_cpu_bound() {
        let samples = run(&[(120, 0.97), (110, 0.99), (190, 0.5), (100, 0.95)], 4);
        let judgement = judge(&samples, &[link(200); 4]);
        assert_eq!(judgement.pace, Pace::Cpu);
        assert_eq!(judgement.cpu_bound, Duration::from_millis(300));
        assert!(judgement.verdict().starts_with("CPU-BOUND"));
    }

    #[test]
    fn slow_links_with_an_idle_cpu_are_the_protocol_s() {
        let samples = run(&[(50, 0.3), (60, 0.3)], 2);
        assert_eq!(judge(&samples, &[link(200); 2]).pace, Pace::Protocol);
        assert_eq!(judge(&run(&[(0, 1.0)], 2), &[link(200); 2]).pace, Pace::Idle);
        // The slowest link alone at its rate is enough: a straggler's link binds.
        let samples = run(&[(20, 0.3), (20, 0.3)], 2);
        assert_eq!(judge(&samples, &[link(200), link(20)]).pace, Pace::Links);
    }

    #[test]
    fn counters_parse_from_proc() {
        let dev = "Inter-|   Receive    |  Transmit\n face |bytes packets errs drop fifo frame compressed multicast|bytes\n\
                   \x20   lo: 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n\
                   \x20   w1: 1000 10 0 0 0 0 0 0 2000 20 0 0 0 0 0 0\n\
                   \x20   b1: 5 1 0 0 0 0 0 0 6 1 0 0 0 0 0 0\n\
                   \x20   w0: 7 1 0 0 0 0 0 0 8 1 0 0 0 0 0 0\n\
                   \x20   sw: 9 1 0 0 0 0 0 0 9 1 0 0 0 0 0 0\n\
                   \x20   s0: 30 1 0 0 0 0 0 0 40 1 0 0 0 0 0 0\n\
                   \x20   s1: 50 1 0 0 0 0 0 0 60 1 0 0 0 0 0 0\n\
                   \x20   v0: 3 1 0 0 0 0 0 0 4 1 0 0 0 0 0 0\n\
                   \x20   u0: 70 1 0 0 0 0 0 0 80 1 0 0 0 0 0 0\n\
                   \x20  rk0: 90 1 0 0 0 0 0 0 90 1 0 0 0 0 0 0\n";
        assert_eq!(link_bytes(dev, 2, 0, 0), vec![(7, 8), (1000, 2000)]);
        // Switch hosts follow the workers; the switch's own unshaped port is not one.
        assert_eq!(link_bytes(dev, 2, 1, 0), vec![(7, 8), (1000, 2000), (30, 40)]);
        // Uplinks last, read at the core's end; the rack's end and bridge are not links.
        assert_eq!(link_bytes(dev, 2, 1, 1), vec![(7, 8), (1000, 2000), (30, 40), (70, 80)]);
        assert_eq!(cpu_ticks("cpu  10 1 5 80 4 0 0 0 0 0\ncpu0 1 2 3\n"), (16, 100));
        // Guest time is in user time already.
        assert_eq!(cpu_ticks("cpu  10 1 5 80 4 0 0 0 7 1\n"), (16, 100));
    }
}
