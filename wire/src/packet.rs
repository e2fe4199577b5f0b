//! Aggregation packets: worker → switch *data*, *ack* and *probe*, switch → worker
//! *result*, *pending* and *progress*.
//!
//! All six share one 48-byte header (little-endian), followed by `element_count`
//! elements of the header's element type, [`ElementType::size`] bytes each, and a 4-byte
//! CRC32C of the header and payload ([`seal`], checked by [`Packet::new_checked`]):
//!
//! | offset | size | field          | meaning |
//! |-------:|-----:|----------------|---------|
//! | 0      | 1    | version        | [`PACKET_VERSION`] |
//! | 1      | 1    | message type   | [`MessageType`] |
//! | 2      | 1    | element type   | [`ElementType`] |
//! | 3      | 1    | flags          | [`Flags`] |
//! | 4      | 4    | session        | session id handed out by the switch's control plane |
//! | 8      | 4    | job            | job number within the session |
//! | 12     | 4    | packet id      | opaque to the switch, echoed in results |
//! | 16     | 2    | rank           | sender rank; in results the recipient, or [`BROADCAST_RANK`] |
//! | 18     | 2    | element count  | elements in the payload |
//! | 20     | 2    | slot           | aggregation slot within the session |
//! | 22     | 1    | exponent       | block-floating-point exponent (i8), max-reduced |
//! | 23     | 1    | sequence       | result: the switch's count of broadcasts to this worker thread, mod 256; data: the thread's count of first sendings to this switch, mod 256; pending with [`Flags::LOST`]: the number lost; zero otherwise |
//! | 24     | 4    | round          | use number of the slot |
//! | 28     | 4    | block          | block index carried (sparse) or packet index (dense) |
//! | 32     | 4    | next block     | sparse: sender's next non-zero block; result: everyone's next |
//! | 36     | 4    | ack round      | data/ack: every result of this slot up to this round is held |
//! | 40     | 8    | token          | the session's secret from the control plane's accept; echoed in results |
//! | 48     | s·n  | payload        | elements of `s` bytes (4 or 2), little-endian |
//! | 48+s·n | 4    | checksum       | CRC32C (Castagnoli) of every byte before it, little-endian |

use crate::{Result, WireError, MAX_DATAGRAM_LEN, PACKET_VERSION};

/// Length of the aggregation-packet header.
pub const HEADER_LEN: usize = field::PAYLOAD;
/// Length of the checksum that ends every packet, after its payload.
pub const CHECKSUM_LEN: usize = 4;
/// Size of the widest payload element (int32, float32): a session's `packet_elements`
/// counts elements of this size, which fixes a packet's payload bytes for every type.
pub const ELEMENT_LEN: usize = 4;
/// Most elements of the widest type one packet can carry inside a 64 KiB datagram.
pub const MAX_ELEMENTS: usize = elements_within(MAX_DATAGRAM_LEN);
/// Most slots one progress report covers: its map of contributions is 64 bits.
pub const PROGRESS_SLOTS: usize = 64;

/// Slots a progress report covers in a session of `packet_elements`-element packets:
/// [`PROGRESS_SLOTS`], or fewer where packets are shorter, so that a report fits any
/// buffer a packet of the session fits.
pub const fn progress_slots(packet_elements: u16) -> usize {
    if (packet_elements as usize) < PROGRESS_SLOTS {
        packet_elements as usize
    } else {
        PROGRESS_SLOTS
    }
}

/// Bytes of a packet of `elements` elements of the widest type: the most a packet of that
/// many elements takes.
pub const fn datagram_len(elements: usize) -> usize {
    HEADER_LEN + elements * ELEMENT_LEN + CHECKSUM_LEN
}

/// The most elements a packet of at most `bytes` bytes carries (0 if not even the header
/// and checksum fit).
pub const fn elements_within(bytes: usize) -> usize {
    bytes.saturating_sub(HEADER_LEN + CHECKSUM_LEN) / ELEMENT_LEN
}

/// Writes the checksum of a datagram into its last [`CHECKSUM_LEN`] bytes: the CRC32C of
/// every byte before them. The last step of building any packet, once its header and
/// payload are written, while its bytes are still in cache; [`Packet::seal`] seals a view.
///
/// # Panics
/// If `datagram` is shorter than [`CHECKSUM_LEN`].
pub fn seal(datagram: &mut [u8]) {
    let (covered, trailer) = datagram.split_at_mut(datagram.len() - CHECKSUM_LEN);
    trailer.copy_from_slice(&crc32c(covered).to_le_bytes());
}

/// Whether a link's packets carry a checksum their sender seals and their receiver
/// checks: on every link that could alter a byte between the two, as any network can;
/// not where both ends share one process's memory and nothing injects corruption (the
/// dummy backend), as Linux's loopback marks its packets as needing no checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Integrity {
    /// Sealed ([`Packet::seal`]) and checked ([`Packet::new_checked`]).
    Checksummed,
    /// Neither: the checksum's bytes are left as they are, every other field is checked
    /// ([`Packet::new_checked_in_process`]).
    InProcess,
}

impl Integrity {
    /// Wraps received bytes as [`Packet::new_checked`] does, checking the checksum only
    /// where this link carries one.
    #[inline]
    pub fn check<T: AsRef<[u8]>>(self, buffer: T) -> Result<Packet<T>> {
        match self {
            Integrity::Checksummed => Packet::new_checked(buffer),
            Integrity::InProcess => Packet::new_checked_in_process(buffer),
        }
    }

    /// Ends a packet built in `packet` as [`Packet::seal`] does where this link carries a
    /// checksum; returns the packet's length either way.
    #[inline]
    pub fn seal<T: AsRef<[u8]> + AsMut<[u8]>>(self, packet: &mut Packet<T>) -> usize {
        match self {
            Integrity::Checksummed => packet.seal(),
            Integrity::InProcess => packet.payload_end() + CHECKSUM_LEN,
        }
    }
}

/// CRC-32C (Castagnoli: iSCSI's and SCTP's) of `bytes`.
fn crc32c(bytes: &[u8]) -> u32 {
    // A 32-bit CRC's value fits its 32 bits; the crate returns every width as a u64.
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, bytes) as u32
}

/// Checks the checksum [`seal`] wrote into the last [`CHECKSUM_LEN`] bytes of `datagram`.
/// A mismatch is a datagram corrupted on its way (or bytes that never were a netagg
/// packet): CRC32C finds every error of up to 3 flipped bits and every burst of up to 32
/// in a packet of any size netagg sends.
pub fn verify(datagram: &[u8]) -> Result<()> {
    let Some(split) = datagram.len().checked_sub(CHECKSUM_LEN) else {
        return Err(WireError::Truncated { len: datagram.len(), needed: CHECKSUM_LEN });
    };
    let (covered, trailer) = datagram.split_at(split);
    let found = u32::from_le_bytes(trailer.try_into().expect("the trailer is CHECKSUM_LEN bytes"));
    let computed = crc32c(covered);
    if found != computed {
        return Err(WireError::Checksum { found, computed });
    }
    Ok(())
}
/// `next block` value meaning "no further non-zero block in this stream".
pub const END_OF_STREAM: u32 = u32::MAX;
/// Rank of a result sent to every worker of the session.
pub const BROADCAST_RANK: u16 = u16::MAX;

mod field {
    use core::ops::Range;
    pub const VERSION: usize = 0;
    pub const MESSAGE_TYPE: usize = 1;
    pub const ELEMENT_TYPE: usize = 2;
    pub const FLAGS: usize = 3;
    pub const SESSION: Range<usize> = 4..8;
    pub const JOB: Range<usize> = 8..12;
    pub const PACKET_ID: Range<usize> = 12..16;
    pub const RANK: Range<usize> = 16..18;
    pub const ELEMENT_COUNT: Range<usize> = 18..20;
    pub const SLOT: Range<usize> = 20..22;
    pub const EXPONENT: usize = 22;
    pub const SEQUENCE: usize = 23;
    pub const ROUND: Range<usize> = 24..28;
    pub const BLOCK: Range<usize> = 28..32;
    pub const NEXT_BLOCK: Range<usize> = 32..36;
    pub const ACK_ROUND: Range<usize> = 36..40;
    pub const TOKEN: Range<usize> = 40..48;
    pub const PAYLOAD: usize = 48;
}

/// What an aggregation packet is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MessageType {
    /// Worker → switch: one worker's contribution to a round of a slot.
    Data = 1,
    /// Switch → worker: the aggregate of a completed round.
    Result = 2,
    /// Worker → switch: a cumulative acknowledgement, optionally asking for a result
    /// again ([`Flags::WANT_RESULT`]); carries no payload.
    Ack = 3,
    /// Switch → one worker: the round it asked about, or contributed to again, is still
    /// aggregating; [`Flags::CONTRIBUTED`] says whether the worker's contribution is in.
    /// Carries no payload.
    Pending = 4,
    /// Worker → switch, sent while every slot of a worker thread waits: where do my slots
    /// from `slot` on stand? Carries no payload; answered with a [`MessageType::Progress`].
    Probe = 5,
    /// Switch → one worker: the open round of each of the slots from `slot` on, one per
    /// payload element (at most [`PROGRESS_SLOTS`]), and which of them hold the
    /// worker's contribution ([`PacketRepr::contributions`]). From it a worker finds every
    /// result and contribution it lost in one round trip, however many they are.
    Progress = 6,
}

impl MessageType {
    /// Acks, pending notices and probes carry no payload.
    pub const fn is_header_only(self) -> bool {
        matches!(self, MessageType::Ack | MessageType::Pending | MessageType::Probe)
    }

    /// Whether a message of this type with `flags` may carry a `sequence` number: results
    /// and data are numbered in their sender's stream, a pending notice with
    /// [`Flags::LOST`] names the number lost; every other message carries 0.
    pub const fn is_numbered(self, flags: Flags) -> bool {
        match self {
            MessageType::Result | MessageType::Data => true,
            MessageType::Pending => flags.contains(Flags::LOST),
            MessageType::Ack | MessageType::Probe | MessageType::Progress => false,
        }
    }
}

/// A payload on a message that carries none.
const HEADER_ONLY: WireError = WireError::InvalidField {
    field: "element count",
    reason: "acks, pending notices and probes carry no payload",
};

/// A sequence number on a message that carries none.
const NOT_SEQUENCED: WireError = WireError::InvalidField {
    field: "sequence",
    reason: "only results, data and pending notices with LOST are numbered; must be zero",
};

/// A progress report over more slots than its map covers.
const PROGRESS_TOO_LONG: WireError =
    WireError::InvalidField { field: "element count", reason: "a progress report covers at most 64 slots" };
const PROGRESS_NOT_INT32: WireError = WireError::InvalidField {
    field: "element type",
    reason: "a progress report's elements are int32 rounds",
};

impl TryFrom<u8> for MessageType {
    type Error = WireError;
    fn try_from(value: u8) -> Result<Self> {
        match value {
            1 => Ok(Self::Data),
            2 => Ok(Self::Result),
            3 => Ok(Self::Ack),
            4 => Ok(Self::Pending),
            5 => Ok(Self::Probe),
            6 => Ok(Self::Progress),
            other => Err(WireError::UnknownMessageType(other)),
        }
    }
}

/// What the payload's elements are, and how the switch sums them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ElementType {
    /// Two's-complement int32, summed with wrap-around as switch hardware does. Also the
    /// carrier of block-floating-point floats (with the packet's exponent).
    Int32 = 1,
    /// IEEE-754 binary32, summed natively (what a server aggregator does).
    Float32 = 2,
    /// IEEE-754 binary16, 2 bytes: summed in float32 and rounded once, to nearest even,
    /// when the result leaves the switch.
    Float16 = 3,
    /// bfloat16 (the upper half of a binary32), 2 bytes: summed as [`ElementType::Float16`].
    BFloat16 = 4,
}

impl ElementType {
    /// Bytes of one element on the wire: the one place an element's size is declared.
    pub const fn size(self) -> usize {
        match self {
            ElementType::Int32 | ElementType::Float32 => 4,
            ElementType::Float16 | ElementType::BFloat16 => 2,
        }
    }

    /// Elements of this type in a packet of a session of `packet_elements`-element packets:
    /// the session fixes the payload bytes (`packet_elements` × [`ELEMENT_LEN`]), so a
    /// 16-bit packet carries twice as many elements, and pays its header once per twice the
    /// data.
    pub const fn per_packet(self, packet_elements: u16) -> u16 {
        // Elements per `ELEMENT_LEN` bytes first, 1 or 2 by the type: a multiplication,
        // where dividing the payload's bytes by the size left a division on every
        // packet's length checks (callgrind). The size divides `ELEMENT_LEN`, so the
        // count is the same.
        (packet_elements as usize * (ELEMENT_LEN / self.size())) as u16
    }

    /// Whether the type is one of the 16-bit floats, which the switch sums in float32.
    pub const fn is_16_bit(self) -> bool {
        matches!(self, ElementType::Float16 | ElementType::BFloat16)
    }
}

impl TryFrom<u8> for ElementType {
    type Error = WireError;
    fn try_from(value: u8) -> Result<Self> {
        match value {
            1 => Ok(Self::Int32),
            2 => Ok(Self::Float32),
            3 => Ok(Self::Float16),
            4 => Ok(Self::BFloat16),
            other => Err(WireError::UnknownElementType(other)),
        }
    }
}

/// Flag bits of the aggregation header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Flags(u8);

impl Flags {
    pub const NONE: Flags = Flags(0);
    /// The slot streams a sparse tensor: `block` / `next block` drive which workers
    /// contribute to the next round.
    pub const SPARSE: Flags = Flags(1);
    /// The sender has sent this packet before (informational, for counters).
    pub const RETRANSMISSION: Flags = Flags(2);
    /// On an ack: send me the result of `round` again if you hold it.
    pub const WANT_RESULT: Flags = Flags(4);
    /// On a pending notice: the addressee's contribution to the round is in.
    pub const CONTRIBUTED: Flags = Flags(8);
    /// On a pending notice: the addressee's first sending numbered `sequence` never came;
    /// the notice's slot and round are those of the packet that showed it.
    pub const LOST: Flags = Flags(16);
    const ALL: u8 = 0b1_1111;

    pub const fn bits(self) -> u8 {
        self.0
    }
    pub const fn contains(self, other: Flags) -> bool {
        self.0 & other.0 == other.0
    }
    pub fn from_bits(bits: u8) -> Result<Self> {
        if bits & !Self::ALL != 0 {
            return Err(WireError::UnknownFlags(bits & !Self::ALL));
        }
        Ok(Flags(bits))
    }
}

impl core::ops::BitOr for Flags {
    type Output = Flags;
    fn bitor(self, rhs: Flags) -> Flags {
        Flags(self.0 | rhs.0)
    }
}

/// A view of an aggregation packet over a byte buffer.
#[derive(Debug, Clone)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wraps a buffer without checking it; for building packets.
    pub const fn new_unchecked(buffer: T) -> Packet<T> {
        Packet { buffer }
    }

    /// Wraps untrusted bytes, checking everything the accessors rely on: length, version,
    /// the checksum ([`verify`]), message and element type, flags, and that the length is
    /// exactly header, payload and checksum.
    ///
    /// The checksum is checked right after the version, before any field is believed: a
    /// corrupted datagram fails as [`WireError::Checksum`] wherever its bit flipped but in
    /// the version byte, so that corruption is told apart from a peer that breaks the
    /// format.
    pub fn new_checked(buffer: T) -> Result<Packet<T>> {
        let packet = Self::new_unchecked(buffer);
        packet.check_framing()?;
        verify(packet.buffer.as_ref())?;
        packet.check_fields()?;
        Ok(packet)
    }

    /// Wraps bytes that never left the process that built them, checking all that
    /// [`Packet::new_checked`] checks but the checksum, which nothing could have broken
    /// there: a link of [`Integrity::InProcess`], whose packets are not sealed either.
    pub fn new_checked_in_process(buffer: T) -> Result<Packet<T>> {
        let packet = Self::new_unchecked(buffer);
        packet.check_framing()?;
        packet.check_fields()?;
        Ok(packet)
    }

    /// The checks that come before the checksum's: a length that holds a header and a
    /// checksum, and this version's format.
    fn check_framing(&self) -> Result<()> {
        let data = self.buffer.as_ref();
        let len = data.len();
        if len > MAX_DATAGRAM_LEN {
            return Err(WireError::Oversized { len, max: MAX_DATAGRAM_LEN });
        }
        if len < HEADER_LEN + CHECKSUM_LEN {
            return Err(WireError::Truncated { len, needed: HEADER_LEN + CHECKSUM_LEN });
        }
        if data[field::VERSION] != PACKET_VERSION {
            return Err(WireError::Version { found: data[field::VERSION], supported: PACKET_VERSION });
        }
        Ok(())
    }

    /// The checks after the checksum's: every field the accessors rely on, and a length of
    /// exactly header, payload and checksum.
    fn check_fields(&self) -> Result<()> {
        let data = self.buffer.as_ref();
        let len = data.len();
        let message_type = MessageType::try_from(data[field::MESSAGE_TYPE])?;
        let element_type = ElementType::try_from(data[field::ELEMENT_TYPE])?;
        let flags = Flags::from_bits(data[field::FLAGS])?;
        if !message_type.is_numbered(flags) && data[field::SEQUENCE] != 0 {
            return Err(NOT_SEQUENCED);
        }
        let count = self.element_count() as usize;
        if message_type.is_header_only() && count != 0 {
            return Err(HEADER_ONLY);
        }
        if message_type == MessageType::Progress {
            if count > PROGRESS_SLOTS {
                return Err(PROGRESS_TOO_LONG);
            }
            if element_type != ElementType::Int32 {
                return Err(PROGRESS_NOT_INT32);
            }
        }
        let expected = HEADER_LEN + count * element_type.size() + CHECKSUM_LEN;
        if len != expected {
            return Err(if len < expected {
                WireError::Truncated { len, needed: expected }
            } else {
                WireError::LengthMismatch { len, expected }
            });
        }
        Ok(())
    }

    pub fn into_inner(self) -> T {
        self.buffer
    }

    fn u16_at(&self, range: core::ops::Range<usize>) -> u16 {
        let bytes = &self.buffer.as_ref()[range];
        u16::from_le_bytes([bytes[0], bytes[1]])
    }

    fn u32_at(&self, range: core::ops::Range<usize>) -> u32 {
        let bytes = &self.buffer.as_ref()[range];
        u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
    }

    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VERSION]
    }
    /// # Panics
    /// On a type byte no checked packet holds (see the crate docs).
    pub fn message_type(&self) -> MessageType {
        MessageType::try_from(self.buffer.as_ref()[field::MESSAGE_TYPE])
            .expect("message type was validated by new_checked")
    }
    /// # Panics
    /// On a type byte no checked packet holds (see the crate docs).
    // Inlined by force, as `payload`, which sizes every result's payload by it: a build
    // of 16 codegen units left it a call of 11 instructions (callgrind).
    #[inline(always)]
    pub fn element_type(&self) -> ElementType {
        ElementType::try_from(self.buffer.as_ref()[field::ELEMENT_TYPE])
            .expect("element type was validated by new_checked")
    }
    pub fn flags(&self) -> Flags {
        // Unknown bits are rejected by new_checked; an unchecked view drops them.
        Flags(self.buffer.as_ref()[field::FLAGS] & Flags::ALL)
    }
    pub fn session(&self) -> u32 {
        self.u32_at(field::SESSION)
    }
    pub fn job(&self) -> u32 {
        self.u32_at(field::JOB)
    }
    pub fn packet_id(&self) -> u32 {
        self.u32_at(field::PACKET_ID)
    }
    pub fn rank(&self) -> u16 {
        self.u16_at(field::RANK)
    }
    pub fn element_count(&self) -> u16 {
        self.u16_at(field::ELEMENT_COUNT)
    }
    pub fn slot(&self) -> u16 {
        self.u16_at(field::SLOT)
    }
    pub fn exponent(&self) -> i8 {
        self.buffer.as_ref()[field::EXPONENT] as i8
    }
    /// On a result: its number among the switch's broadcasts to the recipient's worker
    /// thread; on a contribution's first sending: its number among the sending thread's;
    /// on a pending notice with `LOST`: the number of the first sending the switch found
    /// lost. All modulo 256; 0 elsewhere ([`PacketRepr::sequence`]).
    pub fn sequence(&self) -> u8 {
        self.buffer.as_ref()[field::SEQUENCE]
    }
    pub fn round(&self) -> u32 {
        self.u32_at(field::ROUND)
    }
    pub fn block(&self) -> u32 {
        self.u32_at(field::BLOCK)
    }
    pub fn next_block(&self) -> u32 {
        self.u32_at(field::NEXT_BLOCK)
    }
    pub fn ack_round(&self) -> u32 {
        self.u32_at(field::ACK_ROUND)
    }
    pub fn token(&self) -> u64 {
        let bytes = &self.buffer.as_ref()[field::TOKEN];
        u64::from_le_bytes(bytes.try_into().expect("the token field is 8 bytes"))
    }
    /// The payload: `element_count` little-endian elements.
    ///
    /// # Panics
    /// As [`Packet::element_type`], which sizes it.
    // Inlined by force: a worker's receive path reads each result's payload, and a build
    // of 16 codegen units left it a call of about 20 instructions even when hinted
    // `#[inline]` (callgrind).
    #[inline(always)]
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..self.payload_end()]
    }

    /// The checksum after the payload.
    ///
    /// # Panics
    /// As [`Packet::payload`].
    pub fn checksum(&self) -> u32 {
        let start = self.payload_end();
        let bytes = &self.buffer.as_ref()[start..start + CHECKSUM_LEN];
        u32::from_le_bytes(bytes.try_into().expect("the checksum field is CHECKSUM_LEN bytes"))
    }

    /// Where the payload ends and the checksum starts, by the element count and type.
    #[inline(always)]
    fn payload_end(&self) -> usize {
        HEADER_LEN + self.element_count() as usize * self.element_type().size()
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    fn set_u16_at(&mut self, range: core::ops::Range<usize>, value: u16) {
        self.buffer.as_mut()[range].copy_from_slice(&value.to_le_bytes());
    }
    fn set_u32_at(&mut self, range: core::ops::Range<usize>, value: u32) {
        self.buffer.as_mut()[range].copy_from_slice(&value.to_le_bytes());
    }
    pub fn set_version(&mut self, value: u8) {
        self.buffer.as_mut()[field::VERSION] = value;
    }
    pub fn set_message_type(&mut self, value: MessageType) {
        self.buffer.as_mut()[field::MESSAGE_TYPE] = value as u8;
    }
    pub fn set_element_type(&mut self, value: ElementType) {
        self.buffer.as_mut()[field::ELEMENT_TYPE] = value as u8;
    }
    pub fn set_flags(&mut self, value: Flags) {
        self.buffer.as_mut()[field::FLAGS] = value.bits();
    }
    pub fn set_session(&mut self, value: u32) {
        self.set_u32_at(field::SESSION, value);
    }
    pub fn set_job(&mut self, value: u32) {
        self.set_u32_at(field::JOB, value);
    }
    pub fn set_packet_id(&mut self, value: u32) {
        self.set_u32_at(field::PACKET_ID, value);
    }
    pub fn set_rank(&mut self, value: u16) {
        self.set_u16_at(field::RANK, value);
    }
    pub fn set_element_count(&mut self, value: u16) {
        self.set_u16_at(field::ELEMENT_COUNT, value);
    }
    pub fn set_slot(&mut self, value: u16) {
        self.set_u16_at(field::SLOT, value);
    }
    pub fn set_exponent(&mut self, value: i8) {
        self.buffer.as_mut()[field::EXPONENT] = value as u8;
    }
    pub fn set_sequence(&mut self, value: u8) {
        self.buffer.as_mut()[field::SEQUENCE] = value;
    }
    pub fn set_round(&mut self, value: u32) {
        self.set_u32_at(field::ROUND, value);
    }
    pub fn set_block(&mut self, value: u32) {
        self.set_u32_at(field::BLOCK, value);
    }
    pub fn set_next_block(&mut self, value: u32) {
        self.set_u32_at(field::NEXT_BLOCK, value);
    }
    pub fn set_ack_round(&mut self, value: u32) {
        self.set_u32_at(field::ACK_ROUND, value);
    }
    pub fn set_token(&mut self, value: u64) {
        self.buffer.as_mut()[field::TOKEN].copy_from_slice(&value.to_le_bytes());
    }
    /// The payload, sized by the element count and type already written.
    ///
    /// # Panics
    /// As [`Packet::element_type`].
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let end = self.payload_end();
        &mut self.buffer.as_mut()[HEADER_LEN..end]
    }

    /// Writes the checksum of the header and payload written so far ([`seal`]): the last
    /// step of building a packet. Returns the packet's length.
    ///
    /// # Panics
    /// As [`Packet::payload`], and if the buffer ends before the checksum.
    pub fn seal(&mut self) -> usize {
        let len = self.payload_end() + CHECKSUM_LEN;
        seal(&mut self.buffer.as_mut()[..len]);
        len
    }
}

/// The header of an aggregation packet, in valid states only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacketRepr {
    pub message_type: MessageType,
    pub element_type: ElementType,
    pub flags: Flags,
    pub session: u32,
    pub job: u32,
    pub packet_id: u32,
    pub rank: u16,
    pub element_count: u16,
    pub slot: u16,
    pub exponent: i8,
    /// On a result broadcast to every worker: the switch numbers its broadcasts to each
    /// worker thread in one sequence, modulo 256, so that a thread sees a lost result as
    /// a gap the moment a later one arrives, whatever order the rounds complete in. On a
    /// contribution's first sending, the mirror: the worker thread's count of its first
    /// sendings to this switch, modulo 256, so that the switch sees a lost contribution
    /// as a gap; a pending notice with [`Flags::LOST`] names the number it found lost.
    /// 0 on a result to one worker (an answer), a retransmission and every other message.
    pub sequence: u8,
    pub round: u32,
    pub block: u32,
    pub next_block: u32,
    pub ack_round: u32,
    /// The session's secret: a packet without it is not the session's.
    pub token: u64,
}

impl PacketRepr {
    /// On a progress report: bit `i` says that slot `slot + i`'s open round holds the
    /// addressee's contribution. Carried in `block` (bits 0-31) and `next block` (bits
    /// 32-63), which a report has no other use for.
    pub const fn contributions(&self) -> u64 {
        self.block as u64 | (self.next_block as u64) << 32
    }

    /// Sets the map [`PacketRepr::contributions`] reads.
    pub fn set_contributions(&mut self, map: u64) {
        self.block = map as u32;
        self.next_block = (map >> 32) as u32;
    }

    /// On a result: the rank whose contribution completed the round, the last to arrive.
    /// A worker learns from it whether its own path held the round up, or a peer did.
    /// Carried in `ack round` as the rank plus one, which a result has no other use for;
    /// `None` where that is 0 (not known) or no rank.
    pub const fn completed_by(&self) -> Option<u16> {
        match self.ack_round {
            rank @ 1..=0x1_0000 => Some((rank - 1) as u16),
            _ => None,
        }
    }

    /// Sets what [`PacketRepr::completed_by`] reads.
    #[inline]
    pub fn set_completed_by(&mut self, rank: Option<u16>) {
        self.ack_round = rank.map_or(0, |rank| rank as u32 + 1);
    }

    /// A header of the given type, session, token and element count, with no flags and
    /// every other field 0 (job, rank, slot, round...); set the others by struct update:
    /// `PacketRepr { round: 3, ..PacketRepr::new(MessageType::Data, ElementType::Int32, session, token, 4) }`.
    pub const fn new(
        message_type: MessageType,
        element_type: ElementType,
        session: u32,
        token: u64,
        element_count: u16,
    ) -> PacketRepr {
        PacketRepr {
            message_type,
            element_type,
            flags: Flags::NONE,
            session,
            job: 0,
            packet_id: 0,
            rank: 0,
            element_count,
            slot: 0,
            exponent: 0,
            sequence: 0,
            round: 0,
            block: 0,
            next_block: 0,
            ack_round: 0,
            token,
        }
    }

    /// Reads the header of a checked packet.
    pub fn parse<T: AsRef<[u8]>>(packet: &Packet<T>) -> PacketRepr {
        // Read through a view of the header's fixed length, which one check of the length
        // covers, rather than one per field: this runs twice a packet.
        let header =
            packet.buffer.as_ref().first_chunk::<HEADER_LEN>().expect("a checked packet holds a header");
        let packet = Packet::new_unchecked(header);
        PacketRepr {
            message_type: packet.message_type(),
            element_type: packet.element_type(),
            flags: packet.flags(),
            session: packet.session(),
            job: packet.job(),
            packet_id: packet.packet_id(),
            rank: packet.rank(),
            element_count: packet.element_count(),
            slot: packet.slot(),
            exponent: packet.exponent(),
            sequence: packet.sequence(),
            round: packet.round(),
            block: packet.block(),
            next_block: packet.next_block(),
            ack_round: packet.ack_round(),
            token: packet.token(),
        }
    }

    /// Bytes of the whole packet: header, payload and checksum.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN + self.element_count as usize * self.element_type.size() + CHECKSUM_LEN
    }

    /// Writes the header into the front of `buffer` and returns a view over exactly
    /// `buffer_len()` bytes, whose payload the caller then fills, and then seals
    /// ([`Packet::seal`]): no peer takes a packet without its checksum.
    pub fn emit<'a>(&self, buffer: &'a mut [u8]) -> Result<Packet<&'a mut [u8]>> {
        let len = self.buffer_len();
        if len > MAX_DATAGRAM_LEN {
            return Err(WireError::Oversized { len, max: MAX_DATAGRAM_LEN });
        }
        if self.message_type.is_header_only() && self.element_count != 0 {
            return Err(HEADER_ONLY);
        }
        if !self.message_type.is_numbered(self.flags) && self.sequence != 0 {
            return Err(NOT_SEQUENCED);
        }
        if self.message_type == MessageType::Progress {
            if self.element_count as usize > PROGRESS_SLOTS {
                return Err(PROGRESS_TOO_LONG);
            }
            if self.element_type != ElementType::Int32 {
                return Err(PROGRESS_NOT_INT32);
            }
        }
        let available = buffer.len();
        let Some(target) = buffer.get_mut(..len) else {
            return Err(WireError::BufferTooSmall { len: available, needed: len });
        };
        let mut packet = Packet::new_unchecked(target);
        packet.set_version(PACKET_VERSION);
        packet.set_message_type(self.message_type);
        packet.set_element_type(self.element_type);
        packet.set_flags(self.flags);
        packet.set_session(self.session);
        packet.set_job(self.job);
        packet.set_packet_id(self.packet_id);
        packet.set_rank(self.rank);
        packet.set_element_count(self.element_count);
        packet.set_slot(self.slot);
        packet.set_exponent(self.exponent);
        packet.set_sequence(self.sequence);
        packet.set_round(self.round);
        packet.set_block(self.block);
        packet.set_next_block(self.next_block);
        packet.set_ack_round(self.ack_round);
        packet.set_token(self.token);
        Ok(packet)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `per_packet` multiplies by elements per `ELEMENT_LEN` bytes, which is exact only
    /// where a type's size divides it: a wider type added would count 0 elements.
    #[test]
    fn every_element_types_size_divides_the_element_len_and_fills_the_payload() {
        let types: Vec<ElementType> =
            (0..=u8::MAX).filter_map(|value| ElementType::try_from(value).ok()).collect();
        assert_eq!(types.len(), 4);
        for element_type in types {
            assert_eq!(ELEMENT_LEN % element_type.size(), 0, "{element_type:?}");
            let elements = element_type.per_packet(256) as usize;
            assert_eq!(elements * element_type.size(), 256 * ELEMENT_LEN, "{element_type:?}");
        }
    }

    fn sample() -> PacketRepr {
        PacketRepr {
            message_type: MessageType::Data,
            element_type: ElementType::Int32,
            flags: Flags::SPARSE | Flags::RETRANSMISSION,
            session: 0x0102_0304,
            job: 7,
            packet_id: 0xAABB_CCDD,
            rank: 3,
            element_count: 2,
            slot: 0x1234,
            exponent: -5,
            sequence: 0,
            round: 0x0506_0708,
            block: 42,
            next_block: END_OF_STREAM,
            ack_round: 0x0506_0707,
            token: 0x1122_3344_5566_7788,
        }
    }

    #[rustfmt::skip]
    const SAMPLE_BYTES: [u8; 60] = [
        0x08, 0x01, 0x01, 0x03,             // version, data, int32, sparse|retransmission
        0x04, 0x03, 0x02, 0x01,             // session
        0x07, 0x00, 0x00, 0x00,             // job
        0xDD, 0xCC, 0xBB, 0xAA,             // packet id
        0x03, 0x00, 0x02, 0x00,             // rank, element count
        0x34, 0x12, 0xFB, 0x00,             // slot, exponent -5, sequence (not a first sending)
        0x08, 0x07, 0x06, 0x05,             // round
        0x2A, 0x00, 0x00, 0x00,             // block
        0xFF, 0xFF, 0xFF, 0xFF,             // next block: end of stream
        0x07, 0x07, 0x06, 0x05,             // ack round
        0x88, 0x77, 0x66, 0x55,             // token, low half
        0x44, 0x33, 0x22, 0x11,             // token, high half
        0x01, 0x00, 0x00, 0x00,             // element 0: 1
        0xFF, 0xFF, 0xFF, 0xFF,             // element 1: -1
        0x7A, 0xEF, 0x3E, 0x67,             // CRC32C of the 56 bytes above (as crcmod computes it)
    ];

    /// `bytes` with their checksum written again, after a test changed them.
    fn resealed<const N: usize>(mut bytes: [u8; N]) -> [u8; N] {
        seal(&mut bytes);
        bytes
    }

    #[test]
    fn emit_writes_the_documented_bytes() {
        let mut buffer = [0xEEu8; 64];
        let mut packet = sample().emit(&mut buffer).unwrap();
        packet.payload_mut()[..4].copy_from_slice(&1i32.to_le_bytes());
        packet.payload_mut()[4..].copy_from_slice(&(-1i32).to_le_bytes());
        assert_eq!(packet.seal(), 60);
        assert_eq!(&buffer[..60], &SAMPLE_BYTES[..]);
        assert_eq!(buffer[60], 0xEE, "nothing is written past the packet");
    }

    #[test]
    fn parse_reads_the_documented_bytes() {
        let packet = Packet::new_checked(&SAMPLE_BYTES[..]).unwrap();
        assert_eq!(PacketRepr::parse(&packet), sample());
        assert_eq!(packet.payload(), &SAMPLE_BYTES[48..56]);
        assert_eq!(packet.checksum(), 0x673E_EF7A);
        assert_eq!(HEADER_LEN % 8, 0, "the header keeps payloads 8-byte aligned");
    }

    #[test]
    fn a_session_fixes_payload_bytes_so_16_bit_packets_carry_twice_the_elements() {
        for (element_type, elements) in [
            (ElementType::Int32, 256),
            (ElementType::Float32, 256),
            (ElementType::Float16, 512),
            (ElementType::BFloat16, 512),
        ] {
            assert_eq!(element_type.per_packet(256), elements, "{element_type:?}");
            let full = PacketRepr { element_type, element_count: elements, ..sample() };
            assert_eq!(full.buffer_len(), datagram_len(256), "{element_type:?}");
        }
        // The largest session's 16-bit count still fits the header's 16-bit field.
        assert_eq!(ElementType::Float16.per_packet(MAX_ELEMENTS as u16) as usize, 2 * MAX_ELEMENTS);
    }

    #[test]
    fn sixteen_bit_elements_take_two_bytes_each() {
        // The sample's 8 payload bytes are 4 float16 or bfloat16 elements, or 2 int32 ones.
        for (element_type, byte, count) in
            [(ElementType::Float16, 3, 4), (ElementType::BFloat16, 4, 4), (ElementType::Float32, 2, 2)]
        {
            let repr = PacketRepr { element_type, element_count: count, ..sample() };
            assert_eq!(repr.buffer_len(), 60, "{element_type:?}");
            let mut buffer = [0u8; 60];
            let mut packet = repr.emit(&mut buffer).unwrap();
            packet.payload_mut().copy_from_slice(&SAMPLE_BYTES[48..56]);
            packet.seal();
            assert_eq!(buffer[2], byte);
            let packet = Packet::new_checked(&buffer[..]).unwrap();
            assert_eq!((packet.element_type(), packet.payload()), (element_type, &SAMPLE_BYTES[48..56]));
        }
        // Two float16 elements announced, four bytes' worth sent: the rest is surplus.
        let mut bytes = SAMPLE_BYTES;
        bytes[2] = ElementType::Float16 as u8;
        assert_eq!(
            Packet::new_checked(resealed(bytes)).unwrap_err(),
            WireError::LengthMismatch { len: 60, expected: 56 }
        );
    }

    #[test]
    fn truncated_header_and_payload_are_rejected() {
        assert_eq!(
            Packet::new_checked(&SAMPLE_BYTES[..51]).unwrap_err(),
            WireError::Truncated { len: 51, needed: 52 }
        );
        // One byte of the payload short, sealed as it is: the header promises more.
        let mut short = SAMPLE_BYTES[..59].to_vec();
        seal(&mut short);
        assert_eq!(
            Packet::new_checked(&short[..]).unwrap_err(),
            WireError::Truncated { len: 59, needed: 60 }
        );
    }

    #[test]
    fn trailing_bytes_are_rejected() {
        let mut bytes = SAMPLE_BYTES.to_vec();
        bytes.push(0);
        seal(&mut bytes);
        assert_eq!(
            Packet::new_checked(&bytes[..]).unwrap_err(),
            WireError::LengthMismatch { len: 61, expected: 60 }
        );
    }

    #[test]
    fn oversized_datagrams_are_rejected() {
        let bytes = vec![0u8; MAX_DATAGRAM_LEN + 1];
        assert_eq!(
            Packet::new_checked(&bytes[..]).unwrap_err(),
            WireError::Oversized { len: MAX_DATAGRAM_LEN + 1, max: MAX_DATAGRAM_LEN }
        );
        let too_many = PacketRepr { element_count: u16::MAX, ..sample() };
        let mut buffer = vec![0u8; too_many.buffer_len()];
        assert!(matches!(too_many.emit(&mut buffer), Err(WireError::Oversized { .. })));
    }

    #[test]
    fn largest_packet_fits_a_datagram() {
        let repr = PacketRepr { element_count: MAX_ELEMENTS as u16, ..sample() };
        assert!(repr.buffer_len() <= MAX_DATAGRAM_LEN);
        let mut buffer = vec![0u8; repr.buffer_len()];
        assert_eq!(repr.emit(&mut buffer).unwrap().seal(), repr.buffer_len());
        Packet::new_checked(&buffer[..]).unwrap();
    }

    #[test]
    fn results_data_and_lost_notices_carry_a_sequence_number_and_no_other_message_does() {
        let result = PacketRepr { message_type: MessageType::Result, sequence: 0xA5, ..sample() };
        let mut buffer = [0u8; 60];
        result.emit(&mut buffer).unwrap().seal();
        assert_eq!(buffer[..4], [PACKET_VERSION, 2, 1, 3]);
        assert_eq!(buffer[20..24], [0x34, 0x12, 0xFB, 0xA5], "slot, exponent, sequence");
        let parsed = Packet::new_checked(&buffer[..]).unwrap();
        assert_eq!((parsed.sequence(), PacketRepr::parse(&parsed)), (0xA5, result));
        // A contribution's first sending is numbered by its worker thread.
        let data = PacketRepr { sequence: 0x5A, ..sample() };
        let mut buffer = [0u8; 60];
        data.emit(&mut buffer).unwrap().seal();
        assert_eq!(buffer[23], 0x5A);
        assert_eq!(PacketRepr::parse(&Packet::new_checked(&buffer[..]).unwrap()), data);
        // A pending notice names a number only with LOST.
        let notice = PacketRepr {
            message_type: MessageType::Pending,
            flags: Flags::LOST,
            element_count: 0,
            sequence: 9,
            ..sample()
        };
        let mut lost = [0u8; 52];
        notice.emit(&mut lost).unwrap().seal();
        assert_eq!((lost[3], lost[23]), (0x10, 9), "flags, sequence");
        assert_eq!(PacketRepr::parse(&Packet::new_checked(&lost[..]).unwrap()), notice);
        let unflagged = PacketRepr { flags: Flags::CONTRIBUTED, ..notice };
        assert!(matches!(
            unflagged.emit(&mut [0u8; 52]),
            Err(WireError::InvalidField { field: "sequence", .. })
        ));
        // An ack with a number is refused, built or received.
        let ack = PacketRepr { message_type: MessageType::Ack, element_count: 0, sequence: 1, ..sample() };
        assert!(matches!(ack.emit(&mut [0u8; 52]), Err(WireError::InvalidField { field: "sequence", .. })));
        lost[3] = 0;
        assert!(matches!(
            Packet::new_checked(resealed(lost)).unwrap_err(),
            WireError::InvalidField { field: "sequence", .. }
        ));
    }

    #[test]
    fn wrong_version_unknown_types_and_flags_are_rejected() {
        let with = |offset: usize, value: u8| {
            let mut bytes = SAMPLE_BYTES;
            bytes[offset] = value;
            Packet::new_checked(resealed(bytes)).unwrap_err()
        };
        // Version 1, the 40-byte header without the token, is refused rather than misread.
        assert_eq!(with(0, 1), WireError::Version { found: 1, supported: PACKET_VERSION });
        assert_eq!(with(1, 0), WireError::UnknownMessageType(0));
        assert_eq!(with(1, 7), WireError::UnknownMessageType(7));
        assert_eq!(with(2, 5), WireError::UnknownElementType(5));
        assert_eq!(with(3, 0x83), WireError::UnknownFlags(0x80));
    }

    #[test]
    fn acks_pending_notices_and_probes_carry_no_payload() {
        for message_type in [MessageType::Ack, MessageType::Pending, MessageType::Probe] {
            let mut bytes = SAMPLE_BYTES;
            bytes[1] = message_type as u8;
            assert!(matches!(
                Packet::new_checked(resealed(bytes)).unwrap_err(),
                WireError::InvalidField { field: "element count", .. }
            ));
            let with_payload = PacketRepr { message_type, ..sample() };
            assert!(with_payload.emit(&mut [0u8; 64]).is_err(), "{message_type:?}");
            let header_only = PacketRepr { message_type, element_count: 0, ..sample() };
            let mut buffer = [0u8; HEADER_LEN + CHECKSUM_LEN];
            header_only.emit(&mut buffer).unwrap().seal();
            let parsed = PacketRepr::parse(&Packet::new_checked(&buffer[..]).unwrap());
            assert_eq!(parsed, header_only);
        }
    }

    #[test]
    fn a_progress_report_on_the_wire() {
        let mut report =
            PacketRepr { slot: 3, ..PacketRepr::new(MessageType::Progress, ElementType::Int32, 7, 9, 2) };
        report.set_contributions(0x8000_0000_0000_0005);
        let mut bytes = [0u8; HEADER_LEN + 8 + CHECKSUM_LEN];
        let mut packet = report.emit(&mut bytes).unwrap();
        packet.payload_mut().copy_from_slice(&[10, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF]);
        packet.seal();
        assert_eq!(bytes[..4], [PACKET_VERSION, 6, 1, 0]);
        assert_eq!(bytes[field::BLOCK], [5, 0, 0, 0]);
        assert_eq!(bytes[field::NEXT_BLOCK], [0, 0, 0, 0x80]);
        let parsed = Packet::new_checked(&bytes[..]).unwrap();
        assert_eq!(PacketRepr::parse(&parsed).contributions(), 0x8000_0000_0000_0005);
        assert_eq!(
            parsed.payload(),
            &bytes[HEADER_LEN..HEADER_LEN + 8],
            "slot 3's open round 10, slot 4's u32::MAX"
        );
    }

    #[test]
    fn a_progress_report_covers_at_most_64_slots() {
        let report = |slots: usize| PacketRepr {
            element_count: slots as u16,
            ..PacketRepr::new(MessageType::Progress, ElementType::Int32, 7, 9, 0)
        };
        let mut bytes = vec![0u8; datagram_len(PROGRESS_SLOTS + 1)];
        report(PROGRESS_SLOTS).emit(&mut bytes).unwrap().seal();
        Packet::new_checked(&bytes[..datagram_len(PROGRESS_SLOTS)]).unwrap();
        assert_eq!(report(PROGRESS_SLOTS + 1).emit(&mut bytes).unwrap_err(), PROGRESS_TOO_LONG);
        let mut longer = Packet::new_unchecked(&mut bytes[..]);
        longer.set_element_count(PROGRESS_SLOTS as u16 + 1);
        longer.seal();
        assert_eq!(Packet::new_checked(&bytes[..]).unwrap_err(), PROGRESS_TOO_LONG);
        let float16 = PacketRepr { element_type: ElementType::Float16, ..report(2) };
        assert_eq!(float16.emit(&mut bytes).unwrap_err(), PROGRESS_NOT_INT32);
    }

    #[test]
    fn a_result_names_the_rank_that_completed_its_round_in_ack_round() {
        let mut result = PacketRepr::new(MessageType::Result, ElementType::Int32, 7, 9, 0);
        assert_eq!(result.completed_by(), None, "0: not known");
        result.set_completed_by(Some(0x0102));
        let mut bytes = [0u8; HEADER_LEN + CHECKSUM_LEN];
        result.emit(&mut bytes).unwrap().seal();
        assert_eq!(bytes[field::ACK_ROUND], [3, 1, 0, 0], "the rank plus one");
        let parsed = PacketRepr::parse(&Packet::new_checked(&bytes[..]).unwrap());
        assert_eq!(parsed.completed_by(), Some(0x0102));
        result.set_completed_by(Some(u16::MAX));
        assert_eq!(result.completed_by(), Some(u16::MAX));
        result.ack_round = 0x1_0001;
        assert_eq!(result.completed_by(), None, "beyond any rank");
    }

    #[test]
    fn a_new_header_is_zero_but_for_what_it_names() {
        let repr =
            PacketRepr::new(MessageType::Ack, ElementType::Float32, 0x0102_0304, 0x1122_3344_5566_7788, 0);
        let mut bytes = [0u8; HEADER_LEN];
        repr.emit(&mut bytes[..]).unwrap_err();
        let mut bytes = [0u8; HEADER_LEN + CHECKSUM_LEN];
        repr.emit(&mut bytes).unwrap();
        let mut expected = [0u8; HEADER_LEN + CHECKSUM_LEN];
        expected[field::MESSAGE_TYPE] = MessageType::Ack as u8;
        expected[field::ELEMENT_TYPE] = ElementType::Float32 as u8;
        expected[field::SESSION].copy_from_slice(&0x0102_0304u32.to_le_bytes());
        expected[field::TOKEN].copy_from_slice(&0x1122_3344_5566_7788u64.to_le_bytes());
        assert_eq!(bytes[field::VERSION + 1..], expected[field::VERSION + 1..], "all but the version");
        assert_eq!(bytes[HEADER_LEN..], [0; CHECKSUM_LEN], "not sealed yet");
    }

    #[test]
    fn emit_into_a_short_buffer_fails() {
        let mut buffer = [0u8; 59];
        assert_eq!(
            sample().emit(&mut buffer).unwrap_err(),
            WireError::BufferTooSmall { len: 59, needed: 60 }
        );
    }

    #[test]
    fn the_checksum_is_crc32c() {
        // CRC-32C's check value, as RFC 3720 (iSCSI) and every CRC catalogue list it.
        let mut bytes = *b"123456789\0\0\0\0";
        seal(&mut bytes);
        assert_eq!(bytes[9..], 0xE306_9283u32.to_le_bytes());
        assert_eq!(verify(&bytes), Ok(()));
        assert_eq!(verify(&[1, 2, 3]), Err(WireError::Truncated { len: 3, needed: CHECKSUM_LEN }));
    }

    #[test]
    fn flipping_any_single_bit_of_a_sealed_packet_is_detected() {
        // A full 1 KiB int32 packet of varied elements, as a worker sends.
        let repr = PacketRepr { element_count: 256, ..sample() };
        let mut sealed = vec![0u8; repr.buffer_len()];
        let mut packet = repr.emit(&mut sealed).unwrap();
        for (i, element) in packet.payload_mut().chunks_exact_mut(4).enumerate() {
            element.copy_from_slice(&(i as i32 * 7919 - 1_000_000).to_le_bytes());
        }
        packet.seal();
        Packet::new_checked(&sealed[..]).unwrap();
        let mut bytes = sealed.clone();
        for bit in 0..sealed.len() * 8 {
            bytes[bit / 8] ^= 1 << (bit % 8);
            let error = Packet::new_checked(&bytes[..]).unwrap_err();
            // The version byte is read first, to name a peer of another version.
            if bit / 8 == field::VERSION {
                assert!(matches!(error, WireError::Version { .. }), "bit {bit}: {error}");
            } else {
                assert!(matches!(error, WireError::Checksum { .. }), "bit {bit}: {error}");
            }
            bytes[bit / 8] ^= 1 << (bit % 8);
        }
        assert_eq!(bytes, sealed);
    }

    #[test]
    fn a_checksum_mismatch_names_both_values() {
        let mut bytes = SAMPLE_BYTES;
        bytes[50] ^= 0x10;
        let error = Packet::new_checked(bytes).unwrap_err();
        let WireError::Checksum { found: 0x673E_EF7A, computed } = error else { panic!("{error:?}") };
        assert_eq!(
            error.to_string(),
            format!(
                "checksum 0x673eef7a does not match {computed:#010x}, the CRC32C of the bytes it covers: \
                 the datagram was corrupted on its way"
            )
        );
    }

    #[test]
    fn in_process_packets_are_checked_in_every_field_but_the_checksum() {
        let mut bytes = SAMPLE_BYTES;
        bytes[56] ^= 0x01;
        let packet = Packet::new_checked_in_process(&bytes[..]).unwrap();
        assert_eq!(PacketRepr::parse(&packet), sample());
        assert!(matches!(Packet::new_checked(&bytes[..]), Err(WireError::Checksum { .. })));
        let mut bad_type = bytes;
        bad_type[2] = 0xEE;
        assert_eq!(
            Packet::new_checked_in_process(&bad_type[..]).unwrap_err(),
            Packet::new_checked(&resealed(bad_type)[..]).unwrap_err()
        );
        for len in [0, 51, 59] {
            assert!(matches!(
                Packet::new_checked_in_process(&bytes[..len]),
                Err(WireError::Truncated { .. })
            ));
        }
    }

    #[test]
    fn only_a_checksummed_link_seals_and_checks_the_checksum() {
        let mut checksummed = SAMPLE_BYTES;
        checksummed[56..].fill(0);
        let mut in_process = checksummed;
        assert_eq!(Integrity::Checksummed.seal(&mut Packet::new_unchecked(&mut checksummed[..])), 60);
        assert_eq!(checksummed, SAMPLE_BYTES);
        assert_eq!(Integrity::InProcess.seal(&mut Packet::new_unchecked(&mut in_process[..])), 60);
        assert_eq!(in_process[56..], [0; 4], "an in-process packet's checksum is left as it was");
        // A bit flipped in the payload: only the checksummed link sees it.
        checksummed[50] ^= 0x01;
        in_process[50] ^= 0x01;
        assert!(matches!(Integrity::Checksummed.check(&checksummed[..]), Err(WireError::Checksum { .. })));
        let packet = Integrity::InProcess.check(&in_process[..]).unwrap();
        assert_eq!(packet.payload()[2], SAMPLE_BYTES[50] ^ 0x01);
        // Every other field is checked either way.
        in_process[0] = PACKET_VERSION + 1;
        assert!(matches!(Integrity::InProcess.check(&in_process[..]), Err(WireError::Version { .. })));
    }
}
