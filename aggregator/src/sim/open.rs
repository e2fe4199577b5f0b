//! A simulated cluster's sessions, opened as its switches' shells open them: every worker
//! registers with its switch's control [`Registry`], which opens the session in that
//! switch's engine once every rank has. In a tree each rack's switch serves its rack's
//! ranks ([`Registry::serving_rack`]) and, before opening, registers the rack's session
//! with the upper switch's registry as one member ([`upward`]); the upper switch's
//! accept attaches the rack's session to the upper session, as `netagg-switch
//! --upstream` does.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::ops::Range;
use std::time::{Duration, Instant};

use netagg_wire::control::{rack_ranks, SlotSplit};
use netagg_wire::{ControlMessage, Endpoint, ValueEncoding};

use super::{ClusterConfig, SimError};
use crate::control::upward::{self, MAX_RETRANSMIT_TIMEOUT, RETRANSMIT_TIMEOUT};
use crate::control::{Action, ControlLimits, Group, OpenError, OpenRequest, Opened, Rack, Registry};
use crate::engine::{Engine, EngineLimits, SessionId, SessionSpec};
use crate::worker::{SessionKey, SessionKeys};

/// A switch of the cluster: its engine, and the session the cluster runs in it.
#[derive(Debug)]
pub(super) struct Switch {
    pub engine: Engine,
    pub session: SessionId,
}

/// The cluster's switches (the racks' by rack in a tree, then the core's; or the shards
/// in order), and each worker's rank and keys to its switches' sessions, by rank.
pub(super) struct Sessions {
    pub switches: Vec<Switch>,
    pub workers: Vec<(u16, SessionKeys)>,
}

/// The one address every simulated node has: the links carry no forger.
const HOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// Opens the cluster's sessions at `now`.
pub(super) fn open(config: &ClusterConfig, now: Instant) -> Result<Sessions, SimError> {
    // Any value: the simulated links carry no forger.
    let token = config.seed.rotate_left(17) ^ 0x6e65_7461_6767;
    let Some(racks) = config.racks.filter(|racks| racks.tree) else {
        return open_shards(config, now, token);
    };
    let mut upper = registry(racks.count);
    let mut lower = Vec::new();
    for index in 0..racks.count {
        let rack = Rack { index, count: racks.count };
        let mut registry = registry(config.workers).serving_rack(rack);
        register_workers(&mut registry, now, rack_ranks(index, racks.count, config.workers), config);
        let (request, name, spec, group) = opening(&mut registry)?;
        let connection = upper.handle_connect(now, HOST);
        upper.handle_message(
            now,
            connection,
            0,
            upward::registration(rack, &name, spec, group, vec![endpoint()]),
        );
        lower.push((rack, registry, request, spec, group));
    }
    let (request, _, spec, _) = opening(&mut upper)?;
    let core = open_in(Engine::new(limits()), &mut upper, request, now, spec, token)?;
    let answers = accepts(&mut upper)?;
    let mut switches = Vec::new();
    let mut workers = Vec::new();
    for (rack, mut registry, request, spec, group) in lower {
        let answer = answers
            .iter()
            .find(|answer| matches!(answer, ControlMessage::Accept { rank, .. } if *rank == rack.index));
        let answer = answer.cloned().ok_or_else(|| {
            SimError::Refused(format!("the upper switch did not answer rack {}", rack.index))
        })?;
        let (upstream, _) = upward::joined(rack, group, RETRANSMIT_TIMEOUT, MAX_RETRANSMIT_TIMEOUT, answer)
            .map_err(|answer| {
            SimError::Refused(format!("the upper switch answered rack {} with {answer:?}", rack.index))
        })?;
        let mut engine = Engine::new(limits());
        let rack_token = token ^ (u64::from(rack.index) + 1);
        let id = engine.open_session(now, spec, rack_token).map_err(|e| SimError::Refused(e.to_string()))?;
        engine.attach_upstream(id, upstream).map_err(|e| SimError::Refused(e.to_string()))?;
        registry.handle_opened(request, Ok(Opened { id, token: rack_token }));
        let accepted = accepted_workers(&mut registry)?;
        workers.extend(accepted.into_iter().map(|(rank, key)| (rank, SessionKeys::one(key))));
        switches.push(Switch { engine, session: id });
    }
    switches.push(core);
    workers.sort_by_key(|&(rank, _)| rank);
    Ok(Sessions { switches, workers })
}

/// Opens the session on each of `config.shards` switches at the core, each with a token
/// of its own; every worker registers with each, and its keys give each shard its range
/// of slots.
fn open_shards(config: &ClusterConfig, now: Instant, token: u64) -> Result<Sessions, SimError> {
    let shards = usize::from(config.shards);
    let mut switches = Vec::with_capacity(shards);
    let mut keys: Vec<Vec<(Range<u16>, SessionKey)>> = vec![Vec::new(); usize::from(config.workers)];
    for shard in 0..shards {
        let mut registry = registry(config.workers);
        register_workers(&mut registry, now, 0..config.workers, config);
        let (request, _, spec, _) = opening(&mut registry)?;
        let shard_token = token ^ (shard as u64).rotate_right(8);
        switches.push(open_in(Engine::new(limits()), &mut registry, request, now, spec, shard_token)?);
        let slots = SlotSplit::Ranges.owned(shard, config.slots, shards);
        for (rank, key) in accepted_workers(&mut registry)? {
            keys[usize::from(rank)].push((slots.clone(), key));
        }
    }
    let workers = keys.into_iter().enumerate().map(|(rank, ranges)| {
        let keys = SessionKeys::sharded(ranges)
            .ok_or_else(|| SimError::Refused(format!("no shard accepted rank {rank}")))?;
        Ok((rank as u16, keys))
    });
    Ok(Sessions { switches, workers: workers.collect::<Result<_, SimError>>()? })
}

fn limits() -> EngineLimits {
    EngineLimits { session_idle_timeout: Duration::from_secs(3600), ..EngineLimits::default() }
}

fn endpoint() -> Endpoint {
    Endpoint::Udp(SocketAddr::new(HOST, 0))
}

/// A switch's registry for a session of `members` ranks (workers, or racks).
fn registry(members: u16) -> Registry {
    Registry::new(
        vec![endpoint()],
        ControlLimits {
            max_connections: usize::from(members),
            max_sessions: 1,
            max_workers: members,
            register_timeout: Duration::from_secs(60),
            data_networks: Vec::new(),
            max_datagram: None,
        },
    )
}

/// Workers `ranks` of the cluster register with `registry`.
fn register_workers(registry: &mut Registry, now: Instant, ranks: Range<u16>, config: &ClusterConfig) {
    for rank in ranks {
        let connection = registry.handle_connect(now, HOST);
        let register = ControlMessage::Register {
            rank,
            world_size: config.workers,
            packet_elements: config.packet_elements,
            slots: config.slots,
            depth: config.depth,
            encoding: ValueEncoding::Native,
            sparse_blocks: false,
            name: "sim".into(),
            endpoints: vec![endpoint(); usize::from(config.threads)],
        };
        registry.handle_message(now, connection, 0, register);
    }
}

/// The session `registry` asks to open once every rank registered: the request, the
/// session's name, and its spec and group.
fn opening(registry: &mut Registry) -> Result<(OpenRequest, String, SessionSpec, Group), SimError> {
    while let Some(action) = registry.poll_action() {
        match action {
            Action::OpenSession { request, name, spec, group, .. } => {
                return Ok((request, name, spec, group))
            }
            Action::Send { message: ControlMessage::Reject { message, .. }, .. } => {
                return Err(SimError::Refused(message))
            }
            // Closes follow refusals; the registry asks nothing else of a new session.
            _ => {}
        }
    }
    Err(SimError::Refused("a session needs at least one worker".into()))
}

/// Opens `spec` in `engine` for `registry`'s `request`, and tells the registry.
fn open_in(
    mut engine: Engine,
    registry: &mut Registry,
    request: OpenRequest,
    now: Instant,
    spec: SessionSpec,
    token: u64,
) -> Result<Switch, SimError> {
    let opened = engine.open_session(now, spec, token);
    registry.handle_opened(request, opened.clone().map(|id| Opened { id, token }).map_err(OpenError::from));
    let session = opened.map_err(|e| SimError::Refused(e.to_string()))?;
    Ok(Switch { engine, session })
}

/// The accepts `registry` sends once its session opened.
fn accepts(registry: &mut Registry) -> Result<Vec<ControlMessage>, SimError> {
    let mut accepts = Vec::new();
    while let Some(action) = registry.poll_action() {
        match action {
            Action::Send { message: message @ ControlMessage::Accept { .. }, .. } => accepts.push(message),
            Action::Send { message: ControlMessage::Reject { message, .. }, .. } => {
                return Err(SimError::Refused(message))
            }
            _ => {}
        }
    }
    Ok(accepts)
}

/// Each accepted worker's rank and key, from its accept.
fn accepted_workers(registry: &mut Registry) -> Result<Vec<(u16, SessionKey)>, SimError> {
    let workers = accepts(registry)?.into_iter().filter_map(|accept| match accept {
        ControlMessage::Accept { session, rank, token, .. } => Some((rank, SessionKey { session, token })),
        _ => None,
    });
    Ok(workers.collect())
}
