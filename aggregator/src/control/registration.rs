//! What a registration must satisfy on its own, before it meets the other ranks of its
//! session: the switch's limits, its data path's transport, and where results may go.

use std::net::IpAddr;

use netagg_wire::{packet, Endpoint, RejectCode, ValueEncoding};

use super::{ControlLimits, Refusal, Registered};

/// What every rank of a session must agree on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Shape {
    pub world_size: u16,
    pub packet_elements: u16,
    pub slots: u16,
    pub depth: u8,
    pub encoding: ValueEncoding,
    pub sparse_blocks: bool,
    pub threads: usize,
}

impl Shape {
    /// What differs in `other` from this shape, as "slots 4 instead of 2, ..."; empty if
    /// nothing does.
    pub fn differences(&self, other: &Shape) -> String {
        let mut differences = Vec::new();
        let mut compare = |what: &str, a: String, b: String| {
            if a != b {
                differences.push(format!("{what} {b} instead of {a}"));
            }
        };
        compare("world size", self.world_size.to_string(), other.world_size.to_string());
        compare("packet elements", self.packet_elements.to_string(), other.packet_elements.to_string());
        compare("slots", self.slots.to_string(), other.slots.to_string());
        compare("depth", self.depth.to_string(), other.depth.to_string());
        compare("encoding", format!("{:?}", self.encoding), format!("{:?}", other.encoding));
        let sparse =
            |shape: &Shape| if shape.sparse_blocks { "sparse = auto" } else { "sparse = off" }.to_string();
        compare("blocks", sparse(self), sparse(other));
        compare("worker threads", self.threads.to_string(), other.threads.to_string());
        differences.join(", ")
    }
}

/// A rank's registration, as the registry keeps it.
pub(super) struct Registration {
    pub name: String,
    pub rank: u16,
    pub shape: Shape,
    pub registered: Registered,
}

impl Registration {
    /// Refuses a registration that no session on this switch could take, whatever the
    /// other ranks say.
    pub fn check(&self, limits: &ControlLimits, data_endpoint: &Endpoint) -> Result<(), Refusal> {
        let Registration { rank, shape, registered, .. } = self;
        let rank = *rank;
        if rank >= shape.world_size {
            return Err(Refusal::new(
                RejectCode::RankOutOfRange,
                format!("rank {rank} is not below the world size {}", shape.world_size),
            ));
        }
        if shape.world_size > limits.max_workers {
            return Err(Refusal::new(
                RejectCode::Limit,
                format!(
                    "a world of {} workers is above this switch's limit of {}",
                    shape.world_size, limits.max_workers
                ),
            ));
        }
        let datagram = packet::datagram_len(usize::from(shape.packet_elements));
        if let Some(max) = limits.max_datagram.filter(|&max| datagram > max) {
            return Err(Refusal::new(
                RejectCode::Limit,
                format!(
                    "packets of {} elements make {datagram}-byte datagrams; this switch's data path carries \
                     at most {max} bytes (its MTU): the largest packet_numel that fits is {}",
                    shape.packet_elements,
                    packet::elements_within(max)
                ),
            ));
        }
        if shape.slots as usize % shape.threads != 0 || (shape.slots as usize) < shape.threads {
            return Err(Refusal::new(
                RejectCode::Malformed,
                format!("{} slots do not divide among {} threads", shape.slots, shape.threads),
            ));
        }
        let served = data_endpoint.kind();
        if let Some(other) = registered.endpoints.iter().find(|e| e.kind() != served) {
            return Err(Refusal::new(
                RejectCode::Transport,
                format!(
                    "this switch's data path speaks {served}; rank {rank} registered a {} endpoint",
                    other.kind()
                ),
            ));
        }
        for endpoint in &registered.endpoints {
            check_address(endpoint, registered.peer, &limits.data_networks)
                .map_err(|message| Refusal::new(RejectCode::Transport, format!("rank {rank}: {message}")))?;
        }
        Ok(())
    }
}

/// Refuses an endpoint elsewhere than at `peer`, the address its registration came from,
/// unless it is inside `data_networks`: a switch that sent results wherever a
/// registration pointed would let anyone aim every result of a session at a third
/// party.
fn check_address(endpoint: &Endpoint, peer: IpAddr, data_networks: &[ipnet::IpNet]) -> Result<(), String> {
    // Every kind of endpoint names where results go: a new kind must say how it is checked.
    let ip = match endpoint {
        Endpoint::Udp(_) => endpoint.address(peer).ip().to_canonical(),
        // Results go back over the connection the endpoint's tag opens, wherever it comes
        // from: no one else receives them.
        Endpoint::Rdma { .. } => return Ok(()),
    };
    if ip == peer.to_canonical() || data_networks.iter().any(|network| network.contains(&ip)) {
        return Ok(());
    }
    Err(format!(
        "its endpoint {endpoint} is not at {peer}, where it registered from: a worker receives at the \
         address it registers from, unless switch.data_networks holds its address"
    ))
}
