//! The registry in memory: events in, actions out, each asserted exactly; and the
//! registry driving a real [`Engine`].

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use netagg_wire::{packet, ValueEncoding};

use super::*;
use crate::engine::{Engine, EngineLimits};

const TIMEOUT: Duration = Duration::from_secs(10);

fn limits() -> ControlLimits {
    ControlLimits {
        max_connections: 8,
        max_sessions: 2,
        max_workers: 4,
        register_timeout: TIMEOUT,
        data_networks: vec!["192.168.0.0/16".parse().unwrap()],
        max_datagram: None,
    }
}

/// The switch's data endpoints: two data-path threads, each with a port of its own.
fn data_endpoints() -> Vec<Endpoint> {
    vec![
        Endpoint::Udp("10.0.0.100:48864".parse().unwrap()),
        Endpoint::Udp("10.0.0.100:48865".parse().unwrap()),
    ]
}

/// Where rank `rank`'s worker registers from.
fn peer(rank: u16) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, rank as u8 + 1))
}

fn endpoint(rank: u16) -> Endpoint {
    Endpoint::Udp(SocketAddr::new(peer(rank), 5000 + rank))
}

fn register(rank: u16, world_size: u16, name: &str) -> ControlMessage {
    ControlMessage::Register {
        rank,
        world_size,
        packet_elements: 4,
        slots: 2,
        depth: 2,
        encoding: ValueEncoding::Native,
        sparse_blocks: false,
        name: name.into(),
        endpoints: vec![endpoint(rank)],
    }
}

fn with_slots(mut message: ControlMessage, new_slots: u16) -> ControlMessage {
    if let ControlMessage::Register { slots, .. } = &mut message {
        *slots = new_slots;
    }
    message
}

fn with_endpoints(mut message: ControlMessage, new_endpoints: Vec<Endpoint>) -> ControlMessage {
    if let ControlMessage::Register { endpoints, .. } = &mut message {
        *endpoints = new_endpoints;
    }
    message
}

fn send(connection: ConnectionId, request_id: u32, message: ControlMessage) -> Action {
    Action::Send { connection, request_id, message }
}

fn reject(connection: ConnectionId, request_id: u32, code: RejectCode, message: &str) -> Action {
    send(connection, request_id, ControlMessage::Reject { code, message: message.into() })
}

fn accept(connection: ConnectionId, request_id: u32, rank: u16, opened: Opened) -> Action {
    send(
        connection,
        request_id,
        ControlMessage::Accept {
            session: opened.id.0,
            rank,
            world_size: 2,
            packet_elements: 4,
            slots: 2,
            depth: 2,
            token: opened.token,
            data: data_endpoints(),
            split: SlotSplit::Ranges,
        },
    )
}

const SPEC: SessionSpec = SessionSpec { workers: 2, slots: 2, packet_elements: 4, depth: 2 };

struct Harness {
    registry: Registry,
    start: Instant,
    now: Instant,
}

impl Harness {
    fn new() -> Harness {
        Harness::with_limits(limits())
    }

    fn with_limits(limits: ControlLimits) -> Harness {
        let now = Instant::now();
        Harness { registry: Registry::new(data_endpoints(), limits), start: now, now }
    }

    fn actions(&mut self) -> Vec<Action> {
        std::iter::from_fn(|| self.registry.poll_action()).collect()
    }

    fn connect(&mut self, rank: u16) -> ConnectionId {
        self.registry.handle_connect(self.now, peer(rank))
    }

    /// Connects as `rank` and registers in `name`, request id `10 + rank`.
    fn join(&mut self, rank: u16, world_size: u16, name: &str) -> ConnectionId {
        let connection = self.connect(rank);
        self.registry.handle_message(
            self.now,
            connection,
            10 + u32::from(rank),
            register(rank, world_size, name),
        );
        connection
    }

    /// The one open request among the actions, which must be exactly that.
    fn open_request(&mut self, name: &str, workers: u16) -> OpenRequest {
        match self.actions().as_slice() {
            [Action::OpenSession { request, name: opened, spec, workers: registered, .. }] => {
                assert_eq!(opened, name);
                assert_eq!(*spec, SessionSpec { workers, ..SPEC });
                let expected: Vec<_> = (0..workers)
                    .map(|rank| Registered { peer: peer(rank), endpoints: vec![endpoint(rank)] })
                    .collect();
                assert_eq!(*registered, expected, "every rank, in rank order");
                *request
            }
            other => panic!("expected one open request, got {other:?}"),
        }
    }

    /// Opens a two-rank session `name` as session `id`: its connections, and the session.
    fn open_pair(&mut self, name: &str, id: u32) -> ([ConnectionId; 2], Opened) {
        let first = self.join(0, 2, name);
        assert_eq!(self.actions(), []);
        let second = self.join(1, 2, name);
        let request = self.open_request(name, 2);
        let opened = Opened { id: SessionId(id), token: 0x1234_5678 + u64::from(id) };
        self.registry.handle_opened(request, Ok(opened));
        assert_eq!(self.actions(), [accept(first, 10, 0, opened), accept(second, 11, 1, opened)]);
        ([first, second], opened)
    }

    /// Registers `message` on a new connection from its rank's host and returns the
    /// actions.
    fn register_alone(&mut self, message: ControlMessage) -> (ConnectionId, Vec<Action>) {
        let ControlMessage::Register { rank, .. } = message else {
            panic!("not a registration: {message:?}")
        };
        let connection = self.connect(rank);
        self.registry.handle_message(self.now, connection, 7, message);
        (connection, self.actions())
    }
}

/// The refusal of a registration on its own connection: the reject, then the close.
fn refused(connection: ConnectionId, code: RejectCode, message: &str) -> Vec<Action> {
    vec![reject(connection, 7, code, message), Action::Close(connection)]
}

#[test]
fn a_session_opens_once_every_rank_has_registered_and_every_rank_is_accepted() {
    let mut harness = Harness::new();
    let first = harness.join(0, 3, "job");
    let second = harness.join(2, 3, "job");
    assert_eq!(harness.actions(), [], "two of three ranks: the barrier holds");
    assert_eq!(harness.registry.sessions(), (0, 1));
    let assembly = Assembly { name: "job", rank: 2, joined: 2, world_size: 3 };
    assert_eq!(harness.registry.assembly(second), Some(assembly));
    let third = harness.join(1, 3, "job");
    let request = harness.open_request("job", 3);
    assert_eq!(harness.registry.poll_timeout(), None, "an opening session has no deadline");
    let opened = Opened { id: SessionId(5), token: 99 };
    harness.registry.handle_opened(request, Ok(opened));
    let accept = |connection, request_id, rank| {
        send(
            connection,
            request_id,
            ControlMessage::Accept {
                session: 5,
                rank,
                world_size: 3,
                packet_elements: 4,
                slots: 2,
                depth: 2,
                token: 99,
                data: data_endpoints(),
                split: SlotSplit::Ranges,
            },
        )
    };
    assert_eq!(harness.actions(), [accept(first, 10, 0), accept(third, 11, 1), accept(second, 12, 2)]);
    assert_eq!(harness.registry.sessions(), (1, 0));
    assert_eq!(harness.registry.assembly(third), None, "an open session assembles no more");
}

#[test]
fn a_registration_that_differs_from_the_first_rank_s_is_refused_by_what_differs() {
    let mut harness = Harness::new();
    harness.join(0, 2, "job");
    let (connection, actions) = harness.register_alone(with_slots(register(1, 2, "job"), 4));
    assert_eq!(
        actions,
        refused(connection, RejectCode::Mismatch, "rank 1 differs from rank 0: slots 4 instead of 2")
    );
    let (connection, actions) = harness.register_alone(register(0, 2, "job"));
    assert_eq!(
        actions,
        refused(connection, RejectCode::DuplicateRank, "rank 0 is already registered in session 'job'")
    );
    // The first rank still waits for a rank 1 that agrees.
    harness.join(1, 2, "job");
    harness.open_request("job", 2);
}

#[test]
fn registrations_no_session_here_could_take_are_refused_with_the_reason() {
    let mut harness = Harness::new();
    let cases = [
        (
            register(2, 2, "job"),
            RejectCode::RankOutOfRange,
            "rank 2 is not below the world size 2".to_string(),
        ),
        (
            register(0, 5, "job"),
            RejectCode::Limit,
            "a world of 5 workers is above this switch's limit of 4".into(),
        ),
        (
            with_endpoints(register(0, 2, "job"), vec![endpoint(0); 4]),
            RejectCode::Malformed,
            "2 slots do not divide among 4 threads".into(),
        ),
        (
            with_endpoints(
                register(0, 2, "job"),
                vec![Endpoint::Rdma { address: "10.0.0.1:7471".parse().unwrap(), tag: 3 }],
            ),
            RejectCode::Transport,
            "this switch's data path speaks udp; rank 0 registered a rdma endpoint".into(),
        ),
        (
            with_endpoints(register(0, 2, "job"), vec![Endpoint::Udp("10.9.9.9:5000".parse().unwrap())]),
            RejectCode::Transport,
            "rank 0: its endpoint udp 10.9.9.9:5000 is not at 10.0.0.1, where it registered from: a worker \
             receives at the address it registers from, unless switch.data_networks holds its address"
                .into(),
        ),
    ];
    for (message, code, reason) in cases {
        let (connection, actions) = harness.register_alone(message);
        assert_eq!(actions, refused(connection, code, &reason));
    }
    assert_eq!(harness.registry.sessions(), (0, 0), "no refusal leaves a session behind");

    // An endpoint in a data network, or at the unspecified address (the peer's), is fine.
    let elsewhere = vec![Endpoint::Udp("192.168.3.4:5000".parse().unwrap())];
    let (_, actions) = harness.register_alone(with_endpoints(register(0, 2, "net"), elsewhere));
    assert_eq!(actions, []);
    let unspecified = vec![Endpoint::Udp("0.0.0.0:5000".parse().unwrap())];
    let (_, actions) = harness.register_alone(with_endpoints(register(0, 2, "any"), unspecified));
    assert_eq!(actions, []);
}

#[test]
fn packets_longer_than_the_data_path_carries_are_refused_with_the_largest_that_fits() {
    let max = packet::datagram_len(2);
    let mut harness = Harness::with_limits(ControlLimits { max_datagram: Some(max), ..limits() });
    let (connection, actions) = harness.register_alone(register(0, 2, "job"));
    let reason = format!(
        "packets of 4 elements make {}-byte datagrams; this switch's data path carries at most {max} bytes \
         (its MTU): the largest packet_numel that fits is 2",
        packet::datagram_len(4)
    );
    assert_eq!(actions, refused(connection, RejectCode::Limit, &reason));
}

#[test]
fn sessions_beyond_the_limit_and_a_second_copy_of_a_running_one_are_refused() {
    let mut harness = Harness::new();
    harness.open_pair("first", 1);
    harness.join(0, 2, "second");
    harness.actions();
    let (connection, actions) = harness.register_alone(register(0, 2, "third"));
    assert_eq!(
        actions,
        refused(connection, RejectCode::Limit, "2 sessions are open or assembling, the limit is 2")
    );
    // A rank of a session already assembling is not a new session.
    harness.join(1, 2, "second");
    harness.open_request("second", 2);
    let (connection, actions) = harness.register_alone(register(0, 2, "first"));
    let reason = "session 'first' is already running with all its ranks";
    assert_eq!(actions, refused(connection, RejectCode::DuplicateRank, reason));
    let (connection, actions) = harness.register_alone(register(0, 2, "second"));
    let reason = "session 'second' is already running with all its ranks";
    assert_eq!(actions, refused(connection, RejectCode::DuplicateRank, reason), "opening counts as running");
}

#[test]
fn connections_beyond_the_limit_are_refused_as_they_arrive_and_count_until_they_are_gone() {
    let mut harness = Harness::with_limits(ControlLimits { max_connections: 2, ..limits() });
    let first = harness.connect(0);
    let second = harness.connect(1);
    let third = harness.connect(2);
    let reason = "the switch serves at most 2 control connections at once; try again later";
    assert_eq!(harness.actions(), [reject(third, 0, RejectCode::Limit, reason), Action::Close(third)]);
    assert!(harness.registry.is_live(first) && harness.registry.is_live(second));
    assert!(!harness.registry.is_live(third));

    // A connection closed by the registry counts until its shell says it is gone.
    harness.registry.handle_message(harness.now, first, 1, ControlMessage::Leave { session: 0, rank: 0 });
    assert_eq!(harness.actions(), [Action::Close(first)]);
    let fourth = harness.connect(3);
    assert_eq!(harness.actions(), [reject(fourth, 0, RejectCode::Limit, reason), Action::Close(fourth)]);
    harness.registry.handle_closed(first);
    harness.connect(3);
    assert_eq!(harness.actions(), []);
}

#[test]
fn a_connection_that_does_not_register_in_time_is_refused_and_closed() {
    let mut harness = Harness::new();
    let connection = harness.connect(0);
    assert_eq!(harness.registry.poll_timeout(), Some(harness.start + TIMEOUT));
    harness.registry.handle_timeout(harness.start + TIMEOUT - Duration::from_millis(1));
    assert_eq!(harness.actions(), []);
    harness.registry.handle_timeout(harness.start + TIMEOUT);
    let reason = "no registration within 10s of connecting";
    assert_eq!(
        harness.actions(),
        [reject(connection, 0, RejectCode::Malformed, reason), Action::Close(connection)]
    );
    assert_eq!(harness.registry.poll_timeout(), None);
    // What it says meanwhile is ignored.
    harness.registry.handle_message(harness.now, connection, 1, register(0, 2, "late"));
    assert_eq!(harness.actions(), []);
}

#[test]
fn a_session_that_does_not_assemble_in_time_withdraws_each_rank_at_its_own_deadline() {
    let mut harness = Harness::new();
    let first = harness.join(0, 3, "job");
    harness.now += Duration::from_secs(4);
    let second = harness.join(1, 3, "job");
    // The first rank's deadline runs from its registration.
    assert_eq!(harness.registry.poll_timeout(), Some(harness.start + TIMEOUT));
    harness.registry.handle_timeout(harness.start + TIMEOUT);
    let reason = "session 'job' did not assemble within 10s: 2 of 3 ranks registered";
    assert_eq!(harness.actions(), [reject(first, 0, RejectCode::Limit, reason), Action::Close(first)]);
    // Rank 0 may register again; the session still waits for rank 2.
    harness.now = harness.start + TIMEOUT;
    let again = harness.join(0, 3, "job");
    assert_eq!(harness.actions(), []);
    harness.registry.handle_timeout(harness.start + Duration::from_secs(14));
    let reason = "session 'job' did not assemble within 10s: 2 of 3 ranks registered";
    assert_eq!(harness.actions(), [reject(second, 0, RejectCode::Limit, reason), Action::Close(second)]);
    harness.registry.handle_timeout(harness.start + Duration::from_secs(20));
    let reason = "session 'job' did not assemble within 10s: 1 of 3 ranks registered";
    assert_eq!(harness.actions(), [reject(again, 0, RejectCode::Limit, reason), Action::Close(again)]);
    assert_eq!(harness.registry.sessions(), (0, 0));
}

#[test]
fn a_rank_that_departs_before_the_session_opens_withdraws_its_registration_only() {
    let mut harness = Harness::new();
    let first = harness.join(0, 2, "job");
    harness.registry.handle_closed(first);
    assert_eq!(harness.actions(), []);
    assert_eq!(harness.registry.sessions(), (0, 0), "its session had no one else");
    let first = harness.join(0, 2, "job");
    let leaver = harness.join(1, 2, "job");
    let request = harness.open_request("job", 2);
    // The open request is out; rank 1 leaves before the data path answers.
    harness.registry.handle_closed(leaver);
    assert_eq!(harness.actions(), []);
    harness.registry.handle_opened(request, Ok(Opened { id: SessionId(3), token: 1 }));
    let reason = "rank 1 left session 'job'; the session is closed";
    assert_eq!(
        harness.actions(),
        [
            Action::CloseSession { id: SessionId(3), name: "job".into(), why: Closure::RankLeft(1) },
            reject(first, 10, RejectCode::UnknownSession, reason),
        ]
    );
    assert_eq!(harness.registry.sessions(), (0, 0));
}

#[test]
fn a_rank_whose_connection_closes_after_the_session_opened_closes_it_and_the_others_are_told() {
    let mut harness = Harness::new();
    let ([first, second], opened) = harness.open_pair("job", 1);
    harness.registry.handle_closed(second);
    let reason = "rank 1 left session 'job'; the session is closed";
    assert_eq!(
        harness.actions(),
        [
            Action::CloseSession { id: opened.id, name: "job".into(), why: Closure::RankLeft(1) },
            reject(first, 0, RejectCode::UnknownSession, reason),
        ]
    );
    // The other's closing now ends nothing, and the name is free again.
    harness.registry.handle_closed(first);
    assert_eq!(harness.actions(), []);
    harness.open_pair("job", 2);
}

#[test]
fn a_message_other_than_one_register_then_leave_is_refused_and_a_member_s_closes_its_session() {
    let mut harness = Harness::new();
    let ([first, second], opened) = harness.open_pair("job", 1);
    harness.registry.handle_message(harness.now, first, 4, register(0, 2, "job"));
    assert_eq!(
        harness.actions(),
        [
            reject(first, 4, RejectCode::Malformed, "expected one register, then nothing until leave"),
            Action::Close(first),
            Action::CloseSession { id: opened.id, name: "job".into(), why: Closure::RankLeft(0) },
            reject(second, 0, RejectCode::UnknownSession, "rank 0 left session 'job'; the session is closed"),
        ]
    );
    let stray = harness.connect(0);
    harness.registry.handle_undecodable(stray, &WireError::Version { found: 9, supported: 5 });
    let reason = WireError::Version { found: 9, supported: 5 }.to_string();
    assert_eq!(harness.actions(), [reject(stray, 0, RejectCode::Version, &reason), Action::Close(stray)]);
}

#[test]
fn a_rank_that_leaves_after_its_last_job_lingers_and_the_last_to_leave_closes_the_session() {
    let mut harness = Harness::new();
    let ([first, second], opened) = harness.open_pair("job", 1);
    let leave = ControlMessage::Leave { session: 1, rank: 0 };
    harness.registry.handle_message(harness.now, first, 5, leave);
    assert_eq!(harness.actions(), [Action::Depart { connection: first, id: opened.id, rank: 0 }]);
    // Its client may close before the data path answers: the answer still decides.
    harness.registry.handle_closed(first);
    harness.registry.handle_departure(first, Some(Departure::Lingers));
    assert_eq!(harness.actions(), [], "the others may still recover their last results");

    harness.registry.handle_message(harness.now, second, 6, ControlMessage::Leave { session: 1, rank: 1 });
    assert_eq!(harness.actions(), [Action::Depart { connection: second, id: opened.id, rank: 1 }]);
    harness.registry.handle_departure(second, Some(Departure::AllGone));
    assert_eq!(
        harness.actions(),
        [
            Action::CloseSession { id: opened.id, name: "job".into(), why: Closure::AllLeft },
            Action::Close(second),
        ]
    );
    assert_eq!(harness.registry.sessions(), (0, 0));
}

#[test]
fn a_rank_that_leaves_while_a_round_needs_it_closes_the_session() {
    let mut harness = Harness::new();
    let ([first, second], opened) = harness.open_pair("job", 1);
    harness.registry.handle_message(harness.now, first, 5, ControlMessage::Leave { session: 1, rank: 0 });
    harness.actions();
    harness.registry.handle_departure(first, Some(Departure::Needed));
    assert_eq!(
        harness.actions(),
        [
            Action::Close(first),
            Action::CloseSession { id: opened.id, name: "job".into(), why: Closure::RankLeft(0) },
            reject(second, 0, RejectCode::UnknownSession, "rank 0 left session 'job'; the session is closed"),
        ]
    );
}

#[test]
fn a_new_session_under_the_name_of_a_lingering_one_supersedes_it() {
    let mut harness = Harness::new();
    let ([first, second], old) = harness.open_pair("job", 1);
    harness.registry.handle_message(harness.now, first, 5, ControlMessage::Leave { session: 1, rank: 0 });
    harness.actions();
    harness.registry.handle_departure(first, Some(Departure::Lingers));
    assert_eq!(harness.actions(), [Action::Close(first)]);
    harness.registry.handle_closed(first);

    // The program's next run registers while rank 1 of the last still recovers.
    let third = harness.join(0, 2, "job");
    let fourth = harness.join(1, 2, "job");
    let request = harness.open_request("job", 2);
    let new = Opened { id: SessionId(2), token: 7 };
    harness.registry.handle_opened(request, Ok(new));
    assert_eq!(
        harness.actions(),
        [
            accept(third, 10, 0, new),
            accept(fourth, 11, 1, new),
            Action::CloseSession { id: old.id, name: "job".into(), why: Closure::Superseded },
            reject(second, 0, RejectCode::UnknownSession, "rank 0 left session 'job'; the session is closed"),
        ]
    );
    // The old session's last rank closing ends nothing of the new one.
    harness.registry.handle_closed(second);
    assert_eq!(harness.actions(), []);
    assert_eq!(harness.registry.sessions(), (1, 0));
}

#[test]
fn a_rank_s_next_registration_is_refused_while_its_holder_lives_and_admitted_once_its_end_is_handled() {
    let mut harness = Harness::new();
    let ([first, second], opened) = harness.open_pair("job", 1);
    assert_eq!(harness.registry.holder("job", 0), Some(first));
    assert_eq!(harness.registry.holder("job", 1), Some(second));
    assert_eq!(harness.registry.holder("other", 0), None);

    // While the holder lives, its rank's next process is refused and the session runs on.
    let (early, actions) = harness.register_alone(register(0, 2, "job"));
    let reason = "session 'job' is already running with all its ranks";
    assert_eq!(actions, refused(early, RejectCode::DuplicateRank, reason));
    harness.registry.handle_closed(early);
    assert_eq!(harness.actions(), []);
    assert_eq!(harness.registry.holder("job", 0), Some(first));

    // Its process exited: the holder's end, handled before the registration in the same
    // turn, closes the old session, and the rank is admitted to the next.
    harness.registry.handle_closed(first);
    let next = harness.join(0, 2, "job");
    assert_eq!(
        harness.actions(),
        [
            Action::CloseSession { id: opened.id, name: "job".into(), why: Closure::RankLeft(0) },
            reject(second, 0, RejectCode::UnknownSession, "rank 0 left session 'job'; the session is closed"),
        ]
    );
    assert_eq!(harness.registry.holder("job", 0), Some(next), "an assembling registration holds its rank");
    assert_eq!(harness.registry.assembly(next).map(|assembly| assembly.joined), Some(1));
}

#[test]
fn a_rank_whose_leave_awaits_the_data_path_s_answer_holds_its_rank_until_then() {
    let mut harness = Harness::new();
    let ([first, _], opened) = harness.open_pair("job", 1);
    harness.registry.handle_message(harness.now, first, 5, ControlMessage::Leave { session: 1, rank: 0 });
    assert_eq!(harness.actions(), [Action::Depart { connection: first, id: opened.id, rank: 0 }]);
    harness.registry.handle_closed(first);
    assert_eq!(harness.registry.holder("job", 0), Some(first), "the answer decides what its leave ends");
    harness.registry.handle_departure(first, Some(Departure::Lingers));
    assert_eq!(harness.registry.holder("job", 0), None);
    assert_eq!(harness.registry.holder("job", 1), None, "a session a rank has left holds no rank");
    harness.join(0, 2, "job");
    assert_eq!(harness.actions(), [], "admitted beside the lingering session");
}

#[test]
fn a_session_the_data_path_cannot_open_is_refused_to_every_rank_by_its_reason() {
    let mut harness = Harness::new();
    for (error, code) in [
        (OpenError::Endpoint("rank 1: no route".into()), RejectCode::Transport),
        (OpenError::Session(SessionError::TooManySessions { open: 1, max: 1 }), RejectCode::Limit),
        (OpenError::Unanswered, RejectCode::Limit),
    ] {
        let first = harness.join(0, 2, "job");
        let second = harness.join(1, 2, "job");
        let request = harness.open_request("job", 2);
        let reason = error.to_string();
        harness.registry.handle_opened(request, Err(error));
        assert_eq!(harness.actions(), [reject(first, 10, code, &reason), reject(second, 11, code, &reason)]);
        assert_eq!(harness.registry.sessions(), (0, 0));
        // Their connections stay until their clients close them, and end nothing.
        harness.registry.handle_closed(first);
        harness.registry.handle_closed(second);
        assert_eq!(harness.actions(), []);
    }
}

#[test]
fn a_session_the_data_path_closes_tells_the_ranks_that_have_not_left_why() {
    let mut harness = Harness::new();
    let ([first, second], opened) = harness.open_pair("idle", 1);
    harness.registry.handle_session_ended(opened.id, SessionEnd::Expired);
    let reason = "session 'idle' expired: no packets for the idle timeout";
    assert_eq!(
        harness.actions(),
        [
            reject(first, 0, RejectCode::UnknownSession, reason),
            reject(second, 0, RejectCode::UnknownSession, reason)
        ]
    );
    harness.registry.handle_closed(first);
    assert_eq!(harness.actions(), [], "the session is gone already");

    let ([first, second], opened) = harness.open_pair("orphan", 2);
    harness.registry.handle_message(harness.now, first, 5, ControlMessage::Leave { session: 2, rank: 0 });
    harness.actions();
    harness.registry.handle_departure(first, Some(Departure::Lingers));
    harness.actions();
    harness.registry.handle_session_ended(opened.id, SessionEnd::Orphaned { departed: 0 });
    let reason = "rank 0 left session 'orphan'; the session is closed";
    assert_eq!(harness.actions(), [reject(second, 0, RejectCode::UnknownSession, reason)]);
    harness.registry.handle_session_ended(opened.id, SessionEnd::Expired);
    assert_eq!(harness.actions(), [], "a session is ended once");
}

#[test]
fn a_rank_s_lost_data_connection_closes_its_session_for_every_rank_with_the_cause() {
    let mut harness = Harness::new();
    let ([first, second], opened) = harness.open_pair("lost", 1);
    let why = "worker thread 1: the peer disconnected";
    harness.registry.handle_session_ended(opened.id, SessionEnd::ConnectionLost { rank: 1, why: why.into() });
    // Rank 1's control connection is still open: it is told too, as is every other rank.
    let reason = "session 'lost' is closed: rank 1's data connection to the switch failed, worker thread 1: \
                  the peer disconnected";
    assert_eq!(
        harness.actions(),
        [
            reject(first, 0, RejectCode::UnknownSession, reason),
            reject(second, 0, RejectCode::UnknownSession, reason)
        ]
    );
    harness.registry.handle_closed(second);
    assert_eq!(harness.actions(), [], "the session is gone already");
}

/// The registry and an engine, the actions carried out as the switch's shell does.
struct Switch {
    harness: Harness,
    engine: Engine,
    sent: Vec<(ConnectionId, ControlMessage)>,
    closed: Vec<ConnectionId>,
}

impl Switch {
    fn new() -> Switch {
        let engine = Engine::new(EngineLimits { max_sessions: 1, ..EngineLimits::default() });
        Switch { harness: Harness::new(), engine, sent: Vec::new(), closed: Vec::new() }
    }

    fn perform(&mut self) {
        while let Some(action) = self.harness.registry.poll_action() {
            match action {
                Action::Send { connection, message, .. } => self.sent.push((connection, message)),
                Action::Close(connection) => self.closed.push(connection),
                Action::OpenSession { request, spec, .. } => {
                    let token = 0xfeed;
                    let opened = self.engine.open_session(self.harness.now, spec, token);
                    let opened = opened.map(|id| Opened { id, token }).map_err(OpenError::from);
                    self.harness.registry.handle_opened(request, opened);
                }
                Action::CloseSession { id, .. } => {
                    self.engine.close_session(id).expect("open in the engine");
                }
                Action::Depart { connection, id, rank } => {
                    let departure = self.engine.depart(id, rank).ok();
                    self.harness.registry.handle_departure(connection, departure);
                }
            }
        }
    }
}

#[test]
fn the_registry_opens_and_closes_sessions_in_the_engine_and_passes_its_refusals_on() {
    let mut switch = Switch::new();
    let first = switch.harness.join(0, 2, "a");
    let second = switch.harness.join(1, 2, "a");
    switch.perform();
    let session = switch.engine.sessions().next().expect("open in the engine");
    assert_eq!(switch.engine.session(session).map(|(spec, _)| spec), Some(SPEC));
    assert!(
        matches!(switch.sent[..], [(c0, ControlMessage::Accept { rank: 0, token: 0xfeed, .. }), (c1, ControlMessage::Accept { rank: 1, .. })] if c0 == first && c1 == second)
    );

    // The engine holds one session: a second one is refused by the engine's reason.
    switch.sent.clear();
    let third = switch.harness.join(0, 2, "b");
    let fourth = switch.harness.join(1, 2, "b");
    switch.perform();
    let reason = OpenError::Session(SessionError::TooManySessions { open: 1, max: 1 }).to_string();
    let refusal = ControlMessage::Reject { code: RejectCode::Limit, message: reason };
    assert_eq!(switch.sent, [(third, refusal.clone()), (fourth, refusal)]);

    // Both ranks of the first leave after their last job: the engine frees the session.
    for (connection, rank) in [(first, 0), (second, 1)] {
        switch.harness.registry.handle_message(
            switch.harness.now,
            connection,
            9,
            ControlMessage::Leave { session: session.0, rank },
        );
        switch.perform();
    }
    assert_eq!(switch.engine.sessions().count(), 0);
    assert_eq!(switch.closed, [first, second]);
}

#[test]
fn a_rack_s_switch_opens_its_ranks_alone_numbered_from_0_and_refuses_the_others() {
    // Rack 1 of 2 in a world of 4: ranks 2 and 3.
    let mut harness = Harness::new();
    harness.registry = Registry::new(data_endpoints(), limits()).serving_rack(Rack { index: 1, count: 2 });
    let (connection, actions) = harness.register_alone(register(1, 4, "job"));
    let message = "rank 1 is not in rack 1 of 2, which this switch serves and which holds ranks 2 to 3 \
                   of a world of 4: register at its rack's switch";
    assert_eq!(actions, refused(connection, RejectCode::RankOutOfRange, message));
    let third = harness.join(2, 4, "job");
    assert_eq!(harness.actions(), [], "one of the rack's two ranks");
    let fourth = harness.join(3, 4, "job");
    let request = match harness.actions().as_slice() {
        [Action::OpenSession { request, spec, workers, group, .. }] => {
            assert_eq!(*spec, SessionSpec { workers: 2, ..SPEC });
            assert_eq!(workers[0].peer, peer(2), "the rack's first rank is the data path's worker 0");
            let expected =
                Group { first_rank: 2, world_size: 4, encoding: ValueEncoding::Native, sparse_blocks: false };
            assert_eq!(*group, expected);
            *request
        }
        other => panic!("expected one open request, got {other:?}"),
    };
    let opened = Opened { id: SessionId(3), token: 5 };
    harness.registry.handle_opened(request, Ok(opened));
    let accepts: Vec<_> = harness
        .actions()
        .into_iter()
        .map(|action| match action {
            Action::Send { message: ControlMessage::Accept { rank, world_size, .. }, .. } => {
                (rank, world_size)
            }
            other => panic!("expected accepts, got {other:?}"),
        })
        .collect();
    assert_eq!(accepts, [(2, 4), (3, 4)], "ranks and world size of the whole tree");
    // Rank 3 leaves: the data path hears of its worker 1; a round stopped by it is
    // reported by its rank in the tree.
    harness.registry.handle_message(harness.now, fourth, 0, ControlMessage::Leave { session: 3, rank: 3 });
    assert_eq!(harness.actions(), [Action::Depart { connection: fourth, id: SessionId(3), rank: 1 }]);
    harness.registry.handle_departure(fourth, Some(Departure::Lingers));
    harness.actions();
    harness.registry.handle_session_ended(SessionId(3), SessionEnd::Orphaned { departed: 1 });
    assert_eq!(
        harness.actions(),
        [reject(third, 0, RejectCode::UnknownSession, "rank 3 left session 'job'; the session is closed")]
    );
}
