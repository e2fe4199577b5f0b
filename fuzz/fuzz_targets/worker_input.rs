//! A worker thread's protocol core, running jobs the input chooses, fed datagrams and time
//! by the input: no panic, every packet it sends is a well-formed data or ack packet of
//! its own, and it loads and stores only blocks of the running job.
//!
//! Guessing a result the worker accepts takes the right slot, round, job and block at
//! once, so besides raw bytes and free-form results the input can *answer* one of the
//! packets the worker sent lately, as a switch would.

#![no_main]

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use netagg_aggregator::{
    BlockIo, BlockMask, JobSpec, Layout, PacingConfig, SessionKey, SessionKeys, WorkerConfig, WorkerProtocol,
};
use netagg_fuzz::Raw;
use netagg_wire::packet::{datagram_len, BROADCAST_RANK, ELEMENT_LEN, END_OF_STREAM, PROGRESS_SLOTS};
use netagg_wire::{ElementType, Flags, Integrity, MessageType, Packet, PacketRepr};

const KEY: SessionKey = SessionKey { session: 0x0001_0001, token: 0x0123_4567_89AB_CDEF };

const PACKET_ELEMENTS: u16 = 8;

static CONFIG: std::sync::LazyLock<WorkerConfig> = std::sync::LazyLock::new(|| WorkerConfig {
    keys: SessionKeys::one(KEY),
    rank: 1,
    // Not 0, so slot numbers below the thread's range are reachable.
    slot_base: 2,
    slots: 3,
    packet_elements: PACKET_ELEMENTS,
    depth: 4,
    retransmit_timeout: Duration::from_millis(10),
    max_retransmit_timeout: Duration::from_millis(80),
    job_timeout: Duration::from_secs(1),
    pacing: PacingConfig::DEFAULT,
    integrity: Integrity::Checksummed,
});

const BLOCK_BYTES: usize = PACKET_ELEMENTS as usize * ELEMENT_LEN;

/// Sent packets kept for `Step::Answer`.
const SENT_KEPT: usize = 8;

#[derive(Debug, Arbitrary)]
enum Step {
    Raw(Raw),
    Result(Header),
    Answer(Answer),
    /// A pending notice about the round of a packet the worker sent lately.
    Pending(Pending),
    /// A progress report answering a probe the worker sent lately, or not.
    Progress(Progress),
    /// Takes every packet the worker has to send.
    Transmit,
    /// Lets time pass, in 5 ms units, and fires the timers.
    Wait(u8),
    /// Jumps to the worker's next deadline and fires it.
    NextTimeout,
    /// Starts another job; refused while one runs or after one failed.
    Start(Job),
}

/// A job of up to 32 blocks, whose non-zero blocks (sparse) are the bits of `mask`.
#[derive(Debug, Arbitrary)]
struct Job {
    job: u8,
    float: bool,
    elements: u8,
    sparse: bool,
    mask: u32,
    /// Block floating point (dense jobs only; a sparse one must be refused).
    exponents: bool,
}

impl Job {
    fn spec(&self) -> JobSpec {
        let elements = self.elements as u64;
        let blocks = elements.div_ceil(CONFIG.packet_elements as u64) as u32;
        JobSpec {
            job: self.job as u32 % 3,
            element_type: if self.float { ElementType::Float32 } else { ElementType::Int32 },
            elements,
            layout: if self.sparse {
                Layout::Sparse(BlockMask::from_fn(blocks, |b| self.mask & (1 << b) != 0))
            } else {
                Layout::Dense
            },
            exponents: self.exponents,
        }
    }
}

/// A switch → worker result in a few bytes: small values where the worker compares.
#[derive(Debug, Arbitrary)]
struct Header {
    other_session: bool,
    other_token: bool,
    /// `None` is a broadcast.
    rank: Option<u8>,
    slot: u8,
    /// Sign-extended, so rounds just below zero (wrapped) are reachable too.
    round: i8,
    job: u8,
    flags: u8,
    float: bool,
    exponent: i8,
    block: u8,
    /// `None` is the end of the stream.
    next_block: Option<u8>,
    elements: u8,
    /// Seed of the element values.
    value: i32,
}

/// The switch's word that a round the worker asked about is still aggregating.
#[derive(Debug, Arbitrary)]
struct Pending {
    pick: u8,
    contributed: bool,
    /// A notice that the picked packet's first sending, by its number, never came
    /// (rather than an answer about its round).
    lost: bool,
    /// Sent to every worker, which a notice never is.
    broadcast: bool,
}

/// The switch's report on the slots from a packet's: their open rounds, each a small
/// step from that packet's round, and where the worker's contribution is in.
#[derive(Debug, Arbitrary)]
struct Progress {
    pick: u8,
    /// Each slot's open round, less the picked packet's round; past the thread's range
    /// too (up to the 64 a report covers).
    steps: Vec<i8>,
    contributions: u64,
    /// The probe's transmission count, as the report echoes it (else the picked packet's id).
    probed: Option<u32>,
    /// Sent to every worker, which a report never is.
    broadcast: bool,
}

/// The result of the round of a packet the worker sent lately.
#[derive(Debug, Arbitrary)]
struct Answer {
    pick: u8,
    broadcast: bool,
    /// All workers' blocks were zero: a result without payload.
    empty: bool,
    /// The stream moves to the block the worker named, else to `next_block`.
    own_next: bool,
    /// `None` is the end of the stream.
    next_block: Option<u8>,
    /// Seed of the element values.
    value: i32,
    /// A broadcast's number among the switch's broadcasts to this thread: in or out of
    /// order, repeated or skipped, as the fuzzer picks.
    sequence: u8,
}

/// The job's tensors: `load` reads `input`, `store` writes `output`.
struct Tensor {
    input: Vec<u8>,
    output: Vec<u8>,
}

impl Tensor {
    fn new(spec: &JobSpec) -> Tensor {
        let len = spec.elements as usize * ELEMENT_LEN;
        Tensor { input: (0..len).map(|i| i as u8).collect(), output: vec![0; len] }
    }
}

impl BlockIo for Tensor {
    fn load(&mut self, block: u32, payload: &mut [u8], _exponent: Option<i8>) {
        let start = block as usize * BLOCK_BYTES;
        let Some(source) = self.input.get(start..start + payload.len()) else {
            panic!(
                "load of {} bytes of block {block} past the job's {} bytes",
                payload.len(),
                self.input.len()
            );
        };
        payload.copy_from_slice(source);
    }

    fn exponent(&mut self, block: u32) -> i8 {
        let start = block as usize * BLOCK_BYTES;
        assert!(
            start < self.input.len(),
            "exponent of block {block} past the job's {} bytes",
            self.input.len()
        );
        block as i8
    }

    fn store(&mut self, block: u32, payload: &[u8], _exponent: Option<i8>) {
        let start = block as usize * BLOCK_BYTES;
        let len = self.output.len();
        assert!(start < len, "store of block {block} past the job's {len} bytes");
        if payload.is_empty() {
            self.output[start..len.min(start + BLOCK_BYTES)].fill(0);
            return;
        }
        let Some(target) = self.output.get_mut(start..start + payload.len()) else {
            panic!("store of {} bytes of block {block} past the job's {len} bytes", payload.len());
        };
        target.copy_from_slice(payload);
    }
}

struct Harness {
    worker: WorkerProtocol,
    tensor: Tensor,
    now: Instant,
    sent: VecDeque<PacketRepr>,
    /// Exactly one full packet: the least `poll_transmit` is documented to need.
    buf: Vec<u8>,
}

impl Harness {
    fn new(job: &Job) -> Harness {
        let now = Instant::now();
        let mut worker = WorkerProtocol::new(CONFIG.clone(), now);
        let spec = job.spec();
        let tensor = Tensor::new(&spec);
        let sparse_with_exponents = spec.exponents && matches!(spec.layout, Layout::Sparse(_));
        match worker.start_job(now, spec) {
            Ok(()) => assert!(!sparse_with_exponents, "a sparse block-floating-point job must be refused"),
            Err(error) => assert!(sparse_with_exponents, "a fresh worker refused a job: {error}"),
        }
        Harness {
            worker,
            tensor,
            now,
            sent: VecDeque::with_capacity(SENT_KEPT),
            buf: vec![0; datagram_len(CONFIG.packet_elements as usize)],
        }
    }

    fn step(&mut self, step: Step) {
        match step {
            Step::Raw(Raw(bytes)) => self.deliver(&bytes),
            Step::Result(header) => self.deliver(&result_bytes(&free_form(&header), header.value)),
            Step::Answer(answer) => {
                if let Some(repr) = self.answer(&answer) {
                    self.deliver(&result_bytes(&repr, answer.value));
                }
            }
            Step::Pending(pending) => {
                if let Some(sent) = self.sent.get(pending.pick as usize % SENT_KEPT) {
                    let notice = PacketRepr {
                        message_type: MessageType::Pending,
                        flags: match (pending.lost, pending.contributed) {
                            (true, _) => Flags::LOST,
                            (false, true) => Flags::CONTRIBUTED,
                            (false, false) => Flags::NONE,
                        },
                        rank: if pending.broadcast { BROADCAST_RANK } else { sent.rank },
                        sequence: if pending.lost { sent.sequence } else { 0 },
                        element_count: 0,
                        ack_round: 0,
                        ..*sent
                    };
                    self.deliver(&result_bytes(&notice, 0));
                }
            }
            Step::Progress(progress) => {
                if let Some(sent) = self.sent.get(progress.pick as usize % SENT_KEPT) {
                    let steps = &progress.steps[..progress.steps.len().min(PROGRESS_SLOTS)];
                    let mut report = PacketRepr {
                        message_type: MessageType::Progress,
                        // A report's elements are rounds, whatever the job's type.
                        element_type: ElementType::Int32,
                        flags: Flags::NONE,
                        packet_id: progress.probed.unwrap_or(sent.packet_id),
                        rank: if progress.broadcast { BROADCAST_RANK } else { sent.rank },
                        element_count: steps.len() as u16,
                        ack_round: 0,
                        sequence: 0,
                        ..*sent
                    };
                    report.set_contributions(progress.contributions);
                    let mut bytes = vec![0; report.buffer_len()];
                    let mut packet = report.emit(&mut bytes).expect("at most 64 slots");
                    let rounds = packet.payload_mut().chunks_exact_mut(ELEMENT_LEN);
                    for (round, &step) in rounds.zip(steps) {
                        round.copy_from_slice(&sent.round.wrapping_add(step as i32 as u32).to_le_bytes());
                    }
                    packet.seal();
                    self.deliver(&bytes);
                }
            }
            Step::Transmit => self.transmit(),
            Step::Wait(ticks) => {
                self.now += Duration::from_millis(5 * ticks as u64);
                self.worker.handle_timeout(self.now);
            }
            Step::NextTimeout => {
                if let Some(deadline) = self.worker.poll_timeout() {
                    self.now = self.now.max(deadline);
                    self.worker.handle_timeout(self.now);
                }
            }
            Step::Start(job) => {
                let spec = job.spec();
                let tensor = Tensor::new(&spec);
                if self.worker.start_job(self.now, spec).is_ok() {
                    self.tensor = tensor;
                }
            }
        }
    }

    fn deliver(&mut self, datagram: &[u8]) {
        self.worker.handle_datagram(self.now, datagram, &mut self.tensor);
    }

    fn transmit(&mut self) {
        while let Some(len) = self.worker.poll_transmit(self.now, &mut self.buf, &mut self.tensor) {
            let bytes = &self.buf[..len];
            let packet = match Packet::new_checked(bytes) {
                Ok(packet) => packet,
                Err(error) => panic!("worker sent a malformed packet ({error}): {bytes:02x?}"),
            };
            let repr = PacketRepr::parse(&packet);
            assert!(
                matches!(repr.message_type, MessageType::Data | MessageType::Ack | MessageType::Probe),
                "{repr:?}"
            );
            assert_eq!((repr.session, repr.rank), (KEY.session, CONFIG.rank), "{repr:?}");
            let slots = CONFIG.slot_base..CONFIG.slot_base + CONFIG.slots;
            assert!(slots.contains(&repr.slot), "{repr:?}");
            if self.sent.len() == SENT_KEPT {
                self.sent.pop_front();
            }
            self.sent.push_back(repr);
        }
    }

    fn answer(&self, answer: &Answer) -> Option<PacketRepr> {
        let sent = self.sent.get(answer.pick as usize % SENT_KEPT)?;
        Some(PacketRepr {
            message_type: MessageType::Result,
            flags: if sent.flags.contains(Flags::SPARSE) { Flags::SPARSE } else { Flags::NONE },
            rank: if answer.broadcast { BROADCAST_RANK } else { sent.rank },
            sequence: if answer.broadcast { answer.sequence } else { 0 },
            element_count: if answer.empty { 0 } else { sent.element_count },
            next_block: if answer.own_next {
                sent.next_block
            } else {
                answer.next_block.map_or(END_OF_STREAM, u32::from)
            },
            ack_round: 0,
            ..*sent
        })
    }
}

fn free_form(h: &Header) -> PacketRepr {
    let element_type = if h.float { ElementType::Float32 } else { ElementType::Int32 };
    let session = if h.other_session { !KEY.session } else { KEY.session };
    let token = if h.other_token { !KEY.token } else { KEY.token };
    // One more than a packet holds, to reach the length checks.
    let elements = h.elements as u16 % (CONFIG.packet_elements + 2);
    PacketRepr {
        flags: Flags::from_bits(h.flags & 0b1_1111).expect("masked to the known bits"),
        job: h.job as u32 % 3,
        packet_id: h.block as u32,
        rank: h.rank.map_or(BROADCAST_RANK, |r| r as u16 % 3),
        // Two below and one above the thread's range.
        slot: h.slot as u16 % (CONFIG.slot_base + CONFIG.slots + 1),
        exponent: h.exponent,
        round: h.round as i32 as u32,
        block: h.block as u32,
        next_block: h.next_block.map_or(END_OF_STREAM, u32::from),
        ..PacketRepr::new(MessageType::Result, element_type, session, token, elements)
    }
}

/// The bytes of a result with the given header, its elements made from `value`.
fn result_bytes(repr: &PacketRepr, value: i32) -> Vec<u8> {
    let mut bytes = vec![0; repr.buffer_len()];
    let mut packet = repr.emit(&mut bytes).expect("fields are in range");
    for (i, element) in packet.payload_mut().chunks_exact_mut(ELEMENT_LEN).enumerate() {
        element.copy_from_slice(&value.rotate_left(i as u32).to_le_bytes());
    }
    packet.seal();
    bytes
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let Ok(job) = Job::arbitrary(&mut u) else {
        return;
    };
    let mut harness = Harness::new(&job);
    while !u.is_empty() {
        let Ok(step) = Step::arbitrary(&mut u) else {
            break;
        };
        harness.step(step);
    }
});
