//! The memory of the jobs in flight, so that a job whose buffers another running job
//! writes, or reads where this one would write, is refused at submission instead of
//! racing it.
//!
//! Two jobs over exactly the same memory and element type are the one exception: they are
//! cut into the same slices for the same worker threads, and each thread runs its slices
//! in submission order, so no element is touched by both at once (SwitchML's benchmark
//! submits its jobs that way, and so does netagg's).

use std::ops::Range;

use crate::{DataType, Error};

/// A job's buffers as address ranges, and the type of their elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct JobMemory {
    pub input: Range<usize>,
    pub output: Range<usize>,
    pub data_type: DataType,
}

impl JobMemory {
    /// The memory of a job of `numel` elements read at `input` and written at `output`.
    pub fn new(input: *const u8, output: *const u8, numel: usize, data_type: DataType) -> JobMemory {
        let bytes = numel * data_type.size();
        let (input, output) = (input as usize, output as usize);
        // Saturating: bogus pointers near the end of the address space must be refused,
        // not wrap around and miss an overlap.
        JobMemory {
            input: input..input.saturating_add(bytes),
            output: output..output.saturating_add(bytes),
            data_type,
        }
    }

    /// Refuses input and output that overlap without being the same memory: a sum written
    /// over input that another thread, or a retransmission, still reads would be wrong.
    pub fn check_apart_or_in_place(&self) -> Result<(), Error> {
        if self.input != self.output && overlap(&self.input, &self.output) {
            return Err(Error::OverlappingBuffers);
        }
        Ok(())
    }

    /// Which of this job's buffers meets which of `other`'s where either job writes, if
    /// any: ("input" or "output", "input" or "output").
    fn conflict(&self, other: &JobMemory) -> Option<(&'static str, &'static str)> {
        if self == other {
            return None;
        }
        // Both only reading the same input is fine.
        [
            ("output", &self.output, "input", &other.input),
            ("output", &self.output, "output", &other.output),
            ("input", &self.input, "output", &other.output),
        ]
        .into_iter()
        .find(|(_, mine, _, theirs)| overlap(mine, theirs))
        .map(|(mine, _, theirs, _)| (mine, theirs))
    }
}

/// Whether two address ranges share a byte (an empty range shares none).
fn overlap(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

/// The memory of the jobs submitted and not yet ended, by job number.
#[derive(Debug, Default)]
pub(crate) struct InFlightMemory {
    jobs: Vec<(u64, JobMemory)>,
}

impl InFlightMemory {
    /// Records job `job`'s memory, or refuses it, naming the job in flight it would race.
    /// Admitted, whether a job in flight shares its memory (the one exception): its input
    /// is then still being written, and none of it may be read until its slices run.
    pub fn admit(&mut self, job: u64, memory: JobMemory) -> Result<bool, Error> {
        let shared = self.jobs.iter().any(|(_, theirs)| *theirs == memory);
        for (other, theirs) in &self.jobs {
            if let Some((buffer, other_buffer)) = memory.conflict(theirs) {
                let range = if buffer == "input" { &memory.input } else { &memory.output };
                return Err(Error::BufferInUse {
                    buffer,
                    start: range.start,
                    bytes: range.len(),
                    job: *other,
                    other_buffer,
                });
            }
        }
        self.jobs.push((job, memory));
        Ok(shared)
    }

    /// Forgets job `job`'s memory: it has ended.
    pub fn release(&mut self, job: u64) {
        self.jobs.retain(|(admitted, _)| *admitted != job);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory(input: usize, output: usize, numel: usize) -> JobMemory {
        JobMemory::new(
            std::ptr::without_provenance(input),
            std::ptr::without_provenance(output),
            numel,
            DataType::Int32,
        )
    }

    #[test]
    fn input_and_output_are_the_same_memory_or_apart() {
        assert_eq!(memory(0x1000, 0x1000, 16).check_apart_or_in_place(), Ok(()));
        assert_eq!(memory(0x1000, 0x1040, 16).check_apart_or_in_place(), Ok(()), "adjacent");
        assert_eq!(memory(0x1000, 0x1004, 16).check_apart_or_in_place(), Err(Error::OverlappingBuffers));
        assert_eq!(memory(0x1004, 0x1000, 16).check_apart_or_in_place(), Err(Error::OverlappingBuffers));
    }

    #[test]
    fn a_job_writing_memory_another_job_in_flight_uses_is_refused_until_that_job_ends() {
        let mut in_flight = InFlightMemory::default();
        in_flight.admit(1, memory(0x1000, 0x1000, 16)).unwrap();
        let error = in_flight.admit(2, memory(0x1020, 0x1020, 16)).unwrap_err();
        assert_eq!(
            error,
            Error::BufferInUse { buffer: "output", start: 0x1020, bytes: 64, job: 1, other_buffer: "input" }
        );
        assert_eq!(
            error.to_string(),
            "the output of this job (64 bytes at 0x1020) overlaps the input of job 1, which is still in \
             flight: wait for that job first, or give this one memory of its own"
        );
        // Reading, out of place, what job 1 writes.
        let error = in_flight.admit(2, memory(0x1000, 0x9000, 16)).unwrap_err();
        assert!(matches!(error, Error::BufferInUse { buffer: "input", job: 1, other_buffer: "output", .. }));
        // Writing what job 1 reads, as job 1's input of a different type.
        let floats = JobMemory { data_type: DataType::Float32, ..memory(0x1000, 0x1000, 16) };
        assert!(in_flight.admit(2, floats).is_err());
        in_flight.release(1);
        in_flight.admit(2, memory(0x1020, 0x1020, 16)).unwrap();
    }

    #[test]
    fn jobs_over_the_same_memory_or_only_reading_the_same_input_may_run_together() {
        let mut in_flight = InFlightMemory::default();
        in_flight.admit(1, memory(0x1000, 0x1000, 16)).unwrap();
        in_flight.admit(2, memory(0x1000, 0x1000, 16)).unwrap();
        in_flight.admit(3, memory(0x1000, 0x1000, 0)).unwrap();
        in_flight.admit(4, memory(0x2000, 0x3000, 16)).unwrap();
        in_flight.admit(5, memory(0x2000, 0x4000, 16)).unwrap();
        assert!(in_flight.admit(6, memory(0x5000, 0x3000, 16)).is_err(), "both write 0x3000");
    }
}
