//! What a station knows of its neighbours' MACs, aged so that a neighbour whose MAC
//! changes (an interface recreated, a NIC swapped, a VM moved) is found again.
//!
//! Every frame from a neighbour confirms its entry, without a clock reading: frames come
//! by the burst, and only a send looks at the time. A neighbour not heard from for
//! [`STALE_AFTER`] is asked again by ARP while frames still go to the MAC it had; one
//! silent for [`FORGET_AFTER`] loses its MAC, and sends to it wait for an answer. The
//! table does no I/O: it says when to ask, and the station asks.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use crate::MacAddr;

/// How long a neighbour may go unheard before it is asked again, while frames still go
/// to its MAC: well within a job's timeout, so that a session outlives a MAC change.
pub(crate) const STALE_AFTER: Duration = Duration::from_secs(1);

/// How long a neighbour may go unheard, asked all the while, before its MAC is dropped.
pub(crate) const FORGET_AFTER: Duration = Duration::from_secs(5);

/// How often a neighbour without a confirmed MAC is asked.
pub(crate) const ARP_RETRY: Duration = Duration::from_millis(100);

#[derive(Debug, Clone, Copy, Default)]
struct Entry {
    mac: Option<MacAddr>,
    /// A frame from the neighbour came since the last lookup.
    heard: bool,
    /// When a lookup last found it heard from.
    confirmed: Option<Instant>,
    asked: Option<Instant>,
}

/// The MACs of a station's neighbours, by IPv4 address.
#[derive(Debug, Default)]
pub(crate) struct Neighbours {
    entries: HashMap<Ipv4Addr, Entry>,
}

/// What a lookup found: the MAC to send to, if any, and whether to ask by ARP now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lookup {
    pub mac: Option<MacAddr>,
    pub ask: bool,
}

impl Neighbours {
    /// A frame from `ip`, sent from `mac`, arrived.
    pub fn learn(&mut self, ip: Ipv4Addr, mac: MacAddr) {
        let entry = self.entries.entry(ip).or_default();
        entry.mac = Some(mac);
        entry.heard = true;
    }

    /// The MAC of `ip` as known, without asking or ageing.
    pub fn known(&self, ip: Ipv4Addr) -> Option<MacAddr> {
        self.entries.get(&ip)?.mac
    }

    /// The MAC to send to `ip` at `now`, and whether to ask for it by ARP: if it is not
    /// known, or not heard from for [`STALE_AFTER`], at most every [`ARP_RETRY`].
    pub fn lookup(&mut self, ip: Ipv4Addr, now: Instant) -> Lookup {
        let entry = self.entries.entry(ip).or_default();
        if std::mem::take(&mut entry.heard) {
            entry.confirmed = Some(now);
        }
        let silent = entry.confirmed.map(|confirmed| now.saturating_duration_since(confirmed));
        if silent.is_some_and(|silent| silent >= FORGET_AFTER) {
            entry.mac = None;
        }
        let stale = entry.mac.is_none() || silent.is_none_or(|silent| silent >= STALE_AFTER);
        let ask = stale && entry.asked.is_none_or(|asked| now.saturating_duration_since(asked) >= ARP_RETRY);
        if ask {
            entry.asked = Some(now);
        }
        Lookup { mac: entry.mac, ask }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
    const OLD: MacAddr = MacAddr([2, 0, 0, 0, 0, 1]);
    const NEW: MacAddr = MacAddr([2, 0, 0, 0, 0, 2]);

    #[test]
    fn an_unknown_neighbour_is_asked_every_retry_until_it_answers() {
        let (mut table, start) = (Neighbours::default(), Instant::now());
        assert_eq!(table.lookup(IP, start), Lookup { mac: None, ask: true });
        assert_eq!(table.lookup(IP, start + ARP_RETRY / 2), Lookup { mac: None, ask: false });
        assert_eq!(table.lookup(IP, start + ARP_RETRY), Lookup { mac: None, ask: true });
        table.learn(IP, OLD);
        assert_eq!(table.known(IP), Some(OLD));
        assert_eq!(table.lookup(IP, start + ARP_RETRY * 2), Lookup { mac: Some(OLD), ask: false });
    }

    #[test]
    fn a_neighbour_heard_from_is_never_asked_again() {
        let (mut table, start) = (Neighbours::default(), Instant::now());
        table.learn(IP, OLD);
        for second in 0..100 {
            table.learn(IP, OLD);
            let lookup = table.lookup(IP, start + Duration::from_millis(500) * second);
            assert_eq!(lookup, Lookup { mac: Some(OLD), ask: false }, "at {second}");
        }
    }

    #[test]
    fn a_silent_neighbour_is_asked_again_then_forgotten_and_its_new_mac_learned() {
        let (mut table, start) = (Neighbours::default(), Instant::now());
        table.learn(IP, OLD);
        assert_eq!(table.lookup(IP, start), Lookup { mac: Some(OLD), ask: false });
        // Unheard for STALE_AFTER: asked again, every ARP_RETRY, frames still going to
        // the old MAC.
        let stale = start + STALE_AFTER;
        assert_eq!(table.lookup(IP, stale - ARP_RETRY), Lookup { mac: Some(OLD), ask: false });
        assert_eq!(table.lookup(IP, stale), Lookup { mac: Some(OLD), ask: true });
        assert_eq!(table.lookup(IP, stale + ARP_RETRY / 2), Lookup { mac: Some(OLD), ask: false });
        assert_eq!(table.lookup(IP, stale + ARP_RETRY), Lookup { mac: Some(OLD), ask: true });
        // Silent for FORGET_AFTER: the MAC goes.
        assert_eq!(table.lookup(IP, start + FORGET_AFTER), Lookup { mac: None, ask: true });
        // The answer from its new interface brings the new MAC, confirmed.
        table.learn(IP, NEW);
        let later = start + FORGET_AFTER + ARP_RETRY;
        assert_eq!(table.lookup(IP, later), Lookup { mac: Some(NEW), ask: false });
        assert_eq!(table.lookup(IP, later + STALE_AFTER / 2), Lookup { mac: Some(NEW), ask: false });
    }

    #[test]
    fn a_frame_from_a_new_mac_replaces_the_old_at_once() {
        let (mut table, start) = (Neighbours::default(), Instant::now());
        table.learn(IP, OLD);
        table.lookup(IP, start);
        table.learn(IP, NEW);
        assert_eq!(table.lookup(IP, start + ARP_RETRY), Lookup { mac: Some(NEW), ask: false });
    }
}
