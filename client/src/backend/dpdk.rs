//! The DPDK backend: the worker threads' datagrams leave from one DPDK port, kernel
//! bypassed, as the same UDP datagrams the UDP backend sends, so that a kernel-socket
//! switch serves them (and a DPDK switch serves UDP workers).
//!
//! The port gets a queue pair per worker thread where the device has that many (a NIC,
//! or af_packet's `qpairs=N`), else fewer, which threads share (thread `t` sends on queue
//! `t mod queues`). A thread writes its datagrams straight into mbufs without a lock, and
//! takes its queue's lock only to hand a window of them to the transmit queue, or to poll.
//! The device spreads received frames over the queues by a hash of their addresses, not by
//! thread, so a thread polls its own queue and then any other no one is polling, and
//! whoever polls delivers what arrived for other threads (each has a UDP port of its own)
//! to their inboxes, in the mbufs it came in.

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use netagg_config::{Config, PollMode};
use netagg_dpdk::{
    Datagram, DpdkError, Frame, FrameAllocator, IdleWait, MacAddr, OutgoingDatagram, PortReservation, Station,
};
use netagg_wire::packet;
use netagg_wire::Endpoint;

use super::{ControlAddresses, SwitchTransport, Transport};
use crate::Error;

/// How long connecting waits for the switch's MAC address by ARP.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(3);

/// The port's queues, and what its threads leave each other.
struct Shared {
    /// A station on each queue of the port.
    stations: Vec<Mutex<Station>>,
    /// Datagrams for each thread, received by another.
    inboxes: Vec<Mutex<Vec<Datagram>>>,
    /// The most datagrams an inbox holds: beyond, they are dropped, rather than let a
    /// thread that does not receive (between jobs) hold the mbufs every thread and the
    /// receive ring draw from.
    inbox_limit: usize,
    /// Each thread's UDP port, by thread index.
    ports: Vec<u16>,
    poll: PollMode,
    /// Datagrams lost here: an inbox full, or no mbuf to write one into.
    dropped: AtomicU64,
}

impl Drop for Shared {
    fn drop(&mut self) {
        let counters: Vec<_> = (0..self.stations.len()).map(|queue| self.station(queue).counters()).collect();
        let dropped = self.dropped.load(Ordering::Relaxed);
        tracing::debug!(?counters, dropped, "DPDK port closed");
    }
}

impl Shared {
    fn station(&self, queue: usize) -> MutexGuard<'_, Station> {
        self.stations[queue].lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The station of `queue` unless another thread holds it (polling it, say).
    fn try_station(&self, queue: usize) -> Option<MutexGuard<'_, Station>> {
        match self.stations[queue].try_lock() {
            Ok(station) => Some(station),
            Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    fn inbox(&self, thread: usize) -> MutexGuard<'_, Vec<Datagram>> {
        self.inboxes[thread].lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// One worker thread's share of the port.
pub struct DpdkTransport {
    shared: Arc<Shared>,
    thread: usize,
    /// The queue this thread sends on, and polls first.
    queue: usize,
    /// Holds this thread's UDP port in the kernel, and keeps the kernel quiet about it.
    reservation: PortReservation,
    /// This side's and the switch's MAC and UDP address, once connected.
    route: Option<Route>,
    /// The datagram [`Transport::send_buffer`] lent last.
    lent: Option<OutgoingDatagram>,
    /// Where [`Transport::send_buffer`] writes when the pool is empty: the datagram is
    /// then lost, as on a congested link, and recovered as any loss is.
    spare: Vec<u8>,
    outgoing: Vec<Frame>,
    received: Vec<Datagram>,
    /// Last, so that it is dropped after every frame above: the last allocator of a
    /// pool frees it, if every frame is back.
    allocator: FrameAllocator,
}

#[derive(Debug, Clone, Copy)]
struct Route {
    source: (MacAddr, SocketAddrV4),
    switch: (MacAddr, SocketAddrV4),
}

/// The transports of `config`'s DPDK port, one per worker thread.
pub fn transports(config: &Config) -> Result<Vec<Box<dyn SwitchTransport>>, Error> {
    let dpdk = &config.dpdk;
    let ip = match dpdk.ip {
        IpAddr::V4(ip) => ip,
        IpAddr::V6(ip) => {
            return Err(Error::InvalidConfig(format!(
                "backend.dpdk.ip {ip}: the DPDK backend speaks IPv4 only"
            )))
        }
    };
    let threads = usize::from(config.general.num_worker_threads);
    let stations = Station::start(dpdk, "backend.dpdk", ip, threads as u16).map_err(|error| match error {
        DpdkError::NoDevice { .. } => Error::InvalidConfig(error.to_string()),
        error => Error::Backend(format!("backend.dpdk: {error}")),
    })?;
    check_packet_fits(config, &stations[0])?;
    let reservations = (0..threads)
        .map(|_| PortReservation::new(ip, 0))
        .collect::<io::Result<Vec<_>>>()
        .map_err(|source| Error::io("reserving the DPDK worker threads' UDP ports", source))?;
    let allocator = stations[0].allocator();
    let queues = stations.len();
    let shared = Arc::new(Shared {
        stations: stations.into_iter().map(Mutex::new).collect(),
        inboxes: (0..threads).map(|_| Mutex::new(Vec::new())).collect(),
        // A thread's window of results, and as many again for duplicates, within a
        // quarter of the pool.
        inbox_limit: (usize::from(config.slots_per_thread()) * 2)
            .min(dpdk.pool_size as usize / 4 / threads)
            .max(1),
        ports: reservations.iter().map(PortReservation::port).collect(),
        poll: dpdk.poll,
        dropped: AtomicU64::new(0),
    });
    Ok(reservations
        .into_iter()
        .enumerate()
        .map(|(thread, reservation)| {
            Box::new(DpdkTransport {
                shared: Arc::clone(&shared),
                thread,
                queue: thread % queues,
                reservation,
                route: None,
                lent: None,
                spare: Vec::new(),
                outgoing: Vec::new(),
                received: Vec::new(),
                allocator: allocator.clone(),
            }) as Box<dyn SwitchTransport>
        })
        .collect())
}

/// Refuses a packet size whose datagrams would not fit the port's frames.
fn check_packet_fits(config: &Config, station: &Station) -> Result<(), Error> {
    let numel = usize::from(config.general.packet_numel);
    let datagram = packet::datagram_len(numel);
    let room = station.max_payload();
    if datagram <= room {
        return Ok(());
    }
    Err(Error::InvalidConfig(format!(
        "general.packet_numel {numel} makes {datagram}-byte datagrams, but DPDK device '{}' (MTU {}) carries \
         at most {room} bytes of UDP payload: the largest packet_numel that fits is {}",
        station.port().device(),
        station.port().mtu(),
        packet::elements_within(room)
    )))
}

impl DpdkTransport {
    /// Polls one burst of this thread's queue, then of each other queue no one is
    /// polling, delivering what arrives.
    fn poll_queues(&mut self, route: &Route) {
        let shared = &*self.shared;
        let (received, thread) = (&mut self.received, self.thread);
        let queues = shared.stations.len();
        for queue in (0..queues).map(|offset| (self.queue + offset) % queues) {
            let station =
                if queue == self.queue { Some(shared.station(queue)) } else { shared.try_station(queue) };
            if let Some(mut station) = station {
                station.poll(&mut |datagram| Self::deliver(shared, route, received, thread, datagram));
            }
        }
    }

    fn route(&self) -> io::Result<Route> {
        self.route.ok_or_else(|| {
            io::Error::new(io::ErrorKind::NotConnected, "the DPDK transport has no switch address yet")
        })
    }

    /// Hands `datagram` to this thread or, if another's, to its inbox; drops datagrams
    /// from anywhere but the switch.
    fn deliver(shared: &Shared, route: &Route, own: &mut Vec<Datagram>, thread: usize, datagram: Datagram) {
        if datagram.source != route.switch.1 {
            return;
        }
        match shared.ports.iter().position(|&port| port == datagram.port) {
            Some(index) if index == thread => own.push(datagram),
            Some(index) => {
                let mut inbox = shared.inbox(index);
                if inbox.len() < shared.inbox_limit {
                    inbox.push(datagram);
                } else {
                    shared.dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
            None => {}
        }
    }
}

impl Transport for DpdkTransport {
    fn describe(&self) -> String {
        let station = self.shared.station(self.queue);
        let port = station.port();
        let (queues, threads) = (self.shared.stations.len(), self.shared.ports.len());
        format!(
            "dpdk: device {} (MAC {}, MTU {}) at {}:{}, {threads} threads on {queues} queue{}",
            port.device(),
            port.mac(),
            port.mtu(),
            station.ip(),
            self.reservation.port(),
            if queues == 1 { "" } else { "s" }
        )
    }

    fn send_buffer(&mut self, len: usize) -> &mut [u8] {
        self.lent = OutgoingDatagram::new(&self.allocator, len);
        match &mut self.lent {
            Some(datagram) => &mut datagram.payload_mut()[..len],
            None => {
                self.spare.resize(len, 0);
                &mut self.spare
            }
        }
    }

    fn send(&mut self, len: usize) -> io::Result<()> {
        let route = self.route()?;
        match self.lent.take() {
            Some(datagram) => self.outgoing.push(datagram.finish(len, route.source, route.switch)),
            None => _ = self.shared.dropped.fetch_add(1, Ordering::Relaxed),
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        if !self.outgoing.is_empty() {
            self.shared.station(self.queue).transmit(&mut self.outgoing);
        }
        Ok(())
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        let route = self.route()?;
        let idle = IdleWait::new(timeout, self.shared.poll == PollMode::Adaptive);
        loop {
            std::mem::swap(&mut self.received, &mut *self.shared.inbox(self.thread));
            if self.received.is_empty() {
                self.poll_queues(&route);
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
}

impl DpdkTransport {
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

impl SwitchTransport for DpdkTransport {
    /// An unspecified address, unless configured: the switch takes the one this side's
    /// registration comes from, which is the station's where the DPDK port shares its
    /// interface with the kernel.
    fn endpoint(&self) -> Endpoint {
        let ip = self.shared.station(self.queue).ip();
        Endpoint::Udp(SocketAddr::V4(SocketAddrV4::new(ip, self.reservation.port())))
    }

    fn connect(&mut self, switch: &Endpoint, control: ControlAddresses) -> io::Result<()> {
        let refused = |message: String| io::Error::new(io::ErrorKind::Unsupported, message);
        let Some(SocketAddr::V4(switch)) = switch.udp_address(control.switch) else {
            return Err(refused(format!("the switch's data path is {switch}, not UDP over IPv4")));
        };
        let shared = &*self.shared;
        if shared.station(self.queue).ip().is_unspecified() {
            let IpAddr::V4(local) = control.local else {
                return Err(refused(format!(
                    "the control connection leaves from {}, not an IPv4 address: set backend.dpdk.ip",
                    control.local
                )));
            };
            (0..shared.stations.len()).for_each(|queue| shared.station(queue).set_ip(local));
        }
        let mac = self.resolve(*switch.ip()).map_err(|error| {
            let ip = shared.station(self.queue).ip();
            let hint = if ip.is_loopback() {
                format!(" (this side's address is {ip}, the control connection's: set backend.dpdk.ip)")
            } else {
                String::new()
            };
            io::Error::new(io::ErrorKind::HostUnreachable, format!("{error}{hint}"))
        })?;
        let station = shared.station(self.queue);
        let source = (station.mac(), SocketAddrV4::new(station.ip(), shared.ports[self.thread]));
        self.route = Some(Route { source, switch: (mac, switch) });
        Ok(())
    }
}
