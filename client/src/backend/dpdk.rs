//! The DPDK backend: the worker threads' datagrams leave from one DPDK port, kernel
//! bypassed, as the same UDP datagrams the UDP backend sends, so that a kernel-socket
//! switch serves them (and a DPDK switch serves UDP workers). The threads share the
//! port's queues as [`netagg_dpdk::ThreadEndpoint`]s; this module maps `[backend.dpdk]`
//! onto them and makes each a [`Transport`]. Each thread reaches every data endpoint of
//! the session (every shard's, every lane's) from the one port: each datagram goes to
//! the owner of its slot ([`DataPaths::owner`]).

use std::io;
use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::time::Duration;

use netagg_config::Config;
use netagg_dpdk::{DpdkError, ThreadEndpoint};
use netagg_wire::packet;
use netagg_wire::Endpoint;

use super::{DataPaths, SwitchTransport, Transport};
use crate::Error;

/// One worker thread's share of the port, and where its datagrams go once connected.
pub struct DpdkTransport {
    endpoint: ThreadEndpoint,
    paths: Option<DataPaths>,
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
    let window = usize::from(config.slots_per_thread());
    let endpoints = ThreadEndpoint::open(&dpdk.settings("backend.dpdk"), ip, threads, window).map_err(
        |error| match error {
            DpdkError::NoDevice { .. } => Error::InvalidConfig(error.to_string()),
            error => Error::Backend(format!("backend.dpdk: {error}")),
        },
    )?;
    check_packet_fits(config, &endpoints[0])?;
    Ok(endpoints
        .into_iter()
        .map(|endpoint| Box::new(DpdkTransport { endpoint, paths: None }) as Box<dyn SwitchTransport>)
        .collect())
}

/// Refuses a packet size whose datagrams would not fit the port's frames.
fn check_packet_fits(config: &Config, endpoint: &ThreadEndpoint) -> Result<(), Error> {
    let numel = usize::from(config.general.packet_numel);
    let datagram = packet::datagram_len(numel);
    let port = endpoint.port();
    let room = port.max_udp_payload();
    if datagram <= room {
        return Ok(());
    }
    Err(Error::InvalidConfig(format!(
        "general.packet_numel {numel} makes {datagram}-byte datagrams, but DPDK device '{}' (MTU {}) carries \
         at most {room} bytes of UDP payload: the largest packet_numel that fits is {}",
        port.device(),
        port.mtu(),
        packet::elements_within(room)
    )))
}

impl Transport for DpdkTransport {
    fn describe(&self) -> String {
        format!("dpdk: {}", self.endpoint)
    }

    fn send_buffer(&mut self, len: usize) -> &mut [u8] {
        self.endpoint.send_buffer(len)
    }

    fn send(&mut self, len: usize) -> io::Result<()> {
        // Unconnected, the endpoint refuses the datagram whatever its owner.
        let paths = self.paths.as_ref();
        self.endpoint.send(len, |datagram| paths.map_or(0, |paths| paths.owner(datagram)))
    }

    fn flush(&mut self) -> io::Result<()> {
        self.endpoint.flush();
        Ok(())
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        self.endpoint.recv(timeout, sink)
    }
}

impl SwitchTransport for DpdkTransport {
    /// An unspecified address, unless configured: the switch takes the one this side's
    /// registration comes from, which is the station's where the DPDK port shares its
    /// interface with the kernel.
    fn endpoint(&self) -> Endpoint {
        Endpoint::Udp(SocketAddr::V4(self.endpoint.local_address()))
    }

    fn connect(&mut self, paths: &DataPaths) -> io::Result<()> {
        let peers = paths
            .endpoints()
            .map(|(endpoint, control)| match endpoint.udp_address(control.switch) {
                Some(SocketAddr::V4(address)) => Ok(address),
                _ => Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("the switch's data path is {endpoint}, not UDP over IPv4"),
                )),
            })
            .collect::<io::Result<Vec<_>>>()?;
        self.endpoint.connect(&peers, local_address(paths, self.endpoint.local_address())?)?;
        self.paths = Some(paths.clone());
        Ok(())
    }
}

/// Where this side's datagrams leave from, for an endpoint at `own` (whose IP is
/// unspecified unless `backend.dpdk.ip` set one): where every control connection leaves
/// from. The port has one address, and each switch sends its results to the one its
/// registration came from, so switches reached from different addresses need the
/// address set.
fn local_address(paths: &DataPaths, own: SocketAddrV4) -> io::Result<IpAddr> {
    let first = paths.switches[0].control.local;
    let other = paths.switches.iter().map(|switch| switch.control.local).find(|&local| local != first);
    match other {
        Some(other) if own.ip().is_unspecified() => Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "the control connections to the switches leave from {first} and {other}, but a DPDK port \
                 has one address: set backend.dpdk.ip to the one every switch reaches"
            ),
        )),
        _ => Ok(first),
    }
}

#[cfg(test)]
mod tests {
    use netagg_wire::SlotSplit;

    use super::*;
    use crate::backend::{ControlAddresses, SwitchPaths};

    /// Two switches, reached from `locals`.
    fn paths(locals: [[u8; 4]; 2]) -> DataPaths {
        let switch = |local: [u8; 4], last: u8| SwitchPaths {
            endpoints: vec![Endpoint::Udp(([10, 0, 0, last], 48864).into())],
            split: SlotSplit::Ranges,
            control: ControlAddresses { switch: [10, 0, 0, last].into(), local: local.into() },
        };
        DataPaths { switches: vec![switch(locals[0], 1), switch(locals[1], 2)], slots: 8 }
    }

    #[test]
    fn a_port_takes_the_one_address_its_control_connections_leave_from_or_needs_one_set() {
        let unset = SocketAddrV4::new(std::net::Ipv4Addr::UNSPECIFIED, 40000);
        let same = local_address(&paths([[10, 0, 0, 9]; 2]), unset).unwrap();
        assert_eq!(same, IpAddr::from([10, 0, 0, 9]));
        let error = local_address(&paths([[10, 0, 0, 9], [10, 1, 0, 9]]), unset).unwrap_err();
        assert_eq!(
            error.to_string(),
            "the control connections to the switches leave from 10.0.0.9 and 10.1.0.9, but a DPDK port has \
             one address: set backend.dpdk.ip to the one every switch reaches"
        );
        // With backend.dpdk.ip set, the port keeps it and announced it: any will do.
        let set = SocketAddrV4::new([10, 0, 0, 9].into(), 40000);
        assert!(local_address(&paths([[10, 0, 0, 9], [10, 1, 0, 9]]), set).is_ok());
    }
}
