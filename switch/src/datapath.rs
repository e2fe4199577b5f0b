//! The data path: one thread that owns the engine and the UDP socket.
//!
//! It receives in batches (recvmmsg, and GRO where the kernel coalesces datagrams), hands
//! each datagram to the engine, and sends the results of a batch to each worker thread's
//! socket as one GSO send. The control plane talks to it through a channel of
//! [`Command`]s, which it drains between batches; the receive timeout bounds how long
//! that can wait, and keeps an idle switch asleep instead of spinning.
//!
//! With `[switch.faults]` (or `--faults`) set, datagrams pass through a
//! [`FaultInjector`] on the way in and another on the way out: the switch then drops,
//! duplicates, reorders, delays or corrupts on purpose, like SwitchML's
//! `set_drop_probabilities(ingress, egress)`.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use netagg_aggregator::engine::{EngineCounters, SessionCounters};
use netagg_aggregator::faults::{FaultCounters, FaultInjector};
use netagg_aggregator::{Engine, EngineLimits, Recipient, SessionError, SessionId, SessionSpec, Verdict};
use netagg_udp::{BatchSocket, SegmentBatch};
use netagg_wire::MAX_DATAGRAM_LEN;
use rustc_hash::FxHashMap;

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
    Open { spec: SessionSpec, token: u64, peers: Peers, reply: Sender<Result<SessionId, SessionError>> },
    Close { id: SessionId, reply: Sender<Option<SessionCounters>> },
    Counters { reply: Sender<Counters> },
    Shutdown,
}

/// A snapshot of the data path's counters.
pub struct Counters {
    pub engine: EngineCounters,
    pub sessions: Vec<(SessionId, SessionCounters)>,
    /// What fault injection did to datagrams received and sent, if it is on.
    pub faults: Option<(FaultCounters, FaultCounters)>,
}

/// What the data path tells the control plane on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The session received nothing for the idle timeout and was closed.
    Expired(SessionId),
}

pub struct DataPath {
    socket: BatchSocket,
    /// Faults injected into datagrams received, by source.
    ingress: FaultInjector<SocketAddr>,
    board: Switchboard,
    commands: Receiver<Command>,
    events: Sender<Event>,
}

/// Everything but the socket, so that datagrams are handled while the socket still
/// holds them.
struct Switchboard {
    engine: Engine,
    peers: FxHashMap<SessionId, Peers>,
    /// Faults injected into results sent, by destination.
    egress: FaultInjector<SocketAddr>,
    outbox: Outbox,
}

/// Results waiting to be sent, batched by destination.
struct Outbox {
    /// Results of the current receive call, by destination, sent together after it.
    outgoing: FxHashMap<SocketAddr, SegmentBatch>,
    /// Batches that filled up during the current receive call, sent first after it.
    full: Vec<(SocketAddr, SegmentBatch)>,
    max_segments: usize,
}

impl Outbox {
    fn push(&mut self, destination: SocketAddr, datagram: &[u8]) {
        let max_segments = self.max_segments;
        let batch = self.outgoing.entry(destination).or_insert_with(|| SegmentBatch::new(max_segments));
        if !batch.accepts(datagram.len()) {
            self.full.push((destination, std::mem::replace(batch, SegmentBatch::new(max_segments))));
        }
        batch.push(datagram);
    }
}

impl DataPath {
    pub fn new(
        socket: BatchSocket,
        limits: EngineLimits,
        faults: &netagg_config::Faults,
        commands: Receiver<Command>,
        events: Sender<Event>,
    ) -> DataPath {
        let board = Switchboard {
            engine: Engine::new(limits),
            peers: FxHashMap::default(),
            egress: FaultInjector::new(faults.send, !faults.seed),
            outbox: Outbox {
                outgoing: FxHashMap::default(),
                full: Vec::new(),
                max_segments: socket.max_segments(),
            },
        };
        let ingress = FaultInjector::new(faults.receive, faults.seed);
        DataPath { socket, ingress, board, commands, events }
    }

    /// Runs until a [`Command::Shutdown`] arrives or the command channel closes.
    pub fn run(mut self) -> io::Result<()> {
        let mut out = vec![0u8; MAX_DATAGRAM_LEN];
        let mut next_timer_check = Instant::now();
        loop {
            if !self.drain_commands() {
                return Ok(());
            }
            let board = &mut self.board;
            let ingress = &mut self.ingress;
            // Wake up for held datagrams too (only fault injection holds any).
            let due = [ingress.next_release(), board.egress.next_release()].into_iter().flatten().min();
            let wait =
                due.map_or(IDLE_WAKEUP, |due| due.saturating_duration_since(Instant::now()).min(IDLE_WAKEUP));
            // One clock read per batch: its datagrams arrived together.
            let mut arrived = None;
            self.socket.recv(wait, |source, datagram| {
                let now = *arrived.get_or_insert_with(Instant::now);
                ingress.push(now, source, datagram, |source, datagram| {
                    board.handle(now, source, datagram, &mut out)
                });
            })?;
            let now = Instant::now();
            ingress.release(now, |source, datagram| board.handle(now, source, datagram, &mut out));
            let outbox = &mut board.outbox;
            board.egress.release(now, |destination, datagram| outbox.push(destination, datagram));
            self.flush();
            let now = Instant::now();
            if now >= next_timer_check {
                for id in self.board.engine.handle_timeout(now) {
                    self.board.forget(id);
                    tracing::info!(session = format_args!("{:#010x}", id.0), "session expired: idle");
                    let _ = self.events.send(Event::Expired(id));
                }
                next_timer_check = now + IDLE_WAKEUP;
            }
        }
    }

    /// Sends every result of the last receive call, one GSO batch per destination.
    fn flush(&mut self) {
        for (destination, batch) in self.board.outbox.full.drain(..) {
            send(&self.socket, destination, &batch);
        }
        for (destination, batch) in
            self.board.outbox.outgoing.iter_mut().filter(|(_, batch)| !batch.is_empty())
        {
            send(&self.socket, *destination, batch);
            batch.clear();
        }
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
                Command::Open { spec, token, peers, reply } => {
                    let result = self.board.engine.open_session(Instant::now(), spec, token);
                    if let Ok(id) = result {
                        self.board.peers.insert(id, peers);
                    }
                    let _ = reply.send(result);
                }
                Command::Close { id, reply } => {
                    self.board.forget(id);
                    let _ = reply.send(self.board.engine.close_session(id).ok());
                }
                Command::Counters { reply } => {
                    let sessions = self
                        .board
                        .engine
                        .sessions()
                        .filter_map(|id| Some((id, self.board.engine.session(id)?.1)))
                        .collect();
                    let faults = (self.ingress.rates().is_active() || self.board.egress.rates().is_active())
                        .then(|| (*self.ingress.counters(), *self.board.egress.counters()));
                    let _ = reply.send(Counters { engine: *self.board.engine.counters(), sessions, faults });
                }
                Command::Shutdown => return false,
            }
        }
    }
}

fn send(socket: &BatchSocket, destination: SocketAddr, batch: &SegmentBatch) {
    if let Err(error) = socket.send(destination, batch) {
        // Results that cannot leave are lost like on a congested link; the workers'
        // retransmissions recover them.
        tracing::debug!(%error, %destination, "send failed");
    }
}

impl Switchboard {
    fn handle(&mut self, now: Instant, source: SocketAddr, datagram: &[u8], out: &mut [u8]) {
        let peers = &self.peers;
        // A rank's packets for a slot come from the socket of its thread owning the slot:
        // anything else is forged or misdirected, whatever it says.
        let from_its_rank = |session, rank, slot| {
            peers.get(&session).and_then(|p: &Peers| p.address(rank, slot)) == Some(source)
        };
        let transmit = match self.engine.handle_datagram_from(now, datagram, out, from_its_rank) {
            Verdict::Send(transmit) => transmit,
            Verdict::Consumed => return,
            Verdict::Dropped(reason) => {
                tracing::trace!(%reason, "datagram dropped");
                return;
            }
        };
        let Some(peers) = self.peers.get(&transmit.session) else { return };
        let result = &out[..transmit.len];
        let slot = netagg_wire::Packet::new_unchecked(result).slot();
        let ranks = match transmit.recipient {
            Recipient::All => 0..peers.workers.len() as u16,
            Recipient::Worker(rank) => rank..rank + 1,
        };
        let outbox = &mut self.outbox;
        for destination in ranks.filter_map(|rank| peers.address(rank, slot)) {
            self.egress
                .push(now, destination, result, |destination, datagram| outbox.push(destination, datagram));
        }
    }

    /// Drops a closed session's addresses and their send batches.
    fn forget(&mut self, id: SessionId) {
        let Some(peers) = self.peers.remove(&id) else { return };
        for (ip, ports) in peers.workers {
            for port in ports {
                self.outbox.outgoing.remove(&SocketAddr::new(ip, port));
            }
        }
    }
}
