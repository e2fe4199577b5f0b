//! Parsing and building packets: the per-packet cost every datagram pays at both ends.
//!
//! `wire/parse` checks an incoming datagram (`Packet::new_checked`, its checksum
//! included) and reads its header into a `PacketRepr`; `wire/emit` writes a header in
//! front of a payload; `wire/seal` writes the CRC32C of header and payload after them.
//! Criterion's "elem/s" here are packets per second.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use netagg_wire::{ElementType, MessageType, Packet, PacketRepr};

fn repr(element_count: u16) -> PacketRepr {
    PacketRepr::new(MessageType::Data, ElementType::Int32, 0x0001_0000, 0x5eed_cafe_f00d_beef, element_count)
}

fn wire(c: &mut Criterion) {
    let mut group = c.benchmark_group("wire");
    group.throughput(Throughput::Elements(1));
    for elements in [256u16, 1024] {
        let repr = repr(elements);
        let mut datagram = vec![0u8; repr.buffer_len()];
        repr.emit(&mut datagram).expect("buffer_len fits the packet").seal();
        group.bench_function(format!("parse/{elements}"), |b| {
            b.iter(|| {
                let packet = Packet::new_checked(black_box(&datagram[..])).expect("a valid packet");
                PacketRepr::parse(&packet)
            })
        });
        let mut buffer = vec![0u8; repr.buffer_len()];
        group.bench_function(format!("emit/{elements}"), |b| {
            b.iter(|| black_box(&repr).emit(&mut buffer).map(|packet| packet.payload().len()))
        });
        group.bench_function(format!("seal/{elements}"), |b| {
            b.iter(|| netagg_wire::packet::seal(black_box(&mut datagram[..])))
        });
    }
    group.finish();
}

criterion_group!(benches, wire);
criterion_main!(benches);
