//! A switch started in process through the library: bound ports, registration, and a
//! stop that closes workers' connections and returns instead of waiting on them.

use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use netagg_switch::Switch;
use netagg_wire::{ControlMessage, Endpoint, ValueEncoding};

fn loopback_switch() -> Switch {
    let mut settings = netagg_config::Config::default().switch;
    settings.control = "127.0.0.1:0".parse().unwrap();
    settings.data = "127.0.0.1:0".parse().unwrap();
    Switch::start(&settings).expect("a switch starts on free loopback ports")
}

fn register_alone(switch: &Switch) -> (TcpStream, ControlMessage) {
    let mut stream = TcpStream::connect(switch.control_addr()).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let register = ControlMessage::Register {
        rank: 0,
        world_size: 1,
        packet_elements: 64,
        slots: 8,
        depth: 2,
        encoding: ValueEncoding::Native,
        sparse_blocks: false,
        name: "in-process".into(),
        endpoints: vec![Endpoint::Udp("0.0.0.0:9".parse().unwrap())],
    };
    register.write_to(7, &mut stream).unwrap();
    let (request, reply) = ControlMessage::read_from(&mut stream).unwrap();
    assert_eq!(request, 7);
    (stream, reply)
}

/// Reads until the switch closes `stream`, which must happen within a few seconds: an
/// end of stream, or a reset if the connection was still in the listener's backlog.
fn assert_closed_by_the_switch(mut stream: TcpStream) {
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    if let Err(error) = stream.read_to_end(&mut Vec::new()) {
        let waited = matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut);
        assert!(!waited, "the switch left the connection open");
    }
}

#[test]
fn reports_the_ports_it_bound_and_accepts_a_session() {
    let switch = loopback_switch();
    let control = switch.control_addr();
    let data = switch.data_endpoint().udp_address(control.ip()).expect("a UDP data path");
    assert!(control.port() != 0 && data.port() != 0, "{control} {data}");
    assert!(switch.is_running());
    let (stream, reply) = register_alone(&switch);
    assert!(
        matches!(&reply, ControlMessage::Accept { data: endpoints, world_size: 1, .. } if endpoints[..] == [Endpoint::Udp(data)]),
        "{reply:?}"
    );
    assert_eq!(switch.counters().expect("the data path answers").engine.sessions_opened, 1);
    switch.stop().expect("a clean stop");
    assert_closed_by_the_switch(stream);
    assert!(TcpStream::connect(control).is_err(), "nothing listens at {control} after stop");
}

#[test]
fn dropping_stops_it_though_workers_are_still_connected() {
    let switch = loopback_switch();
    let control = switch.control_addr();
    let (registered, _) = register_alone(&switch);
    // Connected but silent: its thread waits up to a minute for a registration.
    let silent = TcpStream::connect(control).unwrap();
    // Lets the acceptor pick the silent connection up, so that stopping must end it.
    std::thread::sleep(Duration::from_millis(50));
    let started = Instant::now();
    drop(switch);
    assert!(started.elapsed() < Duration::from_secs(3), "stopping took {:?}", started.elapsed());
    assert_closed_by_the_switch(registered);
    assert_closed_by_the_switch(silent);
    assert!(TcpStream::connect(control).is_err(), "nothing listens at {control} after drop");
}

#[test]
fn a_taken_address_is_an_error_that_names_it() {
    let first = loopback_switch();
    let mut settings = netagg_config::Config::default().switch;
    settings.control = first.control_addr();
    settings.data = "127.0.0.1:0".parse().unwrap();
    let error = Switch::start(&settings).err().expect("the control port is taken");
    assert!(
        error.to_string().starts_with(&format!("cannot listen on {}: ", first.control_addr())),
        "{error}"
    );
}

#[test]
fn empty_datagrams_are_counted_as_malformed() {
    let switch = loopback_switch();
    let data = switch.data_endpoint().udp_address(switch.control_addr().ip()).expect("a UDP data path");
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    for _ in 0..3 {
        socket.send_to(&[], data).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let engine = switch.counters().expect("the data path answers").engine;
        if engine.datagrams == 3 {
            assert_eq!(engine.malformed, 3);
            break;
        }
        assert!(Instant::now() < deadline, "{} datagrams counted", engine.datagrams);
        std::thread::sleep(Duration::from_millis(10));
    }
}
