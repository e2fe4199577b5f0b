//! The switch's data path in memory: a real control plane over TCP, and a
//! [`MemorySocket`] where the UDP port would be, so that what the data path sums, sends
//! and refuses is seen datagram by datagram without sockets.

use std::io::{self, Read};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod common;

use common::{memory_switch, register_message, SWITCH_DATA};
use netagg_aggregator::faults::FaultRates;
use netagg_switch::port::{ConnectionEnd, MemoryNetwork, MemorySocket, ThreadLink};
use netagg_switch::{DataPort, Switch};
use netagg_wire::{
    ControlMessage, ElementType, Endpoint, Flags, MessageType, Packet, PacketRepr, RejectCode,
};

fn start(network: &MemoryNetwork, faults: Option<netagg_config::Faults>) -> Switch {
    memory_switch(network, |settings| {
        if let Some(faults) = faults {
            settings.faults = faults;
        }
    })
}

/// Registers every rank of a session of one thread each; returns their control
/// connections (kept open: closing one ends the session) and the accepts' session and
/// token.
fn open_session(switch: &Switch, name: &str, workers: &[&MemorySocket]) -> (Vec<TcpStream>, u32, u64) {
    let streams: Vec<TcpStream> = (0..)
        .zip(workers)
        .map(|(rank, worker)| {
            let mut stream = TcpStream::connect(switch.control_addr()).unwrap();
            let endpoint = Endpoint::Udp(worker.local_addr());
            register_message(rank, workers.len() as u16, name, endpoint).write_to(1, &mut stream).unwrap();
            stream
        })
        .collect();
    let mut accepted = None;
    for mut stream in &streams {
        stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        match ControlMessage::read_from(&mut stream).unwrap() {
            (1, ControlMessage::Accept { session, token, data, .. }) => {
                assert_eq!(data, [Endpoint::Udp(SWITCH_DATA.parse().unwrap())]);
                accepted = Some((session, token));
            }
            other => panic!("{other:?}"),
        }
    }
    let (session, token) = accepted.unwrap();
    (streams, session, token)
}

fn data(session: u32, token: u64, rank: u16, values: [i32; 4]) -> Vec<u8> {
    let repr = PacketRepr {
        job: 1,
        rank,
        ack_round: u32::MAX,
        ..PacketRepr::new(MessageType::Data, ElementType::Int32, session, token, 4)
    };
    let mut bytes = vec![0u8; repr.buffer_len()];
    let mut packet = repr.emit(&mut bytes).unwrap();
    for (element, value) in packet.payload_mut().chunks_exact_mut(4).zip(values) {
        element.copy_from_slice(&value.to_le_bytes());
    }
    packet.seal();
    bytes
}

/// The datagrams `socket` receives within `wait`, with their sources.
fn received(socket: &mut MemorySocket, wait: Duration) -> Vec<(SocketAddr, Vec<u8>)> {
    let mut datagrams = Vec::new();
    socket.recv(wait, |from, datagram| datagrams.push((from, datagram.to_vec())));
    datagrams
}

fn sums(datagram: &[u8]) -> Vec<i32> {
    let result = Packet::new_checked(datagram).unwrap();
    assert_eq!(result.message_type(), MessageType::Result);
    result.payload().chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().unwrap())).collect()
}

#[test]
fn a_session_s_packets_are_summed_and_the_result_broadcast_to_every_rank() {
    let network = MemoryNetwork::new();
    let switch = start(&network, None);
    let mut workers: Vec<MemorySocket> =
        (0..3).map(|_| network.bind("127.0.0.1:0".parse().unwrap()).unwrap()).collect();
    let (_control, session, token) = open_session(&switch, "sum", &workers.iter().collect::<Vec<_>>());
    let mut forger = network.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    // Rank 2's packet from an address rank 2 did not register, with the right token.
    forger.send_to(SWITCH_DATA.parse().unwrap(), &data(session, token, 2, [666; 4]));
    for (rank, worker) in (0..).zip(workers.iter_mut()) {
        let values = [1, 2, 3, 4].map(|v| v * (i32::from(rank) + 1));
        worker.send_to(SWITCH_DATA.parse().unwrap(), &data(session, token, rank, values));
    }
    for worker in &mut workers {
        let results = received(worker, Duration::from_secs(5));
        assert_eq!(results.len(), 1, "one result each");
        assert_eq!(results[0].0, SWITCH_DATA.parse::<SocketAddr>().unwrap());
        assert_eq!(sums(&results[0].1), [6, 12, 18, 24], "the forged packet was not summed");
    }
    assert!(received(&mut forger, Duration::from_millis(50)).is_empty(), "nothing goes to a forger");
    let counters = switch.counters().unwrap();
    let (_, session_counters) = counters.sessions[0];
    assert_eq!((session_counters.contributions, session_counters.forged), (3, 1));
    assert!(counters.faults.is_none(), "no fault injection configured");
}

#[test]
fn registrations_of_a_transport_the_port_does_not_speak_are_refused_by_name() {
    let network = MemoryNetwork::new();
    let switch = start(&network, None);
    let mut bytes = vec![0u8; 64];
    let register = register_message(0, 1, "rdma", Endpoint::Udp("0.0.0.0:9".parse().unwrap()));
    let len = register.emit(1, &mut bytes).unwrap();
    // The endpoint's kind byte, made one this switch does not know.
    let kind = len - 8;
    assert_eq!(bytes[kind], 1);
    bytes[kind] = 9;
    let mut stream = TcpStream::connect(switch.control_addr()).unwrap();
    std::io::Write::write_all(&mut stream, &bytes[..len]).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let (_, reply) = ControlMessage::read_from(&mut stream).unwrap();
    assert_eq!(
        reply,
        ControlMessage::Reject {
            code: RejectCode::Transport,
            message: "unknown endpoint kind 9: the peer offers a transport this side does not know".into()
        }
    );
    // The switch closes the connection after a malformed message.
    assert_eq!(stream.read(&mut [0u8; 8]).unwrap(), 0);
}

#[test]
fn a_faulty_port_wraps_the_memory_port_and_the_protocol_sees_its_faults() {
    let network = MemoryNetwork::new();
    let faults = netagg_config::Faults { receive: FaultRates::dropping(1.0), seed: 3, ..Default::default() };
    let switch = start(&network, Some(faults));
    let mut worker = network.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let (_control, session, token) = open_session(&switch, "lossy", &[&worker]);
    for _ in 0..5 {
        worker.send_to(SWITCH_DATA.parse().unwrap(), &data(session, token, 0, [1; 4]));
    }
    assert!(received(&mut worker, Duration::from_millis(200)).is_empty(), "every packet was dropped");
    let (receive, send) = switch.counters().unwrap().faults.expect("faults are counted");
    assert_eq!((receive.datagrams, receive.dropped, send.datagrams), (5, 5, 0));
}

#[test]
fn a_udp_endpoint_elsewhere_than_its_registration_is_refused_with_the_session() {
    let network = MemoryNetwork::new();
    let switch = start(&network, None);
    let mut stream = TcpStream::connect(switch.control_addr()).unwrap();
    // Registered from 127.0.0.1, pointing the switch's results at another host.
    let elsewhere = Endpoint::Udp("127.0.0.2:9".parse().unwrap());
    register_message(0, 1, "elsewhere", elsewhere).write_to(1, &mut stream).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let (_, reply) = ControlMessage::read_from(&mut stream).unwrap();
    assert_eq!(
        reply,
        ControlMessage::Reject {
            code: RejectCode::Transport,
            message: "rank 0: its endpoint udp 127.0.0.2:9 is not at 127.0.0.1, where it registered \
                      from: a worker receives at the address it registers from, unless \
                      switch.data_networks holds its address"
                .into()
        }
    );
    assert_eq!(switch.counters().unwrap().engine.sessions_opened, 0);
}

#[test]
fn a_udp_endpoint_in_a_data_network_serves_a_worker_that_registered_elsewhere() {
    // A worker whose data leaves from a NIC of its own (127.0.0.2 here) registers from
    // another address (127.0.0.1): allowed inside switch.data_networks.
    let network = MemoryNetwork::new();
    let switch =
        memory_switch(&network, |settings| settings.data_networks = vec!["127.0.0.2/32".parse().unwrap()]);
    let mut worker = network.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let mut stream = TcpStream::connect(switch.control_addr()).unwrap();
    register_message(0, 1, "own-nic", Endpoint::Udp(worker.local_addr())).write_to(1, &mut stream).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let (_, reply) = ControlMessage::read_from(&mut stream).unwrap();
    let ControlMessage::Accept { session, token, .. } = reply else { panic!("refused: {reply:?}") };
    worker.send_to(SWITCH_DATA.parse().unwrap(), &data(session, token, 0, [1, 2, 3, 4]));
    let results = received(&mut worker, Duration::from_secs(5));
    assert_eq!(results.len(), 1, "the result comes back to the NIC's address");
}

fn data_in_round(session: u32, token: u64, rank: u16, round: u32, values: [i32; 4]) -> Vec<u8> {
    let mut bytes = data(session, token, rank, values);
    let mut packet = Packet::new_checked(&mut bytes[..]).unwrap();
    packet.set_round(round);
    packet.seal();
    bytes
}

/// The end of a program on a lossy network: rank 1 has every result and leaves, while
/// rank 0 lost its last one. The session stays: rank 0's retransmission gets the result
/// back. Only a round that needs rank 1 closes it, and rank 0 is told why.
#[test]
fn a_rank_that_leaves_after_its_last_round_does_not_end_the_others_recovery() {
    let network = MemoryNetwork::new();
    let switch = start(&network, None);
    let mut workers: Vec<MemorySocket> =
        (0..2).map(|_| network.bind("127.0.0.1:0".parse().unwrap()).unwrap()).collect();
    let (mut control, session, token) = open_session(&switch, "leave", &workers.iter().collect::<Vec<_>>());
    let switch_data: SocketAddr = SWITCH_DATA.parse().unwrap();
    for (rank, worker) in (0..).zip(workers.iter_mut()) {
        worker.send_to(switch_data, &data_in_round(session, token, rank, 0, [rank as i32 + 1; 4]));
    }
    for worker in &mut workers {
        assert_eq!(received(worker, Duration::from_secs(5)).len(), 1);
    }
    // Rank 1 leaves and closes its connection, as a finished worker does.
    let mut leaver = control.pop().unwrap();
    ControlMessage::Leave { session, rank: 1 }.write_to(0, &mut leaver).unwrap();
    drop(leaver);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(switch.counters().unwrap().engine.sessions_closed, 0, "the session lives on");
    // Rank 0 resends its contribution, as after losing the result: the result comes back.
    workers[0].send_to(switch_data, &data_in_round(session, token, 0, 0, [1; 4]));
    let resent = received(&mut workers[0], Duration::from_secs(5));
    assert_eq!(resent.len(), 1);
    assert_eq!(sums(&resent[0].1), [3; 4]);
    // A new round needs rank 1: the session closes and rank 0 hears why.
    workers[0].send_to(switch_data, &data_in_round(session, token, 0, 1, [1; 4]));
    let mut remaining = control.pop().unwrap();
    remaining.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(
        ControlMessage::read_from(&mut remaining).unwrap().1,
        ControlMessage::Reject {
            code: RejectCode::UnknownSession,
            message: "rank 1 left session 'leave'; the session is closed".into()
        }
    );
    assert_eq!(switch.counters().unwrap().engine.sessions_closed, 1);
}

/// A memory port whose connections to worker threads fail when a test says so, as an
/// RDMA port's do when a peer's queue pair breaks: the failure is reported by
/// [`DataPort::take_failed`], and the thread's datagrams no longer arrive.
struct Severable {
    inner: MemorySocket,
    severed: Arc<Mutex<Vec<(SocketAddr, ConnectionEnd)>>>,
    cut: Vec<SocketAddr>,
}

impl DataPort for Severable {
    type Address = SocketAddr;

    fn endpoint(&self) -> Endpoint {
        self.inner.endpoint()
    }

    fn resolve(&mut self, endpoint: &Endpoint, peer: IpAddr, link: ThreadLink) -> Result<SocketAddr, String> {
        self.inner.resolve(endpoint, peer, link)
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(SocketAddr, &[u8])) -> io::Result<usize> {
        let cut = &self.cut;
        let mut count = 0;
        DataPort::recv(&mut self.inner, timeout, &mut |source, datagram| {
            if !cut.contains(&source) {
                count += 1;
                sink(source, datagram);
            }
        })?;
        Ok(count)
    }

    fn send(&mut self, destination: SocketAddr, datagram: &[u8]) {
        if !self.cut.contains(&destination) {
            DataPort::send(&mut self.inner, destination, datagram);
        }
    }

    fn flush(&mut self) {}

    fn take_failed(&mut self) -> Vec<(SocketAddr, ConnectionEnd)> {
        let failed = std::mem::take(&mut *self.severed.lock().unwrap());
        self.cut.extend(failed.iter().map(|&(address, _)| address));
        failed
    }
}

/// A switch over a [`Severable`] memory port, two ranks of one thread each in session
/// `name`: their sockets, control connections, session and token, and the handle that
/// fails a thread's connection.
#[allow(clippy::type_complexity)]
fn severable_session(
    network: &MemoryNetwork,
    name: &str,
) -> (Switch, Vec<MemorySocket>, Vec<TcpStream>, u32, u64, Arc<Mutex<Vec<(SocketAddr, ConnectionEnd)>>>) {
    let mut settings = netagg_config::Config::default().switch;
    settings.control = "127.0.0.1:0".parse().unwrap();
    let severed = Arc::default();
    let port = Severable {
        inner: network.bind(SWITCH_DATA.parse().unwrap()).unwrap(),
        severed: Arc::clone(&severed),
        cut: Vec::new(),
    };
    let switch = Switch::start_with_port(&settings, port).unwrap();
    let workers: Vec<MemorySocket> =
        (0..2).map(|_| network.bind("127.0.0.1:0".parse().unwrap()).unwrap()).collect();
    let (control, session, token) = open_session(&switch, name, &workers.iter().collect::<Vec<_>>());
    (switch, workers, control, session, token, severed)
}

/// What each control connection is told next, within `wait`.
fn told(control: &mut [TcpStream], wait: Duration) -> Vec<ControlMessage> {
    control
        .iter_mut()
        .map(|stream| {
            stream.set_read_timeout(Some(wait)).unwrap();
            ControlMessage::read_from(stream).expect("a message within the wait").1
        })
        .collect()
}

/// Mid-round, rank 1's data connection fails while its control connection stays open:
/// the session closes at once, and both ranks are told why, with the cause.
#[test]
fn a_failed_data_connection_mid_round_ends_the_session_for_every_rank_at_once() {
    let network = MemoryNetwork::new();
    let (switch, mut workers, mut control, session, token, severed) = severable_session(&network, "cut");
    let switch_data: SocketAddr = SWITCH_DATA.parse().unwrap();
    // Rank 0's contribution makes the round wait for rank 1.
    workers[0].send_to(switch_data, &data_in_round(session, token, 0, 0, [1; 4]));
    std::thread::sleep(Duration::from_millis(100));
    severed
        .lock()
        .unwrap()
        .push((workers[1].local_addr(), ConnectionEnd::Failed("the peer disconnected".into())));
    let reason = "session 'cut' is closed: rank 1's data connection to the switch failed, worker thread 0: \
                  the peer disconnected";
    let expected = ControlMessage::Reject { code: RejectCode::UnknownSession, message: reason.into() };
    // Well before any timeout: the data path looks after every receive call.
    assert_eq!(told(&mut control, Duration::from_secs(2)), [expected.clone(), expected]);
    assert_eq!(switch.counters().unwrap().engine.sessions_closed, 1);
}

/// Between rounds, rank 1's data connection fails: the session lives on (rank 0 may
/// still be recovering a result), until a round needs rank 1; then both are told why.
#[test]
fn a_failed_data_connection_between_rounds_ends_the_session_when_a_round_needs_its_rank() {
    let network = MemoryNetwork::new();
    let (switch, mut workers, mut control, session, token, severed) = severable_session(&network, "idle");
    let switch_data: SocketAddr = SWITCH_DATA.parse().unwrap();
    for (rank, worker) in (0..).zip(workers.iter_mut()) {
        worker.send_to(switch_data, &data_in_round(session, token, rank, 0, [rank as i32 + 1; 4]));
    }
    for worker in &mut workers {
        assert_eq!(received(worker, Duration::from_secs(5)).len(), 1);
    }
    severed
        .lock()
        .unwrap()
        .push((workers[1].local_addr(), ConnectionEnd::Failed("an RDMA completion failed".into())));
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(switch.counters().unwrap().engine.sessions_closed, 0, "the session lives on");
    workers[0].send_to(switch_data, &data_in_round(session, token, 0, 0, [1; 4]));
    assert_eq!(sums(&received(&mut workers[0], Duration::from_secs(5))[0].1), [3; 4]);
    workers[0].send_to(switch_data, &data_in_round(session, token, 0, 1, [1; 4]));
    let reason = "session 'idle' is closed: rank 1's data connection to the switch failed, worker thread 0: \
                  an RDMA completion failed";
    let expected = ControlMessage::Reject { code: RejectCode::UnknownSession, message: reason.into() };
    assert_eq!(told(&mut control, Duration::from_secs(2)), [expected.clone(), expected]);
}

/// A worker closing as it leaves drops its data connections before it sends Leave:
/// the switch sees rank 1 disconnect first, then leave. The session lives on for rank
/// 0, and the round that needs rank 1 closes it as one whose rank left, not failed.
#[test]
fn a_clean_leave_whose_disconnect_comes_first_reads_as_a_leave() {
    let network = MemoryNetwork::new();
    let (switch, mut workers, mut control, session, token, severed) = severable_session(&network, "bye");
    let switch_data: SocketAddr = SWITCH_DATA.parse().unwrap();
    for (rank, worker) in (0..).zip(workers.iter_mut()) {
        worker.send_to(switch_data, &data_in_round(session, token, rank, 0, [rank as i32 + 1; 4]));
    }
    for worker in &mut workers {
        assert_eq!(received(worker, Duration::from_secs(5)).len(), 1);
    }
    severed.lock().unwrap().push((workers[1].local_addr(), ConnectionEnd::Disconnected));
    std::thread::sleep(Duration::from_millis(200));
    let mut leaver = control.pop().unwrap();
    ControlMessage::Leave { session, rank: 1 }.write_to(0, &mut leaver).unwrap();
    drop(leaver);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(switch.counters().unwrap().engine.sessions_closed, 0, "the session lives on");
    workers[0].send_to(switch_data, &data_in_round(session, token, 0, 1, [1; 4]));
    let expected = ControlMessage::Reject {
        code: RejectCode::UnknownSession,
        message: "rank 1 left session 'bye'; the session is closed".into(),
    };
    assert_eq!(told(&mut control, Duration::from_secs(2)), [expected]);
    assert_eq!(switch.counters().unwrap().engine.sessions_closed, 1);
}

/// Rank 0 has left; then rank 1's data connection fails, which leaves no rank: the
/// session closes at once, rather than at the idle timeout, and rank 1 is told why.
#[test]
fn a_failed_data_connection_of_the_last_rank_closes_the_session_at_once() {
    let network = MemoryNetwork::new();
    let (switch, mut workers, mut control, session, token, severed) = severable_session(&network, "last");
    let switch_data: SocketAddr = SWITCH_DATA.parse().unwrap();
    for (rank, worker) in (0..).zip(workers.iter_mut()) {
        worker.send_to(switch_data, &data_in_round(session, token, rank, 0, [rank as i32 + 1; 4]));
    }
    for worker in &mut workers {
        assert_eq!(received(worker, Duration::from_secs(5)).len(), 1);
    }
    let mut leaver = control.remove(0);
    ControlMessage::Leave { session, rank: 0 }.write_to(0, &mut leaver).unwrap();
    drop(leaver);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(switch.counters().unwrap().engine.sessions_closed, 0, "rank 1 is still there");
    severed
        .lock()
        .unwrap()
        .push((workers[1].local_addr(), ConnectionEnd::Failed("an RDMA completion failed".into())));
    let reason = "session 'last' is closed: rank 1's data connection to the switch failed, worker thread 0: \
                  an RDMA completion failed";
    let expected = ControlMessage::Reject { code: RejectCode::UnknownSession, message: reason.into() };
    assert_eq!(told(&mut control, Duration::from_secs(2)), [expected]);
    assert_eq!(switch.counters().unwrap().engine.sessions_closed, 1);
}

/// `GET path` on the metrics endpoint: the status line and the body.
fn http_get(address: SocketAddr, path: &str) -> (String, String) {
    let mut stream = TcpStream::connect(address).unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    std::io::Write::write_all(&mut stream, request.as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_string(), body.to_string())
}

/// Every sample of a scrape in the text format, `name{labels}` to value; fails the test on
/// a line that is neither a sample nor a comment.
fn scrape(address: SocketAddr) -> std::collections::HashMap<String, f64> {
    let (status, body) = http_get(address, "/metrics");
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(body.ends_with("# EOF\n"), "{body}");
    body.lines()
        .filter(|line| !line.starts_with('#'))
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("sample line '{line}'"));
            (series.to_string(), value.parse().unwrap_or_else(|_| panic!("sample value in '{line}'")))
        })
        .collect()
}

#[test]
fn the_metrics_endpoint_shows_a_live_session_s_packets_and_keeps_them_once_it_closes() {
    let network = MemoryNetwork::new();
    let switch = memory_switch(&network, |settings| settings.metrics = Some("127.0.0.1:0".parse().unwrap()));
    let metrics = switch.metrics_addr().expect("metrics served");
    let idle = scrape(metrics);
    assert_eq!(idle["netagg_switch_sessions{state=\"open\"}"], 0.0);
    assert_eq!(idle["netagg_switch_datagrams_total{lane=\"0\"}"], 0.0);
    assert!(idle["process_resident_memory_bytes"] > 1e6, "{idle:?}");

    let mut workers: Vec<MemorySocket> =
        (0..3).map(|_| network.bind("127.0.0.1:0".parse().unwrap()).unwrap()).collect();
    let (mut control, session, token) = open_session(&switch, "scraped", &workers.iter().collect::<Vec<_>>());
    let switch_data: SocketAddr = SWITCH_DATA.parse().unwrap();
    // Four rounds of three ranks, each acknowledging the round before; rank 0 numbers its
    // first sendings 0, 2, 3 and 4, so that the switch takes number 1 as lost. Then rank
    // 0's last packet twice, one packet too short to parse and one of a session that does
    // not exist.
    let numbered = |rank: u16, round: u32, number: u8| {
        let mut bytes = data_in_round(session, token, rank, round, [1; 4]);
        let mut packet = Packet::new_checked(&mut bytes[..]).unwrap();
        packet.set_ack_round(round.wrapping_sub(1));
        packet.set_sequence(number);
        packet.seal();
        bytes
    };
    for round in 0..4 {
        for (rank, worker) in (0..).zip(workers.iter_mut()) {
            let number = if rank == 0 { [0, 2, 3, 4][round as usize] } else { round as u8 };
            worker.send_to(switch_data, &numbered(rank, round, number));
        }
    }
    workers[0].send_to(switch_data, &numbered(0, 3, 4));
    // Rank 2 asks for round 4's result, which no rank has contributed to yet.
    let request = PacketRepr {
        job: 1,
        rank: 2,
        round: 4,
        ack_round: 3,
        flags: Flags::WANT_RESULT,
        ..PacketRepr::new(MessageType::Ack, ElementType::Int32, session, token, 0)
    };
    let mut bytes = vec![0u8; request.buffer_len()];
    request.emit(&mut bytes).unwrap().seal();
    workers[2].send_to(switch_data, &bytes);
    workers[1].send_to(switch_data, &[1, 2, 3]);
    workers[2].send_to(switch_data, &data(session ^ 0x5a5a, token, 2, [1; 4]));
    let lost_notices = received(&mut workers[0], Duration::from_millis(300))
        .iter()
        .map(|(_, datagram)| PacketRepr::parse(&Packet::new_checked(&datagram[..]).unwrap()))
        .filter(|repr| repr.message_type == MessageType::Pending && repr.flags == Flags::LOST)
        .map(|repr| (repr.round, repr.sequence))
        .collect::<Vec<_>>();
    assert_eq!(lost_notices, [(3, 1)], "rank 0 is told of number 1 with round 3's packet");
    for worker in &mut workers[1..] {
        received(worker, Duration::from_millis(300));
    }

    let live = scrape(metrics);
    let id = format!("session=\"{session:#010x}\"");
    let at = |samples: &std::collections::HashMap<String, f64>, series: &str| {
        *samples.get(series).unwrap_or_else(|| panic!("no {series} in {samples:?}"))
    };
    assert_eq!(at(&live, "netagg_switch_sessions{state=\"open\"}"), 1.0);
    assert_eq!(at(&live, "netagg_switch_control_connections"), 3.0);
    assert_eq!(at(&live, "netagg_switch_datagrams_total{lane=\"0\"}"), 16.0);
    assert_eq!(at(&live, &format!("netagg_switch_session_packets_total{{{id}}}")), 14.0);
    assert_eq!(at(&live, &format!("netagg_switch_session_not_ready_total{{{id}}}")), 1.0);
    assert_eq!(at(&live, &format!("netagg_switch_session_contributions_total{{{id}}}")), 12.0);
    assert_eq!(at(&live, &format!("netagg_switch_session_results_total{{{id}}}")), 4.0);
    assert_eq!(at(&live, &format!("netagg_switch_session_duplicates_total{{{id}}}")), 1.0);
    assert_eq!(at(&live, &format!("netagg_switch_session_lost_notices_total{{{id}}}")), 1.0);
    assert_eq!(at(&live, &format!("netagg_switch_session_lost_notices_dropped_total{{{id}}}")), 0.0);
    assert_eq!(at(&live, "netagg_switch_lost_notices_total"), 1.0);
    assert_eq!(at(&live, &format!("netagg_switch_session_open{{{id}}}")), 1.0);
    assert_eq!(at(&live, "netagg_switch_dropped_total{cause=\"malformed\",lane=\"0\"}"), 1.0);
    assert_eq!(at(&live, "netagg_switch_dropped_total{cause=\"wrong_session\",lane=\"0\"}"), 1.0);
    assert_eq!(at(&live, "netagg_switch_packets_total"), 14.0);
    assert!(at(&live, "netagg_switch_uptime_seconds") > at(&idle, "netagg_switch_uptime_seconds"));

    // A rank's connection closes: the session ends, and its series stay with their counts.
    drop(control.pop());
    std::thread::sleep(Duration::from_millis(300));
    let closed = scrape(metrics);
    assert_eq!(at(&closed, "netagg_switch_sessions{state=\"open\"}"), 0.0);
    assert_eq!(at(&closed, "netagg_switch_sessions_closed_total"), 1.0);
    assert_eq!(at(&closed, &format!("netagg_switch_session_open{{{id}}}")), 0.0);
    assert_eq!(at(&closed, &format!("netagg_switch_session_packets_total{{{id}}}")), 14.0);
    assert_eq!(at(&closed, "netagg_switch_packets_total"), 14.0, "closed sessions count once");

    assert_eq!(http_get(metrics, "/").0, "HTTP/1.1 404 Not Found");
    drop(switch);
    assert!(TcpStream::connect(metrics).is_err(), "the endpoint closes with the switch");
}
