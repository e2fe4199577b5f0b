//! Untrusted bytes through both wire parsers: no panic, and whatever parses emits back
//! to exactly the bytes it came from.

#![no_main]

use libfuzzer_sys::fuzz_target;
use netagg_wire::{ControlMessage, Packet, PacketRepr};

/// Fill of the fresh output buffers: not zero, so a byte `emit` forgets to write (a
/// reserved one, say) shows up as a difference.
const FILL: u8 = 0xA5;

fuzz_target!(|data: &[u8]| {
    if let Ok(packet) = Packet::new_checked(data) {
        let repr = PacketRepr::parse(&packet);
        assert_eq!(repr.buffer_len(), data.len(), "buffer_len of {repr:?}");
        let mut buffer = vec![FILL; repr.buffer_len()];
        let mut emitted = repr.emit(&mut buffer).expect("a parsed header emits");
        emitted.payload_mut().copy_from_slice(packet.payload());
        assert!(buffer == data, "packet round trip of {repr:?}");
    }
    if let Ok((request_id, message)) = ControlMessage::parse(data) {
        assert_eq!(message.buffer_len(), data.len(), "buffer_len of {message:?}");
        let mut buffer = vec![FILL; message.buffer_len()];
        let len = message.emit(request_id, &mut buffer).expect("a parsed message emits");
        assert!(buffer[..len] == *data, "control round trip of {message:?} (request {request_id})");
    }
});
