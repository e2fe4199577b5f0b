//! Control messages: registration into a session and leaving it.
//!
//! Every message is an 8-byte header followed by a body (little-endian):
//!
//! | offset | size | field      |
//! |-------:|-----:|------------|
//! | 0      | 1    | version ([`PROTOCOL_VERSION`]) |
//! | 1      | 1    | type: 1 register, 2 accept, 3 reject, 4 leave |
//! | 2      | 2    | body length |
//! | 4      | 4    | request id, echoed in the reply |
//!
//! Bodies are listed with each [`ControlMessage`] variant and in `docs/protocol.md`.

use crate::{Result, WireError, PROTOCOL_VERSION};

/// Length of the control header.
pub const CONTROL_HEADER_LEN: usize = 8;
/// Longest session name, in bytes of UTF-8.
pub const MAX_SESSION_NAME_LEN: usize = 64;
/// Longest reject message, in bytes of UTF-8.
pub const MAX_REJECT_MESSAGE_LEN: usize = 1024;
/// Most worker threads one registration may announce.
pub const MAX_THREADS: usize = 1024;

const REGISTER: u8 = 1;
const ACCEPT: u8 = 2;
const REJECT: u8 = 3;
const LEAVE: u8 = 4;

/// How a session's workers encode floats; every rank must agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ValueEncoding {
    /// int32 as is, float32 as native floats summed by the aggregator.
    Native = 0,
    /// float32 quantised to int32 with a per-packet exponent (switch-faithful).
    BlockFloatingPoint = 1,
}

impl TryFrom<u8> for ValueEncoding {
    type Error = WireError;
    fn try_from(value: u8) -> Result<Self> {
        match value {
            0 => Ok(Self::Native),
            1 => Ok(Self::BlockFloatingPoint),
            _ => Err(WireError::InvalidField { field: "encoding", reason: "unknown encoding" }),
        }
    }
}

/// Why the switch refused a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum RejectCode {
    /// The worker speaks another protocol version.
    Version = 1,
    /// Parameters differ from those of ranks already registered in the session.
    Mismatch = 2,
    /// The rank is already registered in the session.
    DuplicateRank = 3,
    /// The rank is not below the world size.
    RankOutOfRange = 4,
    /// A configured limit (sessions, workers, slots, bytes) would be exceeded.
    Limit = 5,
    /// The message names a session the switch does not hold.
    UnknownSession = 6,
    /// The message could not be parsed.
    Malformed = 7,
}

impl TryFrom<u16> for RejectCode {
    type Error = WireError;
    fn try_from(value: u16) -> Result<Self> {
        Ok(match value {
            1 => Self::Version,
            2 => Self::Mismatch,
            3 => Self::DuplicateRank,
            4 => Self::RankOutOfRange,
            5 => Self::Limit,
            6 => Self::UnknownSession,
            7 => Self::Malformed,
            _ => return Err(WireError::InvalidField { field: "code", reason: "unknown reject code" }),
        })
    }
}

/// A control message, in valid states only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlMessage {
    /// Worker → switch: join session `name` as `rank` of `world_size`.
    ///
    /// Body: rank u16, world size u16, packet elements u16, slots u16, depth u8,
    /// encoding u8, sparse blocks u8 (0 or 1), name length u8, name, thread count u16,
    /// one UDP port u16 per thread.
    Register {
        rank: u16,
        world_size: u16,
        /// Elements per packet.
        packet_elements: u16,
        /// Slots every worker keeps in flight (its window, all threads together).
        slots: u16,
        /// Rounds a slot retains for loss recovery (2 is SwitchML's shadow copy).
        depth: u8,
        encoding: ValueEncoding,
        /// Whether blocks zero on this worker stay off the wire (`general.sparse`): a
        /// slot's packets must all be dense or all sparse, so every rank must agree.
        sparse_blocks: bool,
        /// Groups the registrations of one job; distinct names are distinct sessions.
        name: String,
        /// The UDP port of each worker thread, at the address the registration came
        /// from; thread `t` uses slots `t·slots/threads .. (t+1)·slots/threads`.
        ports: Vec<u16>,
    },
    /// Switch → worker, once every rank has registered: the session is open.
    ///
    /// Body: session u32, rank u16, world size u16, packet elements u16, slots u16,
    /// depth u8, reserved u8, data port u16, token u64.
    Accept {
        session: u32,
        rank: u16,
        world_size: u16,
        packet_elements: u16,
        slots: u16,
        depth: u8,
        /// The switch's UDP port for aggregation packets.
        data_port: u16,
        /// The session's secret, drawn from the switch's CSPRNG: every aggregation
        /// packet of the session carries it, and the switch drops those that do not.
        token: u64,
    },
    /// Switch → worker: the request is refused.
    ///
    /// Body: code u16, message length u16, message (UTF-8).
    Reject { code: RejectCode, message: String },
    /// Worker → switch: this rank leaves the session; the session closes with its first
    /// leaver. Body: session u32, rank u16.
    Leave { session: u32, rank: u16 },
}

impl ControlMessage {
    /// Bytes of the whole message: header and body.
    pub fn buffer_len(&self) -> usize {
        CONTROL_HEADER_LEN + self.body_len()
    }

    fn body_len(&self) -> usize {
        match self {
            Self::Register { name, ports, .. } => 14 + name.len() + 2 * ports.len(),
            Self::Accept { .. } => 24,
            Self::Reject { message, .. } => 4 + message.len(),
            Self::Leave { .. } => 6,
        }
    }

    /// Parses one message, returning its request id with it.
    pub fn parse(bytes: &[u8]) -> Result<(u32, ControlMessage)> {
        if bytes.len() < CONTROL_HEADER_LEN {
            return Err(WireError::Truncated { len: bytes.len(), needed: CONTROL_HEADER_LEN });
        }
        if bytes[0] != PROTOCOL_VERSION {
            return Err(WireError::Version { found: bytes[0] });
        }
        let body_len = u16::from_le_bytes([bytes[2], bytes[3]]) as usize;
        let request_id = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
        let expected = CONTROL_HEADER_LEN + body_len;
        if bytes.len() != expected {
            return Err(if bytes.len() < expected {
                WireError::Truncated { len: bytes.len(), needed: expected }
            } else {
                WireError::LengthMismatch { len: bytes.len(), expected }
            });
        }
        let mut body = Reader { bytes: &bytes[CONTROL_HEADER_LEN..] };
        let message = match bytes[1] {
            REGISTER => Self::Register {
                rank: body.u16()?,
                world_size: body.u16()?,
                packet_elements: body.u16()?,
                slots: body.u16()?,
                depth: body.u8()?,
                encoding: ValueEncoding::try_from(body.u8()?)?,
                sparse_blocks: match body.u8()? {
                    0 => false,
                    1 => true,
                    _ => {
                        return Err(WireError::InvalidField { field: "sparse blocks", reason: "not 0 or 1" })
                    }
                },
                name: {
                    let len = body.u8()? as usize;
                    body.text(len, MAX_SESSION_NAME_LEN, "name")?
                },
                ports: {
                    let threads = body.u16()? as usize;
                    if threads == 0 || threads > MAX_THREADS {
                        return Err(WireError::InvalidField { field: "threads", reason: "not 1 to 1024" });
                    }
                    (0..threads).map(|_| body.u16()).collect::<Result<Vec<u16>>>()?
                },
            },
            ACCEPT => Self::Accept {
                session: body.u32()?,
                rank: body.u16()?,
                world_size: body.u16()?,
                packet_elements: body.u16()?,
                slots: body.u16()?,
                depth: body.u8()?,
                data_port: {
                    if body.u8()? != 0 {
                        return Err(WireError::InvalidField { field: "reserved", reason: "must be zero" });
                    }
                    body.u16()?
                },
                token: body.u64()?,
            },
            REJECT => Self::Reject {
                code: RejectCode::try_from(body.u16()?)?,
                message: {
                    let len = body.u16()? as usize;
                    body.text(len, MAX_REJECT_MESSAGE_LEN, "message")?
                },
            },
            LEAVE => Self::Leave { session: body.u32()?, rank: body.u16()? },
            other => return Err(WireError::UnknownMessageType(other)),
        };
        if !body.bytes.is_empty() {
            return Err(WireError::LengthMismatch {
                len: bytes.len(),
                expected: expected - body.bytes.len(),
            });
        }
        Ok((request_id, message))
    }

    /// Reads one message from a byte stream (the control plane's TCP connection): the
    /// header, then the body it announces. A malformed message is an `InvalidData` error
    /// carrying the [`WireError`]; a stream that ends before a header, `UnexpectedEof`.
    pub fn read_from(reader: &mut impl std::io::Read) -> std::io::Result<(u32, ControlMessage)> {
        let mut header = [0u8; CONTROL_HEADER_LEN];
        reader.read_exact(&mut header)?;
        let body_len = u16::from_le_bytes([header[2], header[3]]) as usize;
        let mut message = vec![0u8; CONTROL_HEADER_LEN + body_len];
        message[..CONTROL_HEADER_LEN].copy_from_slice(&header);
        reader.read_exact(&mut message[CONTROL_HEADER_LEN..])?;
        ControlMessage::parse(&message).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    }

    /// Writes the message to a byte stream in one piece.
    pub fn write_to(&self, request_id: u32, writer: &mut impl std::io::Write) -> std::io::Result<()> {
        let mut buffer = vec![0u8; self.buffer_len()];
        self.emit(request_id, &mut buffer)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        writer.write_all(&buffer)
    }

    /// Writes the message into the front of `buffer` and returns its length.
    pub fn emit(&self, request_id: u32, buffer: &mut [u8]) -> Result<usize> {
        let len = self.buffer_len();
        match self {
            Self::Register { name, .. } if name.len() > MAX_SESSION_NAME_LEN => {
                return Err(WireError::InvalidField { field: "name", reason: "longer than 64 bytes" })
            }
            Self::Register { ports, .. } if ports.is_empty() || ports.len() > MAX_THREADS => {
                return Err(WireError::InvalidField { field: "threads", reason: "not 1 to 1024" })
            }
            Self::Reject { message, .. } if message.len() > MAX_REJECT_MESSAGE_LEN => {
                return Err(WireError::InvalidField { field: "message", reason: "longer than 1024 bytes" })
            }
            _ => {}
        }
        if buffer.len() < len {
            return Err(WireError::BufferTooSmall { len: buffer.len(), needed: len });
        }
        let mut out = Writer { bytes: &mut buffer[..len], at: 0 };
        out.u8(PROTOCOL_VERSION);
        match self {
            Self::Register {
                rank,
                world_size,
                packet_elements,
                slots,
                depth,
                encoding,
                sparse_blocks,
                name,
                ports,
            } => {
                out.header(REGISTER, self.body_len(), request_id);
                out.u16(*rank);
                out.u16(*world_size);
                out.u16(*packet_elements);
                out.u16(*slots);
                out.u8(*depth);
                out.u8(*encoding as u8);
                out.u8(u8::from(*sparse_blocks));
                out.u8(name.len() as u8);
                out.slice(name.as_bytes());
                out.u16(ports.len() as u16);
                ports.iter().for_each(|&port| out.u16(port));
            }
            Self::Accept { session, rank, world_size, packet_elements, slots, depth, data_port, token } => {
                out.header(ACCEPT, self.body_len(), request_id);
                out.u32(*session);
                out.u16(*rank);
                out.u16(*world_size);
                out.u16(*packet_elements);
                out.u16(*slots);
                out.u8(*depth);
                out.u8(0);
                out.u16(*data_port);
                out.u64(*token);
            }
            Self::Reject { code, message } => {
                out.header(REJECT, self.body_len(), request_id);
                out.u16(*code as u16);
                out.u16(message.len() as u16);
                out.slice(message.as_bytes());
            }
            Self::Leave { session, rank } => {
                out.header(LEAVE, self.body_len(), request_id);
                out.u32(*session);
                out.u16(*rank);
            }
        }
        debug_assert_eq!(out.at, len);
        Ok(len)
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.bytes.len() < n {
            return Err(WireError::InvalidField { field: "body", reason: "shorter than its fields" });
        }
        let (head, tail) = self.bytes.split_at(n);
        self.bytes = tail;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().expect("take returned 8 bytes")))
    }
    fn text(&mut self, len: usize, max: usize, field: &'static str) -> Result<String> {
        if len > max {
            return Err(WireError::InvalidField { field, reason: "too long" });
        }
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| WireError::InvalidField { field, reason: "not UTF-8" })
    }
}

struct Writer<'a> {
    bytes: &'a mut [u8],
    at: usize,
}

impl Writer<'_> {
    fn slice(&mut self, data: &[u8]) {
        self.bytes[self.at..self.at + data.len()].copy_from_slice(data);
        self.at += data.len();
    }
    fn u8(&mut self, v: u8) {
        self.slice(&[v]);
    }
    fn u16(&mut self, v: u16) {
        self.slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.slice(&v.to_le_bytes());
    }
    fn header(&mut self, message_type: u8, body_len: usize, request_id: u32) {
        self.u8(message_type);
        self.u16(body_len as u16);
        self.u32(request_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn register() -> ControlMessage {
        ControlMessage::Register {
            rank: 1,
            world_size: 4,
            packet_elements: 256,
            slots: 128,
            depth: 2,
            encoding: ValueEncoding::BlockFloatingPoint,
            sparse_blocks: false,
            name: "job".into(),
            ports: vec![4000, 4001],
        }
    }

    #[rustfmt::skip]
    const REGISTER_BYTES: [u8; 29] = [
        0x03, 0x01, 0x15, 0x00, 0x2A, 0x00, 0x00, 0x00, // version, register, body 21, request 42
        0x01, 0x00, 0x04, 0x00, 0x00, 0x01, 0x80, 0x00, // rank 1, world 4, 256 elements, 128 slots
        0x02, 0x01, 0x00, 0x03, b'j', b'o', b'b',       // depth 2, block fp, dense, name "job"
        0x02, 0x00, 0xA0, 0x0F, 0xA1, 0x0F,             // 2 threads: ports 4000, 4001
    ];

    #[test]
    fn register_bytes_round_trip() {
        let mut buffer = [0u8; 64];
        let len = register().emit(42, &mut buffer).unwrap();
        assert_eq!(&buffer[..len], &REGISTER_BYTES[..]);
        assert_eq!(ControlMessage::parse(&REGISTER_BYTES).unwrap(), (42, register()));
    }

    #[test]
    fn accept_carries_the_token_after_the_data_port() {
        let accept = ControlMessage::Accept {
            session: 0x0001_0002,
            rank: 1,
            world_size: 4,
            packet_elements: 256,
            slots: 128,
            depth: 2,
            data_port: 48864,
            token: 0x1122_3344_5566_7788,
        };
        #[rustfmt::skip]
        let expected: [u8; 32] = [
            0x03, 0x02, 0x18, 0x00, 0x07, 0x00, 0x00, 0x00, // version, accept, body 24, request 7
            0x02, 0x00, 0x01, 0x00,                         // session
            0x01, 0x00, 0x04, 0x00, 0x00, 0x01, 0x80, 0x00, // rank 1, world 4, 256 elements, 128 slots
            0x02, 0x00, 0xE0, 0xBE,                         // depth 2, reserved, data port 48864
            0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, // token
        ];
        let mut buffer = [0u8; 32];
        assert_eq!(accept.emit(7, &mut buffer).unwrap(), 32);
        assert_eq!(buffer, expected);
        assert_eq!(ControlMessage::parse(&expected).unwrap(), (7, accept));
    }

    #[test]
    fn every_message_round_trips() {
        let messages = [
            register(),
            ControlMessage::Accept {
                session: 0xDEAD_BEEF,
                rank: 3,
                world_size: 64,
                packet_elements: 1024,
                slots: 256,
                depth: 8,
                data_port: 48864,
                token: 0x0123_4567_89AB_CDEF,
            },
            ControlMessage::Reject {
                code: RejectCode::Mismatch,
                message: "world size 4 differs from 8 of rank 0".into(),
            },
            ControlMessage::Leave { session: 9, rank: 2 },
        ];
        for message in messages {
            let mut buffer = vec![0u8; message.buffer_len()];
            assert_eq!(message.emit(7, &mut buffer).unwrap(), buffer.len());
            assert_eq!(ControlMessage::parse(&buffer).unwrap(), (7, message));
        }
    }

    #[test]
    fn messages_travel_over_a_byte_stream() {
        let mut stream = Vec::new();
        register().write_to(42, &mut stream).unwrap();
        ControlMessage::Leave { session: 1, rank: 1 }.write_to(43, &mut stream).unwrap();
        assert_eq!(&stream[..REGISTER_BYTES.len()], &REGISTER_BYTES[..]);
        let mut reader = &stream[..];
        assert_eq!(ControlMessage::read_from(&mut reader).unwrap(), (42, register()));
        assert_eq!(
            ControlMessage::read_from(&mut reader).unwrap(),
            (43, ControlMessage::Leave { session: 1, rank: 1 })
        );
        let end = ControlMessage::read_from(&mut reader).unwrap_err();
        assert_eq!(end.kind(), std::io::ErrorKind::UnexpectedEof);
        let mut bad = &[9u8, 1, 0, 0, 0, 0, 0, 0][..];
        let error = ControlMessage::read_from(&mut bad).unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidData);
        assert_eq!(
            error.into_inner().unwrap().downcast::<WireError>().unwrap().as_ref(),
            &WireError::Version { found: 9 }
        );
    }

    #[test]
    fn truncated_and_oversized_messages_are_rejected() {
        assert_eq!(
            ControlMessage::parse(&REGISTER_BYTES[..5]).unwrap_err(),
            WireError::Truncated { len: 5, needed: 8 }
        );
        assert_eq!(
            ControlMessage::parse(&REGISTER_BYTES[..28]).unwrap_err(),
            WireError::Truncated { len: 28, needed: 29 }
        );
        let mut longer = REGISTER_BYTES.to_vec();
        longer.push(0);
        assert_eq!(
            ControlMessage::parse(&longer).unwrap_err(),
            WireError::LengthMismatch { len: 30, expected: 29 }
        );
    }

    #[test]
    fn body_length_that_lies_is_rejected() {
        // A body length covering the bytes but a name length pointing past them.
        let mut bytes = REGISTER_BYTES;
        bytes[19] = 30;
        assert!(matches!(
            ControlMessage::parse(&bytes).unwrap_err(),
            WireError::InvalidField { field: "body", .. }
        ));
    }

    #[test]
    fn wrong_version_and_unknown_type_are_rejected() {
        let mut bytes = REGISTER_BYTES;
        bytes[0] = 9;
        assert_eq!(ControlMessage::parse(&bytes).unwrap_err(), WireError::Version { found: 9 });
        let mut bytes = REGISTER_BYTES;
        bytes[1] = 99;
        assert_eq!(ControlMessage::parse(&bytes).unwrap_err(), WireError::UnknownMessageType(99));
    }

    #[test]
    fn reserved_bytes_must_be_zero() {
        let accept = ControlMessage::Accept {
            session: 1,
            rank: 0,
            world_size: 2,
            packet_elements: 64,
            slots: 8,
            depth: 2,
            data_port: 9,
            token: 0,
        };
        let mut bytes = vec![0u8; accept.buffer_len()];
        accept.emit(0, &mut bytes).unwrap();
        bytes[21] = 1;
        assert_eq!(
            ControlMessage::parse(&bytes).unwrap_err(),
            WireError::InvalidField { field: "reserved", reason: "must be zero" }
        );
    }

    #[test]
    fn invalid_values_are_rejected() {
        let mut bytes = REGISTER_BYTES;
        bytes[17] = 7; // encoding
        assert!(matches!(
            ControlMessage::parse(&bytes).unwrap_err(),
            WireError::InvalidField { field: "encoding", .. }
        ));
        let mut bytes = REGISTER_BYTES;
        bytes[18] = 2; // sparse blocks
        assert!(matches!(
            ControlMessage::parse(&bytes).unwrap_err(),
            WireError::InvalidField { field: "sparse blocks", .. }
        ));
        let mut bytes = REGISTER_BYTES;
        bytes[20] = 0xFF; // name not UTF-8
        assert!(matches!(
            ControlMessage::parse(&bytes).unwrap_err(),
            WireError::InvalidField { field: "name", reason: "not UTF-8" }
        ));
        let long = ControlMessage::Register {
            rank: 0,
            world_size: 1,
            packet_elements: 64,
            slots: 1,
            depth: 2,
            encoding: ValueEncoding::Native,
            sparse_blocks: false,
            name: "x".repeat(65),
            ports: vec![1],
        };
        assert!(long.emit(0, &mut [0u8; 128]).is_err());
        let mut bytes = REGISTER_BYTES;
        bytes[23] = 0; // no threads
        bytes[24] = 0;
        assert!(matches!(
            ControlMessage::parse(&bytes[..25]).unwrap_err(),
            WireError::Truncated { .. } | WireError::InvalidField { field: "threads", .. }
        ));
    }
}
