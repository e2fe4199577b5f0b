//! DPDK's Environment Abstraction Layer: started once per process, from arguments checked
//! first so that EAL never exits the process, on a thread of its own so that the pinning
//! EAL gives its calling thread stays there.

use std::ffi::{c_char, CString};
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::eal_args::{self, Lcore};
use crate::{ffi, DpdkError};

/// Proof that EAL runs in this process; every DPDK object is made from one.
#[derive(Debug)]
pub struct Eal {
    args: Vec<String>,
}

/// EAL's start, once per process: DPDK cannot start twice, nor start again after it
/// failed.
static STARTED: OnceLock<Result<Eal, DpdkError>> = OnceLock::new();

/// Held across whatever changes DPDK's device list (probing, starting and closing a
/// port), which DPDK does not guard.
static CONTROL: Mutex<()> = Mutex::new(());

pub(crate) fn control() -> MutexGuard<'static, ()> {
    CONTROL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Eal {
    /// Starts EAL with `args` (what follows the program name on a DPDK application's
    /// command line), or returns the EAL already running if it started with the same
    /// arguments. Arguments outside what netagg supports are refused before EAL sees them
    /// (see `eal_args`). Without a core option (`-l`, `-c`, `--lcores`), EAL's one lcore
    /// runs on the first core the calling thread may run on: EAL aborts the process when
    /// it cannot pin its thread where it is told, as in a container that excludes core 0.
    pub fn start(args: &[String]) -> Result<&'static Eal, DpdkError> {
        let lcore = eal_args::check(args)?;
        let started = STARTED.get_or_init(|| start(args, lcore));
        match started {
            Ok(eal) if eal.args == args => Ok(eal),
            Ok(eal) => Err(DpdkError::EalRunning { running: eal.args.join(" "), asked: args.join(" ") }),
            Err(error) => Err(error.clone()),
        }
    }

    /// The arguments EAL was started with, as given (before a default core is added).
    pub fn args(&self) -> &[String] {
        &self.args
    }
}

/// `args`, with `--lcores 0@CORE` added if they name no lcore: EAL's lcore 0 on the first
/// core the calling thread may run on (whatever its number, which `-l` would cap at
/// EAL's largest lcore id).
fn with_lcore(args: &[String], named: Option<Lcore>) -> Vec<String> {
    let mut with = args.to_vec();
    if named.is_none() {
        let core = eal_args::allowed_cores().first().copied().unwrap_or(0);
        with.extend(["--lcores".to_string(), format!("0@{core}")]);
    }
    with
}

fn start(args: &[String], lcore: Option<Lcore>) -> Result<Eal, DpdkError> {
    // Errors show the arguments EAL was given, a core added.
    let effective = with_lcore(args, lcore);
    let failed = |reason: String| DpdkError::Eal { args: effective.join(" "), reason };
    let mut owned = Vec::with_capacity(effective.len() + 1);
    for arg in std::iter::once("netagg").chain(effective.iter().map(String::as_str)) {
        owned.push(CString::new(arg).map_err(|_| failed(format!("argument '{arg}' holds a NUL byte")))?);
    }
    let count = owned.len();
    // SAFETY: no arguments; the shim installs its stream once, however often it is called.
    let installed = unsafe { ffi::netagg_dpdk_log_install() };
    if installed < 0 {
        return Err(failed(format!(
            "cannot take DPDK's log: {}",
            std::io::Error::from_raw_os_error(-installed)
        )));
    }
    // EAL pins the thread it starts on to its main lcore: a thread of its own, which ends
    // here, keeps that pinning away from the caller's threads.
    let outcome = std::thread::Builder::new()
        .name("dpdk-eal-init".into())
        .spawn(move || {
            // EAL may permute argv; the strings stay owned here.
            let mut argv: Vec<*mut c_char> = owned.iter().map(|arg| arg.as_ptr().cast_mut()).collect();
            with_captured_log(|| {
                // SAFETY: `argv` holds `count` pointers to NUL-terminated strings that
                // `owned` keeps alive past the call; EAL may reorder the array, which is
                // ours and mutable, and keeps no pointer into it. `STARTED` runs this once
                // per process, as EAL requires.
                unsafe { ffi::netagg_dpdk_eal_init(count as i32, argv.as_mut_ptr()) }
            })
        })
        .map_err(|error| failed(format!("cannot start its thread: {error}")))?
        .join()
        .map_err(|_| failed("its thread panicked".into()))?;
    let (result, log) = outcome;
    if result < 0 {
        return Err(failed(explain(result, &log)));
    }
    replay(&log);
    Ok(Eal { args: args.to_vec() })
}

/// Runs `operation` with what DPDK logs on this thread captured; returns its result and
/// what it logged. Other threads' messages go to standard error meanwhile.
pub(crate) fn with_captured_log<T>(operation: impl FnOnce() -> T) -> (T, String) {
    /// Ends the capture, also when `operation` panics.
    struct Capture(Vec<u8>);
    impl Drop for Capture {
        fn drop(&mut self) {
            // SAFETY: ends this thread's capture, if any, before the buffer it writes into
            // is freed (the field drops after this body).
            unsafe { ffi::netagg_dpdk_log_capture_end() };
        }
    }
    let mut capture = Capture(vec![0u8; 16 << 10]);
    // SAFETY: the buffer is `capture.0.len()` (non-zero) writable bytes, and stays alive
    // and unmoved until the capture ends, below or in `Capture`'s drop, on this thread, the
    // only one that writes into it.
    unsafe { ffi::netagg_dpdk_log_capture_begin(capture.0.as_mut_ptr().cast(), capture.0.len()) };
    let result = operation();
    // SAFETY: touches only this thread's capture, ending it; the length it returns is at
    // most the buffer's, less its terminating NUL.
    let len = unsafe { ffi::netagg_dpdk_log_capture_end() };
    let text = String::from_utf8_lossy(&capture.0[..len]).into_owned();
    (result, text)
}

/// What went wrong, from an error code and what DPDK logged meanwhile.
pub(crate) fn explain(code: i32, log: &str) -> String {
    // SAFETY: rte_strerror returns a NUL-terminated string, static or in a buffer of this
    // thread's that stays as it is until its next call, which nothing here makes before the
    // text is copied out below.
    let error = unsafe { std::ffi::CStr::from_ptr(ffi::netagg_dpdk_strerror(-code)) };
    // EAL's inventory of the machine says nothing of what failed.
    let said: Vec<&str> = log
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with("EAL: Detected"))
        .collect();
    if said.is_empty() {
        error.to_string_lossy().into_owned()
    } else {
        format!("{} ({})", said.join("; "), error.to_string_lossy())
    }
}

/// Writes a log captured from an operation that succeeded to standard error, where DPDK
/// would have written it: its warnings are the user's.
pub(crate) fn replay(log: &str) {
    if !log.trim().is_empty() {
        eprint!("{log}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|arg| arg.to_string()).collect()
    }

    #[test]
    fn a_core_is_added_only_where_none_is_named() {
        let core = format!("0@{}", eal_args::allowed_cores()[0]);
        assert_eq!(
            with_lcore(&strings(&["--no-huge", "--log-level=lib.eal:warning"]), None),
            strings(&["--no-huge", "--log-level=lib.eal:warning", "--lcores", &core])
        );
        let named = strings(&["-l", "1"]);
        assert_eq!(with_lcore(&named, Some(Lcore { lcore: 1, core: 1 })), named);
    }
}
