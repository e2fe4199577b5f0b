//! The log output of netagg's programs, set up one way for all of them: `netagg-switch`,
//! `netagg-allreduce` and `allreduce_benchmark` call [`init`].
//!
//! Events go to stderr, one line each: a line break inside an event (a session name a
//! client chose, the message of an error) is written as `\n`, so that a line is always one
//! event and nothing a peer sends can forge one. Lines are coloured only when stderr is a
//! terminal and `NO_COLOR` is unset or empty (<https://no-color.org>); a file or a pipe
//! gets plain text. `RUST_LOG`, where set to a valid filter, overrides the program's level.
//!
//! It lives in this crate because every netagg program depends on it, and the level is a
//! configuration value (`switch.log_level`); the client library itself installs no
//! logger, which is its host program's choice.

use std::borrow::Cow;
use std::ffi::OsStr;
use std::io::{self, IsTerminal, Write};

use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::EnvFilter;

/// Why the logger could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum LoggingError {
    #[error("log level '{level}': {reason}")]
    Level { level: String, reason: String },
    #[error("cannot install the logger: {0}")]
    Install(String),
}

/// Installs this process's logger: events at `level` (`error`, `warn`, `info`, `debug`,
/// `trace`, or any `RUST_LOG` filter) and above go to stderr, one line each, coloured as
/// [`colour`] decides; `RUST_LOG` overrides `level` when it is set and valid.
pub fn init(level: &str) -> Result<(), LoggingError> {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(level))
        .map_err(|error| LoggingError::Level { level: level.into(), reason: error.to_string() })?;
    let ansi = colour(io::stderr().is_terminal(), std::env::var_os("NO_COLOR").as_deref());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(StderrLines)
        .try_init()
        .map_err(|error| LoggingError::Install(error.to_string()))
}

/// Whether log lines to a stream are coloured: only on a terminal, and only when
/// `NO_COLOR` (its value given here) is unset or empty, as <https://no-color.org> asks.
pub fn colour(is_terminal: bool, no_color: Option<&OsStr>) -> bool {
    is_terminal && no_color.is_none_or(OsStr::is_empty)
}

/// Gives the formatter a [`OneLine`] writer to stderr for each event.
struct StderrLines;

impl<'a> MakeWriter<'a> for StderrLines {
    type Writer = OneLine<io::Stderr>;

    fn make_writer(&'a self) -> Self::Writer {
        OneLine(io::stderr())
    }
}

/// A writer of whole events (the formatter writes each event in one call), which keeps
/// each on one line.
struct OneLine<W>(W);

impl<W: Write> Write for OneLine<W> {
    fn write(&mut self, event: &[u8]) -> io::Result<usize> {
        self.0.write_all(&one_line(event))?;
        Ok(event.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

/// `event` with its line breaks, but for a final `\n`, written as `\n` and `\r`. Bytes,
/// not characters: neither break occurs inside the UTF-8 encoding of another character.
fn one_line(event: &[u8]) -> Cow<'_, [u8]> {
    let body = event.strip_suffix(b"\n").unwrap_or(event);
    if !body.iter().any(|byte| matches!(byte, b'\n' | b'\r')) {
        return Cow::Borrowed(event);
    }
    let mut line = Vec::with_capacity(event.len() + 16);
    for &byte in body {
        match byte {
            b'\n' => line.extend_from_slice(b"\\n"),
            b'\r' => line.extend_from_slice(b"\\r"),
            _ => line.push(byte),
        }
    }
    if body.len() < event.len() {
        line.push(b'\n');
    }
    Cow::Owned(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour(true, None));
        assert!(colour(true, Some(OsStr::new(""))), "an empty NO_COLOR is unset");
        for value in ["1", "0", "true", "anything"] {
            assert!(!colour(true, Some(OsStr::new(value))), "NO_COLOR={value}");
        }
        assert!(!colour(false, None));
        assert!(!colour(false, Some(OsStr::new(""))));
    }

    #[test]
    fn line_breaks_inside_an_event_are_escaped_and_the_final_one_kept() {
        assert_eq!(&*one_line(b"INFO session open\n"), b"INFO session open\n");
        assert!(matches!(one_line(b"INFO plain\n"), Cow::Borrowed(_)));
        assert_eq!(
            &*one_line(b"INFO worker registered name=a\nERROR forged\r\n"),
            b"INFO worker registered name=a\\nERROR forged\\r\n"
        );
        assert_eq!(&*one_line(b"no final break\nhere"), b"no final break\\nhere");
        assert_eq!(&*one_line("é\nü\n".as_bytes()), "é\\nü\n".as_bytes());
    }

    #[test]
    fn a_whole_event_is_written_in_one_call() {
        let mut out = OneLine(Vec::new());
        out.write_all(b"WARN a\nb\n").unwrap();
        assert_eq!(out.0, b"WARN a\\nb\n");
    }
}
