//! DPDK's Environment Abstraction Layer: started once per process, from arguments checked
//! first so that EAL never exits the process, on a thread of its own so that the pinning
//! EAL gives its calling thread stays there.

use std::ffi::{c_char, CString};
use std::sync::{Mutex, OnceLock};

use crate::{ffi, DpdkError};

/// Proof that EAL runs in this process; every DPDK object is made from one.
#[derive(Debug)]
pub struct Eal {
    args: Vec<String>,
}

/// EAL's start, once per process: DPDK cannot start twice, nor start again after it
/// failed.
static STARTED: OnceLock<Result<Eal, DpdkError>> = OnceLock::new();

/// Held by whatever changes DPDK's global state (its log stream, its device list), which
/// DPDK does not guard.
pub(crate) static CONTROL: Mutex<()> = Mutex::new(());

/// Arguments with which EAL prints and calls exit() instead of starting: a library must
/// never end its host process.
const EXITING_ARGUMENTS: &[(&str, &str)] = &[
    ("-h", "EAL prints its usage and exits"),
    ("--help", "EAL prints its usage and exits"),
    ("--log-level=help", "EAL lists its log types and exits"),
];

impl Eal {
    /// Starts EAL with `args` (what follows the program name on a DPDK application's
    /// command line), or returns the EAL already running if it started with the same
    /// arguments. Without a core option (`-l`, `-c`, `--lcores`), EAL's main lcore is
    /// the first core this thread may run on: EAL aborts the process when it cannot
    /// pin its thread to the core it is given, as in a container that excludes core 0.
    pub fn start(args: &[String]) -> Result<&'static Eal, DpdkError> {
        for arg in args {
            if let Some((_, why)) = EXITING_ARGUMENTS.iter().find(|(refused, _)| arg == refused) {
                return Err(DpdkError::RefusedArgument { argument: arg.clone(), why });
            }
        }
        let started = STARTED.get_or_init(|| start(args, &with_lcore(args)));
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

/// `args`, with `-l CORE` added if they name no cores: the first core this thread may
/// run on.
fn with_lcore(args: &[String]) -> Vec<String> {
    let names_cores = args.iter().any(|arg| {
        ["-l", "-c", "--lcores"].iter().any(|option| arg == option || arg.starts_with(&format!("{option}=")))
            || (arg.starts_with("-l") || arg.starts_with("-c")) && !arg.starts_with("--")
    });
    if names_cores {
        return args.to_vec();
    }
    let mut with = args.to_vec();
    with.extend(["-l".to_string(), first_allowed_core().to_string()]);
    with
}

/// The first core of this thread's affinity mask; 0 if it cannot be read.
fn first_allowed_core() -> usize {
    // SAFETY: cpu_set_t is plain data, and sched_getaffinity writes at most its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return 0;
        }
        (0..libc::CPU_SETSIZE as usize).find(|&core| libc::CPU_ISSET(core, &set)).unwrap_or(0)
    }
}

/// Starts EAL with `effective` (`args`, completed); errors name `args` as given.
fn start(args: &[String], effective: &[String]) -> Result<Eal, DpdkError> {
    let failed = |reason: String| DpdkError::Eal { args: effective.join(" "), reason };
    let mut owned = Vec::with_capacity(effective.len() + 1);
    for arg in std::iter::once("netagg").chain(effective.iter().map(String::as_str)) {
        owned.push(CString::new(arg).map_err(|_| failed(format!("argument '{arg}' holds a NUL byte")))?);
    }
    let count = owned.len();
    // EAL pins the thread it starts on to its main lcore: a thread of its own, which ends
    // here, keeps that pinning away from the caller's threads.
    let outcome = std::thread::Builder::new()
        .name("dpdk-eal-init".into())
        .spawn(move || {
            // EAL may permute argv; the strings stay owned here.
            let mut argv: Vec<*mut c_char> = owned.iter().map(|arg| arg.as_ptr().cast_mut()).collect();
            with_captured_log(|| unsafe { ffi::netagg_dpdk_eal_init(count as i32, argv.as_mut_ptr()) })
        })
        .map_err(|error| failed(format!("cannot start its thread: {error}")))?
        .join()
        .map_err(|_| failed("its thread panicked".into()))?;
    let (result, log) = outcome;
    if result < 0 {
        return Err(failed(explain(result, &log)));
    }
    // EAL stops at the first argument that is not an option and leaves the rest: they
    // would be silently ignored.
    if let Some(unused) = effective.get(result as usize..).and_then(<[String]>::first) {
        return Err(failed(format!("it does not take '{unused}' (EAL arguments are options)")));
    }
    replay(&log);
    Ok(Eal { args: args.to_vec() })
}

/// Runs `operation` with DPDK's log captured; returns its result and what it logged.
pub(crate) fn with_captured_log<T>(operation: impl FnOnce() -> T) -> (T, String) {
    let _control = CONTROL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let capturing = unsafe { ffi::netagg_dpdk_log_capture_begin() } == 0;
    let result = operation();
    let mut text = vec![0u8; 16 << 10];
    let len = if capturing {
        unsafe { ffi::netagg_dpdk_log_capture_end(text.as_mut_ptr().cast(), text.len()) }
    } else {
        0
    };
    text.truncate(len);
    (result, String::from_utf8_lossy(&text).into_owned())
}

/// What went wrong, from an error code and what DPDK logged meanwhile.
pub(crate) fn explain(code: i32, log: &str) -> String {
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
        let core = first_allowed_core().to_string();
        assert_eq!(
            with_lcore(&strings(&["--no-huge", "--log-level=lib.eal:warning"])),
            strings(&["--no-huge", "--log-level=lib.eal:warning", "-l", &core])
        );
        for named in [&["-l", "1"][..], &["-l1"], &["-c", "0x2"], &["--lcores", "1@1"], &["--lcores=1@1"]] {
            assert_eq!(with_lcore(&strings(named)), strings(named), "{named:?}");
        }
    }
}
