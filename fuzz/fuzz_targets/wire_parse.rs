//! Untrusted bytes through both wire parsers: no panic, and whatever parses emits back
//! to exactly the bytes it came from. The bytes go to the packet parser as they are and
//! sealed (their last four made their checksum), so that the checks behind the checksum
//! see them too.

#![no_main]

use libfuzzer_sys::fuzz_target;
use netagg_wire::packet::{seal, CHECKSUM_LEN};
use netagg_wire::{ControlMessage, Packet, PacketRepr};

/// Fill of the fresh output buffers: not zero, so a byte `emit` forgets to write (a
/// reserved one, say) shows up as a difference.
const FILL: u8 = 0xA5;

/// Parses `data` as a packet, and if it parses, checks that it emits and seals back to
/// `data`.
fn packet_round_trip(data: &[u8]) {
    if let Ok(packet) = Packet::new_checked(data) {
        let repr = PacketRepr::parse(&packet);
        assert_eq!(repr.buffer_len(), data.len(), "buffer_len of {repr:?}");
        let mut buffer = vec![FILL; repr.buffer_len()];
        let mut emitted = repr.emit(&mut buffer).expect("a parsed header emits");
        emitted.payload_mut().copy_from_slice(packet.payload());
        emitted.seal();
        assert!(buffer == data, "packet round trip of {repr:?}");
    }
}

fuzz_target!(|data: &[u8]| {
    packet_round_trip(data);
    if data.len() >= CHECKSUM_LEN {
        let mut sealed = data.to_vec();
        seal(&mut sealed);
        packet_round_trip(&sealed);
    }
    if let Ok((request_id, message)) = ControlMessage::parse(data) {
        assert_eq!(message.buffer_len(), data.len(), "buffer_len of {message:?}");
        let mut buffer = vec![FILL; message.buffer_len()];
        let len = message.emit(request_id, &mut buffer).expect("a parsed message emits");
        assert!(buffer[..len] == *data, "control round trip of {message:?} (request {request_id})");
    }
});
