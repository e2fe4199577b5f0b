//! The RDMA port: each worker thread connects one reliable queue pair through rdma_cm
//! to the switch's listener, and its datagrams arrive as RDMA SEND messages.
//!
//! A worker thread registers an [`Endpoint::Rdma`] with a tag of its own choosing;
//! once its session opens, it connects, and its connection request carries the tag.
//! Resolving an endpoint therefore only names the thread (a [`Peer`]) and awaits its
//! tag; [`netagg_rdma::Port`] binds the connection that brings the tag to the thread,
//! and refuses the rest with a reason. Until its connection arrives, a thread's results
//! are dropped, as on a link not yet up, and its retransmissions recover them. This
//! module only maps `[switch.rdma]` and the sessions' links onto that port.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use netagg_rdma::tagged::Peer;
use netagg_rdma::{Closed, Options, Port};
use netagg_wire::Endpoint;

use super::{ConnectionEnd, DataPort, ThreadLink};

pub struct RdmaPort {
    port: Port,
    /// Depth and wait of every connection; its message size is per session.
    options: Options,
    /// The configured message size, 0 for each session's own.
    message_size: usize,
}

impl RdmaPort {
    /// Listens through rdma_cm at `switch.data` (its address replaced by the named
    /// device's, if `[switch.rdma]` names one).
    pub fn open(settings: &netagg_config::Switch) -> Result<RdmaPort, String> {
        let rdma = &settings.rdma;
        let rdma_settings = rdma.settings();
        let ip = netagg_rdma::settings::local_ip(&rdma_settings, "switch.rdma")
            .map_err(|error| error.to_string())?;
        let address = SocketAddr::new(ip.unwrap_or(settings.data.ip()), settings.data.port());
        let port = Port::bind(address, rdma_settings.wait)
            .map_err(|error| format!("cannot listen at {address}: {error}"))?;
        tracing::info!(address = %port.local_addr(), device = rdma.device, poll = %rdma.poll, "data path on RDMA");
        Ok(RdmaPort {
            port,
            options: netagg_rdma::settings::options(&rdma_settings, rdma.message_size),
            message_size: rdma.message_size,
        })
    }
}

impl DataPort for RdmaPort {
    type Address = Peer;

    fn endpoint(&self) -> Endpoint {
        Endpoint::Rdma { address: self.port.local_addr(), tag: 0 }
    }

    fn resolve(&mut self, endpoint: &Endpoint, _peer: IpAddr, link: ThreadLink) -> Result<Peer, String> {
        let Endpoint::Rdma { tag, .. } = *endpoint else {
            return Err(format!("{endpoint} is not an RDMA endpoint"));
        };
        let options = Options {
            message_size: if self.message_size == 0 { link.datagram_len } else { self.message_size },
            ..self.options
        };
        // Room for the thread's window and its retransmissions.
        self.port
            .expect(tag, options.with_window(link.window))
            .map_err(|_| format!("{endpoint} is registered twice"))
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(Peer, &[u8])) -> io::Result<usize> {
        self.port.recv(timeout, sink)
    }

    fn send(&mut self, destination: Peer, datagram: &[u8]) {
        self.port.send(destination, datagram);
    }

    fn flush(&mut self) {
        self.port.flush();
    }

    fn max_datagram(&self) -> Option<usize> {
        (self.message_size > 0).then_some(self.message_size)
    }

    fn forget(&mut self, address: Peer) {
        self.port.forget(address);
    }

    fn sever(&mut self, address: Peer) {
        self.port.break_connection(address);
    }

    fn take_failed(&mut self) -> Vec<(Peer, ConnectionEnd)> {
        let ended = self.port.take_failed().into_iter();
        ended
            .map(|(peer, closed)| match closed {
                Closed::Disconnected => (peer, ConnectionEnd::Disconnected),
                Closed::Failed(why) => (peer, ConnectionEnd::Failed(why)),
            })
            .collect()
    }
}
