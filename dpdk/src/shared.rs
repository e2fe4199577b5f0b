//! One port shared by several threads, each a UDP endpoint of its own
//! ([`ThreadEndpoint`]) that exchanges datagrams with a few peers: netagg's worker threads
//! and their switches (shards) or a switch's data-path threads (lanes).
//!
//! The port gets a queue pair per thread where the device has that many (a NIC, or
//! af_packet's `qpairs=N`), else fewer, which threads share (thread `t` sends on queue
//! `t mod queues`). A thread writes its datagrams straight into mbufs without a lock, and
//! takes its queue's lock only to hand a window of them to the transmit queue, or to poll.
//! The device spreads received frames over the queues by a hash of their addresses, not by
//! thread, so a thread polls its own queue and then any other no one is polling, and
//! whoever polls delivers what arrived for other threads (each has a UDP port of its own)
//! to their inboxes, in the mbufs it came in.

use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddrV4};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use crate::{
    Datagram, DpdkError, Frame, FrameAllocator, IdleWait, MacAddr, OutgoingDatagram, PollMode, Port,
    PortReservation, Settings, Station,
};

/// How long connecting waits for each peer's MAC address by ARP.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(3);

/// How often a sending thread looks up its peers' MACs again, which asks a peer by ARP
/// once it has been silent a while: a peer whose MAC changed is followed.
const ROUTE_CHECK: Duration = Duration::from_millis(100);

/// One thread's endpoint on a port it shares with other threads: its own UDP port, the
/// queue it sends on (and polls first), and the datagrams it is writing or has received.
pub struct ThreadEndpoint {
    shared: Arc<SharedPort>,
    thread: usize,
    /// The queue this thread sends on, and polls first.
    queue: usize,
    /// Holds this thread's UDP port in the kernel, and keeps the kernel quiet about it.
    reservation: PortReservation,
    /// This side's and the peers' MAC and UDP addresses, once connected.
    route: Option<Route>,
    /// When the peers' MACs were last looked up again.
    route_checked: Option<Instant>,
    /// The datagram [`ThreadEndpoint::send_buffer`] lent last.
    lent: Option<OutgoingDatagram>,
    /// Where [`ThreadEndpoint::send_buffer`] writes when the pool is empty: the datagram
    /// is then lost, as on a congested link, and recovered as any loss is.
    spare: Vec<u8>,
    outgoing: Vec<Frame>,
    /// The index in the route's peers of where each frame of `outgoing` goes.
    outgoing_peers: Vec<usize>,
    received: Vec<Datagram>,
    /// Last, so that it is dropped after every frame above: the last allocator of a
    /// pool frees it, if every frame is back.
    allocator: FrameAllocator,
}

/// The port's queues, and what its threads leave each other.
struct SharedPort {
    /// A station on each queue of the port.
    stations: Vec<Mutex<Station>>,
    /// Datagrams for each thread, received by another.
    inboxes: Inboxes<Datagram>,
    /// Each thread's UDP port, by thread index.
    ports: Vec<u16>,
    poll: PollMode,
    /// Where the settings came from, for errors that name one.
    section: &'static str,
    /// Datagrams lost here: an inbox full, or no mbuf to write one into.
    dropped: AtomicU64,
    /// Last, so that the port closes after every frame in the inboxes is back.
    port: Arc<Port>,
}

/// This side's MAC and UDP address, and its peers'.
#[derive(Debug, Clone)]
struct Route {
    source: (MacAddr, SocketAddrV4),
    /// The peers' UDP addresses, in the order [`ThreadEndpoint::connect`] was given them.
    peers: Vec<SocketAddrV4>,
    /// Each peer's MAC, in the same order.
    macs: Vec<MacAddr>,
}

impl ThreadEndpoint {
    /// Starts EAL and the port of `settings` with a queue pair per thread where the
    /// device has that many, and `threads` endpoints at `ip` on it, each at a UDP port of
    /// its own. `window` is how many datagrams a thread has in flight, which bounds how
    /// many others hold for it.
    pub fn open(
        settings: &Settings,
        ip: Ipv4Addr,
        threads: usize,
        window: usize,
    ) -> Result<Vec<ThreadEndpoint>, DpdkError> {
        let stations = Station::start(settings, ip, u16::try_from(threads).unwrap_or(u16::MAX))?;
        let reservations =
            (0..threads).map(|_| PortReservation::new(ip, 0)).collect::<Result<Vec<_>, _>>()?;
        let port = Arc::clone(stations[0].port());
        let allocator = port.allocator();
        let queues = stations.len();
        let shared = Arc::new(SharedPort {
            stations: stations.into_iter().map(Mutex::new).collect(),
            inboxes: Inboxes::new(threads, inbox_limit(window, settings.pool_size, threads)),
            ports: reservations.iter().map(PortReservation::port).collect(),
            poll: settings.poll,
            section: settings.section,
            dropped: AtomicU64::new(0),
            port,
        });
        Ok(reservations
            .into_iter()
            .enumerate()
            .map(|(thread, reservation)| ThreadEndpoint {
                shared: Arc::clone(&shared),
                thread,
                queue: queue_of(thread, queues),
                reservation,
                route: None,
                route_checked: None,
                lent: None,
                spare: Vec::new(),
                outgoing: Vec::new(),
                outgoing_peers: Vec::new(),
                received: Vec::new(),
                allocator: allocator.clone(),
            })
            .collect())
    }

    /// The port this endpoint shares.
    pub fn port(&self) -> &Port {
        &self.shared.port
    }

    /// Where this thread's datagrams come from: an unspecified IP until connecting sets
    /// it, where the settings gave none.
    pub fn local_address(&self) -> SocketAddrV4 {
        SocketAddrV4::new(self.shared.station(self.queue).ip(), self.reservation.port())
    }

    /// From now on exchanges datagrams with `peers`, whose MACs it waits for by ARP. An
    /// endpoint without an IP address takes `local`, where the program's other
    /// connections to the peers leave from (right where the port shares its interface
    /// with the kernel).
    pub fn connect(&mut self, peers: &[SocketAddrV4], local: IpAddr) -> io::Result<()> {
        if peers.is_empty() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "no peer to exchange datagrams with"));
        }
        let shared = &*self.shared;
        let section = shared.section;
        if shared.station(self.queue).ip().is_unspecified() {
            let IpAddr::V4(local) = local else {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!(
                        "the control connection leaves from {local}, not an IPv4 address: set {section}.ip"
                    ),
                ));
            };
            (0..shared.stations.len()).for_each(|queue| shared.station(queue).set_ip(local));
        }
        let unreachable = |error: DpdkError| {
            let ip = shared.station(self.queue).ip();
            let hint = if ip.is_loopback() {
                format!(" (this side's address is {ip}, the control connection's: set {section}.ip)")
            } else {
                String::new()
            };
            io::Error::new(io::ErrorKind::HostUnreachable, format!("{error}{hint}"))
        };
        let macs = peers
            .iter()
            .map(|peer| self.resolve(*peer.ip()).map_err(unreachable))
            .collect::<io::Result<Vec<_>>>()?;
        let station = shared.station(self.queue);
        let source = (station.mac(), SocketAddrV4::new(station.ip(), shared.ports[self.thread]));
        self.route = Some(Route { source, peers: peers.to_vec(), macs });
        Ok(())
    }

    /// Lends a buffer of `len` bytes for the next datagram: an mbuf's, where the pool
    /// has one.
    pub fn send_buffer(&mut self, len: usize) -> &mut [u8] {
        self.lent = OutgoingDatagram::new(&self.allocator, len);
        match &mut self.lent {
            Some(datagram) => &mut datagram.payload_mut()[..len],
            None => {
                self.spare.resize(len, 0);
                &mut self.spare
            }
        }
    }

    /// Queues the first `len` bytes of the buffer [`ThreadEndpoint::send_buffer`] lent
    /// last as a datagram to the peer `peer_of` picks from its bytes (an index into the
    /// peers [`ThreadEndpoint::connect`] was given); it leaves at [`ThreadEndpoint::flush`].
    pub fn send(&mut self, len: usize, peer_of: impl FnOnce(&[u8]) -> usize) -> io::Result<()> {
        let route = self.route.as_ref().ok_or_else(not_connected)?;
        let Some(mut datagram) = self.lent.take() else {
            self.shared.dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        };
        let peer = peer_of(&datagram.payload_mut()[..len]);
        let (Some(&address), Some(&mac)) = (route.peers.get(peer), route.macs.get(peer)) else {
            let message = format!("no peer {peer}: this endpoint has {}", route.peers.len());
            return Err(io::Error::new(io::ErrorKind::InvalidInput, message));
        };
        self.outgoing.push(datagram.finish(len, route.source, (mac, address)));
        self.outgoing_peers.push(peer);
        Ok(())
    }

    /// Hands what [`ThreadEndpoint::send`] queued to this thread's transmit queue; every
    /// [`ROUTE_CHECK`], first looks up the peers' MACs again in this thread's station, and
    /// follows each that changed, with the queued frames to it.
    pub fn flush(&mut self) {
        if self.outgoing.is_empty() {
            return;
        }
        let mut station = self.shared.station(self.queue);
        let now = Instant::now();
        if let Some(route) = self.route.as_mut().filter(|_| {
            self.route_checked.is_none_or(|checked| now.saturating_duration_since(checked) >= ROUTE_CHECK)
        }) {
            self.route_checked = Some(now);
            for (peer, (address, known)) in route.peers.iter().zip(&mut route.macs).enumerate() {
                let Some(mac) = station.ask_mac(*address.ip()).filter(|mac| mac != known) else { continue };
                *known = mac;
                let frames = self.outgoing.iter_mut().zip(&self.outgoing_peers);
                for (frame, _) in frames.filter(|(_, &to)| to == peer) {
                    // The Ethernet destination: a frame's first six bytes.
                    frame.bytes_mut()[..6].copy_from_slice(&mac.0);
                }
            }
            // The ARP requests the lookups queued.
            station.flush();
        }
        station.transmit(&mut self.outgoing);
        self.outgoing_peers.clear();
    }

    /// Waits up to `timeout` for datagrams from the peers to this thread and hands each to
    /// `sink`; returns how many arrived (0 when the time ran out).
    pub fn recv(&mut self, timeout: Duration, mut sink: impl FnMut(&[u8])) -> io::Result<usize> {
        let peers = &self.route.as_ref().ok_or_else(not_connected)?.peers;
        let idle = IdleWait::new(timeout, self.shared.poll);
        loop {
            self.shared.inboxes.take(self.thread, &mut self.received);
            if self.received.is_empty() {
                self.shared.poll_queues(self.queue, self.thread, peers, &mut self.received);
            }
            if !self.received.is_empty() {
                let count = self.received.len();
                for datagram in self.received.drain(..) {
                    sink(datagram.payload());
                }
                return Ok(count);
            }
            if !idle.pause() {
                return Ok(0);
            }
        }
    }

    /// Waits up to [`RESOLVE_TIMEOUT`] for `ip`'s MAC, asking by ARP from this thread's
    /// queue; the answer may arrive on any queue. Nothing flows before every thread is
    /// connected: datagrams that arrive meanwhile are not for a session of this context.
    fn resolve(&self, ip: Ipv4Addr) -> Result<MacAddr, DpdkError> {
        let shared = &*self.shared;
        let deadline = Instant::now() + RESOLVE_TIMEOUT;
        loop {
            if let Some(mac) = shared.station(self.queue).ask_mac(ip) {
                return Ok(mac);
            }
            shared.station(self.queue).flush();
            for queue in 0..shared.stations.len() {
                let mut station = shared.station(queue);
                station.poll(&mut drop);
                if let Some(mac) = station.known_mac(ip) {
                    return Ok(mac);
                }
            }
            if Instant::now() >= deadline {
                return Err(DpdkError::Unresolved { ip, timeout: RESOLVE_TIMEOUT });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// The device, its addresses and how many threads share how many queues, for people.
impl fmt::Display for ThreadEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let port = self.port();
        let (queues, threads) = (self.shared.stations.len(), self.shared.ports.len());
        write!(
            f,
            "device {} (MAC {}, MTU {}) at {}, {threads} threads on {queues} queue{}",
            port.device(),
            port.mac(),
            port.mtu(),
            self.local_address(),
            if queues == 1 { "" } else { "s" }
        )
    }
}

impl SharedPort {
    fn station(&self, queue: usize) -> MutexGuard<'_, Station> {
        self.stations[queue].lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Polls one burst of `thread`'s queue `own`, then of each other queue no one is
    /// polling, delivering what arrives from `peers`: `thread`'s into `received`.
    fn poll_queues(&self, own: usize, thread: usize, peers: &[SocketAddrV4], received: &mut Vec<Datagram>) {
        for queue in poll_order(own, self.stations.len()) {
            let station = if queue == own { Some(self.station(queue)) } else { self.try_station(queue) };
            if let Some(mut station) = station {
                station.poll(&mut |datagram| self.deliver(peers, received, thread, datagram));
            }
        }
    }

    /// The station of `queue` unless another thread holds it (polling it, say).
    fn try_station(&self, queue: usize) -> Option<MutexGuard<'_, Station>> {
        match self.stations[queue].try_lock() {
            Ok(station) => Some(station),
            Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// Hands `datagram`, received by `thread`, to that thread or to the inbox of the
    /// thread it is for; drops it if it is from anyone but `peers`.
    fn deliver(&self, peers: &[SocketAddrV4], own: &mut Vec<Datagram>, thread: usize, datagram: Datagram) {
        let Some(index) = recipient(&self.ports, peers, datagram.source, datagram.port) else { return };
        if index == thread {
            own.push(datagram);
        } else if !self.inboxes.push(index, datagram) {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for SharedPort {
    fn drop(&mut self) {
        let counters: Vec<_> = (0..self.stations.len()).map(|queue| self.station(queue).counters()).collect();
        let dropped = self.dropped.load(Ordering::Relaxed);
        tracing::debug!(?counters, dropped, "DPDK port closed");
    }
}

fn not_connected() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "the DPDK transport has no switch address yet")
}

/// The queue thread `thread` sends on and polls first, of `queues`.
fn queue_of(thread: usize, queues: usize) -> usize {
    thread % queues
}

/// The order in which a thread polls `queues` queues: its own first, then the others
/// after it, round.
fn poll_order(own: usize, queues: usize) -> impl Iterator<Item = usize> {
    (0..queues).map(move |offset| (own + offset) % queues)
}

/// The thread a datagram from `source` to UDP port `port` is for: the one at that port,
/// if the datagram comes from one of `peers`.
fn recipient(ports: &[u16], peers: &[SocketAddrV4], source: SocketAddrV4, port: u16) -> Option<usize> {
    if !peers.contains(&source) {
        return None;
    }
    ports.iter().position(|&own| own == port)
}

/// The most datagrams an inbox holds: a thread's window of results and as many again for
/// duplicates, within a quarter of a pool of `pool_size` mbufs shared by `threads`, rather
/// than let a thread that does not receive (between jobs) hold the mbufs every thread and
/// the receive ring draw from.
fn inbox_limit(window: usize, pool_size: u32, threads: usize) -> usize {
    (window * 2).min(pool_size as usize / 4 / threads.max(1)).max(1)
}

/// What each thread's peers received for it, up to a limit per thread.
struct Inboxes<T> {
    inboxes: Vec<Mutex<Vec<T>>>,
    limit: usize,
}

impl<T> Inboxes<T> {
    fn new(threads: usize, limit: usize) -> Inboxes<T> {
        Inboxes { inboxes: (0..threads).map(|_| Mutex::new(Vec::new())).collect(), limit }
    }

    fn inbox(&self, thread: usize) -> MutexGuard<'_, Vec<T>> {
        self.inboxes[thread].lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Puts `item` in `thread`'s inbox; false, and `item` dropped, if the inbox is full.
    fn push(&self, thread: usize, item: T) -> bool {
        let mut inbox = self.inbox(thread);
        if inbox.len() >= self.limit {
            return false;
        }
        inbox.push(item);
        true
    }

    /// Moves what `thread`'s inbox holds into `empty`, which gives the inbox its room in
    /// exchange: no item is copied, and neither vector allocates once both have grown.
    fn take(&self, thread: usize, empty: &mut Vec<T>) {
        debug_assert!(empty.is_empty(), "an inbox is taken into an empty vector");
        std::mem::swap(empty, &mut *self.inbox(thread));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn address(last: u8, port: u16) -> SocketAddrV4 {
        SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, last), port)
    }

    #[test]
    fn threads_share_queues_in_turn_and_poll_their_own_first() {
        let queues: Vec<usize> = (0..5).map(|thread| queue_of(thread, 2)).collect();
        assert_eq!(queues, [0, 1, 0, 1, 0]);
        assert_eq!(queue_of(3, 4), 3);
        assert_eq!(poll_order(2, 4).collect::<Vec<_>>(), [2, 3, 0, 1]);
        assert_eq!(poll_order(0, 1).collect::<Vec<_>>(), [0]);
    }

    #[test]
    fn a_datagram_is_for_the_thread_at_its_port_and_only_from_a_peer() {
        let ports = [40000, 40001, 40002];
        let (peer, other_shard) = (address(1, 9000), address(3, 9000));
        let peers = [peer, other_shard];
        assert_eq!(recipient(&ports, &peers, peer, 40001), Some(1));
        assert_eq!(recipient(&ports, &peers, peer, 40002), Some(2));
        assert_eq!(recipient(&ports, &peers, other_shard, 40000), Some(0));
        // Another port, another sender, or a peer's address at another port: no one's.
        assert_eq!(recipient(&ports, &peers, peer, 5000), None);
        assert_eq!(recipient(&ports, &peers, address(2, 9000), 40000), None);
        assert_eq!(recipient(&ports, &peers, address(1, 9001), 40000), None);
        assert_eq!(recipient(&ports, &[peer], other_shard, 40000), None);
    }

    #[test]
    fn an_inbox_holds_two_windows_within_a_quarter_of_the_pool() {
        assert_eq!(inbox_limit(64, 8191, 2), 128);
        // 8191 mbufs / 4 / 8 threads = 255: the pool caps 2 × 256.
        assert_eq!(inbox_limit(256, 8191, 8), 255);
        // Never none, whatever the pool.
        assert_eq!(inbox_limit(64, 3, 4), 1);
        assert_eq!(inbox_limit(0, 8191, 1), 1);
    }

    #[test]
    fn an_inbox_keeps_up_to_its_limit_and_hands_everything_over_at_once() {
        let inboxes = Inboxes::new(2, 3);
        for item in 0..5 {
            assert_eq!(inboxes.push(1, item), item < 3, "item {item}");
        }
        let mut taken = Vec::new();
        inboxes.take(0, &mut taken);
        assert!(taken.is_empty());
        inboxes.take(1, &mut taken);
        assert_eq!(taken, [0, 1, 2]);
        // The inbox is empty again, and takes the limit again.
        taken.clear();
        assert!((0..3).all(|item| inboxes.push(1, item)) && !inboxes.push(1, 3));
    }

    #[test]
    fn inboxes_filled_from_several_threads_lose_nothing_below_their_limit() {
        let inboxes = Inboxes::new(2, 4000);
        std::thread::scope(|scope| {
            for sender in 0..4u32 {
                let inboxes = &inboxes;
                scope
                    .spawn(move || (0..1000).for_each(|item| assert!(inboxes.push(0, sender * 1000 + item))));
            }
        });
        let mut taken = Vec::new();
        inboxes.take(0, &mut taken);
        taken.sort_unstable();
        assert_eq!(taken, (0..4000).collect::<Vec<u32>>());
    }
}
