//! A lower switch's control connection to its upper switch in an aggregation tree.
//!
//! When a session of its rack opens, the lower switch registers with the upper switch
//! as a worker would, under the session's name and shape, as rank `rack` of a world of
//! `racks`, announcing its own data endpoints; the upper switch's accept says where its
//! data path is and under which session and token. The connection stays open for the
//! life of the session, as a worker's does: the upper switch's reject or its closing ends
//! the rack's session ([`watch`]), and the rack's session ending closes it (with *leave*
//! when every rank of the rack left after its last job), which the upper switch reports
//! to the other racks.

use std::io;
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use netagg_aggregator::control::upward::{self, MAX_RETRANSMIT_TIMEOUT, RETRANSMIT_TIMEOUT};
use netagg_aggregator::control::{Group, Rack};
use netagg_aggregator::SessionSpec;
use netagg_wire::{ControlMessage, Endpoint};

use crate::datapath::UpstreamPath;

/// The upper switch of a lower switch, from `switch.upstream`, `switch.rack` and
/// `switch.racks`.
#[derive(Debug, Clone)]
pub struct UpperSwitch {
    /// Its control address, host:port.
    pub address: String,
    pub rack: Rack,
    /// This switch's data endpoints, which the upper switch sends its results to.
    pub data_endpoints: Vec<Endpoint>,
    /// How long to wait for the connection, and for the upper switch's session to
    /// assemble: the other racks' sessions may open later.
    pub register_timeout: Duration,
}

/// Registers the rack's session `name` with the upper switch and waits for its accept:
/// the open connection, and where the session's rounds go up. The error says what the
/// upper switch answered, or why it could not be asked.
pub fn join(
    upper: &UpperSwitch,
    name: &str,
    spec: SessionSpec,
    group: Group,
) -> Result<(TcpStream, UpstreamPath), String> {
    let address = &upper.address;
    let Rack { index, count } = upper.rack;
    let failed = |error: io::Error| format!("the upper switch at {address}: {error}");
    let deadline = Instant::now() + upper.register_timeout;
    let target = address
        .to_socket_addrs()
        .map_err(failed)?
        .next()
        .ok_or_else(|| format!("the upper switch's address {address} resolves to nothing"))?;
    let mut stream = TcpStream::connect_timeout(&target, upper.register_timeout).map_err(failed)?;
    let _ = stream.set_nodelay(true);
    let register = upward::registration(upper.rack, name, spec, group, upper.data_endpoints.clone());
    register.write_to(1, &mut stream).map_err(failed)?;
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left)).map_err(failed)?;
    let (_, answer) = ControlMessage::read_from(&mut stream).map_err(|error| match error.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => format!(
            "the upper switch at {address} did not open session '{name}' within {:?}: its other racks \
             did not all register",
            upper.register_timeout
        ),
        _ => failed(error),
    })?;
    stream.set_read_timeout(None).map_err(failed)?;
    match upward::joined(upper.rack, group, RETRANSMIT_TIMEOUT, MAX_RETRANSMIT_TIMEOUT, answer) {
        Ok((upstream, endpoints)) => {
            let peer = stream.peer_addr().map_err(failed)?.ip();
            Ok((stream, UpstreamPath { upstream, endpoints, peer }))
        }
        Err(ControlMessage::Reject { message, .. }) => {
            Err(format!("the upper switch at {address} refused rack {index} of {count}: {message}"))
        }
        Err(other) => Err(format!("the upper switch at {address} answered {other:?} to a registration")),
    }
}

/// Reads the upper switch's connection until it ends, and says why: the upper switch
/// closed the session (a rank of another rack, or its switch, left) or is gone.
pub fn watch(stream: &TcpStream, upper: &UpperSwitch) -> String {
    let (address, racks) = (&upper.address, upper.rack.count);
    loop {
        match ControlMessage::read_from(&mut &*stream) {
            // Its ranks are the racks: its message names a rack as a rank.
            Ok((_, ControlMessage::Reject { message, .. })) => {
                return format!(
                "the upper switch at {address}, whose ranks are the tree's {racks} racks, ended the tree's \
                     session: {message}"
            )
            }
            Ok(_) => continue,
            Err(_) => return format!("the upper switch at {address} closed its connection: it is gone"),
        }
    }
}
