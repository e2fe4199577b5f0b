//! The control plane against hostile clients: clients that never read, never register,
//! announce worlds or sessions beyond the limits, or open more connections than allowed,
//! while a legitimate tenant registers, runs and loses a worker.
//!
//! The tenant's data path is a network in memory; its control connections are real TCP.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

mod common;

use common::{memory_switch, register_message};
use netagg_switch::port::MemoryNetwork;
use netagg_switch::Switch;
use netagg_wire::{ControlMessage, Endpoint, RejectCode};

fn start(adjust: impl FnOnce(&mut netagg_config::Switch)) -> Switch {
    memory_switch(&MemoryNetwork::new(), adjust)
}

fn register(rank: u16, world_size: u16, name: &str) -> ControlMessage {
    let endpoint = Endpoint::Udp(format!("127.0.0.1:{}", 5000 + rank).parse().unwrap());
    register_message(rank, world_size, name, endpoint)
}

fn connect(switch: &Switch) -> TcpStream {
    let stream = TcpStream::connect(switch.control_addr()).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stream
}

fn reply(stream: &mut TcpStream) -> ControlMessage {
    ControlMessage::read_from(stream).expect("a reply").1
}

/// Which of two streams the switch writes to first: 0 or 1 (within 10 s).
fn first_to_answer(first: &mut TcpStream, second: &mut TcpStream) -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    for stream in [&*first, &*second] {
        stream.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
    }
    let answered = loop {
        if let Some(index) = [&*first, &*second].iter().position(|stream| stream.peek(&mut [0u8; 1]).is_ok())
        {
            break index;
        }
        assert!(Instant::now() < deadline, "neither stream was answered");
    };
    for stream in [&*first, &*second] {
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    }
    answered
}

/// Whether the switch has closed `stream`: the read ends, or the connection is reset.
fn closed(stream: &mut TcpStream) -> bool {
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    match stream.read(&mut [0u8; 64]) {
        Ok(0) => true,
        Ok(_) => false,
        Err(error) => !matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
    }
}

/// Registers a two-rank session and checks that both accepts come within `within`.
fn open_pair(switch: &Switch, name: &str, within: Duration) -> (TcpStream, TcpStream) {
    let started = Instant::now();
    let (mut first, mut second) = (connect(switch), connect(switch));
    register(0, 2, name).write_to(1, &mut first).unwrap();
    register(1, 2, name).write_to(1, &mut second).unwrap();
    for stream in [&mut first, &mut second] {
        assert!(matches!(reply(stream), ControlMessage::Accept { .. }), "the tenant is accepted");
    }
    assert!(started.elapsed() < within, "accepted after {:?}", started.elapsed());
    (first, second)
}

#[test]
fn a_client_that_never_reads_stalls_no_other_tenant() {
    let switch = start(|_| {});
    // A hostile client pipelines rejected registrations and reads nothing.
    let hostile = connect(&switch);
    let mut writer = hostile.try_clone().unwrap();
    writer.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    let flood = std::thread::spawn(move || {
        let mut bytes = Vec::new();
        register(7, 2, "hostile").write_to(1, &mut bytes).unwrap();
        // Until the switch closes the connection, or the kernel's buffers fill.
        (0..100_000).take_while(|_| writer.write_all(&bytes).is_ok()).count()
    });
    // Another never-reading client in a session of its own, which opens: its accept must
    // not wait for it to read either.
    let (_idle_first, _idle_second) = open_pair(&switch, "never-reads", Duration::from_secs(2));

    let (first, mut second) = open_pair(&switch, "tenant", Duration::from_secs(2));
    // A worker of the tenant dies: the other hears of it at once.
    let died = Instant::now();
    first.shutdown(Shutdown::Both).unwrap();
    match reply(&mut second) {
        ControlMessage::Reject { code: RejectCode::UnknownSession, message } => {
            assert_eq!(message, "rank 0 left session 'tenant'; the session is closed")
        }
        other => panic!("{other:?}"),
    }
    assert!(died.elapsed() < Duration::from_secs(1), "reported after {:?}", died.elapsed());

    // The hostile connection got one reject and was closed: it cannot pile up replies.
    let sent = flood.join().unwrap();
    assert!(sent < 100_000, "the switch kept reading {sent} registrations");
    let mut hostile = hostile;
    match ControlMessage::read_from(&mut hostile) {
        Ok((_, ControlMessage::Reject { code: RejectCode::RankOutOfRange, .. })) => {
            assert!(closed(&mut hostile))
        }
        // The reset of a connection closed with unread data may overtake the reject.
        Err(error) => assert_ne!(error.kind(), ErrorKind::WouldBlock, "{error}"),
        Ok(other) => panic!("{other:?}"),
    }
}

#[test]
fn worlds_and_sessions_over_the_limits_are_refused_at_once() {
    let switch = start(|settings| {
        settings.max_workers = 4;
        settings.max_sessions = 2;
    });
    let started = Instant::now();
    let mut big = connect(&switch);
    register(0, 2000, "big").write_to(1, &mut big).unwrap();
    assert_eq!(
        reply(&mut big),
        ControlMessage::Reject {
            code: RejectCode::Limit,
            message: "a world of 2000 workers is above this switch's limit of 4".into()
        }
    );
    assert!(closed(&mut big));
    // Two sessions assembling take both places; a third is refused, not left pending.
    let mut waiting: Vec<TcpStream> = ["one", "two"]
        .iter()
        .map(|name| {
            let mut stream = connect(&switch);
            register(0, 2, name).write_to(1, &mut stream).unwrap();
            stream
        })
        .collect();
    // Both are pending once the switch calls a second rank 0 of each a duplicate: the
    // one it reads second, usually the probe, though connections are read in no order.
    for (pending, name) in waiting.iter_mut().zip(["one", "two"]) {
        let mut probe = connect(&switch);
        register(0, 2, name).write_to(1, &mut probe).unwrap();
        let mut refused =
            if first_to_answer(pending, &mut probe) == 0 { std::mem::replace(pending, probe) } else { probe };
        assert!(matches!(
            reply(&mut refused),
            ControlMessage::Reject { code: RejectCode::DuplicateRank, .. }
        ));
    }
    let mut third = connect(&switch);
    register(0, 2, "three").write_to(1, &mut third).unwrap();
    assert_eq!(
        reply(&mut third),
        ControlMessage::Reject {
            code: RejectCode::Limit,
            message: "2 sessions are open or assembling, the limit is 2".into()
        }
    );
    assert!(started.elapsed() < Duration::from_secs(2), "refused after {:?}", started.elapsed());
    // A rank of a session already assembling still joins it.
    let mut second_rank = connect(&switch);
    register(1, 2, "one").write_to(1, &mut second_rank).unwrap();
    assert!(matches!(reply(&mut second_rank), ControlMessage::Accept { .. }));
    assert!(matches!(reply(&mut waiting[0]), ControlMessage::Accept { .. }));
}

#[test]
fn registrations_and_sessions_that_take_too_long_are_refused_and_closed() {
    let switch = start(|settings| settings.register_timeout = Duration::from_millis(500));
    let mut silent = connect(&switch);
    let mut lonely = connect(&switch);
    register(0, 2, "lonely").write_to(1, &mut lonely).unwrap();
    let started = Instant::now();
    assert_eq!(
        reply(&mut silent),
        ControlMessage::Reject {
            code: RejectCode::Malformed,
            message: "no registration within 500ms of connecting".into()
        }
    );
    assert!(closed(&mut silent));
    assert_eq!(
        reply(&mut lonely),
        ControlMessage::Reject {
            code: RejectCode::Limit,
            message: "session 'lonely' did not assemble within 500ms: 1 of 2 ranks registered".into()
        }
    );
    assert!(closed(&mut lonely));
    assert!(started.elapsed() < Duration::from_secs(2), "refused after {:?}", started.elapsed());
    // The withdrawn registration holds nothing: the name assembles afresh.
    let (_first, _second) = open_pair(&switch, "lonely", Duration::from_secs(2));
    // An open session outlives the timeout.
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(switch.counters().unwrap().engine.sessions_closed, 0);
}

#[test]
fn connections_over_the_cap_are_refused_and_the_sessions_within_it_go_on() {
    let switch = start(|settings| settings.max_connections = 4);
    let (mut first, mut second) = open_pair(&switch, "within", Duration::from_secs(2));
    let _idle = [connect(&switch), connect(&switch)];
    // Lets the acceptor take the idle ones in.
    std::thread::sleep(Duration::from_millis(100));
    for _ in 0..20 {
        let mut over = connect(&switch);
        assert_eq!(
            reply(&mut over),
            ControlMessage::Reject {
                code: RejectCode::Limit,
                message: "the switch serves at most 4 control connections at once; try again later".into()
            }
        );
        assert!(closed(&mut over));
    }
    // The session within the cap is still served: its ranks' leaves are heard, and
    // the session closes with the last.
    ControlMessage::Leave { session: 0, rank: 1 }.write_to(0, &mut second).unwrap();
    assert!(closed(&mut second));
    ControlMessage::Leave { session: 0, rank: 0 }.write_to(0, &mut first).unwrap();
    assert!(closed(&mut first));
    let deadline = Instant::now() + Duration::from_secs(2);
    while switch.counters().unwrap().engine.sessions_closed == 0 {
        assert!(Instant::now() < deadline, "the session did not close");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_rank_s_next_process_registers_as_soon_as_its_last_closed_and_a_live_duplicate_is_refused() {
    let switch = start(|_| {});
    for run in 0..20 {
        let (mut first, mut second) = open_pair(&switch, "default", Duration::from_secs(5));
        let mut duplicate = connect(&switch);
        register(1, 2, "default").write_to(1, &mut duplicate).unwrap();
        assert_eq!(
            reply(&mut duplicate),
            ControlMessage::Reject {
                code: RejectCode::DuplicateRank,
                message: "session 'default' is already running with all its ranks".into()
            },
            "run {run}: rank 1's holder lives"
        );
        // The run ends as a client's does (a leave, then the close) or as a killed
        // process's (the close alone), and the next run's processes register at once,
        // before the switch may have read those ends.
        for (rank, stream) in [&mut first, &mut second].into_iter().enumerate() {
            if run % 2 == 0 {
                ControlMessage::Leave { session: 0, rank: rank as u16 }.write_to(0, stream).unwrap();
            }
            stream.shutdown(Shutdown::Both).unwrap();
        }
    }
}
