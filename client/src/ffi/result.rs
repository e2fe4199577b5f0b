//! The C API's one result type, and how the library's errors map onto it.

use netagg_config::ConfigError;

use crate::Error;

/// What a `netagg_*` function did. `NETAGG_OK` is zero; the errors are numbered from 7000
/// so they cannot be mistaken for errno values or another library's codes.
/// `netagg_result_message` describes a code; `netagg_last_error_message` gives the detail
/// of the calling thread's last failure (the file, key, address or job at fault).
#[allow(non_camel_case_types)]
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum netagg_result {
    NETAGG_OK = 0,
    /// A pointer argument that must not be NULL was NULL.
    NETAGG_NULL_ARGUMENT = 7000,
    /// An argument is out of range: an unknown data type, a size that overflows memory,
    /// a string that is not UTF-8.
    NETAGG_INVALID_ARGUMENT,
    /// A job handle that was freed, or never issued.
    NETAGG_INVALID_JOB,
    /// The output buffer is too small; the size needed was written.
    NETAGG_BUFFER_TOO_SMALL,
    /// The library hit a bug (a Rust panic); the call had no effect.
    NETAGG_PANIC,
    /// The config file could not be read or parsed.
    NETAGG_CONFIG_FILE,
    /// A config key that netagg does not know.
    NETAGG_CONFIG_UNKNOWN_KEY,
    /// A config value outside what its key accepts.
    NETAGG_CONFIG_VALUE,
    /// Config values that are valid alone but not together.
    NETAGG_CONFIG_INVALID,
    /// The context was not started yet.
    NETAGG_NOT_STARTED,
    /// The context is already running.
    NETAGG_ALREADY_STARTED,
    /// The context was stopped (jobs it still had failed with this code).
    NETAGG_STOPPED,
    /// The switch could not be reached within `general.connect_timeout`.
    NETAGG_CONNECT,
    /// The switch refused the registration (a mismatch with other ranks, a limit).
    NETAGG_REJECTED,
    /// Not every rank registered within `general.connect_timeout`.
    NETAGG_REGISTER_TIMEOUT,
    /// The switch closed the session (another rank left or died).
    NETAGG_SESSION_LOST,
    /// A job failed: no progress within `general.job_timeout` (a dead switch or worker).
    NETAGG_JOB_FAILED,
    /// `netagg_job_wait_timeout`: the job is still running.
    NETAGG_WAIT_TIMEOUT,
    /// The job's codec refused the tensor (Rust codecs of one's own; netagg's refuse none).
    NETAGG_INVALID_INPUT,
    /// A socket or system call failed.
    NETAGG_IO,
    /// The backend's device could not start (DPDK's EAL or port, say); the message says
    /// why.
    NETAGG_BACKEND,
    /// A buffer of the job meets one of a job still in flight where either writes; the
    /// message names that job.
    NETAGG_BUFFER_IN_USE,
}

use netagg_result::*;

impl netagg_result {
    /// Every code, for looking one up by its number; a test checks none is missing.
    const ALL: [netagg_result; 23] = [
        NETAGG_OK,
        NETAGG_NULL_ARGUMENT,
        NETAGG_INVALID_ARGUMENT,
        NETAGG_INVALID_JOB,
        NETAGG_BUFFER_TOO_SMALL,
        NETAGG_PANIC,
        NETAGG_CONFIG_FILE,
        NETAGG_CONFIG_UNKNOWN_KEY,
        NETAGG_CONFIG_VALUE,
        NETAGG_CONFIG_INVALID,
        NETAGG_NOT_STARTED,
        NETAGG_ALREADY_STARTED,
        NETAGG_STOPPED,
        NETAGG_CONNECT,
        NETAGG_REJECTED,
        NETAGG_REGISTER_TIMEOUT,
        NETAGG_SESSION_LOST,
        NETAGG_JOB_FAILED,
        NETAGG_WAIT_TIMEOUT,
        NETAGG_INVALID_INPUT,
        NETAGG_IO,
        NETAGG_BACKEND,
        NETAGG_BUFFER_IN_USE,
    ];

    /// The result with this number, if there is one (C callers may pass any).
    pub fn from_code(code: u32) -> Option<netagg_result> {
        netagg_result::ALL.into_iter().find(|result| *result as u32 == code)
    }

    /// A fixed description of the code.
    pub fn description(self) -> &'static str {
        match self {
            NETAGG_OK => "success",
            NETAGG_NULL_ARGUMENT => "a required pointer argument is NULL",
            NETAGG_INVALID_ARGUMENT => "an argument is out of range",
            NETAGG_INVALID_JOB => "the job handle was freed or never issued",
            NETAGG_BUFFER_TOO_SMALL => "the output buffer is too small",
            NETAGG_PANIC => "internal error in the netagg library (a bug; please report it)",
            NETAGG_CONFIG_FILE => "the config file cannot be read",
            NETAGG_CONFIG_UNKNOWN_KEY => "unknown config key",
            NETAGG_CONFIG_VALUE => "invalid config value",
            NETAGG_CONFIG_INVALID => "invalid combination of config values",
            NETAGG_NOT_STARTED => "the context is not started",
            NETAGG_ALREADY_STARTED => "the context is already started",
            NETAGG_STOPPED => "the context is stopped",
            NETAGG_CONNECT => "cannot reach the switch",
            NETAGG_REJECTED => "the switch refused the registration",
            NETAGG_REGISTER_TIMEOUT => "not every rank registered in time",
            NETAGG_SESSION_LOST => "the switch closed the session",
            NETAGG_JOB_FAILED => "the job failed",
            NETAGG_WAIT_TIMEOUT => "the job is still running",
            NETAGG_INVALID_INPUT => "the codec refused the tensor",
            NETAGG_IO => "I/O error",
            NETAGG_BACKEND => "the backend's device cannot start",
            NETAGG_BUFFER_IN_USE => "a buffer is in use by a job still in flight",
        }
    }
}

impl From<&Error> for netagg_result {
    fn from(error: &Error) -> netagg_result {
        match error {
            Error::Config(ConfigError::File { .. }) => NETAGG_CONFIG_FILE,
            Error::Config(ConfigError::UnknownKey { .. }) => NETAGG_CONFIG_UNKNOWN_KEY,
            Error::Config(ConfigError::Value { .. }) => NETAGG_CONFIG_VALUE,
            Error::Config(ConfigError::Combination { .. })
            | Error::InvalidConfig(_)
            | Error::NotBuiltIn { .. } => NETAGG_CONFIG_INVALID,
            Error::Connect { .. } => NETAGG_CONNECT,
            Error::Rejected { .. } | Error::Version { .. } => NETAGG_REJECTED,
            Error::RegisterTimeout { .. } => NETAGG_REGISTER_TIMEOUT,
            Error::SessionLost(_) => NETAGG_SESSION_LOST,
            Error::Job(_) | Error::Panicked { .. } => NETAGG_JOB_FAILED,
            Error::Stopped => NETAGG_STOPPED,
            Error::LengthMismatch { .. } | Error::OverlappingBuffers => NETAGG_INVALID_ARGUMENT,
            Error::NullBuffer => NETAGG_NULL_ARGUMENT,
            Error::InvalidInput(_) => NETAGG_INVALID_INPUT,
            Error::Io { .. } => NETAGG_IO,
            Error::Backend(_) => NETAGG_BACKEND,
            Error::BufferInUse { .. } => NETAGG_BUFFER_IN_USE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_result_has_a_description_and_is_listed_once() {
        let listed: std::collections::HashSet<u32> = netagg_result::ALL.iter().map(|r| *r as u32).collect();
        let errors = (NETAGG_NULL_ARGUMENT as u32..=NETAGG_BUFFER_IN_USE as u32).chain([NETAGG_OK as u32]);
        assert_eq!(listed, errors.collect());
        assert!(netagg_result::ALL.iter().all(|r| !r.description().is_empty()));
        assert_eq!(netagg_result::from_code(7011), Some(NETAGG_STOPPED));
        assert_eq!(netagg_result::from_code(6999), None);
    }
}
