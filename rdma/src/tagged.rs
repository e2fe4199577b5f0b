//! Connections bound to peers by a tag: a peer announces a tag of its own choosing
//! elsewhere (netagg's registration), then connects with the tag in its request's
//! private data ([`netagg_wire::control::rdma_hello`]); the listening side binds the
//! connection that brings a tag to the peer that announced it, and refuses the rest.
//!
//! [`Tags`] is that matching, without verbs, so that it is tested without a device;
//! [`crate::Port`] drives it with a listener, and [`connect`] is the peer's side.

use std::collections::hash_map::Entry;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use netagg_wire::control::{rdma_hello, rdma_hello_tag};
use rustc_hash::FxHashMap;

use crate::{Connection, Options};

/// A peer, as the listening side names it: a number given when its tag is announced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Peer(u32);

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Why a connection request is refused: the reason its peer is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("not a netagg worker of this version")]
    NotAWorker,
    #[error("no open session awaits this connection")]
    NotAwaited,
}

/// A tag announced while a peer that announced it still awaits its connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("tag {0:#018x} is awaited already")]
pub struct TagTaken(pub u64);

/// The tags announced whose connections have not come yet, each with its peer and the
/// options its connection is to have.
#[derive(Debug, Default)]
pub struct Tags {
    awaited: FxHashMap<u64, (Peer, Options)>,
    next_peer: u32,
}

impl Tags {
    /// Awaits a connection that brings `tag`, for a new peer whose connection is to have
    /// `options`; returns the peer.
    pub fn expect(&mut self, tag: u64, options: Options) -> Result<Peer, TagTaken> {
        let Entry::Vacant(entry) = self.awaited.entry(tag) else { return Err(TagTaken(tag)) };
        let peer = Peer(self.next_peer);
        self.next_peer = self.next_peer.wrapping_add(1);
        entry.insert((peer, options));
        Ok(peer)
    }

    /// The peer, and its connection's options, of a request that brought `private`; the
    /// tag is awaited no more. A refusal for a request without a tag, or with one that
    /// no peer awaits (any more).
    pub fn claim(&mut self, private: &[u8]) -> Result<(Peer, Options), Refusal> {
        let tag = rdma_hello_tag(private).ok_or(Refusal::NotAWorker)?;
        self.awaited.remove(&tag).ok_or(Refusal::NotAwaited)
    }

    /// `peer` awaits its connection no more.
    pub fn forget(&mut self, peer: Peer) {
        self.awaited.retain(|_, (awaited, _)| *awaited != peer);
    }
}

/// Connects to the listener at `address` as the peer that announced `tag` (from
/// `source`, if given, within `timeout`); an error names the address.
pub fn connect(
    address: SocketAddr,
    source: Option<IpAddr>,
    tag: u64,
    timeout: Duration,
    options: Options,
) -> io::Result<Connection> {
    Connection::connect(address, source, &rdma_hello(tag), timeout, options)
        .map_err(|error| io::Error::new(error.kind(), format!("RDMA connection to {address}: {error}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Wait;

    fn options(message_size: usize) -> Options {
        Options { depth: 64, message_size, wait: Wait::Event }
    }

    /// Over RoCE, private data comes padded with zeros to 56 bytes.
    fn request(tag: u64) -> Vec<u8> {
        let mut private = rdma_hello(tag).to_vec();
        private.resize(56, 0);
        private
    }

    #[test]
    fn a_request_binds_to_the_peer_that_announced_its_tag_once() {
        let mut tags = Tags::default();
        let first = tags.expect(7, options(1072)).unwrap();
        let second = tags.expect(u64::MAX, options(4096)).unwrap();
        assert_ne!(first, second);
        assert_eq!(tags.claim(&request(u64::MAX)), Ok((second, options(4096))));
        assert_eq!(tags.claim(&request(7)), Ok((first, options(1072))));
        // Claimed, a tag awaits nothing more: a second connection bringing it is refused.
        assert_eq!(tags.claim(&request(7)), Err(Refusal::NotAwaited));
    }

    #[test]
    fn a_request_without_a_tag_or_with_one_not_announced_is_refused_with_the_reason() {
        let mut tags = Tags::default();
        tags.expect(7, options(1072)).unwrap();
        assert_eq!(tags.claim(b"netagg-rdma-echo"), Err(Refusal::NotAWorker));
        assert_eq!(tags.claim(&[]), Err(Refusal::NotAWorker));
        assert_eq!(tags.claim(&request(8)), Err(Refusal::NotAwaited));
        assert_eq!(Refusal::NotAWorker.to_string(), "not a netagg worker of this version");
        assert_eq!(Refusal::NotAwaited.to_string(), "no open session awaits this connection");
        // The refusals took nothing from the peer that waits.
        assert!(tags.claim(&request(7)).is_ok());
    }

    #[test]
    fn a_tag_awaited_already_is_refused_and_a_forgotten_peer_awaits_no_more() {
        let mut tags = Tags::default();
        let peer = tags.expect(7, options(1072)).unwrap();
        assert_eq!(tags.expect(7, options(1072)), Err(TagTaken(7)));
        tags.forget(peer);
        assert_eq!(tags.claim(&request(7)), Err(Refusal::NotAwaited));
        // Forgotten, the tag may be announced again, for a new peer.
        let again = tags.expect(7, options(1072)).unwrap();
        assert_ne!(again, peer);
        assert_eq!(tags.claim(&request(7)), Ok((again, options(1072))));
    }
}
