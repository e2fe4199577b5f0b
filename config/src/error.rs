//! The one error type of loading and setting keys, whose messages name the file,
//! variable, flag or program a value came from.

use std::path::PathBuf;

use crate::Origin;

/// Why a configuration could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {reason}")]
    File { path: PathBuf, reason: String },
    #[error("{origin}: unknown key '{key}'; known keys: {known}")]
    UnknownKey { origin: Origin, key: String, known: String },
    #[error("{origin}: key '{key}' = '{value}': expected {expected}")]
    Value { origin: Origin, key: String, value: String, expected: String },
    /// Values valid alone but not together; the message names where each came from.
    #[error("{message}")]
    Combination { message: String },
}

impl ConfigError {
    /// `value`, given for `key` in `origin`, is not what the key expects.
    pub(crate) fn refused(origin: &Origin, key: &str, value: &str, expected: String) -> ConfigError {
        ConfigError::Value {
            origin: origin.clone(),
            key: key.to_string(),
            value: value.to_string(),
            expected,
        }
    }
}
