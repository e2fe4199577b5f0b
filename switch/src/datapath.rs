//! The data path: one thread that owns the engine and the UDP socket.
//!
//! It receives in batches (recvmmsg, and GRO where the kernel coalesces datagrams), hands
//! each datagram to the engine, and sends the results of a batch to each worker thread's
//! socket as one GSO send. The control plane talks to it through a channel of
//! [`Command`]s, which it drains between batches; the receive timeout bounds how long
//! that can wait, and keeps an idle switch asleep instead of spinning.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use netagg_aggregator::engine::{EngineCounters, SessionCounters};
use netagg_aggregator::{Engine, EngineLimits, Recipient, SessionError, SessionId, SessionSpec, Verdict};
use netagg_udp::{BatchSocket, SegmentBatch};
use netagg_wire::MAX_DATAGRAM_LEN;

/// How long the data thread sleeps in `recv` before it looks at commands and timers.
const IDLE_WAKEUP: Duration = Duration::from_millis(20);
/// Socket buffer size asked for; the kernel caps it at net.core.rmem_max / wmem_max.
pub const SOCKET_BUFFER: usize = 16 << 20;

/// Where each worker thread of a session listens.
#[derive(Debug, Clone)]
pub struct Peers {
    /// Per rank: its address and the UDP port of each of its threads.
    pub workers: Vec<(IpAddr, Vec<u16>)>,
    /// Slots of one worker thread: slot `s` belongs to thread `s / slots_per_thread`.
    pub slots_per_thread: u16,
}

impl Peers {
    fn address(&self, rank: u16, slot: u16) -> Option<SocketAddr> {
        let (ip, ports) = self.workers.get(rank as usize)?;
        let thread = (slot / self.slots_per_thread.max(1)) as usize;
        Some(SocketAddr::new(*ip, *ports.get(thread)?))
    }
}

/// Requests from the control plane.
pub enum Command {
    Open { spec: SessionSpec, peers: Peers, reply: Sender<Result<SessionId, SessionError>> },
    Close { id: SessionId, reply: Sender<Option<SessionCounters>> },
    Counters { reply: Sender<(EngineCounters, Vec<(SessionId, SessionCounters)>)> },
    Shutdown,
}

/// What the data path tells the control plane on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The session received nothing for the idle timeout and was closed.
    Expired(SessionId),
}

pub struct DataPath {
    socket: BatchSocket,
    engine: Engine,
    peers: HashMap<SessionId, Peers>,
    commands: Receiver<Command>,
    events: Sender<Event>,
    /// Results of the current receive batch, by destination, sent together after it.
    outgoing: HashMap<SocketAddr, SegmentBatch>,
    max_segments: usize,
    send_errors: u64,
}

impl DataPath {
    pub fn new(
        socket: BatchSocket,
        limits: EngineLimits,
        commands: Receiver<Command>,
        events: Sender<Event>,
    ) -> DataPath {
        let max_segments = socket.max_segments();
        DataPath {
            socket,
            engine: Engine::new(limits),
            peers: HashMap::new(),
            commands,
            events,
            outgoing: HashMap::new(),
            max_segments,
            send_errors: 0,
        }
    }

    /// Runs until a [`Command::Shutdown`] arrives or the command channel closes.
    pub fn run(mut self) -> io::Result<()> {
        let mut out = vec![0u8; MAX_DATAGRAM_LEN];
        let mut datagrams = Vec::new();
        let mut next_timer_check = Instant::now();
        loop {
            if !self.drain_commands() {
                return Ok(());
            }
            // Copied out of the socket's buffers so the engine and the socket are not
            // borrowed at once; a memcpy per datagram is cheap beside its system call.
            self.socket.recv(IDLE_WAKEUP, |_, datagram| datagrams.push(datagram.to_vec()))?;
            let now = Instant::now();
            for datagram in datagrams.drain(..) {
                self.handle(now, &datagram, &mut out);
            }
            self.flush_all();
            if now >= next_timer_check {
                for id in self.engine.handle_timeout(now) {
                    self.forget(id);
                    tracing::info!(session = format_args!("{:#010x}", id.0), "session expired: idle");
                    let _ = self.events.send(Event::Expired(id));
                }
                next_timer_check = now + IDLE_WAKEUP;
            }
        }
    }

    fn handle(&mut self, now: Instant, datagram: &[u8], out: &mut [u8]) {
        let transmit = match self.engine.handle_datagram(now, datagram, out) {
            Verdict::Send(transmit) => transmit,
            Verdict::Consumed => return,
            Verdict::Dropped(reason) => {
                tracing::trace!(%reason, "datagram dropped");
                return;
            }
        };
        let Some(peers) = self.peers.get(&transmit.session) else { return };
        let slot = netagg_wire::Packet::new_unchecked(&out[..transmit.len]).slot();
        let result = &out[..transmit.len];
        let destinations: Vec<SocketAddr> = match transmit.recipient {
            Recipient::All => {
                (0..peers.workers.len() as u16).filter_map(|rank| peers.address(rank, slot)).collect()
            }
            Recipient::Worker(rank) => peers.address(rank, slot).into_iter().collect(),
        };
        for destination in destinations {
            let accepts = self.outgoing.get(&destination).is_none_or(|batch| batch.accepts(result.len()));
            if !accepts {
                self.flush(destination);
            }
            let max_segments = self.max_segments;
            self.outgoing.entry(destination).or_insert_with(|| SegmentBatch::new(max_segments)).push(result);
        }
    }

    /// Drops a closed session's addresses and their send batches.
    fn forget(&mut self, id: SessionId) {
        let Some(peers) = self.peers.remove(&id) else { return };
        for (ip, ports) in peers.workers {
            for port in ports {
                self.outgoing.remove(&SocketAddr::new(ip, port));
            }
        }
    }

    fn flush_all(&mut self) {
        let destinations: Vec<SocketAddr> = self
            .outgoing
            .iter()
            .filter(|(_, batch)| !batch.is_empty())
            .map(|(address, _)| *address)
            .collect();
        for destination in destinations {
            self.flush(destination);
        }
    }

    fn flush(&mut self, destination: SocketAddr) {
        let Some(batch) = self.outgoing.get_mut(&destination) else { return };
        if let Err(error) = self.socket.send(destination, batch) {
            // Results that cannot leave are lost like on a congested link; the workers'
            // retransmissions recover them.
            self.send_errors += 1;
            tracing::debug!(%error, %destination, "send failed");
        }
        batch.clear();
    }

    /// Applies pending commands; false when the data path must stop.
    fn drain_commands(&mut self) -> bool {
        loop {
            let command = match self.commands.try_recv() {
                Ok(command) => command,
                Err(crossbeam_channel::TryRecvError::Empty) => return true,
                Err(crossbeam_channel::TryRecvError::Disconnected) => return false,
            };
            match command {
                Command::Open { spec, peers, reply } => {
                    let result = self.engine.open_session(Instant::now(), spec);
                    if let Ok(id) = result {
                        self.peers.insert(id, peers);
                    }
                    let _ = reply.send(result);
                }
                Command::Close { id, reply } => {
                    self.forget(id);
                    let _ = reply.send(self.engine.close_session(id).ok());
                }
                Command::Counters { reply } => {
                    let sessions = self
                        .engine
                        .sessions()
                        .filter_map(|id| Some((id, self.engine.session(id)?.1)))
                        .collect();
                    let _ = reply.send((*self.engine.counters(), sessions));
                }
                Command::Shutdown => return false,
            }
        }
    }
}
