//! A lower switch's registration with its upper switch in an aggregation tree, without
//! I/O: the message it sends for a rack's session, and its place in the upper switch's
//! session that the answer gives. The switch's shell (`switch/src/tree.rs`) carries them
//! over a TCP connection; the simulator (`crate::sim`) hands them to an upper
//! [`Registry`](super::Registry) in memory.

use std::time::Duration;

use netagg_wire::{ControlMessage, Endpoint, SlotSplit};

use super::{Group, Rack};
use crate::engine::{SessionSpec, Upstream};

/// How long a round sent up waits for the upper switch before it is sent again, at
/// first; it doubles on every timeout of a slot up to [`MAX_RETRANSMIT_TIMEOUT`]. The
/// switch's data path looks at its timers every 20 ms, which bounds how early it can act
/// anyway.
pub const RETRANSMIT_TIMEOUT: Duration = Duration::from_millis(20);
pub const MAX_RETRANSMIT_TIMEOUT: Duration = Duration::from_secs(1);

/// The registration rack `rack`'s switch sends its upper switch for its session `name`:
/// as a worker's, its rank the rack's, its world the racks, announcing `endpoints` (its
/// own data endpoints) for the upper switch's results.
pub fn registration(
    rack: Rack,
    name: &str,
    spec: SessionSpec,
    group: Group,
    endpoints: Vec<Endpoint>,
) -> ControlMessage {
    ControlMessage::Register {
        rank: rack.index,
        world_size: rack.count,
        packet_elements: spec.packet_elements,
        slots: spec.slots,
        depth: spec.depth,
        encoding: group.encoding,
        sparse_blocks: group.sparse_blocks,
        name: name.to_string(),
        endpoints,
    }
}

/// Rack `rack`'s place in the upper switch's session, from the upper switch's `answer` to
/// its [`registration`], and the upper switch's data endpoints; the answer itself if it
/// is no accept a tree can take (a reject, or slots split otherwise than in ranges).
pub fn joined(
    rack: Rack,
    group: Group,
    retransmit_timeout: Duration,
    max_retransmit_timeout: Duration,
    answer: ControlMessage,
) -> Result<(Upstream, Vec<Endpoint>), ControlMessage> {
    match answer {
        ControlMessage::Accept { session, token, data, split: SlotSplit::Ranges, .. } => {
            let upstream = Upstream {
                session,
                token,
                rank: rack.index,
                first_rank: group.first_rank,
                retransmit_timeout,
                max_retransmit_timeout,
            };
            Ok((upstream, data))
        }
        other => Err(other),
    }
}
