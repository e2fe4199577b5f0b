//! A DPDK port in this process, without hugepages or devices: EAL starts once for the
//! whole test binary, as it does for a program.

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddrV4};
use std::time::{Duration, Instant};

use netagg_dpdk::{
    DpdkError, Eal, PollMode, Port, PortEndpoint, PortSettings, Settings, Station, ThreadEndpoint,
};

fn eal_args() -> Vec<String> {
    "--no-huge --no-shconf -m 64 --no-pci --log-level=lib.eal:warning"
        .split_whitespace()
        .map(String::from)
        .collect()
}

fn eal() -> &'static Eal {
    Eal::start(&eal_args()).expect("EAL starts without hugepages")
}

fn settings(device: &str) -> PortSettings {
    PortSettings {
        device: device.into(),
        rx_descriptors: 256,
        tx_descriptors: 256,
        pool_size: 1023,
        queues: 1,
    }
}

/// An endpoint's settings on `device`, with this binary's EAL arguments.
fn endpoint_settings(device: &str) -> Settings {
    Settings {
        section: "test.dpdk",
        eal_args: eal_args(),
        device: device.into(),
        peer_mac: None,
        rx_descriptors: 256,
        tx_descriptors: 256,
        pool_size: 2047,
        burst: 32,
        poll: PollMode::Busy,
    }
}

#[test]
fn a_second_start_with_other_arguments_is_refused_and_the_same_ones_reuse_eal() {
    let eal = eal();
    assert_eq!(eal.args(), eal_args());
    let mut other = eal_args();
    other.push("--no-telemetry".into());
    let error = Eal::start(&other).unwrap_err();
    assert!(matches!(error, DpdkError::EalRunning { .. }), "{error}");
    assert!(error.to_string().contains("starts once per process"), "{error}");
    assert!(std::ptr::eq(Eal::start(&eal_args()).unwrap(), eal));
}

#[test]
fn arguments_that_would_exit_the_process_are_refused() {
    for argument in ["-h", "--help", "--log-level=help"] {
        let error = Eal::start(&[argument.to_string()]).unwrap_err();
        assert!(error.to_string().contains("end this process"), "{error}");
    }
    // Several lcores, which EAL aborts the process for when it cannot start their
    // threads, are refused before EAL sees them, while EAL runs with one.
    let mut several = eal_args();
    several.extend(["-l".to_string(), "0-1".to_string()]);
    let error = Eal::start(&several).unwrap_err();
    assert!(matches!(error, DpdkError::RefusedArgument { .. }), "{error}");
    assert!(error.to_string().contains("names several lcores"), "{error}");
}

#[test]
fn missing_devices_are_errors_with_dpdks_reason() {
    let eal = eal();
    let error = Port::open(eal, &settings("net_nosuchdriver0")).err().expect("no such driver");
    assert!(error.to_string().starts_with("DPDK device 'net_nosuchdriver0': cannot probe it"), "{error}");
    let error =
        Port::open(eal, &settings("net_af_packet7,iface=nosuchif0")).err().expect("no such interface");
    assert!(error.to_string().contains("cannot probe it"), "{error}");
    let error = Port::open(eal, &settings("")).err().expect("no device");
    assert!(error.to_string().contains("no device named"), "{error}");
    let small_pool = PortSettings { pool_size: 512, ..settings("net_null2") };
    let error = Port::open(eal, &small_pool).err().expect("a pool smaller than the rings");
    assert!(error.to_string().contains("cannot fill its rings (1 × 256 receive and 256 transmit"), "{error}");
}

#[test]
fn a_station_on_a_loopback_ring_receives_what_it_sends_and_answers_arp() {
    // net_ring with no arguments is a port whose transmit ring is its receive ring.
    let queue = Port::open(eal(), &settings("net_ring0")).expect("a ring port starts").pop().unwrap();
    let ip = Ipv4Addr::new(10, 9, 8, 7);
    let mut station = Station::new(queue, ip, None, 32);
    let own_mac = station.mac();

    // The first send asks by ARP and is dropped; the request comes back and is answered,
    // the reply teaches the station its own MAC, and the next send leaves.
    let destination = SocketAddrV4::new(ip, 5000);
    let datagram = station.datagram(6).expect("a frame");
    assert!(!station.send(datagram, 6, 4000, destination));
    let mac = station.resolve(ip, Duration::from_secs(2), &mut |_| panic!("no datagram yet")).unwrap();
    assert_eq!(mac, own_mac);
    let counters = station.counters();
    assert_eq!((counters.arp_requests_sent, counters.arp_requests_answered, counters.unresolved), (1, 1, 1));

    for round in 0..100u32 {
        let mut datagram = station.datagram(64).expect("a frame");
        datagram.payload_mut()[..4].copy_from_slice(&round.to_le_bytes());
        assert!(station.send(datagram, 4, 4000, destination));
        station.flush();
        let mut received = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while received.is_empty() && Instant::now() < deadline {
            station.poll(&mut |datagram| {
                received.push((datagram.source, datagram.port, datagram.payload().to_vec()))
            });
        }
        assert_eq!(received, vec![(SocketAddrV4::new(ip, 4000), 5000, round.to_le_bytes().to_vec())]);
    }
    assert!(station.datagram(station.max_payload() + 1).is_none());
    assert_eq!(station.max_payload(), 1500 - 28);
}

#[test]
fn a_device_open_already_is_refused_and_opens_again_once_closed() {
    let eal = eal();
    let first = Port::open(eal, &settings("net_null1")).expect("a null port starts");
    let error = Port::open(eal, &settings("net_null1")).err().expect("a second owner");
    assert!(error.to_string().contains("it is open already in this process"), "{error}");
    // The refusal left the first port running.
    let frame = first[0].port().frame(64).expect("the first port's pool still serves");
    drop(frame);
    drop(first);
    let again = Port::open(eal, &settings("net_null1")).expect("the device opens again once closed");
    assert_eq!(again[0].port().mtu(), 1500);
    drop(again);
    // As many queues as asked where the device has them (net_null has plenty), each its
    // own; the port closes with the last.
    let queues =
        Port::open(eal, &PortSettings { queues: 3, pool_size: 2047, ..settings("net_null1") }).unwrap();
    assert_eq!(queues.iter().map(|queue| queue.index()).collect::<Vec<_>>(), [0, 1, 2]);
}

#[test]
fn threads_sharing_a_port_receive_what_another_thread_polled_for_them() {
    // net_ring's queues are loops of their own: what a queue sends, it receives.
    let ip = Ipv4Addr::new(10, 9, 8, 6);
    let mut endpoints = ThreadEndpoint::open(&endpoint_settings("net_ring4"), ip, 2, 16).unwrap();
    let (mut second, mut first) = (endpoints.pop().unwrap(), endpoints.pop().unwrap());
    assert!(first.to_string().ends_with("2 threads on 2 queues"), "{first}");
    assert_eq!(second.send(8, |_| 0).unwrap_err().kind(), io::ErrorKind::NotConnected);

    // Both threads' peers are their own two addresses: what the first sends on its queue
    // comes back on it, each datagram to the thread it was sent to.
    let peers = [first.local_address(), second.local_address()];
    first.connect(&peers, IpAddr::V4(ip)).unwrap();
    second.connect(&peers, IpAddr::V4(ip)).unwrap();
    for round in 0..4u8 {
        first.send_buffer(8).fill(round);
        // Odd rounds to the second peer, picked from the datagram's bytes.
        first.send(8, |datagram| usize::from(datagram[0] % 2)).unwrap();
    }
    first.send_buffer(8);
    let error = first.send(8, |_| 2).unwrap_err();
    assert_eq!(error.to_string(), "no peer 2: this endpoint has 2");
    first.flush();
    // The second thread polls the first one's queue after its own, keeps what is for
    // itself, and leaves the rest in the first one's inbox.
    // Until a deadline: a lost or misdirected datagram fails the test, not hangs it.
    let mut received = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while received.len() < 2 && Instant::now() < deadline {
        second.recv(Duration::from_millis(100), |payload| received.push(payload.to_vec())).unwrap();
    }
    assert_eq!(received, [vec![1; 8], vec![3; 8]]);
    received.clear();
    assert_eq!(first.recv(Duration::from_secs(1), |payload| received.push(payload.to_vec())).unwrap(), 2);
    assert_eq!(received, [vec![0; 8], vec![2; 8]]);
    let none = first.recv(Duration::from_millis(50), |_| panic!("every datagram came once"));
    assert_eq!(none.unwrap(), 0);
}

#[test]
fn a_port_endpoint_receives_at_its_own_udp_port_only() {
    let ip = Ipv4Addr::new(10, 9, 8, 5);
    let mut endpoint = PortEndpoint::open(&endpoint_settings("net_ring5"), ip, 0).unwrap();
    let own = endpoint.local_address();
    assert_eq!(*own.ip(), ip);
    // The first datagram asks for the MAC and is lost; the endpoint answers its own ARP.
    endpoint.send(own, b"lost");
    endpoint.flush();
    assert_eq!(endpoint.recv(Duration::from_millis(20), |_, _| panic!("the first datagram left")), 0);
    assert_eq!(endpoint.counters().unresolved, 1);

    endpoint.send(own, b"netagg");
    endpoint.send(SocketAddrV4::new(ip, own.port().wrapping_add(1)), b"another port's");
    endpoint.flush();
    let mut received = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while received.is_empty() && Instant::now() < deadline {
        endpoint
            .recv(Duration::from_millis(100), |source, payload| received.push((source, payload.to_vec())));
    }
    assert_eq!(received, [(own, b"netagg".to_vec())]);
    assert_eq!(endpoint.max_payload(), 1500 - 28);
}
