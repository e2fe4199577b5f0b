//! Entering a network namespace from one thread: sockets the thread opens afterwards,
//! and its `/proc/thread-self/net`, are that namespace's, while the process's other
//! threads stay where they are.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// Moves the calling thread, and only it, into the network namespace `namespace` is a
/// file of (`/run/netns/NAME`).
pub(crate) fn enter(namespace: &File) -> io::Result<()> {
    // SAFETY: setns takes no pointers; an fd that is no namespace is refused with EINVAL.
    if unsafe { libc::setns(namespace.as_raw_fd(), libc::CLONE_NEWNET) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Where `ip netns` keeps its namespaces, by name.
pub(crate) const FOLDER: &str = "/run/netns";

/// The file of the namespace `ip netns` calls `name`.
pub(crate) fn path(name: &str) -> String {
    format!("{FOLDER}/{name}")
}

/// Moves the calling thread into the namespace `ip netns` calls `name`.
pub(crate) fn enter_by_name(name: &str) -> io::Result<()> {
    let in_context =
        |error: io::Error| io::Error::new(error.kind(), format!("network namespace {name}: {error}"));
    enter(&File::open(path(name)).map_err(in_context)?).map_err(in_context)
}
