//! The dummy backend: no network. An in-process engine answers every packet as if all
//! workers had sent the same data, and the thread sleeps to emulate a link's bandwidth.
//!
//! Each data or ack packet is fed to a private engine once per rank of the session, so
//! the result is exactly what the switch would return if every worker held this
//! worker's tensor: dense and sparse jobs and the whole worker-side protocol run as they
//! would over a network.

use std::io;
use std::time::{Duration, Instant};

use netagg_aggregator::{Engine, EngineLimits, SessionId, SessionSpec, Verdict};
use netagg_wire::{Packet, MAX_DATAGRAM_LEN};

use super::Transport;

pub struct DummyTransport {
    engine: Engine,
    workers: u16,
    process_packets: bool,
    /// Emulated link: bits per second, 0 for none.
    bits_per_second: f64,
    /// When the emulated link has delivered everything sent so far.
    link_free_at: Instant,
    /// The engine's clock: read once per batch of results, not per packet (the engine
    /// needs it only for idle sessions, which this one never is).
    engine_now: Instant,
    /// Results not yet received, back to back, and where each ends: one buffer reused
    /// for every packet rather than an allocation per result.
    results: Vec<u8>,
    result_ends: Vec<usize>,
    scratch: Vec<u8>,
    out: Vec<u8>,
}

impl DummyTransport {
    /// A session token for [`DummyTransport::new`], drawn as the switch draws one.
    pub fn new_token() -> u64 {
        rand::RngCore::next_u64(&mut rand::rngs::OsRng)
    }

    /// A transport for one worker thread; `spec` and `token` are the session every
    /// thread shares.
    pub fn new(
        spec: SessionSpec,
        token: u64,
        bandwidth_mbps: f64,
        process_packets: bool,
    ) -> Result<(DummyTransport, SessionId), String> {
        let mut engine =
            Engine::new(EngineLimits { session_idle_timeout: Duration::MAX, ..EngineLimits::default() });
        let session = engine.open_session(Instant::now(), spec, token).map_err(|e| e.to_string())?;
        let transport = DummyTransport {
            engine,
            workers: spec.workers,
            process_packets,
            bits_per_second: bandwidth_mbps * 1e6,
            link_free_at: Instant::now(),
            engine_now: Instant::now(),
            results: Vec::new(),
            result_ends: Vec::new(),
            scratch: vec![0; MAX_DATAGRAM_LEN],
            out: vec![0; MAX_DATAGRAM_LEN],
        };
        Ok((transport, session))
    }
}

impl Transport for DummyTransport {
    fn send(&mut self, datagram: &[u8]) -> io::Result<()> {
        if self.bits_per_second > 0.0 {
            let wire_time = Duration::from_secs_f64(datagram.len() as f64 * 8.0 / self.bits_per_second);
            self.link_free_at = self.link_free_at.max(Instant::now()) + wire_time;
        }
        let Ok(packet) = Packet::new_checked(datagram) else {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "dummy backend: malformed packet"));
        };
        if !self.process_packets {
            // Returned unchanged but for its type: the payload is this worker's alone.
            if packet.message_type() == netagg_wire::MessageType::Data {
                let start = self.results.len();
                self.results.extend_from_slice(datagram);
                let mut view = Packet::new_unchecked(&mut self.results[start..]);
                view.set_message_type(netagg_wire::MessageType::Result);
                view.set_rank(netagg_wire::packet::BROADCAST_RANK);
                self.result_ends.push(self.results.len());
            }
            return Ok(());
        }
        let len = datagram.len();
        self.scratch[..len].copy_from_slice(datagram);
        let own_rank = packet.rank();
        for rank in 0..self.workers {
            Packet::new_unchecked(&mut self.scratch[..len]).set_rank(rank);
            if let Verdict::Send(transmit) =
                self.engine.handle_datagram(self.engine_now, &self.scratch[..len], &mut self.out)
            {
                // Broadcasts reach this worker; of the unicasts (one per emulated rank)
                // only its own is meant for it.
                let recipient = Packet::new_unchecked(&self.out[..transmit.len]).rank();
                if recipient == netagg_wire::packet::BROADCAST_RANK || recipient == own_rank {
                    self.results.extend_from_slice(&self.out[..transmit.len]);
                    self.result_ends.push(self.results.len());
                }
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        if self.result_ends.is_empty() {
            std::thread::sleep(timeout.min(Duration::from_millis(1)));
            return Ok(0);
        }
        if self.bits_per_second > 0.0 {
            let wait = self.link_free_at.saturating_duration_since(Instant::now());
            if !wait.is_zero() {
                std::thread::sleep(wait.min(timeout));
                if Instant::now() < self.link_free_at {
                    return Ok(0);
                }
            }
        }
        let mut start = 0;
        for &end in &self.result_ends {
            sink(&self.results[start..end]);
            start = end;
        }
        let delivered = self.result_ends.len();
        self.engine_now = Instant::now();
        self.results.clear();
        self.result_ends.clear();
        Ok(delivered)
    }
}
