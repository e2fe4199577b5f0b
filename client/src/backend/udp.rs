//! The UDP backend: one socket per worker thread, batched system calls.
//!
//! A worker thread's packets are written straight into GSO batches of an [`Outbox`], one
//! group per switch endpoint, and leave together at the thread's flush; its results
//! arrive through recvmmsg and GRO ([`netagg_udp::BatchSocket`]), so a window of packets
//! costs a system call or two each way rather than one a datagram. A sparse job's answers mix data packets
//! with header-only acks and empty contributions; the outbox keeps a batch for each size
//! rather than one that would leave at every change of size (about 4 datagrams a call,
//! against 46 in a dense job). The switches' slot split gives a thread's contiguous slots
//! to as few endpoints as it can, so batches stay long.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use netagg_udp::outbox::Lent;
use netagg_udp::{BatchSocket, Outbox};
use netagg_wire::Endpoint;

use super::{DataPaths, SwitchTransport, Transport};

/// A worker thread's socket, bound before registration so its port can be announced.
pub struct UdpTransport {
    socket: BatchSocket,
    local: SocketAddr,
    /// The switches' data addresses, in [`DataPaths::endpoints`] order, and which takes
    /// each datagram; `None` until connected.
    switch: Option<(Vec<SocketAddr>, DataPaths)>,
    /// Datagrams queued for the next flush, by the index of their switch address.
    outbox: Outbox<usize, SocketAddr>,
    /// Where the datagram being written was lent room: the batch of the path the last
    /// one took, which it most likely takes too.
    lent: Lent<usize>,
    last_path: usize,
}

impl UdpTransport {
    /// Binds a socket at `ip` on a free port; `socket_buffer` sizes its kernel buffers
    /// (0: default).
    pub fn bind(ip: IpAddr, socket_buffer: usize) -> io::Result<UdpTransport> {
        let socket = BatchSocket::bind(SocketAddr::new(ip, 0), socket_buffer)?;
        let local = socket.local_addr()?;
        let outbox = Outbox::new(socket.max_segments());
        Ok(UdpTransport { socket, local, switch: None, outbox, lent: Lent::SCRATCH, last_path: 0 })
    }
}

fn not_connected() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "the UDP transport has no switch address yet")
}

impl Transport for UdpTransport {
    fn describe(&self) -> String {
        format!("udp: a kernel socket at {}", self.local)
    }

    fn send_buffer(&mut self, len: usize) -> &mut [u8] {
        let path = self.last_path;
        let (lent, room) = match &self.switch {
            Some((addresses, _)) => self.outbox.room(Some(path), || vec![addresses[path]]),
            None => self.outbox.room(None, Vec::new),
        };
        self.lent = lent;
        &mut room[..len]
    }

    fn send(&mut self, len: usize) -> io::Result<()> {
        let Some((addresses, paths)) = &self.switch else {
            return Err(not_connected());
        };
        let path = paths.owner(self.outbox.written(self.lent, len));
        self.outbox.commit(self.lent, len, path, || vec![addresses[path]]);
        self.last_path = path;
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        let batches = self.outbox.batches();
        let result =
            self.socket.send_all(batches.flat_map(|(to, batch)| to.iter().map(move |&to| (to, batch))));
        self.outbox.clear();
        result
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        match &self.switch {
            // Connected: the kernel takes datagrams from the one data address only.
            Some((addresses, _)) if addresses.len() > 1 => self.socket.recv(timeout, |source, datagram| {
                if addresses.contains(&source) {
                    sink(datagram);
                }
            }),
            _ => self.socket.recv(timeout, |_, datagram| sink(datagram)),
        }
    }
}

impl SwitchTransport for UdpTransport {
    fn endpoint(&self) -> Endpoint {
        Endpoint::Udp(self.local)
    }

    fn connect(&mut self, paths: &DataPaths) -> io::Result<()> {
        let addresses = paths
            .endpoints()
            .map(|(endpoint, control)| {
                endpoint.udp_address(control.switch).ok_or_else(|| {
                    let message = format!("the switch's data path is {endpoint}, not UDP");
                    io::Error::new(io::ErrorKind::Unsupported, message)
                })
            })
            .collect::<io::Result<Vec<_>>>()?;
        // One data address: the kernel accepts datagrams from it only. With several, the
        // socket stays unconnected and `recv` keeps theirs.
        if let [one] = addresses[..] {
            self.socket.connect(one)?;
        }
        // Queued for addresses of before, if any: their groups go with them.
        self.outbox.retain(|_| false);
        (self.lent, self.last_path) = (Lent::SCRATCH, 0);
        self.switch = Some((addresses, paths.clone()));
        Ok(())
    }
}
