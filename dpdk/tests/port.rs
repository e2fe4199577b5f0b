//! A DPDK port in this process, without hugepages or devices: EAL starts once for the
//! whole test binary, as it does for a program.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

use netagg_dpdk::{DpdkError, Eal, Port, PortSettings, Station};

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
        assert!(error.to_string().contains("which would end this process"), "{error}");
    }
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
        while received.is_empty() {
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
