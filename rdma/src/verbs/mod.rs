//! Thin owning wrappers over librdmacm's and libibverbs' objects: each holds its handle
//! as a `NonNull`, frees it in `Drop`, and holds (by `Arc`) what it must outlive, so that
//! no object is freed while another still needs it, whatever order its owners drop in.
//!
//! - [`cm`]: the rdma_cm event channel and ids (listening, requested, connecting);
//! - [`ibv`]: a connection's protection domain, completion channel and queues,
//!   registered memory and queue pair.
//!
//! All unsafe calls into the two libraries are here (and in [`crate::device`]); the
//! connection logic above uses these types.

pub(crate) mod cm;
pub(crate) mod ibv;

use std::io;
use std::os::fd::RawFd;

/// An error of the connection: what failed, and why.
pub(crate) fn failed(what: &str, error: io::Error) -> io::Error {
    io::Error::new(error.kind(), format!("{what}: {error}"))
}

/// The errno of a verbs or rdma_cm call that returned `result` (-1 with errno set, or an
/// errno itself).
pub(crate) fn call(what: &str, result: i32) -> io::Result<()> {
    match result {
        0 => Ok(()),
        -1 => Err(failed(what, io::Error::last_os_error())),
        code => Err(failed(what, io::Error::from_raw_os_error(code.abs()))),
    }
}

/// Makes `fd` non-blocking; `what` names it in the error.
pub(crate) fn set_nonblocking(fd: RawFd, what: &str) -> io::Result<()> {
    // SAFETY: F_GETFL and F_SETFL read and set flags of a descriptor; on one that is not
    // open they fail with EBADF, which is reported.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(failed(&format!("making {what} non-blocking"), io::Error::last_os_error()));
    }
    Ok(())
}
