//! The DPDK port: the data path on a DPDK device, kernel bypassed, answering the same
//! UDP datagrams a kernel socket would, so that UDP and DPDK workers alike reach it.
//! Workers are addressed by their UDP address, as [`super::UdpPort`] addresses them;
//! their MACs are learned from the frames they send. The endpoint is a
//! [`netagg_dpdk::PortEndpoint`]; this module maps `[switch.dpdk]` onto it and makes it a
//! [`DataPort`].

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use netagg_dpdk::PortEndpoint;
use netagg_wire::Endpoint;

use super::{DataPort, ThreadLink};

pub struct DpdkPort(PortEndpoint);

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
        let endpoint = PortEndpoint::open(&dpdk.settings("switch.dpdk"), ip, settings.data.port())
            .map_err(|error| error.to_string())?;
        let port = endpoint.port();
        tracing::info!(
            device = port.device(),
            mac = %port.mac(),
            mtu = port.mtu(),
            address = %endpoint.local_address(),
            "data path on a DPDK port"
        );
        Ok(DpdkPort(endpoint))
    }
}

impl Drop for DpdkPort {
    fn drop(&mut self) {
        let counters = self.0.counters();
        tracing::info!(?counters, "DPDK port closed");
    }
}

impl DataPort for DpdkPort {
    type Address = SocketAddr;

    fn endpoint(&self) -> Endpoint {
        Endpoint::Udp(SocketAddr::V4(self.0.local_address()))
    }

    fn resolve(&mut self, endpoint: &Endpoint, peer: IpAddr, _: ThreadLink) -> Result<SocketAddr, String> {
        let address = super::udp_peer(endpoint, peer)?;
        match address {
            SocketAddr::V4(_) => Ok(address),
            SocketAddr::V6(_) => Err(format!("{endpoint} is IPv6; the DPDK data path speaks IPv4 only")),
        }
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(SocketAddr, &[u8])) -> io::Result<usize> {
        Ok(self.0.recv(timeout, |source, payload| sink(SocketAddr::V4(source), payload)))
    }

    fn send(&mut self, destination: SocketAddr, datagram: &[u8]) {
        // `resolve` gives only IPv4 addresses.
        let SocketAddr::V4(destination) = destination else { return };
        self.0.send(destination, datagram);
    }

    fn flush(&mut self) {
        self.0.flush();
    }

    fn max_datagram(&self) -> Option<usize> {
        Some(self.0.max_payload())
    }
}
