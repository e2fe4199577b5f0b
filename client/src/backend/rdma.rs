//! The RDMA backend: one reliable connection (an RC queue pair) per worker thread to the
//! switch's RDMA port, set up through rdma_cm once the session is open.
//!
//! A thread writes each datagram straight into a registered send buffer, and a window's
//! datagrams leave as one chain of SEND work requests at the flush; results arrive in
//! registered receive buffers and are handed over in place. RC delivers in order and
//! retransmits in the NIC, so the protocol core's own retransmissions only run when a
//! peer is gone, and then the connection reports it: a connection that fails fails the
//! thread's jobs at once, with an error naming the switch and the cause.

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use netagg_config::Config;
use netagg_rdma::{Connection, Options};
use netagg_wire::{packet, Endpoint};

use super::{DataPaths, SwitchTransport, Transport};
use crate::Error;

/// How long a lent send buffer is waited for while every one is in flight: far beyond
/// what RC's own retries take, so that only a stuck queue pair ends up here.
const SEND_BUFFER_WAIT: Duration = Duration::from_secs(5);

/// The transports of `config`'s `[backend.rdma]`, one per worker thread, not yet
/// connected: an error now if the buffers cannot hold a datagram, or this host has no
/// RDMA device, or not the one named.
pub fn transports(config: &Config) -> Result<Vec<Box<dyn SwitchTransport>>, Error> {
    let rdma = &config.rdma;
    let numel = usize::from(config.general.packet_numel);
    let datagram = packet::datagram_len(numel);
    let message_size = match rdma.message_size {
        0 => datagram,
        size if size >= datagram => size,
        size => {
            return Err(Error::InvalidConfig(format!(
                "backend.rdma.message_size {size} is smaller than the {datagram}-byte datagrams of \
                 general.packet_numel {numel}: set 0 to fit them, or at least {datagram}"
            )))
        }
    };
    let settings = rdma.settings();
    let local = netagg_rdma::settings::local_ip(&settings, "backend.rdma")
        .map_err(|error| Error::Backend(format!("backend.rdma: {error}")))?;
    // Room for the thread's window of results and its retransmissions' answers.
    let options = netagg_rdma::settings::options(&settings, message_size)
        .with_window(usize::from(config.slots_per_thread()));
    let threads = usize::from(config.general.num_worker_threads);
    Ok((0..threads)
        .map(|_| {
            Box::new(RdmaTransport {
                local,
                // Unguessable: whoever brings it gets this thread's results.
                tag: rand::RngCore::next_u64(&mut rand::rngs::OsRng),
                options,
                connect_timeout: config.general.connect_timeout,
                connection: None,
                switch: None,
                failed: None,
                scratch: Vec::new(),
            }) as Box<dyn SwitchTransport>
        })
        .collect())
}

pub struct RdmaTransport {
    /// The address connections leave from, if a device is named.
    local: Option<IpAddr>,
    /// Announced at registration and carried by the connection request.
    tag: u64,
    options: Options,
    connect_timeout: Duration,
    connection: Option<Connection>,
    /// The switch's data address the connection goes to, for errors.
    switch: Option<SocketAddr>,
    /// Why the last send buffer could not be lent, reported by the send that follows.
    failed: Option<io::Error>,
    /// Where a datagram is written when no send buffer can be lent.
    scratch: Vec<u8>,
}

fn not_connected() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "the RDMA transport is not connected to the switch yet")
}

impl RdmaTransport {
    /// The connection, and what to say of its errors: which switch it goes to.
    fn connected(&mut self) -> io::Result<(&mut Connection, impl Fn(io::Error) -> io::Error)> {
        let switch = self.switch;
        let connection = self.connection.as_mut().ok_or_else(not_connected)?;
        Ok((connection, move |error: io::Error| at_switch(switch, error)))
    }
}

/// `error` of the connection to the switch at `switch`, saying so.
fn at_switch(switch: Option<SocketAddr>, error: io::Error) -> io::Error {
    match switch {
        Some(switch) => io::Error::new(
            error.kind(),
            format!("the RDMA connection to the switch at {switch} failed: {error}"),
        ),
        None => error,
    }
}

impl Transport for RdmaTransport {
    fn describe(&self) -> String {
        match &self.connection {
            Some(connection) => format!(
                "rdma: an RC queue pair on {}, {}-byte messages, {} deep",
                connection.device_name(),
                self.options.message_size,
                self.options.depth
            ),
            None => "rdma: not connected".into(),
        }
    }

    fn send_buffer(&mut self, len: usize) -> &mut [u8] {
        // The driver asks for a buffer even when it then has nothing to send: an error
        // of an earlier lend that no send reported is stale now.
        self.failed = None;
        let switch = self.switch;
        let lent = match self.connection.as_mut() {
            Some(connection) => {
                connection.send_buffer(SEND_BUFFER_WAIT).map_err(|error| at_switch(switch, error))
            }
            None => Err(not_connected()),
        };
        // The trait lends without failing: the error waits for the send.
        match lent {
            Ok(buffer) if buffer.len() >= len => return buffer,
            Ok(_) => {
                let message =
                    format!("a datagram of {len} bytes; the buffers hold {}", self.options.message_size);
                self.failed = Some(io::Error::new(io::ErrorKind::InvalidInput, message));
            }
            Err(error) => self.failed = Some(error),
        }
        self.scratch.resize(len, 0);
        &mut self.scratch
    }

    fn send(&mut self, len: usize) -> io::Result<()> {
        if let Some(error) = self.failed.take() {
            return Err(error);
        }
        let (connection, at_switch) = self.connected()?;
        connection.queue(len).map_err(at_switch)
    }

    fn flush(&mut self) -> io::Result<()> {
        let (connection, at_switch) = self.connected()?;
        connection.flush().map_err(at_switch)
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        let (connection, at_switch) = self.connected()?;
        connection.recv(timeout, sink).map_err(at_switch)
    }

    fn sever(&mut self) {
        if let Some(Err(error)) = self.connection.as_mut().map(Connection::break_queue_pair) {
            tracing::warn!(%error, "cannot break the connection to the switch");
        }
    }
}

impl SwitchTransport for RdmaTransport {
    fn endpoint(&self) -> Endpoint {
        let ip = self.local.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        Endpoint::Rdma { address: SocketAddr::new(ip, 0), tag: self.tag }
    }

    fn connect(&mut self, paths: &DataPaths) -> io::Result<()> {
        let (switch, control) = paths.single("rdma")?;
        let Endpoint::Rdma { .. } = switch else {
            let message = format!("the switch's data path is {switch}, not RDMA");
            return Err(io::Error::new(io::ErrorKind::Unsupported, message));
        };
        let address = switch.address(control.switch);
        let connection =
            netagg_rdma::tagged::connect(address, self.local, self.tag, self.connect_timeout, self.options)?;
        self.connection = Some(connection);
        self.switch = Some(address);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a host whose kernel has no RDMA (this one, and CI's): the error that says so,
    /// how to get a device, and that UDP needs none, before anything else is tried.
    #[test]
    fn without_an_rdma_device_the_transports_say_so_and_how_to_get_one() {
        if std::path::Path::new("/sys/class/infiniband").exists() {
            return; // A host with RDMA devices: the VM tests cover it.
        }
        let mut config = Config::default();
        config.general.backend = netagg_config::BackendKind::Rdma;
        let Err(Error::Backend(message)) = transports(&config) else { panic!("no device, no transports") };
        assert!(
            message.starts_with("backend.rdma: no RDMA device: this kernel has no RDMA support"),
            "{message}"
        );
        assert!(message.contains("rdma link add rxe0 type rxe netdev eth0"), "{message}");
        assert!(message.contains("backend = udp needs none"), "{message}");
    }

    #[test]
    fn a_message_size_below_the_datagram_s_is_refused_with_the_size_that_fits() {
        let mut config = Config::default();
        config.rdma.message_size = 1000;
        let Err(Error::InvalidConfig(message)) = transports(&config) else {
            panic!("too small a size accepted")
        };
        assert_eq!(
            message,
            "backend.rdma.message_size 1000 is smaller than the 1076-byte datagrams of general.packet_numel 256: \
             set 0 to fit them, or at least 1076"
        );
    }
}
