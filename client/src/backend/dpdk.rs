//! The DPDK backend: the worker threads' datagrams leave from one DPDK port, kernel
//! bypassed, as the same UDP datagrams the UDP backend sends, so that a kernel-socket
//! switch serves them (and a DPDK switch serves UDP workers).
//!
//! The port has one queue each way, shared by the context's threads: a thread writes
//! its datagrams straight into mbufs without a lock, and takes the port's lock only to
//! hand a window of them to the transmit queue, or to poll the receive queue. Whoever
//! polls delivers what arrived for other threads (each has a UDP port of its own) to
//! their inboxes, in the mbufs it came in.

use std::io;
use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use netagg_config::{Config, PollMode};
use netagg_dpdk::{
    Datagram, DpdkError, Frame, FrameAllocator, IdleWait, MacAddr, OutgoingDatagram, PortReservation, Station,
};
use netagg_wire::packet::{ELEMENT_LEN, HEADER_LEN};
use netagg_wire::Endpoint;

use super::{ControlAddresses, SwitchTransport, Transport};
use crate::Error;

/// How long connecting waits for the switch's MAC address by ARP.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(3);

/// The port, and what its threads leave each other.
struct Shared {
    station: Mutex<Station>,
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
        let counters = self.station().counters();
        let dropped = self.dropped.load(Ordering::Relaxed);
        tracing::debug!(?counters, dropped, "DPDK port closed");
    }
}

impl Shared {
    fn station(&self) -> MutexGuard<'_, Station> {
        self.station.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn inbox(&self, thread: usize) -> MutexGuard<'_, Vec<Datagram>> {
        self.inboxes[thread].lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// One worker thread's share of the port.
pub struct DpdkTransport {
    shared: Arc<Shared>,
    thread: usize,
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
    let station = Station::start(dpdk, "backend.dpdk", ip).map_err(|error| match error {
        DpdkError::NoDevice { .. } => Error::InvalidConfig(error.to_string()),
        error => Error::Backend(format!("backend.dpdk: {error}")),
    })?;
    check_packet_fits(config, &station)?;
    let threads = usize::from(config.general.num_worker_threads);
    let reservations = (0..threads)
        .map(|_| PortReservation::new(ip, 0))
        .collect::<io::Result<Vec<_>>>()
        .map_err(|source| Error::io("reserving the DPDK worker threads' UDP ports", source))?;
    let allocator = station.allocator();
    let shared = Arc::new(Shared {
        station: Mutex::new(station),
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
    let datagram = HEADER_LEN + numel * ELEMENT_LEN;
    let room = station.max_payload();
    if datagram <= room {
        return Ok(());
    }
    Err(Error::InvalidConfig(format!(
        "general.packet_numel {numel} makes {datagram}-byte datagrams, but DPDK device '{}' (MTU {}) carries \
         at most {room} bytes of UDP payload: the largest packet_numel that fits is {}",
        station.port().device(),
        station.port().mtu(),
        (room - HEADER_LEN) / ELEMENT_LEN
    )))
}

impl DpdkTransport {
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
        let station = self.shared.station();
        let port = station.port();
        format!(
            "dpdk: device {} (MAC {}, MTU {}) at {}:{}, its threads sharing one queue",
            port.device(),
            port.mac(),
            port.mtu(),
            station.ip(),
            self.reservation.port()
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
            self.shared.station().transmit(&mut self.outgoing);
        }
        Ok(())
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        let route = self.route()?;
        let idle = IdleWait::new(timeout, self.shared.poll == PollMode::Adaptive);
        loop {
            std::mem::swap(&mut self.received, &mut *self.shared.inbox(self.thread));
            if self.received.is_empty() {
                let shared = &*self.shared;
                let (received, thread) = (&mut self.received, self.thread);
                shared
                    .station()
                    .poll(&mut |datagram| Self::deliver(shared, &route, received, thread, datagram));
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

impl SwitchTransport for DpdkTransport {
    /// An unspecified address, unless configured: the switch takes the one this side's
    /// registration comes from, which is the station's where the DPDK port shares its
    /// interface with the kernel.
    fn endpoint(&self) -> Endpoint {
        let ip = self.shared.station().ip();
        Endpoint::Udp(SocketAddr::V4(SocketAddrV4::new(ip, self.reservation.port())))
    }

    fn connect(&mut self, switch: &Endpoint, control: ControlAddresses) -> io::Result<()> {
        let refused = |message: String| io::Error::new(io::ErrorKind::Unsupported, message);
        let Some(SocketAddr::V4(switch)) = switch.udp_address(control.switch) else {
            return Err(refused(format!("the switch's data path is {switch}, not UDP over IPv4")));
        };
        let mut station = self.shared.station();
        if station.ip().is_unspecified() {
            let IpAddr::V4(local) = control.local else {
                return Err(refused(format!(
                    "the control connection leaves from {}, not an IPv4 address: set backend.dpdk.ip",
                    control.local
                )));
            };
            station.set_ip(local);
        }
        let shared = &*self.shared;
        // Nothing flows before every thread is connected: whatever arrives meanwhile is
        // not for a session of this context.
        let mac = station.resolve(*switch.ip(), RESOLVE_TIMEOUT, &mut drop).map_err(|error| {
            let hint = if station.ip().is_loopback() {
                format!(
                    " (this side's address is {}, the control connection's: set backend.dpdk.ip)",
                    station.ip()
                )
            } else {
                String::new()
            };
            io::Error::new(io::ErrorKind::HostUnreachable, format!("{error}{hint}"))
        })?;
        let source = (station.mac(), SocketAddrV4::new(station.ip(), shared.ports[self.thread]));
        self.route = Some(Route { source, switch: (mac, switch) });
        Ok(())
    }
}
