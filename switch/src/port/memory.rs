//! A network in memory: sockets with UDP-style addresses that exchange datagrams through
//! channels, with no kernel in between.
//!
//! It stands in for UDP wherever a test wants the switch's data path, or a whole session,
//! without sockets: a [`MemorySocket`] is a [`DataPort`] for the switch, and a worker
//! thread's transport can be built on another socket of the same network. Endpoints are
//! [`Endpoint::Udp`] addresses, so registration works unchanged. Like UDP, a datagram to
//! an address nobody holds is lost; unlike UDP, nothing is lost otherwise (wrap a port in
//! a [`super::FaultyPort`] for that).

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use netagg_wire::Endpoint;

use super::{DataPort, ThreadLink};

type Datagram = (SocketAddr, Vec<u8>);

/// The sockets of one network, by address; clones share the network.
#[derive(Clone, Default)]
pub struct MemoryNetwork {
    inboxes: Arc<Mutex<Inboxes>>,
}

#[derive(Default)]
struct Inboxes {
    by_address: HashMap<SocketAddr, Sender<Datagram>>,
    /// The last port handed out for a bind at port 0.
    last_port: u16,
}

impl MemoryNetwork {
    pub fn new() -> MemoryNetwork {
        MemoryNetwork::default()
    }

    /// A socket at `address`; port 0 picks a free one. An address held already is
    /// refused as the kernel refuses it.
    pub fn bind(&self, mut address: SocketAddr) -> io::Result<MemorySocket> {
        let mut inboxes = self.lock();
        if address.ip().is_unspecified() {
            address.set_ip(IpAddr::V4(Ipv4Addr::LOCALHOST));
        }
        if address.port() == 0 {
            // The ports from 1024 up, in turn from the one after the last handed out.
            let last = u32::from(inboxes.last_port.max(1023));
            let free = (1..=64512)
                .map(|step| (1024 + (last + step - 1024) % 64512) as u16)
                .find(|&port| !inboxes.by_address.contains_key(&SocketAddr::new(address.ip(), port)))
                .ok_or_else(|| io::Error::new(io::ErrorKind::AddrInUse, "every port is taken"))?;
            inboxes.last_port = free;
            address.set_port(free);
        }
        if inboxes.by_address.contains_key(&address) {
            return Err(io::Error::new(io::ErrorKind::AddrInUse, format!("{address} is taken")));
        }
        let (sender, inbox) = crossbeam_channel::unbounded();
        inboxes.by_address.insert(address, sender);
        Ok(MemorySocket { address, network: self.clone(), inbox, peers: HashMap::new() })
    }

    fn lock(&self) -> MutexGuard<'_, Inboxes> {
        self.inboxes.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// One bound socket of a [`MemoryNetwork`]; dropping it frees its address.
pub struct MemorySocket {
    address: SocketAddr,
    network: MemoryNetwork,
    inbox: Receiver<Datagram>,
    /// The inboxes this socket has sent to, so that a send takes no lock.
    peers: HashMap<SocketAddr, Sender<Datagram>>,
}

impl MemorySocket {
    pub fn local_addr(&self) -> SocketAddr {
        self.address
    }

    /// Sends one datagram; to an address nobody holds, it is lost.
    pub fn send_to(&mut self, destination: SocketAddr, datagram: &[u8]) {
        let delivered = match self.peers.get(&destination) {
            Some(inbox) => inbox.send((self.address, datagram.to_vec())).is_ok(),
            None => false,
        };
        if delivered {
            return;
        }
        // A first send, or the peer's socket was dropped (and perhaps bound again).
        self.peers.remove(&destination);
        let Some(inbox) = self.network.lock().by_address.get(&destination).cloned() else { return };
        if inbox.send((self.address, datagram.to_vec())).is_ok() {
            self.peers.insert(destination, inbox);
        }
    }

    /// Waits up to `timeout` for a datagram, then hands it and every other one waiting
    /// to `sink`; returns how many.
    pub fn recv(&mut self, timeout: Duration, mut sink: impl FnMut(SocketAddr, &[u8])) -> usize {
        let Ok((source, datagram)) = self.inbox.recv_timeout(timeout) else { return 0 };
        sink(source, &datagram);
        let mut count = 1;
        for (source, datagram) in self.inbox.try_iter() {
            sink(source, &datagram);
            count += 1;
        }
        count
    }
}

impl Drop for MemorySocket {
    fn drop(&mut self) {
        self.network.lock().by_address.remove(&self.address);
    }
}

impl DataPort for MemorySocket {
    type Address = SocketAddr;

    fn endpoint(&self) -> Endpoint {
        Endpoint::Udp(self.address)
    }

    fn resolve(&mut self, endpoint: &Endpoint, peer: IpAddr, _: ThreadLink) -> Result<SocketAddr, String> {
        super::udp_peer(endpoint, peer)
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(SocketAddr, &[u8])) -> io::Result<usize> {
        Ok(MemorySocket::recv(self, timeout, sink))
    }

    fn send(&mut self, destination: SocketAddr, datagram: &[u8]) {
        self.send_to(destination, datagram);
    }

    fn flush(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datagrams_reach_the_bound_address_and_are_lost_elsewhere() {
        let network = MemoryNetwork::new();
        let mut a = network.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let mut b = network.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        assert_ne!(a.local_addr(), b.local_addr());
        let taken = network.bind(a.local_addr()).err().unwrap();
        assert_eq!(taken.kind(), io::ErrorKind::AddrInUse);
        a.send_to(b.local_addr(), b"one");
        a.send_to(b.local_addr(), b"two");
        a.send_to("127.0.0.1:9".parse().unwrap(), b"nobody");
        let mut received = Vec::new();
        assert_eq!(b.recv(Duration::from_secs(1), |from, d| received.push((from, d.to_vec()))), 2);
        assert_eq!(received, [(a.local_addr(), b"one".to_vec()), (a.local_addr(), b"two".to_vec())]);
        assert_eq!(b.recv(Duration::from_millis(10), |_, _| panic!("nothing was sent")), 0);

        // A dropped socket's address is free again, and its old senders reach the new one.
        let address = b.local_addr();
        drop(b);
        a.send_to(address, b"lost");
        let mut again = network.bind(address).unwrap();
        a.send_to(address, b"three");
        let mut received = Vec::new();
        again.recv(Duration::from_secs(1), |_, d| received.push(d.to_vec()));
        assert_eq!(received, [b"three".to_vec()]);
    }
}
