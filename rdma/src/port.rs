//! The listening side of many tagged connections: a [`Listener`] whose connections are
//! bound to the peers that announced their tags ([`Tags`]), received from and sent to
//! as one port, as a switch's data path wants.
//!
//! Until its connection arrives, a peer's messages are dropped, as on a link not yet up.
//! Each connection has its own completion queues, and in [`Wait::Event`] its own
//! completion channel: waiting means one `poll` over every channel and the listener.
//! A connection that fails or whose peer disconnects is closed once the messages it
//! received are handed over, and [`Port::take_failed`] names its peer and how it ended,
//! for whatever depended on it.
//!
//! Connections that end, or whose peers are forgotten, are destroyed by the port's
//! [`Reaper`], never on the thread that serves the port: destroying a queue pair to a
//! peer host that vanished can block in the kernel for tens of seconds, and every other
//! peer of the port would wait with it. Dropping the port hands its last connections to
//! the reaper and waits at most [`crate::reaper::FINISH_WAIT`] for them.

use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use crate::reaper::Reaper;
use crate::tagged::{Peer, TagTaken, Tags};
use crate::{sleep_until_readable, Connection, Listener, Options, Wait};

/// How often a busy port looks for connection requests.
const REQUEST_CHECK_INTERVAL: Duration = Duration::from_millis(1);

/// How a peer's connection ended, as [`Port::take_failed`] tells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Closed {
    /// The peer disconnected, no request failing for a cause of its own: an orderly
    /// end, as of a process that closes its connection or exits.
    Disconnected,
    /// It failed (a completion or a post failed, the device went), as the message says:
    /// what the peer sent last may be lost.
    Failed(String),
}

/// A listener and the connections it accepted, each a peer's.
pub struct Port {
    listener: Listener,
    local: SocketAddr,
    /// How the port waits: every connection's [`Options::wait`] should be the same.
    wait: Wait,
    tags: Tags,
    connections: FxHashMap<Peer, Connection>,
    /// Connections with sends queued since the last flush.
    queued: Vec<Peer>,
    /// Connections that ended since [`Port::take_failed`] was last called, and how.
    failed: Vec<(Peer, Closed)>,
    last_request_check: Instant,
    /// Destroys the connections that go, away from the thread that serves the port.
    reaper: Reaper<Connection>,
}

impl Port {
    /// Listens at `address` (see [`Listener::bind`]), waiting as `wait` says.
    pub fn bind(address: SocketAddr, wait: Wait) -> io::Result<Port> {
        let listener = Listener::bind(address)?;
        let local = listener.local_addr()?;
        Ok(Port {
            listener,
            local,
            wait,
            tags: Tags::default(),
            connections: FxHashMap::default(),
            queued: Vec::new(),
            failed: Vec::new(),
            last_request_check: Instant::now(),
            reaper: Reaper::start("RDMA connections")?,
        })
    }

    /// The address listened at, with the port actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Awaits the connection of a peer that announced `tag`, to have `options`.
    pub fn expect(&mut self, tag: u64, options: Options) -> Result<Peer, TagTaken> {
        self.tags.expect(tag, options)
    }

    /// Accepts every connection request waiting, or refuses it.
    fn answer_requests(&mut self) -> io::Result<()> {
        self.last_request_check = Instant::now();
        while let Some(request) = self.listener.request(Duration::ZERO)? {
            let (peer, options) = match self.tags.claim(request.private()) {
                Ok(claimed) => claimed,
                Err(refusal) => {
                    request.reject(&refusal.to_string());
                    continue;
                }
            };
            match request.accept(options) {
                Ok(connection) => {
                    tracing::debug!(%peer, "worker thread connected");
                    self.connections.insert(peer, connection);
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
        mut operation: impl FnMut(Peer, &mut Connection) -> io::Result<usize>,
    ) -> usize {
        let mut total = 0;
        let mut failed = Vec::new();
        for (&peer, connection) in &mut self.connections {
            match operation(peer, connection) {
                Ok(count) => total += count,
                Err(error) if connection.peer_disconnected() => {
                    tracing::debug!(%peer, %error, "worker thread disconnected");
                    failed.push((peer, Closed::Disconnected));
                }
                Err(error) => {
                    tracing::info!(%peer, %error, "worker thread's connection failed");
                    failed.push((peer, Closed::Failed(error.to_string())));
                }
            }
        }
        for (peer, closed) in failed {
            self.close(peer, closed);
        }
        total
    }

    /// Drops a connection that ended (its peer gone, a completion failed), once every
    /// message it received is handed over, and keeps how for [`Port::take_failed`].
    fn close(&mut self, peer: Peer, closed: Closed) {
        self.let_go(peer);
        self.failed.push((peer, closed));
    }

    /// The peers whose connections ended since the last call, each with how: peers
    /// [`Port::forget`] let go are not among them.
    pub fn take_failed(&mut self) -> Vec<(Peer, Closed)> {
        std::mem::take(&mut self.failed)
    }

    /// Hands what every connection received to `sink`.
    fn poll_all(&mut self, sink: &mut dyn FnMut(Peer, &[u8])) -> usize {
        self.for_each_connection(|peer, connection| connection.poll(&mut |message| sink(peer, message)))
    }

    /// Sleeps until a connection or the listener has something, or `timeout` passes;
    /// hands over what arrived before the connections were armed.
    fn sleep(&mut self, timeout: Duration, sink: &mut dyn FnMut(Peer, &[u8])) -> io::Result<usize> {
        self.for_each_connection(|_, connection| connection.arm().map(|()| 0));
        // What arrived before arming signals nothing: look once more.
        let count = self.poll_all(sink);
        if count > 0 {
            return Ok(count);
        }
        let fds = self.connections.values().flat_map(Connection::wait_fds).chain([self.listener.fd()]);
        sleep_until_readable(fds.collect::<Vec<_>>(), timeout)?;
        self.for_each_connection(|_, connection| connection.woken().map(|()| 0));
        Ok(0)
    }

    /// Waits up to `timeout` for messages and hands each, with its peer, to `sink`;
    /// returns how many (0 when the time ran out). Answers connection requests
    /// meanwhile; fails only when the listener does.
    pub fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(Peer, &[u8])) -> io::Result<usize> {
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
            if self.wait == Wait::Event {
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

    /// Queues a copy of `message` for `peer`, to leave at the next [`Port::flush`]; lost
    /// if the peer has no connection or no free send buffer, the message is longer than
    /// its buffers, or the connection failed. A failed connection is closed by the next
    /// [`Port::recv`], after the messages it received before failing.
    pub fn send(&mut self, peer: Peer, message: &[u8]) {
        let Some(connection) = self.connections.get_mut(&peer) else { return };
        if let Ok(true) = connection.try_queue_copy(message) {
            if !self.queued.contains(&peer) {
                self.queued.push(peer);
            }
        }
    }

    /// Sends what is queued; what a connection cannot post is lost. A connection that
    /// failed to (but for a full send queue, which frees up) is broken by it, and the
    /// next [`Port::recv`] closes it.
    pub fn flush(&mut self) {
        // Only the connections with sends queued: this runs after every receive call.
        for peer in std::mem::take(&mut self.queued) {
            if let Some(Err(error)) = self.connections.get_mut(&peer).map(Connection::flush) {
                tracing::debug!(%peer, %error, "cannot post sends to a worker thread");
            }
        }
    }

    /// Breaks `peer`'s connection as a failing device would ([`Connection::break_queue_pair`]),
    /// to inject that fault; the next [`Port::recv`] finds it failed.
    pub fn break_connection(&mut self, peer: Peer) {
        if let Some(Err(error)) = self.connections.get_mut(&peer).map(Connection::break_queue_pair) {
            tracing::warn!(%peer, %error, "cannot break the connection");
        }
    }

    /// `peer` is done with: its connection, or the wait for it, goes.
    pub fn forget(&mut self, peer: Peer) {
        self.let_go(peer);
        self.tags.forget(peer);
        self.failed.retain(|&(failed, _)| failed != peer);
    }

    /// Hands `peer`'s connection, if it has one, to the reaper, and unqueues it.
    fn let_go(&mut self, peer: Peer) {
        if let Some(connection) = self.connections.remove(&peer) {
            self.reaper.reap(connection);
        }
        self.queued.retain(|&queued| queued != peer);
    }
}

impl Drop for Port {
    /// Hands every connection to the reaper, which the fields' drop then ends.
    fn drop(&mut self) {
        for (_, connection) in self.connections.drain() {
            self.reaper.reap(connection);
        }
    }
}
