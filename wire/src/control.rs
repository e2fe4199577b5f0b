//! Control messages: registration into a session and leaving it.
//!
//! Every message is an 8-byte header followed by a body (little-endian):
//!
//! | offset | size | field      |
//! |-------:|-----:|------------|
//! | 0      | 1    | version ([`CONTROL_VERSION`]) |
//! | 1      | 1    | type: 1 register, 2 accept, 3 reject, 4 leave |
//! | 2      | 2    | body length |
//! | 4      | 4    | request id, echoed in the reply |
//!
//! Bodies are listed with each [`ControlMessage`] variant and in `docs/protocol.md`.
//! Where the data path is reached travels as an [`Endpoint`]: a transport kind and its
//! address, so that a new transport adds a kind, not a message.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::{Result, WireError};

/// Version of the control protocol (4: registration and accept carry transport-tagged
/// endpoints instead of UDP ports; 5: the same messages, for packets of
/// [`PACKET_VERSION`](crate::PACKET_VERSION) 4; 6: an accept lists the switch's data
/// endpoints and how the session's slots split over them, for packets of version 5; 7: the
/// same messages, for packets of version 6, which carry a checksum).
/// Registration is where a worker and a
/// switch meet, so this version also stands for the packet format they will speak: peers
/// of another version refuse each other's first message with [`WireError::Version`],
/// which names both versions.
pub const CONTROL_VERSION: u8 = 7;

/// Length of the control header.
pub const CONTROL_HEADER_LEN: usize = 8;
/// Longest session name, in bytes of UTF-8.
pub const MAX_SESSION_NAME_LEN: usize = 64;
/// Longest reject message, in bytes of UTF-8.
pub const MAX_REJECT_MESSAGE_LEN: usize = 1024;
/// Most worker threads one registration may announce.
pub const MAX_THREADS: usize = 1024;
/// Most data endpoints one accept may list.
pub const MAX_DATA_ENDPOINTS: usize = 1024;

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

/// Which of an accept's data endpoints owns each slot of the session: its packets go
/// there, and its results come from there.
///
/// One rule serves both a switch whose data-path threads each own a share of the slots
/// and a session spread over several switches: the worker sends each slot's packets to
/// its owner, whatever serves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum SlotSplit {
    /// Contiguous ranges, in endpoint order: of `slots` slots over `endpoints`, slot `s`
    /// belongs to endpoint `s · endpoints / slots`. A worker thread's slots are a
    /// contiguous range too, so that with as many endpoints as threads each thread talks
    /// to one endpoint and its send batches stay whole.
    Ranges = 0,
}

impl SlotSplit {
    /// The index of the endpoint, of `endpoints`, that owns `slot` of `slots`.
    pub fn owner(self, slot: u16, slots: u16, endpoints: usize) -> usize {
        match self {
            SlotSplit::Ranges => usize::from(slot) * endpoints / usize::from(slots.max(1)),
        }
    }

    /// The slots, of `slots`, that endpoint `endpoint` of `endpoints` owns: those whose
    /// [`SlotSplit::owner`] it is (possibly none, with fewer slots than endpoints).
    pub fn owned(self, endpoint: usize, slots: u16, endpoints: usize) -> std::ops::Range<u16> {
        match self {
            SlotSplit::Ranges => {
                // The first slot s with s · endpoints / slots ≥ e is ⌈e · slots / endpoints⌉.
                let first = |e: usize| (e * usize::from(slots)).div_ceil(endpoints.max(1)) as u16;
                first(endpoint)..first(endpoint + 1)
            }
        }
    }
}

/// The ranks, of a world of `world_size`, that rack `rack` of `racks` holds in an
/// aggregation tree: contiguous ranges in rack order, by the rule that splits slots over
/// endpoints ([`SlotSplit::Ranges`]), so that racks differ in size by one at most.
pub fn rack_ranks(rack: u16, racks: u16, world_size: u16) -> std::ops::Range<u16> {
    SlotSplit::Ranges.owned(usize::from(rack), world_size, usize::from(racks))
}

/// The rack, of `racks`, whose [`rack_ranks`] hold `rank` of a world of `world_size`;
/// `None` for a rank outside the world or no racks.
pub fn rack_of(rank: u16, racks: u16, world_size: u16) -> Option<u16> {
    let inside = rank < world_size && racks > 0;
    // The owner is below `racks`, a u16, for a rank inside the world.
    inside.then(|| SlotSplit::Ranges.owner(rank, world_size, usize::from(racks)) as u16)
}

impl TryFrom<u8> for SlotSplit {
    type Error = WireError;
    fn try_from(value: u8) -> Result<Self> {
        match value {
            0 => Ok(Self::Ranges),
            _ => Err(WireError::InvalidField { field: "slot split", reason: "unknown rule" }),
        }
    }
}

/// Bytes of the private data a worker thread's RDMA connection request carries.
pub const RDMA_HELLO_LEN: usize = 16;
const RDMA_HELLO_MAGIC: [u8; 7] = *b"netaggR";

/// The private data of a worker thread's RDMA connection request: "netaggR", the control
/// version, then the tag of the [`Endpoint::Rdma`] it registered (u64), so that the
/// switch knows which registered thread is connecting.
pub fn rdma_hello(tag: u64) -> [u8; RDMA_HELLO_LEN] {
    let mut hello = [0; RDMA_HELLO_LEN];
    hello[..7].copy_from_slice(&RDMA_HELLO_MAGIC);
    hello[7] = CONTROL_VERSION;
    hello[8..].copy_from_slice(&tag.to_le_bytes());
    hello
}

/// The tag of an [`rdma_hello`] (which may come padded with zeros, as RoCE pads private
/// data); `None` for anything else, or a hello of another control version.
pub fn rdma_hello_tag(private: &[u8]) -> Option<u64> {
    let hello = private.get(..RDMA_HELLO_LEN)?;
    if hello[..7] != RDMA_HELLO_MAGIC || hello[7] != CONTROL_VERSION {
        return None;
    }
    Some(u64::from_le_bytes(hello[8..].try_into().expect("8 bytes")))
}

/// The transports an [`Endpoint`] can name, by their kind byte on the wire.
///
/// A peer that meets a kind it does not know refuses the message with
/// [`WireError::UnknownEndpoint`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum EndpointKind {
    Udp = 1,
    Rdma = 2,
}

impl std::fmt::Display for EndpointKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EndpointKind::Udp => "udp",
            EndpointKind::Rdma => "rdma",
        })
    }
}

/// Where one side's data path is reached: a worker thread's, announced in its
/// registration, or the switch's, announced in its accept.
///
/// On the wire: kind u8, length u8, then the kind's address of that many bytes. In
/// every kind an unspecified IP stands for the address of the control connection's
/// other end, so that neither side needs to know which of its addresses the other
/// reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// A UDP socket (kind 1; 6 bytes: IPv4 address, port u16; or 18: IPv6 address, port).
    Udp(SocketAddr),
    /// An RDMA reliable connection set up through rdma_cm (kind 2; the UDP kind's bytes,
    /// then tag u64). The switch announces where it listens, with tag 0. A worker thread
    /// announces the IP its connection comes from (port 0: rdma_cm picks one) and an
    /// unguessable tag that its connection request then carries, so that the switch
    /// knows which registered thread is connecting.
    Rdma { address: SocketAddr, tag: u64 },
}

impl Endpoint {
    pub fn kind(&self) -> EndpointKind {
        match self {
            Endpoint::Udp(_) => EndpointKind::Udp,
            Endpoint::Rdma { .. } => EndpointKind::Rdma,
        }
    }

    /// The socket address as announced, an unspecified IP left so.
    pub fn socket_addr(&self) -> SocketAddr {
        let (Endpoint::Udp(address) | Endpoint::Rdma { address, .. }) = *self;
        address
    }

    /// The socket address meant, an unspecified IP replaced by `peer`: the IP the control
    /// connection's other end has.
    pub fn address(&self, peer: IpAddr) -> SocketAddr {
        let mut address = self.socket_addr();
        if address.ip().is_unspecified() {
            address.set_ip(peer);
        }
        address
    }

    /// [`Endpoint::address`] of a UDP endpoint; `None` for other kinds.
    pub fn udp_address(&self, peer: IpAddr) -> Option<SocketAddr> {
        matches!(self, Endpoint::Udp(_)).then(|| self.address(peer))
    }

    fn address_len(&self) -> usize {
        let ip_and_port = if self.socket_addr().is_ipv4() { 6 } else { 18 };
        match self {
            Endpoint::Udp(_) => ip_and_port,
            Endpoint::Rdma { .. } => ip_and_port + 8,
        }
    }

    fn buffer_len(&self) -> usize {
        2 + self.address_len()
    }

    fn read(body: &mut Reader) -> Result<Endpoint> {
        let kind = body.u8()?;
        let len = body.u8()? as usize;
        let mut address = Reader { bytes: body.take(len)? };
        let socket_address = |address: &mut Reader, ipv6: bool| {
            let ip = match ipv6 {
                false => IpAddr::V4(Ipv4Addr::from(address.array::<4>()?)),
                true => IpAddr::V6(Ipv6Addr::from(address.array::<16>()?)),
            };
            Ok(SocketAddr::new(ip, address.u16()?))
        };
        let endpoint = match (kind, len) {
            (1, 6 | 18) => Endpoint::Udp(socket_address(&mut address, len == 18)?),
            (1, _) => {
                return Err(WireError::InvalidField {
                    field: "endpoint",
                    reason: "a UDP endpoint has 6 or 18 bytes",
                })
            }
            (2, 14 | 26) => {
                Endpoint::Rdma { address: socket_address(&mut address, len == 26)?, tag: address.u64()? }
            }
            (2, _) => {
                return Err(WireError::InvalidField {
                    field: "endpoint",
                    reason: "an RDMA endpoint has 14 or 26 bytes",
                })
            }
            (other, _) => return Err(WireError::UnknownEndpoint(other)),
        };
        Ok(endpoint)
    }

    fn write(&self, out: &mut Writer) {
        out.u8(self.kind() as u8);
        out.u8(self.address_len() as u8);
        let address = self.socket_addr();
        match address.ip() {
            IpAddr::V4(ip) => out.slice(&ip.octets()),
            IpAddr::V6(ip) => out.slice(&ip.octets()),
        }
        out.u16(address.port());
        if let Endpoint::Rdma { tag, .. } = self {
            out.u64(*tag);
        }
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Udp(address) => write!(f, "udp {address}"),
            Endpoint::Rdma { address, tag: 0 } => write!(f, "rdma {address}"),
            Endpoint::Rdma { address, tag } => write!(f, "rdma {} tag {tag:#018x}", address.ip()),
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
    /// The switch serves no data port of the endpoints' transport.
    Transport = 8,
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
            8 => Self::Transport,
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
    /// one [`Endpoint`] per thread.
    Register {
        rank: u16,
        world_size: u16,
        /// Elements of 4 bytes per packet: its payload bytes (16-bit packets carry twice as many).
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
        /// Where each worker thread receives results, all of one transport; thread `t`
        /// uses slots `t·slots/threads .. (t+1)·slots/threads`.
        endpoints: Vec<Endpoint>,
    },
    /// Switch → worker, once every rank has registered: the session is open.
    ///
    /// Body: session u32, rank u16, world size u16, packet elements u16, slots u16,
    /// depth u8, slot split u8, token u64, endpoint count u16, one data [`Endpoint`]
    /// each.
    Accept {
        session: u32,
        rank: u16,
        world_size: u16,
        packet_elements: u16,
        slots: u16,
        depth: u8,
        /// The session's secret, drawn from the switch's CSPRNG: every aggregation
        /// packet of the session carries it, and the switch drops those that do not.
        token: u64,
        /// Where the switch's data path takes this worker's packets, all of the
        /// transport the worker registered with: each slot's packets go to the endpoint
        /// that `split` names its owner.
        data: Vec<Endpoint>,
        split: SlotSplit,
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
            Self::Register { name, endpoints, .. } => {
                14 + name.len() + endpoints.iter().map(Endpoint::buffer_len).sum::<usize>()
            }
            Self::Accept { data, .. } => 24 + data.iter().map(Endpoint::buffer_len).sum::<usize>(),
            Self::Reject { message, .. } => 4 + message.len(),
            Self::Leave { .. } => 6,
        }
    }

    /// Parses one message, returning its request id with it.
    pub fn parse(bytes: &[u8]) -> Result<(u32, ControlMessage)> {
        if bytes.len() < CONTROL_HEADER_LEN {
            return Err(WireError::Truncated { len: bytes.len(), needed: CONTROL_HEADER_LEN });
        }
        if bytes[0] != CONTROL_VERSION {
            return Err(WireError::Version { found: bytes[0], supported: CONTROL_VERSION });
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
                endpoints: {
                    let threads = body.u16()? as usize;
                    if threads == 0 || threads > MAX_THREADS {
                        return Err(WireError::InvalidField { field: "threads", reason: "not 1 to 1024" });
                    }
                    (0..threads).map(|_| Endpoint::read(&mut body)).collect::<Result<Vec<_>>>()?
                },
            },
            ACCEPT => Self::Accept {
                session: body.u32()?,
                rank: body.u16()?,
                world_size: body.u16()?,
                packet_elements: body.u16()?,
                slots: body.u16()?,
                depth: body.u8()?,
                split: SlotSplit::try_from(body.u8()?)?,
                token: body.u64()?,
                data: {
                    let endpoints = body.u16()? as usize;
                    if endpoints == 0 || endpoints > MAX_DATA_ENDPOINTS {
                        return Err(WireError::InvalidField {
                            field: "data endpoints",
                            reason: "not 1 to 1024",
                        });
                    }
                    (0..endpoints).map(|_| Endpoint::read(&mut body)).collect::<Result<Vec<_>>>()?
                },
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
            Self::Register { endpoints, .. } if endpoints.is_empty() || endpoints.len() > MAX_THREADS => {
                return Err(WireError::InvalidField { field: "threads", reason: "not 1 to 1024" })
            }
            Self::Accept { data, .. } if data.is_empty() || data.len() > MAX_DATA_ENDPOINTS => {
                return Err(WireError::InvalidField { field: "data endpoints", reason: "not 1 to 1024" })
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
        out.u8(CONTROL_VERSION);
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
                endpoints,
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
                out.u16(endpoints.len() as u16);
                endpoints.iter().for_each(|endpoint| endpoint.write(&mut out));
            }
            Self::Accept { session, rank, world_size, packet_elements, slots, depth, token, data, split } => {
                out.header(ACCEPT, self.body_len(), request_id);
                out.u32(*session);
                out.u16(*rank);
                out.u16(*world_size);
                out.u16(*packet_elements);
                out.u16(*slots);
                out.u8(*depth);
                out.u8(*split as u8);
                out.u64(*token);
                out.u16(data.len() as u16);
                data.iter().for_each(|endpoint| endpoint.write(&mut out));
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
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        // `take` returned N bytes, so the conversion cannot fail.
        Ok(self.take(N)?.try_into().expect("take returned N bytes"))
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

    fn udp(address: &str) -> Endpoint {
        Endpoint::Udp(address.parse().unwrap())
    }

    fn register() -> ControlMessage {
        register_as("job", vec![udp("0.0.0.0:4000"), udp("10.0.0.2:4001")])
    }

    fn register_as(name: &str, endpoints: Vec<Endpoint>) -> ControlMessage {
        ControlMessage::Register {
            rank: 1,
            world_size: 4,
            packet_elements: 256,
            slots: 128,
            depth: 2,
            encoding: ValueEncoding::BlockFloatingPoint,
            sparse_blocks: false,
            name: name.into(),
            endpoints,
        }
    }

    fn accept(data: Endpoint) -> ControlMessage {
        ControlMessage::Accept {
            session: 0x0001_0002,
            rank: 1,
            world_size: 4,
            packet_elements: 256,
            slots: 128,
            depth: 2,
            token: 0x1122_3344_5566_7788,
            data: vec![data],
            split: SlotSplit::Ranges,
        }
    }

    #[rustfmt::skip]
    const REGISTER_BYTES: [u8; 41] = [
        0x07, 0x01, 0x21, 0x00, 0x2A, 0x00, 0x00, 0x00, // version 7, register, body 33, request 42
        0x01, 0x00, 0x04, 0x00, 0x00, 0x01, 0x80, 0x00, // rank 1, world 4, 256 elements, 128 slots
        0x02, 0x01, 0x00, 0x03, b'j', b'o', b'b',       // depth 2, block fp, dense, name "job"
        0x02, 0x00,                                     // 2 threads:
        0x01, 0x06, 0, 0, 0, 0, 0xA0, 0x0F,             //   udp, 6 bytes, 0.0.0.0 port 4000
        0x01, 0x06, 10, 0, 0, 2, 0xA1, 0x0F,            //   udp, 6 bytes, 10.0.0.2 port 4001
    ];

    #[test]
    fn register_bytes_round_trip() {
        let mut buffer = [0u8; 64];
        let len = register().emit(42, &mut buffer).unwrap();
        assert_eq!(&buffer[..len], &REGISTER_BYTES[..]);
        assert_eq!(ControlMessage::parse(&REGISTER_BYTES).unwrap(), (42, register()));
    }

    #[test]
    fn accept_carries_the_token_and_then_the_data_endpoints() {
        #[rustfmt::skip]
        let expected: [u8; 48] = [
            0x07, 0x02, 0x28, 0x00, 0x07, 0x00, 0x00, 0x00, // version 7, accept, body 40, request 7
            0x02, 0x00, 0x01, 0x00,                         // session
            0x01, 0x00, 0x04, 0x00, 0x00, 0x01, 0x80, 0x00, // rank 1, world 4, 256 elements, 128 slots
            0x02, 0x00,                                     // depth 2, slot split: ranges
            0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, // token
            0x02, 0x00,                                     // 2 data endpoints
            0x01, 0x06, 0, 0, 0, 0, 0xE0, 0xBE,             // udp, 6 bytes, 0.0.0.0 port 48864
            0x01, 0x06, 0, 0, 0, 0, 0xE1, 0xBE,             // udp, 6 bytes, 0.0.0.0 port 48865
        ];
        let mut accept = accept(udp("0.0.0.0:48864"));
        let ControlMessage::Accept { data, .. } = &mut accept else { unreachable!("an accept") };
        data.push(udp("0.0.0.0:48865"));
        let mut buffer = [0u8; 48];
        assert_eq!(accept.emit(7, &mut buffer).unwrap(), 48);
        assert_eq!(buffer, expected);
        assert_eq!(ControlMessage::parse(&expected).unwrap(), (7, accept));
    }

    #[test]
    fn ranges_give_each_endpoint_the_slots_it_owns_and_no_other() {
        for (slots, endpoints) in [(128, 1), (128, 2), (128, 3), (6, 4), (1, 2), (7, 7), (1000, 24)] {
            let owned: Vec<_> =
                (0..endpoints).map(|e| SlotSplit::Ranges.owned(e, slots, endpoints)).collect();
            assert_eq!(owned.first().map(|r| r.start), Some(0));
            assert_eq!(owned.last().map(|r| r.end), Some(slots));
            for (endpoint, range) in owned.iter().enumerate() {
                for slot in range.clone() {
                    assert_eq!(
                        SlotSplit::Ranges.owner(slot, slots, endpoints),
                        endpoint,
                        "{slots} over {endpoints}"
                    );
                }
            }
        }
        // As many endpoints as worker threads: each thread's slots have one owner.
        assert_eq!(SlotSplit::Ranges.owned(1, 128, 2), 64..128);
        assert_eq!(SlotSplit::Ranges.owned(1, 1, 2), 1..1);
    }

    #[test]
    fn an_accept_lists_one_to_1024_data_endpoints() {
        let mut none = accept(udp("0.0.0.0:9"));
        let ControlMessage::Accept { data, .. } = &mut none else { unreachable!("an accept") };
        data.clear();
        let error = none.emit(0, &mut [0u8; 64]).unwrap_err();
        assert_eq!(error, WireError::InvalidField { field: "data endpoints", reason: "not 1 to 1024" });
        let mut bytes = vec![0u8; accept(udp("0.0.0.0:9")).buffer_len()];
        accept(udp("0.0.0.0:9")).emit(0, &mut bytes).unwrap();
        bytes[30] = 0;
        assert_eq!(
            ControlMessage::parse(&bytes).unwrap_err(),
            WireError::InvalidField { field: "data endpoints", reason: "not 1 to 1024" }
        );
    }

    #[test]
    fn an_rdma_endpoint_is_the_udp_bytes_then_its_tag() {
        let endpoint = Endpoint::Rdma { address: "10.77.0.2:0".parse().unwrap(), tag: 0x0102_0304_0506_0708 };
        let message = register_as("job", vec![endpoint]);
        let mut buffer = vec![0u8; message.buffer_len()];
        message.emit(1, &mut buffer).unwrap();
        #[rustfmt::skip]
        let expected: [u8; 16] = [
            0x02, 0x0E, 10, 77, 0, 2, 0x00, 0x00,           // rdma, 14 bytes, 10.77.0.2 port 0
            0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01, // tag
        ];
        assert_eq!(&buffer[buffer.len() - 16..], &expected);
        assert_eq!(ControlMessage::parse(&buffer).unwrap(), (1, message));
        assert_eq!(endpoint.to_string(), "rdma 10.77.0.2 tag 0x0102030405060708");
        let listener = Endpoint::Rdma { address: "0.0.0.0:48864".parse().unwrap(), tag: 0 };
        assert_eq!(listener.to_string(), "rdma 0.0.0.0:48864");
        assert_eq!(listener.address("10.77.0.1".parse().unwrap()), "10.77.0.1:48864".parse().unwrap());
        assert_eq!(listener.udp_address("10.77.0.1".parse().unwrap()), None);
        // Cut by one byte, with the lengths kept consistent.
        let len = buffer.len();
        buffer[len - 15] = 13;
        buffer.pop();
        buffer[2] -= 1;
        assert_eq!(
            ControlMessage::parse(&buffer).unwrap_err(),
            WireError::InvalidField { field: "endpoint", reason: "an RDMA endpoint has 14 or 26 bytes" }
        );
    }

    #[test]
    fn an_rdma_hello_carries_the_tag_and_nothing_else_passes_for_one() {
        let hello = rdma_hello(0xDEAD_BEEF_0000_0001);
        assert_eq!(&hello[..8], b"netaggR\x07");
        let mut padded = hello.to_vec();
        padded.resize(56, 0);
        assert_eq!(rdma_hello_tag(&padded), Some(0xDEAD_BEEF_0000_0001));
        assert_eq!(rdma_hello_tag(&hello[..15]), None);
        assert_eq!(rdma_hello_tag(b"netagg-rdma-echo"), None);
        let mut other_version = hello;
        other_version[7] = 4;
        assert_eq!(rdma_hello_tag(&other_version), None);
    }

    #[test]
    fn every_message_round_trips() {
        let messages = [
            register(),
            accept(udp("[::1]:48864")),
            accept(Endpoint::Rdma { address: "[::]:48864".parse().unwrap(), tag: 0 }),
            register_as(
                "v6",
                vec![Endpoint::Rdma { address: "[fd00::2]:0".parse().unwrap(), tag: u64::MAX }],
            ),
            register_as(&"x".repeat(MAX_SESSION_NAME_LEN), vec![udp("[fe80::1]:9"); MAX_THREADS]),
            ControlMessage::Reject {
                code: RejectCode::Mismatch,
                message: "world size 4 differs from 8 of rank 0".into(),
            },
            ControlMessage::Reject { code: RejectCode::Transport, message: "no rdma port".into() },
            ControlMessage::Leave { session: 9, rank: 2 },
        ];
        for message in messages {
            let mut buffer = vec![0u8; message.buffer_len()];
            assert_eq!(message.emit(7, &mut buffer).unwrap(), buffer.len());
            assert_eq!(ControlMessage::parse(&buffer).unwrap(), (7, message));
        }
    }

    #[test]
    fn an_unspecified_udp_address_means_the_control_peer_s() {
        let peer: IpAddr = "192.0.2.7".parse().unwrap();
        assert_eq!(udp("0.0.0.0:4000").udp_address(peer), Some("192.0.2.7:4000".parse().unwrap()));
        assert_eq!(udp("10.0.0.2:4001").udp_address(peer), Some("10.0.0.2:4001".parse().unwrap()));
        assert_eq!(udp("[::]:5").udp_address(peer), Some("192.0.2.7:5".parse().unwrap()));
    }

    #[test]
    fn unknown_endpoint_kinds_and_bad_udp_lengths_are_refused() {
        let mut bytes = REGISTER_BYTES;
        bytes[33] = 9; // the second thread's endpoint kind
        assert_eq!(ControlMessage::parse(&bytes).unwrap_err(), WireError::UnknownEndpoint(9));
        assert_eq!(
            WireError::UnknownEndpoint(9).to_string(),
            "unknown endpoint kind 9: the peer offers a transport this side does not know"
        );
        // A UDP endpoint of 5 bytes, its body length kept consistent.
        let mut bytes = REGISTER_BYTES.to_vec();
        bytes[26] = 5;
        bytes.remove(27);
        bytes[2] -= 1;
        assert_eq!(
            ControlMessage::parse(&bytes).unwrap_err(),
            WireError::InvalidField { field: "endpoint", reason: "a UDP endpoint has 6 or 18 bytes" }
        );
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
            &WireError::Version { found: 9, supported: CONTROL_VERSION }
        );
    }

    #[test]
    fn a_peer_of_the_previous_version_is_refused_by_name() {
        // Version 6's register: the same layout, for the packets of version 5, which carry
        // no checksum.
        let mut old = REGISTER_BYTES;
        old[0] = 6;
        let error = ControlMessage::parse(&old).unwrap_err();
        assert_eq!(error.to_string(), "protocol version 6 is not supported (this side speaks 7)");
    }

    #[test]
    fn truncated_and_oversized_messages_are_rejected() {
        assert_eq!(
            ControlMessage::parse(&REGISTER_BYTES[..5]).unwrap_err(),
            WireError::Truncated { len: 5, needed: 8 }
        );
        assert_eq!(
            ControlMessage::parse(&REGISTER_BYTES[..40]).unwrap_err(),
            WireError::Truncated { len: 40, needed: 41 }
        );
        let mut longer = REGISTER_BYTES.to_vec();
        longer.push(0);
        assert_eq!(
            ControlMessage::parse(&longer).unwrap_err(),
            WireError::LengthMismatch { len: 42, expected: 41 }
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
        // An endpoint length pointing past the body.
        let mut bytes = REGISTER_BYTES;
        bytes[34] = 7;
        assert!(matches!(
            ControlMessage::parse(&bytes).unwrap_err(),
            WireError::InvalidField { field: "body", .. }
        ));
    }

    #[test]
    fn wrong_version_and_unknown_type_are_rejected() {
        let mut bytes = REGISTER_BYTES;
        bytes[0] = 9;
        assert_eq!(
            ControlMessage::parse(&bytes).unwrap_err(),
            WireError::Version { found: 9, supported: CONTROL_VERSION }
        );
        let mut bytes = REGISTER_BYTES;
        bytes[1] = 99;
        assert_eq!(ControlMessage::parse(&bytes).unwrap_err(), WireError::UnknownMessageType(99));
    }

    #[test]
    fn an_unknown_slot_split_is_refused() {
        let accept = accept(udp("0.0.0.0:9"));
        let mut bytes = vec![0u8; accept.buffer_len()];
        accept.emit(0, &mut bytes).unwrap();
        bytes[21] = 1;
        assert_eq!(
            ControlMessage::parse(&bytes).unwrap_err(),
            WireError::InvalidField { field: "slot split", reason: "unknown rule" }
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
        let long = register_as(&"x".repeat(65), vec![udp("0.0.0.0:1")]);
        assert!(long.emit(0, &mut [0u8; 128]).is_err());
        let none = register_as("job", Vec::new());
        assert!(none.emit(0, &mut [0u8; 128]).is_err());
        let mut bytes = REGISTER_BYTES;
        bytes[23] = 0; // no threads
        bytes[24] = 0;
        assert!(matches!(
            ControlMessage::parse(&bytes[..25]).unwrap_err(),
            WireError::Truncated { .. } | WireError::InvalidField { field: "threads", .. }
        ));
    }

    #[test]
    fn rack_of_names_the_rack_whose_ranks_hold_a_rank() {
        for world_size in 1..40u16 {
            for racks in 1..=world_size {
                for rack in 0..racks {
                    for rank in rack_ranks(rack, racks, world_size) {
                        assert_eq!(rack_of(rank, racks, world_size), Some(rack), "{rank} of {world_size}");
                    }
                }
            }
        }
        assert_eq!(rack_of(7, 2, 7), None, "a rank outside the world");
        assert_eq!(rack_of(0, 0, 7), None, "no racks");
    }
}
