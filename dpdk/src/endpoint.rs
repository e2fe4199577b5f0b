//! A UDP endpoint with a port to itself, polled by one thread: netagg's switch on a DPDK
//! port, which answers whoever sends to it, by UDP address.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

use crate::{DpdkError, IdleWait, PollMode, Port, PortReservation, Settings, Station, StationCounters};

/// The one UDP endpoint on a port: a station on its one queue, at a UDP port the kernel
/// holds for it.
pub struct PortEndpoint {
    station: Station,
    /// Holds the UDP port in the kernel and keeps the kernel quiet about it.
    reservation: PortReservation,
    poll: PollMode,
}

impl PortEndpoint {
    /// Starts EAL and the port of `settings` with one queue, and the endpoint at `ip` and
    /// UDP port `udp_port` (0: a free one).
    pub fn open(settings: &Settings, ip: Ipv4Addr, udp_port: u16) -> Result<PortEndpoint, DpdkError> {
        let station = Station::start(settings, ip, 1)?.pop().expect("a port has a queue");
        let reservation = PortReservation::new(ip, udp_port)?;
        Ok(PortEndpoint { station, reservation, poll: settings.poll })
    }

    pub fn local_address(&self) -> SocketAddrV4 {
        SocketAddrV4::new(self.station.ip(), self.reservation.port())
    }

    pub fn port(&self) -> &Port {
        self.station.port()
    }

    pub fn counters(&self) -> StationCounters {
        self.station.counters()
    }

    /// The longest UDP payload that leaves in one frame.
    pub fn max_payload(&self) -> usize {
        self.station.max_payload()
    }

    /// Waits up to `timeout` for datagrams to this endpoint's UDP port and hands each,
    /// with its source, to `sink`; returns how many arrived (0 when the time ran out).
    pub fn recv(&mut self, timeout: Duration, mut sink: impl FnMut(SocketAddrV4, &[u8])) -> usize {
        let port = self.reservation.port();
        let idle = IdleWait::new(timeout, self.poll);
        loop {
            let mut handed = 0;
            self.station.poll(&mut |datagram| {
                if datagram.port == port {
                    sink(datagram.source, datagram.payload());
                    handed += 1;
                }
            });
            if handed > 0 || !idle.pause() {
                return handed;
            }
        }
    }

    /// Queues a copy of `datagram` to `destination`; it leaves at
    /// [`PortEndpoint::flush`] or when a burst is full. An empty pool or an unknown MAC
    /// (asked for meanwhile) loses it, as a congested link would.
    pub fn send(&mut self, destination: SocketAddrV4, datagram: &[u8]) {
        let Some(mut outgoing) = self.station.datagram(datagram.len()) else { return };
        outgoing.payload_mut()[..datagram.len()].copy_from_slice(datagram);
        self.station.send(outgoing, datagram.len(), self.reservation.port(), destination);
    }

    pub fn flush(&mut self) {
        self.station.flush();
    }
}
