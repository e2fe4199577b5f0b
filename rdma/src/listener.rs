//! Where peers connect: a listening rdma_cm id, and the requests it receives, each
//! accepted as a [`Connection`] or refused with a reason.

use std::io;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use rdma_sys::rdma_cm_event_type;

use crate::connection::{remaining, RNR_RETRIES};
use crate::verbs::cm::{CmId, EventChannel};
use crate::{Connection, Options};

/// Requests that may wait to be answered.
const BACKLOG: i32 = 64;

/// A listening rdma_cm id, where peers connect.
pub struct Listener {
    id: CmId,
}

impl Listener {
    /// Listens at `address` (an RDMA device's IP address, or the unspecified address for
    /// every device, and a port).
    pub fn bind(address: SocketAddr) -> io::Result<Listener> {
        let id = CmId::new(&EventChannel::new()?)?;
        id.listen(address, BACKLOG)?;
        Ok(Listener { id })
    }

    /// The address listened at, with the port actually bound.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.id
            .local_addr()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "rdma_cm bound no IP address"))
    }

    /// The descriptor that becomes readable when a request arrives, for a `poll` that
    /// waits on connections too.
    pub fn fd(&self) -> RawFd {
        self.id.channel().fd()
    }

    /// The next connection request, if one waits (within `timeout`); events of other
    /// kinds (an address change) are not the listener's to answer.
    pub fn request(&self, timeout: Duration) -> io::Result<Option<Request<'_>>> {
        let deadline = Instant::now().checked_add(timeout);
        while let Some(event) = self.id.channel().next(remaining(deadline))? {
            if let Some(id) = event.request {
                return Ok(Some(Request { id: Some(id), private: event.private, listener: PhantomData }));
            }
        }
        Ok(None)
    }

    /// Accepts the next connection within `timeout` and waits until it is established;
    /// returns it and the private data its peer sent.
    pub fn accept(&self, timeout: Duration, options: Options) -> io::Result<(Connection, Vec<u8>)> {
        let deadline = Instant::now().checked_add(timeout);
        let Some(request) = self.request(remaining(deadline))? else {
            return Err(io::Error::new(io::ErrorKind::TimedOut, format!("no connection within {timeout:?}")));
        };
        let private = request.private().to_vec();
        let connection = request.accept(options)?;
        connection.events().expect(rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED, remaining(deadline))?;
        Ok((connection, private))
    }
}

/// A peer's connection request, to accept or reject; dropped, it is rejected. Until
/// accepted, its id's events come to the listener's channel (which the id keeps alive);
/// the lifetime still ties it to its listener, so that a request is answered while the
/// listener that took it listens.
pub struct Request<'listener> {
    /// `None` once answered.
    id: Option<CmId>,
    private: Vec<u8>,
    listener: PhantomData<&'listener Listener>,
}

impl Request<'_> {
    /// What the peer sent with its request: over RoCE, padded with zeros to 56 bytes.
    pub fn private(&self) -> &[u8] {
        &self.private
    }

    /// Accepts the connection without waiting for it to be established: the queue pair
    /// is ready to send once this returns, and the peer's first message can only follow
    /// its own establishment.
    pub fn accept(mut self, options: Options) -> io::Result<Connection> {
        let mut id = self.id.take().expect("a request not yet answered");
        // Its own channel at once, so that its events (a disconnect) are its own; a
        // request that cannot be served is rejected, so that its peer learns it now (why:
        // memory it cannot lock, say).
        if let Err(error) = EventChannel::new().and_then(|channel| id.migrate(channel)) {
            id.reject(&error.to_string());
            return Err(error);
        }
        let id = std::sync::Arc::new(id);
        let mut connection = match Connection::make(&id, options) {
            Ok(connection) => connection,
            Err(error) => {
                id.reject(&error.to_string());
                return Err(error);
            }
        };
        id.accept(RNR_RETRIES)?;
        connection.set_established();
        Ok(connection)
    }

    /// Refuses the connection, telling the peer `reason` (its first 148 bytes, what
    /// the connection manager carries).
    pub fn reject(mut self, reason: &str) {
        self.id.take().expect("a request not yet answered").reject(reason);
    }
}

impl Drop for Request<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            id.reject("");
        }
    }
}
