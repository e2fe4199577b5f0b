//! Fault injection, without I/O: what a bad network does to a stream of datagrams.
//!
//! One [`FaultInjector`] stands for one direction of a link. Each datagram pushed in is
//! dropped, duplicated, corrupted (one bit flipped), delayed or held back so that later
//! ones overtake it, each with its own probability, drawn from a seeded RNG so that a run
//! can be repeated. It is middleware that knows nothing of netagg's protocol, so that
//! every layer that moves datagrams can wrap itself with it, as smoltcp's
//! `FaultInjector` wraps any device: the client's `FaultyTransport` around any backend,
//! the switch's data path on its receive and send sides (SwitchML's
//! `set_drop_probabilities`, and more), and the links of the aggregator's in-memory
//! simulator. Time comes in as an argument; held datagrams come out of
//! [`FaultInjector::release`] once due.
//!
//! A crate of its own so that the configuration, which names [`FaultRates`], need not
//! depend on the protocol; `netagg_aggregator::faults` re-exports it.

#![forbid(unsafe_code)]

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The longest delay a direction may add; a longer one only makes jobs time out.
pub const MAX_FAULT_DELAY: Duration = Duration::from_secs(10);

/// How long a reordered datagram is held back by default when the direction adds no
/// longer delay: long enough for a window of later datagrams to overtake it on a real
/// link, short against any timeout.
pub const REORDER_HOLD: Duration = Duration::from_millis(1);

/// Fault probabilities and delay of one direction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultRates {
    /// Probability that a datagram is lost.
    pub drop: f64,
    /// Probability that a datagram arrives twice.
    pub duplicate: f64,
    /// Probability that a datagram is held back and overtaken by later ones.
    pub reorder: f64,
    /// Probability that one bit of a datagram is flipped.
    pub corrupt: f64,
    /// Every datagram is delayed by a uniform random time up to this much (which also
    /// reorders datagrams closer together than the delay's spread).
    pub delay: Duration,
    /// How long a reordered datagram is held back, at least (`delay` if longer).
    pub reorder_hold: Duration,
}

impl Default for FaultRates {
    fn default() -> Self {
        FaultRates::NONE
    }
}

impl FaultRates {
    /// A direction that does nothing to its datagrams.
    pub const NONE: FaultRates = FaultRates {
        drop: 0.0,
        duplicate: 0.0,
        reorder: 0.0,
        corrupt: 0.0,
        delay: Duration::ZERO,
        reorder_hold: REORDER_HOLD,
    };

    /// Drops `rate` of the datagrams and nothing else.
    pub fn dropping(rate: f64) -> FaultRates {
        FaultRates { drop: rate, ..FaultRates::NONE }
    }

    /// Whether any fault is configured.
    pub fn is_active(&self) -> bool {
        self.drop > 0.0
            || self.duplicate > 0.0
            || self.reorder > 0.0
            || self.corrupt > 0.0
            || !self.delay.is_zero()
    }

    /// Whether a datagram may arrive with bytes other than those sent: only corruption
    /// changes bytes, every other fault moves or removes whole datagrams.
    pub fn may_alter_bytes(&self) -> bool {
        self.corrupt > 0.0
    }
}

/// What one direction did to its datagrams.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCounters {
    /// Datagrams pushed in.
    pub datagrams: u64,
    pub dropped: u64,
    pub duplicated: u64,
    pub reordered: u64,
    pub corrupted: u64,
    /// Copies held back for a delay or a reordering, released later.
    pub delayed: u64,
}

/// A held datagram: due time, then arrival order, so equal times keep their order.
type Held<A> = Reverse<(Instant, u64, HeldDatagram<A>)>;

#[derive(Debug)]
struct HeldDatagram<A> {
    address: A,
    bytes: Vec<u8>,
}

// Held datagrams are ordered by (due, sequence) alone, which are unique.
impl<A> PartialEq for HeldDatagram<A> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl<A> Eq for HeldDatagram<A> {}
impl<A> PartialOrd for HeldDatagram<A> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl<A> Ord for HeldDatagram<A> {
    fn cmp(&self, _: &Self) -> std::cmp::Ordering {
        std::cmp::Ordering::Equal
    }
}

/// One direction of a faulty link. `A` is what travels with each datagram (its source or
/// destination address in the switch, nothing in a worker thread).
#[derive(Debug)]
pub struct FaultInjector<A = ()> {
    rates: FaultRates,
    rng: ChaCha8Rng,
    held: BinaryHeap<Held<A>>,
    sequence: u64,
    counters: FaultCounters,
    scratch: Vec<u8>,
}

impl<A: Copy> FaultInjector<A> {
    /// An injector applying `rates`, its choices drawn from `seed`.
    pub fn new(rates: FaultRates, seed: u64) -> FaultInjector<A> {
        FaultInjector {
            rates,
            rng: ChaCha8Rng::seed_from_u64(seed),
            held: BinaryHeap::new(),
            sequence: 0,
            counters: FaultCounters::default(),
            scratch: Vec::new(),
        }
    }

    pub fn rates(&self) -> &FaultRates {
        &self.rates
    }

    pub fn counters(&self) -> &FaultCounters {
        &self.counters
    }

    /// Passes one datagram through the link: every copy that goes through at once is
    /// handed to `deliver`, the others are held until [`FaultInjector::release`].
    pub fn push(&mut self, now: Instant, address: A, datagram: &[u8], mut deliver: impl FnMut(A, &[u8])) {
        self.counters.datagrams += 1;
        if !self.rates.is_active() {
            return deliver(address, datagram);
        }
        if self.chance(self.rates.drop) {
            self.counters.dropped += 1;
            return;
        }
        let copies = if self.chance(self.rates.duplicate) {
            self.counters.duplicated += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let corrupt = !datagram.is_empty() && self.chance(self.rates.corrupt);
            let mut hold = Duration::ZERO;
            if !self.rates.delay.is_zero() {
                hold = self.rates.delay.mul_f64(self.rng.gen::<f64>());
            }
            if self.chance(self.rates.reorder) {
                self.counters.reordered += 1;
                hold += self.rates.delay.max(self.rates.reorder_hold);
            }
            let bytes = if corrupt {
                self.counters.corrupted += 1;
                self.scratch.clear();
                self.scratch.extend_from_slice(datagram);
                let bit = self.rng.gen_range(0..datagram.len() * 8);
                self.scratch[bit / 8] ^= 1 << (bit % 8);
                &self.scratch[..]
            } else {
                datagram
            };
            if hold.is_zero() {
                deliver(address, bytes);
            } else {
                self.counters.delayed += 1;
                let held = HeldDatagram { address, bytes: bytes.to_vec() };
                self.held.push(Reverse((now + hold, self.sequence, held)));
                self.sequence += 1;
            }
        }
    }

    /// Hands every held datagram due by `now` to `deliver`, earliest first; returns how
    /// many.
    pub fn release(&mut self, now: Instant, mut deliver: impl FnMut(A, &[u8])) -> usize {
        let mut released = 0;
        while self.held.peek().is_some_and(|Reverse((due, _, _))| *due <= now) {
            let Some(Reverse((_, _, held))) = self.held.pop() else { break };
            deliver(held.address, &held.bytes);
            released += 1;
        }
        released
    }

    /// When the next held datagram is due.
    pub fn next_release(&self) -> Option<Instant> {
        self.held.peek().map(|Reverse((due, _, _))| *due)
    }

    fn chance(&mut self, probability: f64) -> bool {
        probability > 0.0 && self.rng.gen::<f64>() < probability
    }
}

/// When to sever a connection, for transports whose connections can fail (RDMA's):
/// once, after a set number of datagrams received (`sever_after` of the fault sections).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Severance {
    left: Option<u64>,
}

impl Severance {
    /// Severs after `datagrams` datagrams received; 0 never.
    pub fn after(datagrams: u64) -> Severance {
        Severance { left: (datagrams > 0).then_some(datagrams) }
    }

    /// Counts a datagram received: true for the one after which the connection fails,
    /// and only once.
    pub fn count(&mut self) -> bool {
        let Some(left) = &mut self.left else { return false };
        *left -= 1;
        let due = *left == 0;
        if due {
            self.left = None;
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(rates: FaultRates, seed: u64, count: u32) -> (Vec<u32>, FaultCounters) {
        let mut link = FaultInjector::<()>::new(rates, seed);
        let start = Instant::now();
        let mut out = Vec::new();
        for i in 0..count {
            let now = start + Duration::from_micros(10 * i as u64);
            link.push(now, (), &i.to_le_bytes(), |_, d| out.push(d.to_vec()));
            link.release(now, |_, d| out.push(d.to_vec()));
        }
        link.release(start + Duration::from_secs(60), |_, d| out.push(d.to_vec()));
        assert_eq!(link.next_release(), None);
        let values = out.iter().map(|d| u32::from_le_bytes(d[..].try_into().unwrap())).collect();
        (values, *link.counters())
    }

    #[test]
    fn a_clean_link_delivers_everything_in_order_at_once() {
        let (values, counters) = run(FaultRates::NONE, 1, 1000);
        assert_eq!(values, (0..1000).collect::<Vec<_>>());
        assert_eq!(counters, FaultCounters { datagrams: 1000, ..FaultCounters::default() });
    }

    #[test]
    fn each_fault_happens_at_about_its_rate_and_a_seed_repeats_a_run() {
        let count = 100_000;
        let (values, counters) = run(FaultRates::dropping(0.05), 7, count);
        assert_eq!(values.len() as u64, count as u64 - counters.dropped);
        assert!((4_500..5_500).contains(&counters.dropped), "{counters:?}");
        assert!(values.windows(2).all(|w| w[0] < w[1]), "drops alone keep the order");

        let rates = FaultRates { duplicate: 0.02, reorder: 0.03, ..FaultRates::NONE };
        let (values, counters) = run(rates, 7, count);
        assert!((1_700..2_300).contains(&counters.duplicated), "{counters:?}");
        assert!((2_600..3_400).contains(&counters.reordered), "{counters:?}");
        assert_eq!(values.len() as u64, count as u64 + counters.duplicated);
        let mut sorted = values.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted, (0..count).collect::<Vec<_>>(), "nothing lost, nothing invented");
        let overtaken = values.windows(2).filter(|w| w[0] > w[1]).count();
        assert!(overtaken > 2_000, "held datagrams are overtaken: {overtaken}");
        assert_eq!(run(rates, 7, count).0, values, "the same seed makes the same faults");
        assert_ne!(run(rates, 8, count).0, values);
    }

    #[test]
    fn corruption_flips_exactly_one_bit() {
        let rates = FaultRates { corrupt: 1.0, ..FaultRates::NONE };
        let mut link = FaultInjector::new(rates, 3);
        let original = [0u8; 48];
        for _ in 0..100 {
            let mut seen = Vec::new();
            link.push(Instant::now(), 9u16, &original, |tag, d| seen.push((tag, d.to_vec())));
            assert_eq!(seen.len(), 1);
            assert_eq!(seen[0].0, 9, "the address travels with the datagram");
            assert_eq!(seen[0].1.iter().map(|b| b.count_ones()).sum::<u32>(), 1);
        }
        assert_eq!(link.counters().corrupted, 100);
    }

    #[test]
    fn delayed_datagrams_wait_for_their_time() {
        let rates = FaultRates { delay: Duration::from_millis(5), ..FaultRates::NONE };
        let mut link = FaultInjector::new(rates, 11);
        let start = Instant::now();
        let mut out = Vec::new();
        for i in 0u8..50 {
            link.push(start, i, &[i], |_, _| panic!("a delayed datagram left at once"));
        }
        let first = link.next_release().unwrap();
        assert!(first > start && first <= start + Duration::from_millis(5));
        assert_eq!(link.release(start, |_, _| ()), 0);
        assert_eq!(link.release(start + Duration::from_millis(5), |a, d| out.push((a, d[0]))), 50);
        assert!(out.iter().all(|(a, d)| a == d));
        assert_eq!(link.counters().delayed, 50);
    }

    #[test]
    fn a_severance_falls_on_the_nth_datagram_once_and_zero_never_severs() {
        let mut third = Severance::after(3);
        let counted: Vec<bool> = (0..6).map(|_| third.count()).collect();
        assert_eq!(counted, [false, false, true, false, false, false]);
        let mut never = Severance::after(0);
        assert!((0..100).all(|_| !never.count()));
    }
}
