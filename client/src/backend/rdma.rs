//! The RDMA backend: one reliable connection (an RC queue pair) per worker thread to each
//! switch's RDMA port (several for a session sharded over switches), set up through
//! rdma_cm once the session is open. Each datagram goes down the connection of the switch
//! owning its slot ([`DataPaths::owner`]); results come from all of them.
//!
//! A thread writes each datagram straight into a registered send buffer, and a window's
//! datagrams leave as one chain of SEND work requests at the flush; results arrive in
//! registered receive buffers and are handed over in place. RC delivers in order and
//! retransmits in the NIC, so the protocol core's own retransmissions only run when a
//! peer is gone, and then the connection reports it: a connection that fails fails the
//! thread's jobs at once, with an error naming its switch and the cause.

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
                connections: Vec::new(),
                switches: Vec::new(),
                paths: None,
                lent: None,
                next: 0,
                failed: None,
                scratch: Vec::new(),
            }) as Box<dyn SwitchTransport>
        })
        .collect())
}

pub struct RdmaTransport {
    /// The address connections leave from, if a device is named.
    local: Option<IpAddr>,
    /// Announced at registration and carried by each connection request.
    tag: u64,
    options: Options,
    connect_timeout: Duration,
    /// One connection per data endpoint of the session's switches, in
    /// [`DataPaths::endpoints`] order; empty until connected.
    connections: Vec<Connection>,
    /// The data address of each connection's switch, for errors.
    switches: Vec<SocketAddr>,
    /// Which connection takes each datagram; `None` until connected.
    paths: Option<DataPaths>,
    /// The connection whose send buffer [`Transport::send_buffer`] lent last, until sent.
    lent: Option<usize>,
    /// The connection the next send buffer is lent from: the owner of the datagram sent
    /// last, since a thread sends its slots in order and most of them to one switch.
    next: usize,
    /// Why the last send buffer could not be lent, reported by the send that follows.
    failed: Option<io::Error>,
    /// Where a datagram is written when no send buffer can be lent.
    scratch: Vec<u8>,
}

fn not_connected() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "the RDMA transport is not connected to the switch yet")
}

/// `error` of the connection to the switch at `switch`, saying so.
fn at_switch(switch: SocketAddr, error: io::Error) -> io::Error {
    io::Error::new(error.kind(), format!("the RDMA connection to the switch at {switch} failed: {error}"))
}

impl RdmaTransport {
    /// Connection `index` and what to say of its errors: which switch it goes to.
    fn connection(&mut self, index: usize) -> io::Result<(&mut Connection, impl Fn(io::Error) -> io::Error)> {
        let switch = *self.switches.get(index).ok_or_else(not_connected)?;
        Ok((&mut self.connections[index], move |error| at_switch(switch, error)))
    }

    /// Moves the datagram of `len` bytes written into connection `from`'s lent buffer to
    /// connection `to`, which owns its slot; `from`'s buffer stays lent, to be lent again.
    fn queue_elsewhere(&mut self, from: usize, to: usize, len: usize) -> io::Result<()> {
        let (switch_from, switch_to) = (self.switches[from], self.switches[to]);
        let Ok([source, target]) = self.connections.get_disjoint_mut([from, to]) else {
            unreachable!("connections {from} and {to} are distinct and exist")
        };
        let datagram = source.send_buffer(Duration::ZERO).map_err(|error| at_switch(switch_from, error))?;
        let buffer = target.send_buffer(SEND_BUFFER_WAIT).map_err(|error| at_switch(switch_to, error))?;
        // Every connection has the same options: its buffers hold what `from`'s held.
        buffer[..len].copy_from_slice(&datagram[..len]);
        target.queue(len).map_err(|error| at_switch(switch_to, error))
    }
}

impl Transport for RdmaTransport {
    fn describe(&self) -> String {
        let queue_pairs = match self.connections.len() {
            0 => return "rdma: not connected".into(),
            1 => "an RC queue pair".to_string(),
            count => format!("{count} RC queue pairs (one per switch)"),
        };
        format!(
            "rdma: {queue_pairs} on {}, {}-byte messages, {} deep",
            self.connections[0].device_name(),
            self.options.message_size,
            self.options.depth
        )
    }

    fn send_buffer(&mut self, len: usize) -> &mut [u8] {
        // The driver asks for a buffer even when it then has nothing to send: an error
        // of an earlier lend that no send reported is stale now.
        self.failed = None;
        self.lent = None;
        let index = self.next;
        let switch = self.switches.get(index).copied();
        let lent = match (self.connections.get_mut(index), switch) {
            (Some(connection), Some(switch)) => {
                connection.send_buffer(SEND_BUFFER_WAIT).map_err(|error| at_switch(switch, error))
            }
            _ => Err(not_connected()),
        };
        // The trait lends without failing: the error waits for the send.
        match lent {
            Ok(buffer) if buffer.len() >= len => {
                self.lent = Some(index);
                return buffer;
            }
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
        let Some(lent) = self.lent.take() else {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "no send buffer was lent"));
        };
        let several = self.connections.len() > 1;
        let owner = match (&self.paths, self.connections.get_mut(lent)) {
            (Some(paths), Some(connection)) if several => {
                // Lent again, the same buffer comes back at once: it holds the datagram.
                let datagram = connection
                    .send_buffer(Duration::ZERO)
                    .map_err(|error| at_switch(self.switches[lent], error))?;
                paths.owner(&datagram[..len])
            }
            _ => lent,
        };
        self.next = owner;
        if owner != lent {
            return self.queue_elsewhere(lent, owner, len);
        }
        let (connection, at_switch) = self.connection(lent)?;
        connection.queue(len).map_err(at_switch)
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.connections.is_empty() {
            return Err(not_connected());
        }
        for (connection, &switch) in self.connections.iter_mut().zip(&self.switches) {
            connection.flush().map_err(|error| at_switch(switch, error))?;
        }
        Ok(())
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        if self.connections.is_empty() {
            return Err(not_connected());
        }
        netagg_rdma::recv_any(&mut self.connections, timeout, sink).map_err(|failure| {
            match failure.connection {
                Some(index) => at_switch(self.switches[index], failure.error),
                None => failure.error,
            }
        })
    }

    fn sever(&mut self) {
        // As a failing device would: every connection at once.
        for connection in &mut self.connections {
            if let Err(error) = connection.break_queue_pair() {
                tracing::warn!(%error, "cannot break the connection to the switch");
            }
        }
    }
}

/// What the transport's reapers destroy, for their log lines.
const CONNECTIONS: &str = "RDMA connections to the switch";

impl Drop for RdmaTransport {
    /// Destroys the connections on a thread of their own, waiting at most
    /// [`netagg_rdma::reaper::FINISH_WAIT`]: a queue pair to a switch host that vanished
    /// can take tens of seconds to destroy, which would hold up the worker thread's end
    /// and so `Context::stop` long after its jobs failed. The process's exit may still
    /// wait for it.
    fn drop(&mut self) {
        netagg_rdma::reaper::reap_all(self.connections.drain(..), CONNECTIONS);
    }
}

impl SwitchTransport for RdmaTransport {
    fn endpoint(&self) -> Endpoint {
        let ip = self.local.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        Endpoint::Rdma { address: SocketAddr::new(ip, 0), tag: self.tag }
    }

    fn connect(&mut self, paths: &DataPaths) -> io::Result<()> {
        let switches = rdma_addresses(paths)?;
        // One after the other, each within the connect timeout: each error names its switch.
        let connections = switches
            .iter()
            .map(|&address| {
                netagg_rdma::tagged::connect(
                    address,
                    self.local,
                    self.tag,
                    self.connect_timeout,
                    self.options,
                )
            })
            .collect::<io::Result<Vec<_>>>()?;
        // Connections to an earlier set of switches go as the transport's own do at its
        // end: one to a host that vanished could block here for tens of seconds.
        let replaced = std::mem::replace(&mut self.connections, connections);
        netagg_rdma::reaper::reap_all(replaced, CONNECTIONS);
        self.switches = switches;
        self.paths = Some(paths.clone());
        self.next = 0;
        Ok(())
    }
}

/// The address of every data endpoint of `paths`, in [`DataPaths::endpoints`] order: the
/// connections a worker thread makes; an error naming the first endpoint that is not RDMA.
fn rdma_addresses(paths: &DataPaths) -> io::Result<Vec<SocketAddr>> {
    paths
        .endpoints()
        .map(|(endpoint, control)| match endpoint {
            Endpoint::Rdma { .. } => Ok(endpoint.address(control.switch)),
            other => {
                let message = format!("the switch's data path is {other}, not RDMA");
                Err(io::Error::new(io::ErrorKind::Unsupported, message))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use netagg_wire::{ElementType, MessageType, PacketRepr, SlotSplit};

    use super::super::{ControlAddresses, SwitchPaths};
    use super::*;

    /// A session over one switch at each of `switches`, whose accept announced `endpoint`.
    fn paths(switches: &[([u8; 4], Endpoint)]) -> DataPaths {
        let switches = switches
            .iter()
            .map(|&(ip, endpoint)| SwitchPaths {
                endpoints: vec![endpoint],
                split: SlotSplit::Ranges,
                control: ControlAddresses { switch: ip.into(), local: [10, 77, 0, 2].into() },
            })
            .collect();
        DataPaths { switches, slots: 8 }
    }

    fn rdma(ip: [u8; 4], port: u16) -> Endpoint {
        Endpoint::Rdma { address: (ip, port).into(), tag: 0 }
    }

    /// A thread connects to every switch of the session, in the order that makes
    /// [`DataPaths::owner`] index its connections; an endpoint announced without an IP
    /// is at its switch's control address.
    #[test]
    fn a_thread_connects_to_every_switch_s_data_endpoint_in_slot_order() {
        let two = paths(&[
            ([10, 77, 0, 1], rdma([0, 0, 0, 0], 48864)),
            ([10, 77, 0, 3], rdma([10, 77, 0, 4], 48865)),
        ]);
        let expected: Vec<SocketAddr> = vec![([10, 77, 0, 1], 48864).into(), ([10, 77, 0, 4], 48865).into()];
        assert_eq!(rdma_addresses(&two).unwrap(), expected);
        // Slots 0 to 3 go to the first connection, 4 to 7 to the second.
        let owners: Vec<usize> = (0..8)
            .map(|slot| {
                let repr =
                    PacketRepr { slot, ..PacketRepr::new(MessageType::Data, ElementType::Int32, 1, 2, 0) };
                let mut bytes = vec![0; repr.buffer_len()];
                repr.emit(&mut bytes).unwrap();
                two.owner(&bytes)
            })
            .collect();
        assert_eq!(owners, [0, 0, 0, 0, 1, 1, 1, 1]);
    }

    /// A switch of the session whose data path is not RDMA is refused by name before
    /// any connection is tried.
    #[test]
    fn a_switch_whose_data_path_is_not_rdma_is_refused_naming_it() {
        let udp = Endpoint::Udp(([10, 77, 0, 3], 48864).into());
        let mixed = paths(&[([10, 77, 0, 1], rdma([0, 0, 0, 0], 48864)), ([10, 77, 0, 3], udp)]);
        let error = rdma_addresses(&mixed).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::Unsupported);
        assert_eq!(error.to_string(), "the switch's data path is udp 10.77.0.3:48864, not RDMA");
    }

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
