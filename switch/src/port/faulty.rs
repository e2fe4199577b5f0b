//! A port that injects faults around any other: `[switch.faults]` or `--faults`.
//!
//! Datagrams received pass through one [`FaultInjector`] before the engine sees them,
//! results through another before the inner port sends them, so the switch drops,
//! duplicates, reorders, delays or corrupts on purpose, like SwitchML's
//! `set_drop_probabilities(ingress, egress)`. Held datagrams (delayed or reordered) come
//! out on later calls, once due; a receive never sleeps past the next of them.

use std::io;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use netagg_aggregator::faults::{FaultCounters, FaultInjector, Severance};
use netagg_wire::Endpoint;

use super::{ConnectionEnd, DataPort, ThreadLink};

pub struct FaultyPort<P: DataPort> {
    inner: P,
    /// Faults injected into datagrams received, by source.
    ingress: FaultInjector<P::Address>,
    /// Faults injected into datagrams sent, by destination.
    egress: FaultInjector<P::Address>,
    /// When the connection of a datagram's sender is severed.
    severance: Severance,
}

impl<P: DataPort> FaultyPort<P> {
    /// Wraps `inner`; the two directions draw from distinct streams of `faults.seed`.
    pub fn new(inner: P, faults: &netagg_config::Faults) -> FaultyPort<P> {
        FaultyPort {
            inner,
            ingress: FaultInjector::new(faults.receive, faults.seed),
            egress: FaultInjector::new(faults.send, !faults.seed),
            severance: Severance::after(faults.sever_after),
        }
    }

    fn release_sends(&mut self, now: Instant) {
        let inner = &mut self.inner;
        self.egress.release(now, |destination, datagram| inner.send(destination, datagram));
    }
}

impl<P: DataPort> DataPort for FaultyPort<P> {
    type Address = P::Address;

    fn endpoint(&self) -> Endpoint {
        self.inner.endpoint()
    }

    fn resolve(&mut self, endpoint: &Endpoint, peer: IpAddr, link: ThreadLink) -> Result<P::Address, String> {
        self.inner.resolve(endpoint, peer, link)
    }

    fn max_datagram(&self) -> Option<usize> {
        self.inner.max_datagram()
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(P::Address, &[u8])) -> io::Result<usize> {
        let due = [self.ingress.next_release(), self.egress.next_release()].into_iter().flatten().min();
        let wait = due.map_or(timeout, |due| due.saturating_duration_since(Instant::now()).min(timeout));
        let (ingress, severance) = (&mut self.ingress, &mut self.severance);
        let mut delivered = 0;
        let mut severed = None;
        // One clock read per batch, as the data path reads it.
        let mut arrived = None;
        self.inner.recv(wait, &mut |source, datagram| {
            if severance.count() {
                severed = Some(source);
            }
            let now = *arrived.get_or_insert_with(Instant::now);
            ingress.push(now, source, datagram, |source, datagram| {
                sink(source, datagram);
                delivered += 1;
            });
        })?;
        if let Some(source) = severed {
            tracing::warn!(?source, "fault injection: severing the connection of this datagram's sender");
            self.inner.sever(source);
        }
        let now = Instant::now();
        delivered += self.ingress.release(now, |source, datagram| sink(source, datagram));
        self.release_sends(now);
        Ok(delivered)
    }

    fn send(&mut self, destination: P::Address, datagram: &[u8]) {
        let inner = &mut self.inner;
        self.egress.push(Instant::now(), destination, datagram, |destination, datagram| {
            inner.send(destination, datagram)
        });
    }

    fn flush(&mut self) {
        self.release_sends(Instant::now());
        self.inner.flush();
    }

    fn forget(&mut self, address: P::Address) {
        self.inner.forget(address);
    }

    fn sever(&mut self, address: P::Address) {
        self.inner.sever(address);
    }

    fn take_failed(&mut self) -> Vec<(P::Address, ConnectionEnd)> {
        self.inner.take_failed()
    }

    fn fault_counters(&self) -> Option<(FaultCounters, FaultCounters)> {
        Some((*self.ingress.counters(), *self.egress.counters()))
    }
}
