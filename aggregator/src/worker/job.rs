//! A job: what a worker thread is asked to aggregate, and how its job starts, finishes
//! and fails.
//!
//! One job runs at a time. A failed job leaves the slots' rounds out of step with the
//! other workers', so the thread refuses later jobs: the session must be opened anew.

use std::ops::Range;
use std::time::{Duration, Instant};

use netagg_wire::packet::END_OF_STREAM;
use netagg_wire::ElementType;

use super::streams::Layout;
use super::{Job, WorkerProtocol};

/// One job, as this worker thread sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobSpec {
    /// Job number, the same on every rank; results of other jobs are stale.
    pub job: u32,
    pub element_type: ElementType,
    /// Elements of this thread's share of the tensor.
    pub elements: u64,
    pub layout: Layout,
    /// Block floating point: every block is encoded with an exponent all workers agreed
    /// on beforehand (dense jobs only). A header-only *exponent round* on the thread's
    /// first slot agrees one for the first block of every slot; after that each packet
    /// carries its sender's exponent of the next block in its slot, and the switch's
    /// maximum of those comes back with the result, one round ahead of its use. A job of
    /// `L` packets thus costs `L + 1` packets (SwitchML's look-ahead batch costs
    /// `L + min(L, window)`).
    pub exponents: bool,
}

/// Why a job could not start or did not finish.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobError {
    #[error("a job is already running")]
    Busy,
    #[error("the job's {blocks} blocks exceed the protocol's 2^32 - 1")]
    TooLarge { blocks: u64 },
    #[error("the sparse mask has {mask} blocks, the job has {blocks}")]
    MaskSize { mask: u32, blocks: u32 },
    #[error("no progress for {0:?}: the switch or another worker is not answering")]
    Timeout(Duration),
    #[error("an earlier job failed, so the slots' rounds are out of step: open a new session")]
    SessionBroken,
    #[error("block floating point needs a dense layout")]
    SparseExponents,
    #[error("aborted: {0}")]
    Aborted(String),
}

/// Where the current job stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobStatus {
    Idle,
    Running,
    Done,
    Failed(JobError),
}

impl WorkerProtocol {
    /// Starts a job; its packets then come out of [`WorkerProtocol::poll_transmit`].
    pub fn start_job(&mut self, now: Instant, spec: JobSpec) -> Result<(), JobError> {
        if self.status == JobStatus::Running {
            return Err(JobError::Busy);
        }
        if self.broken {
            return Err(JobError::SessionBroken);
        }
        let blocks = spec.elements.div_ceil(spec.element_type.per_packet(self.config.packet_elements) as u64);
        if blocks >= END_OF_STREAM as u64 {
            return Err(JobError::TooLarge { blocks });
        }
        let blocks = blocks as u32;
        if let Layout::Sparse(mask) = &spec.layout {
            if mask.blocks() != blocks {
                return Err(JobError::MaskSize { mask: mask.blocks(), blocks });
            }
            if spec.exponents {
                return Err(JobError::SparseExponents);
            }
        }
        let active_slots = (self.config.slots as u32).min(blocks) as u16;
        self.pending.clear();
        self.clear_paced();
        self.clear_timers();
        self.last_progress = now;
        self.timed = None;
        self.probe = None;
        for endpoint in &mut self.endpoints {
            endpoint.latest_answered = None;
            endpoint.first_sendings.clear();
            endpoint.gaps.settle();
        }
        self.pacer.job_started(now, &mut self.delivered);
        self.start_streams(&spec, active_slots);
        self.job = Some(Job { spec, blocks });
        self.status = JobStatus::Running;
        if active_slots == 0 {
            self.finish_job();
        }
        Ok(())
    }

    /// Fails the running job from outside, say because its transport broke. The slots'
    /// rounds are then out of step with the other workers, so later jobs are refused.
    pub fn abort(&mut self, reason: &str) {
        if self.status == JobStatus::Running {
            self.fail(JobError::Aborted(reason.to_string()));
        }
    }

    pub(super) fn fail(&mut self, error: JobError) {
        self.status = JobStatus::Failed(error);
        self.counters.jobs_failed += 1;
        self.broken = true;
        self.pending.clear();
        self.clear_paced();
        self.clear_timers();
        for slot in &mut self.slots {
            slot.active = false;
        }
    }

    /// Whether the job running, or the last one, sends only its non-zero blocks.
    pub(super) fn sparse_job(&self) -> bool {
        self.job.as_ref().is_some_and(|job| matches!(job.spec.layout, Layout::Sparse(_)))
    }

    pub(super) fn finish_job(&mut self) {
        self.status = JobStatus::Done;
        self.counters.jobs_done += 1;
        self.pending.clear();
        self.clear_paced();
        self.clear_timers();
    }
}

/// The blocks each of a worker's `threads` threads takes of a job of `blocks`: one
/// contiguous run each, in thread order, the first `blocks % threads` one block longer.
/// Every rank cuts its jobs so, and so the same elements meet in the same slots.
pub fn thread_blocks(blocks: usize, threads: usize) -> impl Iterator<Item = Range<usize>> {
    let threads = threads.max(1);
    let (share, extra) = (blocks / threads, blocks % threads);
    (0..threads).scan(0, move |first, thread| {
        let run = *first..*first + share + usize::from(thread < extra);
        *first = run.end;
        Some(run)
    })
}

/// Elements in block `block` of a job: a full packet of its element type, or the tail.
#[inline]
pub(super) fn block_len(spec: &JobSpec, block: u32, packet_elements: u16) -> u16 {
    let full = spec.element_type.per_packet(packet_elements) as u64;
    spec.elements.saturating_sub(block as u64 * full).min(full) as u16
}

#[cfg(test)]
mod tests {
    use super::super::testing::{running, sent};
    use super::super::BlockMask;
    use super::*;

    fn dense(elements: u64) -> JobSpec {
        JobSpec {
            job: 2,
            element_type: ElementType::Int32,
            elements,
            layout: Layout::Dense,
            exponents: false,
        }
    }

    #[test]
    fn a_job_that_cannot_run_is_refused_and_changes_nothing() {
        let start = Instant::now();
        let mut protocol = running(start, 2, 4, Duration::from_millis(10));
        assert_eq!(protocol.start_job(start, dense(4)), Err(JobError::Busy));
        assert_eq!(protocol.status(), &JobStatus::Running);

        let mut idle = running(start, 2, 0, Duration::from_millis(10));
        assert_eq!(idle.status(), &JobStatus::Done, "a job of no blocks is done at once");
        let too_large = dense(u64::from(END_OF_STREAM));
        assert_eq!(
            idle.start_job(start, too_large),
            Err(JobError::TooLarge { blocks: END_OF_STREAM as u64 })
        );
        let short_mask = JobSpec { layout: Layout::Sparse(BlockMask::new(3)), ..dense(4) };
        assert_eq!(idle.start_job(start, short_mask), Err(JobError::MaskSize { mask: 3, blocks: 4 }));
        let sparse_exponents =
            JobSpec { layout: Layout::Sparse(BlockMask::new(4)), exponents: true, ..dense(4) };
        assert_eq!(idle.start_job(start, sparse_exponents), Err(JobError::SparseExponents));
        assert_eq!((idle.status(), idle.counters().jobs_failed), (&JobStatus::Done, 0));
    }

    #[test]
    fn threads_take_contiguous_runs_the_first_ones_a_block_longer() {
        let runs: Vec<Range<usize>> = thread_blocks(7, 3).collect();
        assert_eq!(runs, [0..3, 3..5, 5..7]);
        let runs: Vec<Range<usize>> = thread_blocks(1, 2).collect();
        assert_eq!(runs, [0..1, 1..1], "a thread may have nothing to do");
    }

    #[test]
    fn an_aborted_job_breaks_the_session_for_later_jobs() {
        let start = Instant::now();
        let mut protocol = running(start, 2, 4, Duration::from_millis(10));
        assert_eq!(sent(&mut protocol, start).len(), 2);
        protocol.abort("the transport broke");
        assert_eq!(protocol.status(), &JobStatus::Failed(JobError::Aborted("the transport broke".into())));
        assert!(sent(&mut protocol, start).is_empty(), "nothing more to send");
        assert_eq!(protocol.poll_timeout(), None);
        assert_eq!(protocol.start_job(start, dense(4)), Err(JobError::SessionBroken));
        assert_eq!(protocol.counters().jobs_failed, 1);
    }
}
