//! The DPDK port: the data path on a DPDK device, kernel bypassed, answering the same
//! UDP datagrams a kernel socket would, so that UDP and DPDK workers alike reach it.
//! Workers are addressed by their UDP address, as [`super::UdpPort`] addresses them;
//! their MACs are learned from the frames they send.

use std::io;
use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::time::Duration;

use netagg_config::PollMode;
use netagg_dpdk::{IdleWait, PortReservation, Station};
use netagg_wire::Endpoint;

use super::{DataPort, ThreadLink};

pub struct DpdkPort {
    station: Station,
    /// Holds the data port in the kernel and keeps the kernel quiet about it.
    reservation: PortReservation,
    poll: PollMode,
}

impl DpdkPort {
    /// Starts EAL and the `[switch.dpdk]` port, at `switch.dpdk.ip` (else
    /// `switch.data`'s address) and `switch.data`'s UDP port (0: a free one).
    pub fn open(settings: &netagg_config::Switch) -> Result<DpdkPort, String> {
        let dpdk = &settings.dpdk;
        let ip = match (dpdk.ip, settings.data.ip()) {
            (IpAddr::V4(ip), _) if !ip.is_unspecified() => ip,
            (IpAddr::V4(_), IpAddr::V4(ip)) if !ip.is_unspecified() => ip,
            _ => {
                return Err(format!(
                    "the DPDK data path needs its IPv4 address: set switch.dpdk.ip or switch.data (now {} and {})",
                    dpdk.ip, settings.data
                ))
            }
        };
        // One queue: the data path is one thread.
        let station = Station::start(dpdk, "switch.dpdk", ip, 1)
            .map_err(|error| error.to_string())?
            .pop()
            .expect("a port has a queue");
        let reservation = PortReservation::new(ip, settings.data.port())
            .map_err(|error| format!("cannot reserve UDP port {} at {ip}: {error}", settings.data.port()))?;
        let port = station.port();
        tracing::info!(
            device = port.device(),
            mac = %port.mac(),
            mtu = port.mtu(),
            address = %SocketAddrV4::new(ip, reservation.port()),
            "data path on a DPDK port"
        );
        Ok(DpdkPort { station, reservation, poll: dpdk.poll })
    }

    fn local(&self) -> SocketAddrV4 {
        SocketAddrV4::new(self.station.ip(), self.reservation.port())
    }
}

impl Drop for DpdkPort {
    fn drop(&mut self) {
        let counters = self.station.counters();
        tracing::info!(?counters, "DPDK port closed");
    }
}

impl DataPort for DpdkPort {
    type Address = SocketAddr;

    fn endpoint(&self) -> Endpoint {
        Endpoint::Udp(SocketAddr::V4(self.local()))
    }

    fn resolve(&mut self, endpoint: &Endpoint, peer: IpAddr, _: ThreadLink) -> Result<SocketAddr, String> {
        let address = super::udp_peer(endpoint, peer)?;
        match address {
            SocketAddr::V4(_) => Ok(address),
            SocketAddr::V6(_) => Err(format!("{endpoint} is IPv6; the DPDK data path speaks IPv4 only")),
        }
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(SocketAddr, &[u8])) -> io::Result<usize> {
        let port = self.reservation.port();
        let idle = IdleWait::new(timeout, self.poll == PollMode::Adaptive);
        loop {
            let mut handed = 0;
            self.station.poll(&mut |datagram| {
                if datagram.port == port {
                    sink(SocketAddr::V4(datagram.source), datagram.payload());
                    handed += 1;
                }
            });
            if handed > 0 || !idle.pause() {
                return Ok(handed);
            }
        }
    }

    fn send(&mut self, destination: SocketAddr, datagram: &[u8]) {
        let SocketAddr::V4(destination) = destination else { return };
        // An empty pool or an unknown MAC loses the datagram, as a congested link would.
        let Some(mut outgoing) = self.station.datagram(datagram.len()) else { return };
        outgoing.payload_mut()[..datagram.len()].copy_from_slice(datagram);
        self.station.send(outgoing, datagram.len(), self.reservation.port(), destination);
    }

    fn flush(&mut self) {
        self.station.flush();
    }

    fn max_datagram(&self) -> Option<usize> {
        Some(self.station.max_payload())
    }
}
