//! A transport that injects faults around any other: the `[faults]` section.
//!
//! Datagrams sent pass through one [`FaultInjector`], datagrams received through another,
//! before the protocol sees them; held ones (delayed or reordered) leave or arrive on
//! later calls, once due. The choices come from a seeded RNG, so a run repeats.

use std::io;
use std::time::{Duration, Instant};

use netagg_aggregator::faults::{FaultCounters, FaultInjector, Severance};
use netagg_config::{Config, Faults};

use super::Transport;

pub struct FaultyTransport {
    inner: Box<dyn Transport>,
    send: FaultInjector,
    receive: FaultInjector,
    /// Where the worker writes a datagram, before the injector decides its fate: the
    /// inner transport's buffers take only what leaves.
    outgoing: Vec<u8>,
    /// When the connection to the switch is severed.
    severance: Severance,
}

impl FaultyTransport {
    /// Wraps `inner`; `stream` (a worker thread's index) is mixed into the seed so that
    /// threads make different choices.
    pub fn new(inner: Box<dyn Transport>, faults: &Faults, stream: u64) -> FaultyTransport {
        // Distinct streams per thread and direction, repeatable for one seed.
        let seed = faults.seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        FaultyTransport {
            inner,
            send: FaultInjector::new(faults.send, seed),
            receive: FaultInjector::new(faults.receive, !seed),
            outgoing: Vec::new(),
            severance: Severance::after(faults.sever_after),
        }
    }

    /// What each direction did so far: (send, receive).
    pub fn counters(&self) -> (FaultCounters, FaultCounters) {
        (*self.send.counters(), *self.receive.counters())
    }

    /// Sends the held datagrams that are due.
    fn release_sends(&mut self, now: Instant) -> io::Result<()> {
        let mut result = Ok(());
        let inner = &mut self.inner;
        self.send.release(now, |(), datagram| {
            if result.is_ok() {
                result = inner.send_copy(datagram);
            }
        });
        result
    }
}

impl Transport for FaultyTransport {
    fn describe(&self) -> String {
        format!("{}, with faults injected", self.inner.describe())
    }

    fn send_buffer(&mut self, len: usize) -> &mut [u8] {
        if self.outgoing.len() < len {
            self.outgoing.resize(len, 0);
        }
        &mut self.outgoing
    }

    fn send(&mut self, len: usize) -> io::Result<()> {
        let mut result = Ok(());
        let inner = &mut self.inner;
        self.send.push(Instant::now(), (), &self.outgoing[..len], |(), datagram| {
            if result.is_ok() {
                result = inner.send_copy(datagram);
            }
        });
        result
    }

    fn flush(&mut self) -> io::Result<()> {
        self.release_sends(Instant::now())?;
        self.inner.flush()
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        let now = Instant::now();
        // Wake up for the next held datagram, in either direction.
        let due = [self.send.next_release(), self.receive.next_release()].into_iter().flatten().min();
        let wait = due.map_or(timeout, |due| due.saturating_duration_since(now).min(timeout));
        let (receive, severance) = (&mut self.receive, &mut self.severance);
        let mut delivered = 0;
        let mut severed = false;
        self.inner.recv(wait, &mut |datagram| {
            severed |= severance.count();
            receive.push(Instant::now(), (), datagram, |(), datagram| {
                sink(datagram);
                delivered += 1;
            });
        })?;
        if severed {
            tracing::warn!("fault injection: severing this worker thread's connection");
            self.inner.sever();
        }
        let now = Instant::now();
        delivered += self.receive.release(now, |(), datagram| sink(datagram));
        if self.send.next_release().is_some_and(|due| due <= now) {
            self.release_sends(now)?;
            self.inner.flush()?;
        }
        Ok(delivered)
    }
}

/// Wraps every transport in the fault injector of `[faults]`, if any fault is set.
pub(crate) fn with_faults(transports: Vec<Box<dyn Transport>>, config: &Config) -> Vec<Box<dyn Transport>> {
    if !config.faults.is_active() {
        return transports;
    }
    tracing::warn!(faults = ?config.faults, "injecting faults into this worker's packets");
    let rank = config.general.rank as u64;
    (0..)
        .zip(transports)
        .map(|(thread, transport)| {
            let stream = rank << 16 | thread;
            Box::new(FaultyTransport::new(transport, &config.faults, stream)) as Box<dyn Transport>
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use netagg_aggregator::faults::FaultRates;
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    /// A loopback: what is sent comes back on `recv`, and a log of what reached it.
    struct Echo {
        outgoing: Vec<u8>,
        queue: VecDeque<Vec<u8>>,
        sent: Arc<Mutex<Vec<Vec<u8>>>>,
    }

    impl Transport for Echo {
        fn send_buffer(&mut self, len: usize) -> &mut [u8] {
            self.outgoing.resize(len, 0);
            &mut self.outgoing
        }
        fn send(&mut self, len: usize) -> io::Result<()> {
            let datagram = self.outgoing[..len].to_vec();
            self.sent.lock().unwrap().push(datagram.clone());
            self.queue.push_back(datagram);
            Ok(())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
        fn recv(&mut self, _: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
            let count = self.queue.len();
            self.queue.drain(..).for_each(|d| sink(&d));
            Ok(count)
        }
        /// Logged among the datagrams sent, to see when it came.
        fn sever(&mut self) {
            self.sent.lock().unwrap().push(b"severed".to_vec());
        }
    }

    #[test]
    fn the_connection_is_severed_once_after_the_set_number_of_datagrams_received() {
        let sent = Arc::new(Mutex::new(Vec::new()));
        let echo = Echo { outgoing: Vec::new(), queue: VecDeque::new(), sent: Arc::clone(&sent) };
        let faults = Faults { sever_after: 3, ..Faults::default() };
        let mut transport = FaultyTransport::new(Box::new(echo), &faults, 0);
        for round in 0u8..2 {
            for i in 0u8..5 {
                transport.send_copy(&[round, i]).unwrap();
            }
            transport.flush().unwrap();
            let mut received = 0;
            transport.recv(Duration::ZERO, &mut |_| received += 1).unwrap();
            assert_eq!(received, 5, "severing drops nothing by itself");
        }
        let log = sent.lock().unwrap();
        let severed: Vec<usize> = (0..log.len()).filter(|&i| log[i] == b"severed").collect();
        // After the batch holding the third datagram, and never again.
        assert_eq!(severed, [5], "{log:?}");
    }

    #[test]
    fn each_direction_applies_its_own_faults_and_held_datagrams_arrive_later() {
        let sent = Arc::new(Mutex::new(Vec::new()));
        let echo = Echo { outgoing: Vec::new(), queue: VecDeque::new(), sent: Arc::clone(&sent) };
        let faults = Faults {
            send: FaultRates::dropping(0.5),
            receive: FaultRates { delay: Duration::from_millis(200), ..FaultRates::NONE },
            seed: 5,
            sever_after: 0,
        };
        let mut transport = FaultyTransport::new(Box::new(echo), &faults, 0);
        for i in 0u32..200 {
            transport.send_copy(&i.to_le_bytes()).unwrap();
        }
        transport.flush().unwrap();
        let (send, _) = transport.counters();
        assert_eq!(sent.lock().unwrap().len() as u64, 200 - send.dropped);
        assert!((70..130).contains(&send.dropped), "{send:?}");

        let mut received = Vec::new();
        let started = Instant::now();
        // Each is held for up to 200 ms: few can be due at once.
        let at_once = transport.recv(Duration::ZERO, &mut |d| received.push(d.to_vec())).unwrap();
        assert!(at_once < sent.lock().unwrap().len() / 2, "{at_once} arrived at once");
        while received.len() < sent.lock().unwrap().len() {
            assert!(started.elapsed() < Duration::from_secs(5), "held datagrams never arrived");
            transport.recv(Duration::from_millis(10), &mut |d| received.push(d.to_vec())).unwrap();
        }
        let mut expected = sent.lock().unwrap().clone();
        expected.sort();
        received.sort();
        assert_eq!(received, expected, "delayed, not lost");
        assert_eq!(transport.counters().1.delayed, expected.len() as u64);
    }
}
