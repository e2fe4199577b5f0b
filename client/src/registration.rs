//! Registration: the control connections to the switches, which stay open for the life
//! of the session so that each switch can say when the session ends.
//!
//! A session spread over several switches (shards, `general.switches`) registers with
//! each: every switch opens it on its own, under an id and token of its own, once every
//! rank has registered there. A rank sends every registration before it waits for any
//! answer, so no switch waits on another's barrier.

use std::io;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use netagg_aggregator::{SessionKey, SessionKeys};
use netagg_config::{Config, SparseMode};
use netagg_wire::{ControlMessage, ValueEncoding, WireError};

use crate::backend::{ControlAddresses, DataPaths, SwitchPaths, SwitchTransport};
use crate::driver::Shared;
use crate::Error;

/// One switch's open session, as this rank holds it.
pub(crate) struct SwitchSession {
    /// The switch's control address, as configured: errors name it.
    pub address: String,
    /// The control connection, kept open for the life of the session.
    pub control: TcpStream,
    /// The session id this switch assigned.
    pub session: u32,
    /// Disconnects once [`watch_session`]'s thread has ended: the switch closed the
    /// connection or said why the session ended. `None` until the watch starts.
    pub watch_ended: Option<mpsc::Receiver<()>>,
}

/// The longest [`leave`] waits for the switches to close their control connections: a
/// switch does once its data path has taken the rank's departure, in well under a
/// millisecond; one frozen or gone costs a stopping host no more than this.
const LEAVE_WAIT: Duration = Duration::from_secs(1);

/// A session every switch opened: every rank registered with each.
pub(crate) struct Registration {
    /// In `general.switches` order.
    pub switches: Vec<SwitchSession>,
    /// Each slot's switch's session id and token.
    pub keys: SessionKeys,
}

/// Registers every worker thread's endpoint with every switch, waits until every rank has,
/// and connects each transport to the switches' data endpoints.
pub(crate) fn register(
    config: &Config,
    slots: u16,
    transports: &mut [Box<dyn SwitchTransport>],
) -> Result<Registration, Error> {
    let general = &config.general;
    let addresses = config.switch_addresses();
    let deadline = Instant::now() + general.connect_timeout;
    let register = ControlMessage::Register {
        rank: general.rank,
        world_size: general.num_workers,
        packet_elements: general.packet_numel,
        slots,
        depth: general.depth,
        encoding: match general.prepostprocessor.as_str() {
            "cpu_exponent_quantizer" => ValueEncoding::BlockFloatingPoint,
            _ => ValueEncoding::Native,
        },
        sparse_blocks: general.sparse == SparseMode::Auto,
        name: general.session.clone(),
        endpoints: transports.iter().map(|transport| transport.endpoint()).collect(),
    };
    let mut streams = Vec::with_capacity(addresses.len());
    for address in &addresses {
        let mut stream = connect(address, deadline)?;
        let _ = stream.set_nodelay(true);
        register.write_to(1, &mut stream).map_err(failed(address))?;
        streams.push(stream);
    }
    let mut switches = Vec::with_capacity(addresses.len());
    let mut paths = DataPaths { switches: Vec::with_capacity(addresses.len()), slots };
    let mut keys = Vec::with_capacity(addresses.len());
    for (address, stream) in addresses.into_iter().zip(streams) {
        let (session, token, switch) = accepted(config, &address, &stream, deadline)?;
        switches.push(SwitchSession { address, control: stream, session, watch_ended: None });
        paths.switches.push(switch);
        keys.push(SessionKey { session, token });
    }
    for transport in transports.iter_mut() {
        transport.connect(&paths).map_err(|source| {
            Error::io(format!("connecting to the switches' data paths at {paths}"), source)
        })?;
    }
    // Ranges of each endpoint, not only of each switch: a probe goes to the endpoint of its
    // first slot (a lane of a switch with several data-path threads), whose progress report
    // speaks only of the slots it owns.
    let ranges = paths.endpoint_slots().map(|(switch, slots)| (slots, keys[switch]));
    // `general.switches` lists no more switches than slots (the configuration's check):
    // some range is not empty.
    let keys = SessionKeys::sharded(ranges)
        .ok_or_else(|| Error::InvalidConfig(format!("{slots} slots for {} switches", switches.len())))?;
    Ok(Registration { switches, keys })
}

/// What an I/O error of the registration with the switch at `address` becomes.
fn failed(address: &str) -> impl Fn(io::Error) -> Error + '_ {
    move |source| Error::io(format!("registration with {address}"), source)
}

/// Waits on `stream`, until `deadline`, for the switch at `address` to accept the
/// registration: its session id, token and data paths.
fn accepted(
    config: &Config,
    address: &str,
    mut stream: &TcpStream,
    deadline: Instant,
) -> Result<(u32, u64, SwitchPaths), Error> {
    let general = &config.general;
    let failed = failed(address);
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left)).map_err(&failed)?;
    let reply = ControlMessage::read_from(&mut stream).map_err(|error| match error.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Error::RegisterTimeout {
            waited: general.connect_timeout,
            session: general.session.clone(),
            workers: general.num_workers,
            switch: address.to_string(),
        },
        _ => match version_mismatch(&error) {
            Some((switch, library)) => Error::Version { address: address.to_string(), switch, library },
            None => failed(error),
        },
    })?;
    stream.set_read_timeout(None).map_err(&failed)?;
    match reply {
        (_, ControlMessage::Accept { session, token, data, split, .. }) => {
            let control = ControlAddresses {
                switch: stream.peer_addr().map_err(&failed)?.ip(),
                local: stream.local_addr().map_err(&failed)?.ip(),
            };
            Ok((session, token, SwitchPaths { endpoints: data, split, control }))
        }
        (_, ControlMessage::Reject { code, message }) => {
            let message = match shard_name(config, address) {
                None => message,
                Some(switch) => format!("{switch}: {message}"),
            };
            Err(Error::Rejected { code, message })
        }
        (_, other) => {
            Err(failed(io::Error::new(io::ErrorKind::InvalidData, format!("unexpected reply {other:?}"))))
        }
    }
}

/// Connects to the switch's control address, again and again until `deadline`: the switch
/// may still be starting.
fn connect(target: &str, deadline: Instant) -> Result<TcpStream, Error> {
    loop {
        let attempt = target
            .to_socket_addrs()
            .and_then(|mut addresses| {
                addresses.next().ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address"))
            })
            .and_then(|address| {
                let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
                TcpStream::connect_timeout(&address, left)
            });
        match attempt {
            Ok(stream) => return Ok(stream),
            Err(error) if Instant::now() + Duration::from_millis(100) < deadline => {
                tracing::debug!(%error, "switch not reachable yet");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(source) => return Err(Error::Connect { address: target.to_string(), source: source.into() }),
        }
    }
}

/// The switch's and this library's control protocol versions, if `error` says they
/// differ.
fn version_mismatch(error: &io::Error) -> Option<(u8, u8)> {
    match error.get_ref()?.downcast_ref::<WireError>()? {
        WireError::Version { found, supported } => Some((*found, *supported)),
        _ => None,
    }
}

/// How a switch's refusal or departure names it: not at all with one switch, whose
/// message says it all; by its address ("the switch at ADDRESS") when the session has
/// several, so that the user knows which.
pub(crate) fn shard_name(config: &Config, address: &str) -> Option<String> {
    (config.general.switches.len() > 1).then(|| format!("the switch at {address}"))
}

/// Watches the control connection to `switch`: the switch says so there when the session
/// ends, and a switch that dies closes it. `shard` names the switch in a reason the
/// switch gave, where the session has several ([`shard_name`]); a closed connection names
/// it by its address whatever the count.
pub(crate) fn watch_session(
    switch: &mut SwitchSession,
    shard: Option<String>,
    shared: Arc<Shared>,
) -> io::Result<()> {
    let mut stream = switch.control.try_clone()?;
    let (ended, watch_ended) = mpsc::channel::<()>();
    switch.watch_ended = Some(watch_ended);
    // The context's span, with the rank and the session, goes along.
    let span = tracing::Span::current();
    let switch = format!("the switch at {}", switch.address);
    std::thread::spawn(move || {
        let _entered = span.enter();
        // Dropped as the thread ends, which tells `leave` the connection is done with.
        let _ended = ended;
        let reason = match ControlMessage::read_from(&mut stream) {
            Ok((_, ControlMessage::Reject { message, .. })) => match &shard {
                None => message,
                Some(switch) => format!("{switch}: {message}"),
            },
            Ok((_, other)) => format!("unexpected control message {other:?} from {switch}"),
            Err(error) => {
                let waiting = match *shared.outstanding.lock().unwrap_or_else(|p| p.into_inner()) {
                    0 => String::new(),
                    1 => " while a job waited for its sums".to_string(),
                    jobs => format!(" while {jobs} jobs waited for their sums"),
                };
                format!("{switch} closed the control connection{waiting} ({error})")
            }
        };
        if !shared.stopping.load(Ordering::Acquire) {
            tracing::warn!(%reason, "session lost");
            // The first loss is the cause; the others (every switch closes the session
            // when a rank dies) follow from it.
            shared.session_lost.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(reason);
        }
    });
    Ok(())
}

/// Leaves the session on every switch of `switches`, and waits, for at most
/// [`LEAVE_WAIT`] in all, until each has closed its control connection: then the switch
/// has taken the departure, and a next process of this rank registers with no holder left
/// in its way (the switch need not guess, as it must for a client that closes at once).
pub(crate) fn leave(mut switches: Vec<SwitchSession>, rank: u16) {
    for switch in &mut switches {
        let leave = ControlMessage::Leave { session: switch.session, rank };
        // A switch that reads nothing (frozen, its receive window closed) must not hold
        // the leave up for longer than the wait.
        let bounded = switch.control.set_write_timeout(Some(LEAVE_WAIT));
        if bounded.is_err() || leave.write_to(0, &mut switch.control).is_err() {
            // Already closed: nothing to wait for.
            switch.watch_ended = None;
        }
    }
    let deadline = Instant::now() + LEAVE_WAIT;
    for switch in switches {
        if let Some(watch_ended) = &switch.watch_ended {
            let left = deadline.saturating_duration_since(Instant::now());
            if let Err(mpsc::RecvTimeoutError::Timeout) = watch_ended.recv_timeout(left) {
                tracing::debug!(switch = %switch.address, "the switch kept the control connection open after the leave");
            }
        }
        let _ = switch.control.shutdown(std::net::Shutdown::Both);
    }
}
