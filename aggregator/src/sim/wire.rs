//! The simulated network: links, each a latency behind a queue at a rate and faults of
//! its own, and the routes packets take over them from node to node (a worker's link; a
//! rack's uplink on a network of racks; a switch host's link when the switch runs on a
//! server).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use netagg_wire::control::{rack_of, rack_ranks, SlotSplit};
use netagg_wire::Packet;

use super::{ClusterConfig, LinkFaults, QueueWaits, RateLimit};
use crate::engine::Recipient;
use crate::faults::FaultInjector;

/// A sender or receiver of packets: a worker by rank, or a switch: the racks' switches by
/// rack (in a tree), then the switch at the core.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Node {
    Worker(u16),
    Switch(u16),
}

/// Links a route crosses at most: a worker's, a rack's uplink and a switch host's.
const MAX_HOPS: usize = 4;

/// The links from a node to a node, and how far along them a packet is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Route {
    hops: [u32; MAX_HOPS],
    len: u8,
    /// The next link the packet enters.
    next: u8,
    to: Node,
    /// The packet goes down, to a worker or from the core to a rack's switch, whichever
    /// way each link it crosses runs (a switch host's link out carries a rack's sums up).
    down: bool,
}

impl Route {
    fn new(to: Node, down: bool, hops: impl IntoIterator<Item = u32>) -> Route {
        let mut route = Route { hops: [0; MAX_HOPS], len: 0, next: 0, to, down };
        for hop in hops {
            route.hops[usize::from(route.len)] = hop;
            route.len += 1;
        }
        route
    }

    fn link(&self) -> usize {
        self.hops[usize::from(self.next)] as usize
    }
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct InFlight {
    at: Instant,
    sequence: u64,
    route: Route,
    bytes: Vec<u8>,
}

/// Whether a link carries packets towards a switch, for the queue waits reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    Up,
    Down,
}

#[derive(Debug)]
struct Link {
    bottleneck: Option<Bottleneck>,
    latency: Duration,
    /// The injector whose faults a packet meets as it enters the link.
    faults: Option<usize>,
    way: Way,
    /// Bytes of the frames it took, link headers counted.
    frame_bytes: u64,
}

/// Where each link of the network sits in [`Links::links`].
#[derive(Debug)]
struct Layout {
    workers: u16,
    racks: u16,
    /// Whether the racks' switches sum first (a tree), or pass every packet on to the
    /// core (flat).
    tree: bool,
    switch_links: bool,
    /// Switches sharing the session's slots, without racks; 1 otherwise.
    shards: u16,
    /// Each worker's slots, which the shards split.
    slots: u16,
}

impl Layout {
    fn worker_up(&self, rank: u16) -> u32 {
        u32::from(rank)
    }

    fn worker_down(&self, rank: u16) -> u32 {
        u32::from(self.workers) + u32::from(rank)
    }

    fn switches(&self) -> u16 {
        if self.tree {
            self.racks + 1
        } else {
            self.shards
        }
    }

    /// The switch host's link of switch `switch`, towards it and from it.
    fn switch_link(&self, switch: u16) -> Option<(u32, u32)> {
        let first = 2 * u32::from(self.workers) + 2 * u32::from(switch);
        self.switch_links.then_some((first, first + 1))
    }

    /// Rack `rack`'s uplink, up and down.
    fn uplink(&self, rack: u16) -> Option<(u32, u32)> {
        let switch_links = if self.switch_links { 2 * u32::from(self.switches()) } else { 0 };
        let first = 2 * u32::from(self.workers) + switch_links + 2 * u32::from(rack);
        (rack < self.racks).then_some((first, first + 1))
    }

    /// The rack of worker `rank`, on a network of racks.
    fn rack(&self, rank: u16) -> Option<u16> {
        rack_of(rank, self.racks, self.workers)
    }

    /// The switch at the core.
    fn core(&self) -> u16 {
        self.switches() - 1
    }

    /// The links from `from` to `to`.
    fn route(&self, from: Node, to: Node) -> Route {
        let through_uplink =
            |rank: u16| (!self.tree).then(|| self.rack(rank)).flatten().and_then(|rack| self.uplink(rack));
        match (from, to) {
            (Node::Worker(rank), Node::Switch(switch)) => {
                let uplink = through_uplink(rank).map(|(up, _)| up);
                let host = self.switch_link(switch).map(|(into, _)| into);
                Route::new(to, false, [self.worker_up(rank)].into_iter().chain(uplink).chain(host))
            }
            (Node::Switch(switch), Node::Worker(rank)) => {
                let host = self.switch_link(switch).map(|(_, out)| out);
                let uplink = through_uplink(rank).map(|(_, down)| down);
                Route::new(to, true, host.into_iter().chain(uplink).chain([self.worker_down(rank)]))
            }
            (Node::Switch(from), Node::Switch(to_switch)) => {
                let out = self.switch_link(from).map(|(_, out)| out);
                let into = self.switch_link(to_switch).map(|(into, _)| into);
                let up = to_switch == self.core();
                let uplink = if up {
                    self.uplink(from).map(|(up, _)| up)
                } else {
                    self.uplink(to_switch).map(|(_, down)| down)
                };
                Route::new(to, !up, out.into_iter().chain(uplink).chain(into))
            }
            (Node::Worker(_), Node::Worker(_)) => unreachable!("workers send only to switches"),
        }
    }
}

/// The packets on their way, and the links' queues.
#[derive(Debug)]
struct Links {
    in_flight: BinaryHeap<Reverse<InFlight>>,
    sequence: u64,
    links: Vec<Link>,
    frame_overhead_bytes: u64,
    /// Packets dropped by full queues, and of those, the ones on their way down to a
    /// worker or a rack's switch, whichever link they were on.
    queue_drops: u64,
    queue_drops_down: u64,
}

/// The simulated network.
#[derive(Debug)]
pub(super) struct Wire {
    layout: Layout,
    /// Faults of the workers' links up and down, then of the racks' uplinks up and down.
    injectors: Vec<FaultInjector<Route>>,
    /// When the injectors last released what they held.
    released_at: Option<Instant>,
    links: Links,
}

/// The nodes a switch's packet goes to: a range of workers or of switches.
pub(super) type Recipients = std::iter::Map<std::ops::Range<u16>, fn(u16) -> Node>;

/// The injectors of [`Wire::injectors`].
const WORKERS_UP: usize = 0;
const WORKERS_DOWN: usize = 1;
const UPLINKS_UP: usize = 2;
const UPLINKS_DOWN: usize = 3;

impl Wire {
    pub(super) fn new(config: &ClusterConfig, now: Instant) -> Wire {
        let racks = config.racks.as_ref();
        let count = racks.map_or(0, |racks| racks.count);
        let layout = Layout {
            workers: config.workers,
            racks: count,
            tree: racks.is_some_and(|racks| racks.tree),
            switch_links: config.switch_link.is_some(),
            shards: config.shards,
            slots: config.slots,
        };
        let link = |rate: Option<RateLimit>, latency, faults, way| Link {
            bottleneck: rate.map(|limit| Bottleneck::new(limit, now)),
            latency,
            faults,
            way,
            frame_bytes: 0,
        };
        let mut links: Vec<Link> = (0..config.workers)
            .map(|rank| {
                link(
                    config.rank_rate(rank, config.uplink.rate),
                    config.uplink.latency,
                    Some(WORKERS_UP),
                    Way::Up,
                )
            })
            .collect();
        links.extend((0..config.workers).map(|rank| {
            link(
                config.rank_rate(rank, config.downlink.rate),
                config.downlink.latency,
                Some(WORKERS_DOWN),
                Way::Down,
            )
        }));
        if let Some(limit) = config.switch_link {
            for _ in 0..layout.switches() {
                links.push(link(Some(limit), Duration::ZERO, None, Way::Up));
                links.push(link(Some(limit), Duration::ZERO, None, Way::Down));
            }
        }
        let uplink = racks.map_or(LinkFaults::perfect(Duration::ZERO), |racks| racks.uplink);
        for _ in 0..count {
            links.push(link(uplink.rate, uplink.latency, Some(UPLINKS_UP), Way::Up));
            links.push(link(uplink.rate, uplink.latency, Some(UPLINKS_DOWN), Way::Down));
        }
        let injectors = vec![
            FaultInjector::new(config.uplink.rates(), config.seed),
            FaultInjector::new(config.downlink.rates(), !config.seed),
            FaultInjector::new(uplink.rates(), derived_seed(config.seed, 1)),
            FaultInjector::new(uplink.rates(), derived_seed(config.seed, 2)),
        ];
        let links = Links {
            in_flight: BinaryHeap::new(),
            sequence: 0,
            links,
            frame_overhead_bytes: config.frame_overhead_bytes,
            queue_drops: 0,
            queue_drops_down: 0,
        };
        Wire { layout, injectors, released_at: None, links }
    }

    /// The switch worker `rank` sends `datagram` to: its rack's in a tree, else the
    /// shard that owns its slot (the core, with one), as the client's data paths pick
    /// it.
    pub(super) fn switch_of(&self, rank: u16, datagram: &[u8]) -> u16 {
        let layout = &self.layout;
        match layout.rack(rank) {
            Some(rack) if layout.tree => rack,
            _ if layout.shards > 1 => {
                let slot = Packet::new_checked(datagram).map_or(0, |packet| packet.slot());
                let owner = SlotSplit::Ranges.owner(slot, layout.slots, usize::from(layout.shards));
                owner.min(usize::from(layout.shards) - 1) as u16
            }
            _ => layout.core(),
        }
    }

    /// The switches the workers send to: the racks' in a tree, else every shard (the
    /// core, with one).
    pub(super) fn workers_switches(&self) -> std::ops::Range<u16> {
        if self.layout.tree {
            0..self.layout.racks
        } else {
            0..self.layout.shards
        }
    }

    /// The nodes switch `switch`'s packet for `recipient` goes to: a rack's switch
    /// numbers its workers from 0 and sends its partial sums up to the core, the upper
    /// switch's members are the racks' switches.
    pub(super) fn recipients(&self, switch: u16, recipient: Recipient) -> Recipients {
        let layout = &self.layout;
        let (core, racks) = (layout.core(), layout.racks);
        let one = |node: u16| node..node + 1;
        let (nodes, kind): (_, fn(u16) -> Node) = match recipient {
            Recipient::All if layout.tree && switch == core => (0..racks, Node::Switch),
            Recipient::All if layout.tree => (rack_ranks(switch, racks, layout.workers), Node::Worker),
            Recipient::All => (0..layout.workers, Node::Worker),
            Recipient::Worker(rack) if layout.tree && switch == core => (one(rack), Node::Switch),
            Recipient::Worker(rank) if layout.tree => {
                (one(rack_ranks(switch, racks, layout.workers).start + rank), Node::Worker)
            }
            Recipient::Worker(rank) => (one(rank), Node::Worker),
            Recipient::Upstream if layout.tree && switch != core => (one(core), Node::Switch),
            // Only a rack's switch has an upper switch.
            Recipient::Upstream => (0..0, Node::Switch),
        };
        nodes.map(kind)
    }

    /// Puts a packet from `from` on its way to `to` at `now`.
    pub(super) fn send(&mut self, now: Instant, from: Node, to: Node, bytes: &[u8]) {
        let route = self.layout.route(from, to);
        self.enter(now, route, bytes.to_vec());
    }

    /// The next packet that has reached its destination by `now`, and where; packets
    /// that reached a hop of their route by then go on to its next link.
    pub(super) fn pop_due(&mut self, now: Instant) -> Option<(Node, Vec<u8>)> {
        // What the injectors hold back is held for a time that is never zero: once
        // released at `now`, nothing new falls due before the clock moves.
        if self.released_at != Some(now) {
            self.released_at = Some(now);
            for injector in &mut self.injectors {
                let links = &mut self.links;
                injector.release(now, |route, bytes| links.admit(now, route, bytes.to_vec()));
            }
        }
        while self.links.in_flight.peek().is_some_and(|Reverse(packet)| packet.at <= now) {
            let Reverse(packet) = self.links.in_flight.pop()?;
            if packet.route.next == packet.route.len {
                return Some((packet.route.to, packet.bytes));
            }
            self.enter(now, packet.route, packet.bytes);
        }
        None
    }

    /// When a packet next arrives somewhere or a held one goes on.
    pub(super) fn next_event(&self) -> Option<Instant> {
        let arrival = self.links.in_flight.peek().map(|Reverse(packet)| packet.at);
        self.injectors.iter().filter_map(FaultInjector::next_release).chain(arrival).min()
    }

    /// A packet enters its route's next link: through that link's faults, then its queue.
    /// Its buffer goes with it from hop to hop; only a link that has faults copies it.
    fn enter(&mut self, now: Instant, route: Route, bytes: Vec<u8>) {
        let links = &mut self.links;
        let faults = links.links[route.link()].faults.map(|faults| &mut self.injectors[faults]);
        match faults {
            Some(injector) if injector.rates().is_active() => {
                injector.push(now, route, &bytes, |route, bytes| links.admit(now, route, bytes.to_vec()))
            }
            _ => links.admit(now, route, bytes),
        }
    }

    pub(super) fn queue_drops(&self) -> u64 {
        self.links.queue_drops
    }

    /// Of [`Wire::queue_drops`], those on links towards the workers.
    pub(super) fn queue_drops_down(&self) -> u64 {
        self.links.queue_drops_down
    }

    /// The longest queue waits since the last call, which starts the next count.
    pub(super) fn take_longest_waits(&mut self) -> QueueWaits {
        let mut waits = QueueWaits::default();
        for link in &mut self.links.links {
            let Some(bottleneck) = &mut link.bottleneck else { continue };
            let wait = std::mem::take(&mut bottleneck.longest_wait);
            let longest = match link.way {
                Way::Up => &mut waits.up,
                Way::Down => &mut waits.down,
            };
            *longest = (*longest).max(wait);
        }
        waits
    }

    /// Bytes each rack's uplink has carried, up and down, link headers counted.
    pub(super) fn uplink_bytes(&self) -> Vec<(u64, u64)> {
        let bytes = |link: u32| self.links.links[link as usize].frame_bytes;
        (0..self.layout.racks)
            .filter_map(|rack| self.layout.uplink(rack))
            .map(|(up, down)| (bytes(up), bytes(down)))
            .collect()
    }
}

impl Links {
    /// Puts `bytes` on its route's next link at `now`, through the link's queue if it
    /// has one, to reach the link's far end its latency after it leaves.
    fn admit(&mut self, now: Instant, mut route: Route, bytes: Vec<u8>) {
        let frame_bytes = bytes.len() as u64 + self.frame_overhead_bytes;
        let link = &mut self.links[route.link()];
        let departure = match &mut link.bottleneck {
            Some(bottleneck) => match bottleneck.admit(now, frame_bytes) {
                Some(departure) => departure,
                None => {
                    self.queue_drops += 1;
                    self.queue_drops_down += u64::from(route.down);
                    return;
                }
            },
            None => now,
        };
        link.frame_bytes += frame_bytes;
        route.next += 1;
        self.sequence += 1;
        let packet = InFlight { at: departure + link.latency, sequence: self.sequence, route, bytes };
        self.in_flight.push(Reverse(packet));
    }
}

/// The state of one link in one direction under a [`RateLimit`].
#[derive(Debug, Clone)]
struct Bottleneck {
    limit: RateLimit,
    /// When the last packet admitted has left the link.
    free_at: Instant,
    /// Bytes in the bucket when it left.
    tokens: u64,
    /// The longest a packet admitted since the last reset waited in the queue.
    longest_wait: Duration,
}

impl Bottleneck {
    fn new(limit: RateLimit, now: Instant) -> Bottleneck {
        Bottleneck { limit, free_at: now, tokens: limit.burst_bytes, longest_wait: Duration::ZERO }
    }

    /// When a packet of `bytes` offered at `now` has left the link; `None` if the queue
    /// ahead of it is full and it is dropped.
    fn admit(&mut self, now: Instant, bytes: u64) -> Option<Instant> {
        let start = self.free_at.max(now);
        let backlog = self.limit.bytes_in(start - now);
        if backlog + bytes > self.limit.queue_bytes {
            return None;
        }
        // The bucket refilled while the link idled: what it holds leaves at once, the
        // rest at the rate.
        let tokens =
            self.tokens.saturating_add(self.limit.bytes_in(start - self.free_at)).min(self.limit.burst_bytes);
        let (departure, tokens) = match bytes.checked_sub(tokens) {
            None | Some(0) => (start, tokens - bytes),
            Some(lacking) => (start + self.limit.serialization(lacking), 0),
        };
        // The wait before its own bytes go out at the rate.
        let wait = (departure - now).saturating_sub(self.limit.serialization(bytes));
        self.longest_wait = self.longest_wait.max(wait);
        self.free_at = departure;
        self.tokens = tokens;
        Some(departure)
    }
}

/// The seed of the `stream`th injector after the workers' links' (which draw from `seed`
/// and `!seed`): SplitMix64's `stream`th output from `seed`, so that no seed, 0 or one of
/// equal halves included, gives two links the same draws, as a rotation of it did.
fn derived_seed(seed: u64, stream: u64) -> u64 {
    let mut x = seed.wrapping_add(stream.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_uplinks_draw_from_seeds_unlike_the_workers_links_for_any_seed() {
        for seed in [0, u64::MAX, 0x1234_5678_1234_5678, 11] {
            let seeds = [seed, !seed, derived_seed(seed, 1), derived_seed(seed, 2)];
            for (index, a) in seeds.iter().enumerate() {
                assert!(!seeds[index + 1..].contains(a), "seed {seed:#x}: {seeds:x?}");
            }
        }
    }
}
