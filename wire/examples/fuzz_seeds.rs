//! One valid message of each kind, built with this crate's `PacketRepr` and
//! `ControlMessage`, each written to a file of its own in a folder: the seed corpus of the
//! `wire_parse` fuzz target, so that every fuzz run starts from the round trip of each
//! payload and control body in the current format. `.ci/fuzz-smoke` runs it before the
//! targets:
//!
//! `cargo run -p netagg-wire --example fuzz_seeds -- fuzz/corpus/wire_parse`

use std::net::SocketAddr;
use std::path::Path;

use netagg_wire::{
    ControlMessage, ElementType, Endpoint, Flags, MessageType, Packet, PacketRepr, RejectCode, SlotSplit,
    ValueEncoding,
};

const SESSION: u32 = 0x0001_0001;
const TOKEN: u64 = 0x1122_3344_5566_7788;
const REQUEST: u32 = 42;

fn main() -> Result<(), String> {
    let folder = std::env::args().nth(1).ok_or("usage: fuzz_seeds FOLDER")?;
    write_seeds(Path::new(&folder), &seeds())
}

/// Every packet type with a payload or none, flags and the fields each type uses; every
/// control message, with UDP and RDMA endpoints.
fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let header = |message_type, element_type, element_count| PacketRepr {
        job: 7,
        slot: 1,
        ..PacketRepr::new(message_type, element_type, SESSION, TOKEN, element_count)
    };
    let data = PacketRepr {
        flags: Flags::SPARSE,
        packet_id: 3,
        rank: 2,
        exponent: -5,
        round: 5,
        block: 3,
        next_block: 11,
        ack_round: 4,
        // The sending thread's 100th first sending to this switch.
        sequence: 100,
        ..header(MessageType::Data, ElementType::Int32, 2)
    };
    let mut result = PacketRepr {
        packet_id: 3,
        rank: netagg_wire::packet::BROADCAST_RANK,
        // The switch's 200th broadcast to this worker thread.
        sequence: 200,
        round: 5,
        block: 3,
        next_block: netagg_wire::packet::END_OF_STREAM,
        ..header(MessageType::Result, ElementType::Float32, 1)
    };
    result.set_completed_by(Some(1));
    // 16-bit elements, two bytes each: a float16 contribution and a bfloat16 result.
    let data_float16 = PacketRepr { element_type: ElementType::Float16, element_count: 3, ..data };
    let result_bfloat16 = PacketRepr { element_type: ElementType::BFloat16, element_count: 2, ..result };
    let ack = PacketRepr {
        flags: Flags::SPARSE | Flags::WANT_RESULT,
        rank: 2,
        round: 6,
        ack_round: 5,
        ..header(MessageType::Ack, ElementType::Int32, 0)
    };
    let pending = PacketRepr {
        flags: Flags::CONTRIBUTED,
        rank: 2,
        round: 6,
        ..header(MessageType::Pending, ElementType::Int32, 0)
    };
    // The switch found this rank's thread's first sending 97 lost, shown by this round's.
    let lost = PacketRepr { flags: Flags::LOST, sequence: 97, ..pending };
    let probe =
        PacketRepr { rank: 2, round: 6, ack_round: 5, ..header(MessageType::Probe, ElementType::Int32, 0) };
    // Slots 1 to 3: open rounds 6, 9 and 9; this rank's contributions are in slots 1 and 3.
    let mut progress = PacketRepr { rank: 2, ..header(MessageType::Progress, ElementType::Int32, 3) };
    progress.set_contributions(0b101);
    let open_rounds = [6u32, 9, 9].map(u32::to_le_bytes).concat();

    let udp = |address: &str| Endpoint::Udp(address.parse::<SocketAddr>().expect("a literal address"));
    let register = |name: &str, endpoints| ControlMessage::Register {
        rank: 1,
        world_size: 4,
        packet_elements: 256,
        slots: 128,
        depth: 2,
        encoding: ValueEncoding::BlockFloatingPoint,
        sparse_blocks: false,
        name: name.into(),
        endpoints,
    };
    let accept = |data| ControlMessage::Accept {
        session: 0xdead_beef,
        rank: 1,
        world_size: 4,
        packet_elements: 256,
        slots: 128,
        depth: 2,
        token: TOKEN,
        data,
        split: SlotSplit::Ranges,
    };
    let rdma =
        |address: &str, tag| Endpoint::Rdma { address: address.parse().expect("a literal address"), tag };

    vec![
        ("data", packet(&data, &[1i32.to_le_bytes(), (-1i32).to_le_bytes()].concat())),
        ("result", packet(&result, &1.0f32.to_le_bytes())),
        // float16 1.0, -2.0 and +infinity; bfloat16 1.0 and a quiet NaN.
        ("data-float16", packet(&data_float16, &[0x00, 0x3C, 0x00, 0xC0, 0x00, 0x7C])),
        ("result-bfloat16", packet(&result_bfloat16, &[0x80, 0x3F, 0xC0, 0x7F])),
        ("ack", packet(&ack, &[])),
        ("pending", packet(&pending, &[])),
        ("pending-lost", packet(&lost, &[])),
        ("probe", packet(&probe, &[])),
        ("progress", packet(&progress, &open_rounds)),
        ("register", control(&register("job", vec![udp("0.0.0.0:40000"), udp("10.0.0.2:40001")]))),
        ("register-rdma", control(&register("job", vec![rdma("10.0.0.2:0", 0x0123_4567_89ab_cdef)]))),
        ("accept", control(&accept(vec![udp("0.0.0.0:48864")]))),
        ("accept-threads", control(&accept(vec![udp("0.0.0.0:48864"), udp("0.0.0.0:48865")]))),
        ("accept-rdma", control(&accept(vec![rdma("[::]:48864", 0)]))),
        ("reject", control(&ControlMessage::Reject { code: RejectCode::Limit, message: "limit".into() })),
        ("leave", control(&ControlMessage::Leave { session: 0xdead_beef, rank: 1 })),
    ]
}

/// The bytes of a packet with header `repr` and `payload`, checked to parse back.
fn packet(repr: &PacketRepr, payload: &[u8]) -> Vec<u8> {
    let mut bytes = vec![0; repr.buffer_len()];
    let mut view = repr.emit(&mut bytes).unwrap_or_else(|e| panic!("{repr:?} does not emit: {e}"));
    view.payload_mut().copy_from_slice(payload);
    view.seal();
    let parsed = Packet::new_checked(&bytes).map(|packet| PacketRepr::parse(&packet));
    assert_eq!(parsed.as_ref().ok(), Some(repr), "a seed that does not parse back: {parsed:?}");
    bytes
}

/// The bytes of control message `message`, checked to parse back.
fn control(message: &ControlMessage) -> Vec<u8> {
    let mut bytes = Vec::new();
    message.write_to(REQUEST, &mut bytes).unwrap_or_else(|e| panic!("{message:?} does not emit: {e}"));
    let parsed = ControlMessage::parse(&bytes);
    assert_eq!(
        parsed.as_ref().ok(),
        Some(&(REQUEST, message.clone())),
        "a seed that does not parse back: {parsed:?}"
    );
    bytes
}

/// Writes each seed to `folder/seed-<name>`.
fn write_seeds(folder: &Path, seeds: &[(&str, Vec<u8>)]) -> Result<(), String> {
    std::fs::create_dir_all(folder).map_err(|e| format!("{}: {e}", folder.display()))?;
    for (name, bytes) in seeds {
        let path = folder.join(format!("seed-{name}"));
        std::fs::write(&path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}
