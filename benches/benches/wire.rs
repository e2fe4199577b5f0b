//! Parsing and building packets: the per-packet cost every datagram pays at both ends.
//!
//! `wire/parse` checks an incoming datagram (`Packet::new_checked`, its checksum
//! included) and reads its header into a `PacketRepr`; `wire/emit` writes a header in
//! front of a payload; `wire/seal` writes the CRC32C of header and payload after them.
//! Criterion's "elem/s" here are packets per second.
//!
//! `checksum/*` times what a packet of 256 int32 (1076 bytes) could end in, each over the
//! same bytes in L1: the CRC32C netagg uses (`crc-fast`, carry-less multiplication fused
//! with the CRC32 instruction), the same CRC through `crc-fast`'s folding alone, the CRC32
//! instruction alone over three interleaved streams (the `crc32c` crate), and XXH3, a
//! 64-bit hash with no guaranteed detection of bit errors.

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

fn checksum(c: &mut Criterion) {
    let mut group = c.benchmark_group("checksum");
    let len = netagg_wire::packet::datagram_len(256) - netagg_wire::packet::CHECKSUM_LEN;
    group.throughput(Throughput::Bytes(len as u64));
    let bytes: Vec<u8> = (0..len).map(|i| (i * 131 % 251) as u8).collect();
    group.bench_function("crc-fast", |b| {
        b.iter(|| crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, black_box(&bytes)))
    });
    // The same CRC32C through crc-fast's general folding (carry-less multiplication alone,
    // VPCLMULQDQ where present), which custom parameters take.
    let folded = crc_fast::CrcParams::new(
        "CRC-32/ISCSI",
        32,
        0x1EDC_6F41,
        0xFFFF_FFFF,
        true,
        0xFFFF_FFFF,
        0xE306_9283,
    );
    assert_eq!(
        crc_fast::checksum_with_params(folded, &bytes),
        crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, &bytes)
    );
    group.bench_function("crc-fast, folding only", |b| {
        b.iter(|| crc_fast::checksum_with_params(folded, black_box(&bytes)))
    });
    group.bench_function("crc32c, 3 streams", |b| b.iter(|| crc32c::crc32c(black_box(&bytes))));
    group.bench_function("xxh3-64", |b| b.iter(|| xxhash_rust::xxh3::xxh3_64(black_box(&bytes))));
    group.finish();
}

criterion_group!(benches, wire, checksum);
criterion_main!(benches);
