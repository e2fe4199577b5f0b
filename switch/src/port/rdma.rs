//! The RDMA port: each worker thread connects one reliable queue pair through rdma_cm
//! to the switch's listener, and its datagrams arrive as RDMA SEND messages.
//!
//! A worker thread registers an [`Endpoint::Rdma`] with a tag of its own choosing;
//! once its session opens, it connects, and its connection request carries the tag
//! ([`netagg_wire::control::rdma_hello`]). Resolving an endpoint therefore only names
//! the thread ([`RdmaPeer`]) and awaits its tag; the connection that brings the tag
//! becomes the thread's. A request with a tag no session awaits is refused with a
//! reason. Until its connection arrives, a thread's results are dropped, as on a link
//! not yet up, and its retransmissions recover them.
//!
//! Each connection has its own completion queues, and in event mode its own completion
//! channel: waiting means one `poll` over every channel and the listener.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use netagg_rdma::{Connection, Listener, Options, Wait};
use netagg_wire::control::rdma_hello_tag;
use netagg_wire::Endpoint;
use rustc_hash::FxHashMap;

use super::{DataPort, ThreadLink};

/// How often a busy data path looks for connection requests.
const REQUEST_CHECK_INTERVAL: Duration = Duration::from_millis(1);

/// A worker thread, as the RDMA port names it: a number given when its session opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RdmaPeer(u32);

/// A thread resolved but not yet connected.
struct Awaited {
    peer: RdmaPeer,
    /// Its buffers: their size (its session's longest datagram, or the configured
    /// size) and how many (twice its window, or the configured depth if more).
    options: Options,
}

pub struct RdmaPort {
    listener: Listener,
    local: SocketAddr,
    /// Depth and wait of every connection; its message size is per session.
    options: Options,
    /// The configured message size, 0 for each session's own.
    message_size: usize,
    awaited: FxHashMap<u64, Awaited>,
    connections: FxHashMap<RdmaPeer, Connection>,
    next_peer: u32,
    /// Connections with sends queued since the last flush.
    queued: Vec<RdmaPeer>,
    /// Results dropped for want of a send buffer or a connection.
    dropped: u64,
    last_request_check: Instant,
}

impl RdmaPort {
    /// Listens through rdma_cm at `switch.data` (its address replaced by the named
    /// device's, if `[switch.rdma]` names one).
    pub fn open(settings: &netagg_config::Switch) -> Result<RdmaPort, String> {
        let rdma = &settings.rdma;
        let ip = netagg_rdma::settings::local_ip(rdma, "switch.rdma").map_err(|error| error.to_string())?;
        let address = SocketAddr::new(ip.unwrap_or(settings.data.ip()), settings.data.port());
        let listener =
            Listener::bind(address).map_err(|error| format!("cannot listen at {address}: {error}"))?;
        let local = listener.local_addr().map_err(|error| error.to_string())?;
        tracing::info!(address = %local, device = rdma.device, poll = %rdma.poll, "data path on RDMA");
        Ok(RdmaPort {
            listener,
            local,
            options: netagg_rdma::settings::options(rdma, rdma.message_size),
            message_size: rdma.message_size,
            awaited: FxHashMap::default(),
            connections: FxHashMap::default(),
            next_peer: 0,
            queued: Vec::new(),
            dropped: 0,
            last_request_check: Instant::now(),
        })
    }

    /// Accepts every connection request waiting, or refuses it.
    fn answer_requests(&mut self) -> io::Result<()> {
        self.last_request_check = Instant::now();
        while let Some(request) = self.listener.request(Duration::ZERO)? {
            let Some(tag) = rdma_hello_tag(request.private()) else {
                request.reject("not a netagg worker of this version");
                continue;
            };
            let Some(awaited) = self.awaited.remove(&tag) else {
                request.reject("no open session awaits this connection");
                continue;
            };
            match request.accept(awaited.options) {
                Ok(connection) => {
                    tracing::debug!(peer = awaited.peer.0, "worker thread connected");
                    self.connections.insert(awaited.peer, connection);
                }
                Err(error) => tracing::warn!(%error, "cannot accept a worker thread's connection"),
            }
        }
        Ok(())
    }

    /// Runs `operation` on every connection; a connection for which it fails (its peer
    /// gone) is dropped. Returns the sum of what it returned.
    fn for_each_connection(
        &mut self,
        mut operation: impl FnMut(RdmaPeer, &mut Connection) -> io::Result<usize>,
    ) -> usize {
        let mut total = 0;
        let mut failed = Vec::new();
        for (&peer, connection) in &mut self.connections {
            match operation(peer, connection) {
                Ok(count) => total += count,
                Err(error) => failed.push((peer, error)),
            }
        }
        for (peer, error) in failed {
            self.close(peer, &error);
        }
        total
    }

    /// Drops a connection that failed (its peer gone, a completion failed).
    fn close(&mut self, peer: RdmaPeer, error: &io::Error) {
        tracing::info!(peer = peer.0, %error, "worker thread's connection closed");
        self.connections.remove(&peer);
    }

    /// Hands what every connection received to `sink`.
    fn poll_all(&mut self, sink: &mut dyn FnMut(RdmaPeer, &[u8])) -> usize {
        self.for_each_connection(|peer, connection| connection.poll(&mut |datagram| sink(peer, datagram)))
    }

    /// Sleeps until a connection or the listener has something, or `timeout` passes;
    /// hands over what arrived before the connections were armed.
    fn sleep(&mut self, timeout: Duration, sink: &mut dyn FnMut(RdmaPeer, &[u8])) -> io::Result<usize> {
        self.for_each_connection(|_, connection| connection.arm().map(|()| 0));
        // What arrived before arming signals nothing: look once more.
        let count = self.poll_all(sink);
        if count > 0 {
            return Ok(count);
        }
        let fds = self.connections.values().flat_map(Connection::wait_fds).chain([self.listener.fd()]);
        netagg_rdma::sleep_until_readable(fds.collect::<Vec<_>>(), timeout)?;
        self.for_each_connection(|_, connection| connection.woken().map(|()| 0));
        Ok(0)
    }
}

impl DataPort for RdmaPort {
    type Address = RdmaPeer;

    fn endpoint(&self) -> Endpoint {
        Endpoint::Rdma { address: self.local, tag: 0 }
    }

    fn resolve(&mut self, endpoint: &Endpoint, _peer: IpAddr, link: ThreadLink) -> Result<RdmaPeer, String> {
        let Endpoint::Rdma { tag, .. } = *endpoint else {
            return Err(format!("{endpoint} is not an RDMA endpoint"));
        };
        if self.awaited.contains_key(&tag) {
            return Err(format!("{endpoint} is registered twice"));
        }
        let peer = RdmaPeer(self.next_peer);
        self.next_peer = self.next_peer.wrapping_add(1);
        let options = Options {
            message_size: if self.message_size == 0 { link.datagram_len } else { self.message_size },
            // Room for the thread's window and as much again in retransmissions, so that
            // its sends never wait for a receive to be posted.
            depth: self.options.depth.max(2 * link.window),
            ..self.options
        };
        self.awaited.insert(tag, Awaited { peer, options });
        Ok(peer)
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(RdmaPeer, &[u8])) -> io::Result<usize> {
        let deadline = Instant::now() + timeout;
        self.answer_requests()?;
        loop {
            let count = self.poll_all(sink);
            if count > 0 {
                return Ok(count);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(0);
            }
            if self.options.wait == Wait::Event {
                let count = self.sleep(deadline - now, sink)?;
                if count > 0 {
                    return Ok(count);
                }
                self.answer_requests()?;
            } else {
                self.for_each_connection(|_, connection| connection.check_peer().map(|()| 0));
                if now.duration_since(self.last_request_check) >= REQUEST_CHECK_INTERVAL {
                    self.answer_requests()?;
                }
                std::hint::spin_loop();
            }
        }
    }

    fn send(&mut self, destination: RdmaPeer, datagram: &[u8]) {
        let Some(connection) = self.connections.get_mut(&destination) else {
            self.dropped += 1;
            return;
        };
        match connection.try_queue_copy(datagram) {
            Ok(true) => {
                if !self.queued.contains(&destination) {
                    self.queued.push(destination);
                }
            }
            // No free buffer, or a datagram longer than this thread's buffers: lost.
            Ok(false) => self.dropped += 1,
            Err(error) if error.kind() == io::ErrorKind::InvalidInput => self.dropped += 1,
            Err(error) => self.close(destination, &error),
        }
    }

    fn flush(&mut self) {
        // Only the connections with sends queued: this runs after every receive call.
        for peer in std::mem::take(&mut self.queued) {
            if let Some(Err(error)) = self.connections.get_mut(&peer).map(Connection::flush) {
                self.close(peer, &error);
            }
        }
    }

    fn max_datagram(&self) -> Option<usize> {
        (self.message_size > 0).then_some(self.message_size)
    }

    fn forget(&mut self, address: RdmaPeer) {
        self.connections.remove(&address);
        self.awaited.retain(|_, awaited| awaited.peer != address);
        self.queued.retain(|&peer| peer != address);
    }
}
