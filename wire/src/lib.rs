//! netagg's wire formats: typed views over bytes, shared by workers and the switch.
//!
//! Two families of messages exist:
//! - [`packet`]: the aggregation packets of the data path (worker → switch *data*, *ack* and
//!   *probe*, switch → worker *result*, *pending* and *progress*), one fixed 48-byte header
//!   followed by the payload and a CRC32C of both;
//! - [`control`]: registration and session set-up, exchanged once per session.
//!
//! Each format comes as a view over a byte buffer (`Packet<T: AsRef<[u8]>>`), with getters,
//! setters when `T: AsMut<[u8]>`, `new_checked` for untrusted input and `new_unchecked` for
//! building, and as a `Repr` that holds only valid states, with `parse`, `emit` and
//! `buffer_len`.
//!
//! # Byte order
//! Every multi-byte field and every payload element is **little-endian**. SwitchML's
//! switch parses big-endian because a Tofino does; netagg's aggregator is software on
//! little-endian hosts, where little-endian payloads are summed in place without a byte
//! swap per element per hop. `docs/protocol.md` lists every field.
//!
//! # Panics
//! Accessors of a view made with `new_checked` never panic. A view made with
//! `new_unchecked` over a buffer shorter than its header panics in the accessors that read
//! past its end, and the enum getters (`message_type`, `element_type`, and the payload
//! accessors, which the element type sizes) panic on a value no valid packet holds: build with `new_unchecked`, read untrusted bytes with `new_checked`.

#![forbid(unsafe_code)]

pub mod control;
pub mod packet;

pub use control::{
    ControlMessage, Endpoint, EndpointKind, RejectCode, SlotSplit, ValueEncoding, CONTROL_VERSION,
};
pub use packet::{ElementType, Flags, Integrity, MessageType, Packet, PacketRepr};

/// Version of the aggregation-packet format (2: the 48-byte header with the session
/// token; 3: the block-floating-point exponent byte is the f32 exponent field less 128,
/// with markers for zero and non-finite blocks; 4: the switch's *pending* notice, which
/// answers a request or a repeated contribution for a round still aggregating; 5: the
/// *probe* and its *progress* report, which carries the map of contributions a pending
/// notice no longer does; 6: a CRC32C trailer over header and payload, so that a
/// corrupted datagram is dropped rather than summed; 7: a result's *sequence* byte, the
/// switch's count of broadcasts to the recipient's worker thread, so that a lost result
/// shows as a gap at the next one; 8: the mirror, a contribution's first sending
/// numbered by its worker thread in the same byte, and the pending notice with
/// [`Flags::LOST`] by which the switch names one it found missing). The control protocol
/// has its own,
/// [`CONTROL_VERSION`].
pub const PACKET_VERSION: u8 = 8;

/// The largest UDP payload over IPv4: the bound on any netagg datagram.
pub const MAX_DATAGRAM_LEN: usize = 65_507;

/// Why a byte buffer is not a valid netagg message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("message truncated: {len} bytes, at least {needed} needed")]
    Truncated { len: usize, needed: usize },
    #[error("message of {len} bytes exceeds the {max}-byte limit")]
    Oversized { len: usize, max: usize },
    #[error("message length {len} does not match the {expected} bytes its header announces")]
    LengthMismatch { len: usize, expected: usize },
    #[error("protocol version {found} is not supported (this side speaks {supported})")]
    Version { found: u8, supported: u8 },
    #[error("unknown message type {0}")]
    UnknownMessageType(u8),
    #[error("unknown element type {0}")]
    UnknownElementType(u8),
    #[error("unknown endpoint kind {0}: the peer offers a transport this side does not know")]
    UnknownEndpoint(u8),
    #[error("unknown flag bits {0:#04x}")]
    UnknownFlags(u8),
    #[error("invalid field {field}: {reason}")]
    InvalidField { field: &'static str, reason: &'static str },
    #[error(
        "checksum {found:#010x} does not match {computed:#010x}, the CRC32C of the bytes it covers: the \
         datagram was corrupted on its way"
    )]
    Checksum { found: u32, computed: u32 },
    #[error("buffer of {len} bytes cannot hold a {needed}-byte message")]
    BufferTooSmall { len: usize, needed: usize },
}

pub type Result<T> = core::result::Result<T, WireError>;
