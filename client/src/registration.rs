//! Registration: the control connection to the switch, which stays open for the life of
//! the session so that the switch can say when the session ends.

use std::io;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use netagg_config::{Config, SparseMode};
use netagg_wire::{ControlMessage, ValueEncoding, WireError};

use crate::backend::{ControlAddresses, DataPaths, SwitchTransport};
use crate::driver::Shared;
use crate::Error;

/// A session the switch opened: every rank registered.
pub(crate) struct Registration {
    /// The control connection, kept open for the life of the session.
    pub control: TcpStream,
    pub session: u32,
    pub token: u64,
}

/// Registers every worker thread's endpoint with the switch, waits until every rank has,
/// and connects each transport to the switch's data endpoint.
pub(crate) fn register(
    config: &Config,
    slots: u16,
    transports: &mut [Box<dyn SwitchTransport>],
) -> Result<Registration, Error> {
    let general = &config.general;
    let target = format!("{}:{}", general.controller_ip, general.controller_port);
    let deadline = Instant::now() + general.connect_timeout;
    let mut stream = connect(&target, deadline)?;
    let _ = stream.set_nodelay(true);
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
    let failed = |source: io::Error| Error::io(format!("registration with {target}"), source);
    register.write_to(1, &mut stream).map_err(failed)?;
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left)).map_err(failed)?;
    let reply = ControlMessage::read_from(&mut stream).map_err(|error| match error.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Error::RegisterTimeout {
            waited: general.connect_timeout,
            session: general.session.clone(),
            workers: general.num_workers,
        },
        _ => match version_mismatch(&error) {
            Some((switch, library)) => Error::Version { address: target.clone(), switch, library },
            None => failed(error),
        },
    })?;
    stream.set_read_timeout(None).map_err(failed)?;
    match reply {
        (_, ControlMessage::Accept { session, token, data, split, slots, .. }) => {
            let control = ControlAddresses {
                switch: stream.peer_addr().map_err(failed)?.ip(),
                local: stream.local_addr().map_err(failed)?.ip(),
            };
            let paths = DataPaths { endpoints: data, split, slots };
            for transport in transports.iter_mut() {
                transport.connect(&paths, control).map_err(|source| {
                    Error::io(format!("connecting to the switch's data path at {paths}"), source)
                })?;
            }
            Ok(Registration { control: stream, session, token })
        }
        (_, ControlMessage::Reject { code, message }) => Err(Error::Rejected { code, message }),
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

/// Watches the control connection: the switch says so there when the session ends.
pub(crate) fn watch_session(mut stream: TcpStream, shared: Arc<Shared>) {
    // The context's span, with the rank and the session, goes along.
    let span = tracing::Span::current();
    std::thread::spawn(move || {
        let _entered = span.enter();
        let reason = match ControlMessage::read_from(&mut stream) {
            Ok((_, ControlMessage::Reject { message, .. })) => message,
            Ok((_, other)) => format!("unexpected control message {other:?}"),
            Err(error) => format!("the switch closed the control connection ({error})"),
        };
        if !shared.stopping.load(Ordering::Acquire) {
            tracing::warn!(%reason, "session lost");
            *shared.session_lost.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason);
        }
    });
}
