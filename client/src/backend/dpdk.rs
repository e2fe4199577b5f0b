//! The DPDK backend: the worker threads' datagrams leave from one DPDK port, kernel
//! bypassed, as the same UDP datagrams the UDP backend sends, so that a kernel-socket
//! switch serves them (and a DPDK switch serves UDP workers). The threads share the
//! port's queues as [`netagg_dpdk::ThreadEndpoint`]s; this module maps `[backend.dpdk]`
//! onto them and makes each a [`Transport`].

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use netagg_config::Config;
use netagg_dpdk::{DpdkError, ThreadEndpoint};
use netagg_wire::packet;
use netagg_wire::Endpoint;

use super::{DataPaths, SwitchTransport, Transport};
use crate::Error;

/// One worker thread's share of the port.
pub struct DpdkTransport(ThreadEndpoint);

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
        .map(|endpoint| Box::new(DpdkTransport(endpoint)) as Box<dyn SwitchTransport>)
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
        format!("dpdk: {}", self.0)
    }

    fn send_buffer(&mut self, len: usize) -> &mut [u8] {
        self.0.send_buffer(len)
    }

    fn send(&mut self, len: usize) -> io::Result<()> {
        self.0.send(len)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush();
        Ok(())
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        self.0.recv(timeout, sink)
    }
}

impl SwitchTransport for DpdkTransport {
    /// An unspecified address, unless configured: the switch takes the one this side's
    /// registration comes from, which is the station's where the DPDK port shares its
    /// interface with the kernel.
    fn endpoint(&self) -> Endpoint {
        Endpoint::Udp(SocketAddr::V4(self.0.local_address()))
    }

    fn connect(&mut self, paths: &DataPaths) -> io::Result<()> {
        let (switch, control) = paths.single("dpdk")?;
        let Some(SocketAddr::V4(switch)) = switch.udp_address(control.switch) else {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("the switch's data path is {switch}, not UDP over IPv4"),
            ));
        };
        self.0.connect(switch, control.local)
    }
}
