//! What netagg's DPDK code costs per datagram, without a NIC: a [`Station`] on DPDK's
//! `net_ring` device (its transmit ring is its receive ring) sends bursts of datagrams to
//! itself and reads them back, each written into an mbuf with its Ethernet, IPv4 and UDP
//! headers, handed to the ring, polled, parsed and read. That is the code a real NIC
//! would leave as the cost of the DPDK path; net_ring itself costs a ring enqueue and
//! dequeue per burst.
//!
//! Group `dpdk_station/burst_32x1072` (32 datagrams of 1072 bytes, the default
//! `packet_numel` of 256), in one run:
//! - `station_round_trip`: the above;
//! - `memcpy`: copying the same payloads into and out of buffers, the least any path
//!   does;
//! - `kernel_udp_loopback`: the same datagrams through a pair of kernel UDP sockets on
//!   loopback, batched as netagg's UDP backend batches them (GSO, recvmmsg and GRO).
//!
//! EAL starts without hugepages (root, as in CI). Throughput is in datagrams.

use std::hint::black_box;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use netagg_dpdk::{Eal, Port, PortSettings, Station};
use netagg_udp::{BatchSocket, SegmentBatch};

const BURST: usize = 32;
/// A packet of 256 int32 elements with netagg's 48-byte header.
const DATAGRAM: usize = 48 + 256 * 4;

fn dpdk_station(c: &mut Criterion) {
    let payload: Vec<u8> = (0..DATAGRAM).map(|i| i as u8).collect();
    let mut group = c.benchmark_group(format!("dpdk_station/burst_{BURST}x{DATAGRAM}"));
    group.throughput(Throughput::Elements(BURST as u64));
    group.measurement_time(Duration::from_secs(5));

    let args: Vec<String> =
        "--no-huge --no-shconf -m 128 --no-pci --no-telemetry --log-level=lib.eal:warning"
            .split_whitespace()
            .map(String::from)
            .collect();
    let eal = Eal::start(&args).expect("EAL starts without hugepages (as root)");
    let settings = PortSettings {
        device: "net_ring0".into(),
        rx_descriptors: 1024,
        tx_descriptors: 1024,
        pool_size: 4095,
        queues: 1,
    };
    let queue = Port::open(eal, &settings).expect("a net_ring port").pop().expect("a queue");
    let ip = Ipv4Addr::new(10, 0, 0, 1);
    // Frames go to the port's own MAC, so no ARP is asked.
    let mac = queue.port().mac();
    let mut station = Station::new(queue, ip, Some(mac), BURST as u16);
    let destination = SocketAddrV4::new(ip, 5000);
    let mut received = vec![0u8; DATAGRAM];
    group.bench_function("station_round_trip", |b| {
        b.iter(|| {
            for _ in 0..BURST {
                let mut datagram = station.datagram(DATAGRAM).expect("the pool has frames");
                datagram.payload_mut()[..DATAGRAM].copy_from_slice(&payload);
                station.send(datagram, DATAGRAM, 4000, destination);
            }
            station.flush();
            let mut count = 0;
            while count < BURST {
                station.poll(&mut |datagram| {
                    received.copy_from_slice(datagram.payload());
                    count += 1;
                });
            }
            black_box(&received);
        })
    });

    let mut buffers = vec![vec![0u8; DATAGRAM]; BURST];
    group.bench_function("memcpy", |b| {
        b.iter(|| {
            for buffer in &mut buffers {
                buffer.copy_from_slice(black_box(&payload));
            }
            for buffer in &buffers {
                received.copy_from_slice(black_box(buffer));
            }
            black_box(&received);
        })
    });

    let loopback = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let sender = BatchSocket::bind(loopback, 4 << 20).expect("a UDP socket");
    let mut receiver = BatchSocket::bind(loopback, 4 << 20).expect("a UDP socket");
    let to = receiver.local_addr().expect("bound");
    let mut batch = SegmentBatch::new(sender.max_segments());
    group.bench_function("kernel_udp_loopback", |b| {
        b.iter(|| {
            for _ in 0..BURST {
                if !batch.accepts(DATAGRAM) {
                    sender.send(to, &batch).expect("loopback takes the batch");
                    batch.clear();
                }
                batch.push(&payload);
            }
            sender.send(to, &batch).expect("loopback takes the batch");
            batch.clear();
            let mut count = 0;
            while count < BURST {
                receiver
                    .recv(Duration::from_secs(1), |_, datagram| {
                        received.copy_from_slice(datagram);
                        count += 1;
                    })
                    .expect("loopback delivers");
            }
            black_box(&received);
        })
    });
    group.finish();
}

criterion_group!(benches, dpdk_station);
criterion_main!(benches);
