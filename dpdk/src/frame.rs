//! Owned mbufs and the pool they come from: a [`Frame`] is one mbuf, returned to its
//! pool on drop; a [`Pool`] is freed once its port and every [`FrameAllocator`] are gone.
//! Together with the port's queues, the one place where mbuf pointers are dereferenced.

use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::eal::{explain, with_captured_log};
use crate::ffi;

/// A port's mbuf pool, freed when the port and every [`FrameAllocator`] are gone.
pub(crate) struct Pool(NonNull<ffi::Mempool>);

// SAFETY: the pool is created with the "ring_mt_hts" ops, a ring that any number of
// threads may take mbufs from and give them back to at once; the pointer itself is only
// freed by `Drop`, when no other reference to the pool is left.
unsafe impl Send for Pool {}
// SAFETY: as for `Send`: every operation through `&Pool` is a take or a give on that
// multi-producer, multi-consumer ring, or a read of the pool's fixed parameters.
unsafe impl Sync for Pool {}

impl Pool {
    /// A pool of `count` mbufs on the NUMA node of port `id`; an error says why not.
    pub(crate) fn create(id: u16, count: u32) -> Result<Pool, String> {
        // Pool names are process-wide, and a pool a port leaked keeps its name.
        static POOLS: AtomicU32 = AtomicU32::new(0);
        let name = format!("netagg-{}", POOLS.fetch_add(1, Ordering::Relaxed));
        let name = CString::new(name).expect("no NUL in a number");
        let mut code = 0;
        let (pool, log) = with_captured_log(|| {
            // SAFETY: `name` is a NUL-terminated string that outlives the call (DPDK copies
            // it), `code` is a valid place for an int, and a port id DPDK does not know
            // only makes the socket lookup answer "any node".
            unsafe { ffi::netagg_dpdk_pool_create(name.as_ptr(), count, id, &mut code) }
        });
        NonNull::new(pool)
            .map(Pool)
            .ok_or_else(|| format!("cannot create a pool of {count} mbufs: {}", explain(code, &log)))
    }

    /// The longest frame one of the pool's mbufs holds.
    pub(crate) fn frame_room(&self) -> usize {
        // SAFETY: the pool is live for as long as `self` is (freed only in `Drop`).
        usize::from(unsafe { ffi::netagg_dpdk_pool_frame_room(self.0.as_ptr()) })
    }

    /// The pool's pointer, to give a port's receive queues; valid while `self` is.
    pub(crate) fn as_ptr(&self) -> *mut ffi::Mempool {
        self.0.as_ptr()
    }

    /// A new frame of `len` bytes from this pool.
    pub(crate) fn frame(&self, len: usize) -> Option<Frame> {
        let len = u16::try_from(len).ok()?;
        let mut data = std::ptr::null_mut();
        // SAFETY: the pool is live for as long as `self` is, and `data` is a valid place for
        // a pointer; the mbuf returned, if any, is this frame's alone.
        let mbuf = unsafe { ffi::netagg_dpdk_frame_alloc(self.0.as_ptr(), len, &mut data) };
        NonNull::new(mbuf).map(Frame)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // A frame still held somewhere returns to the pool when it drops: the pool then
        // stays, as a leak, rather than be freed under it.
        // SAFETY: this is the last reference to the pool (it is only ever shared through an
        // `Arc`), so nothing takes from it meanwhile; the shim frees it only if every mbuf is
        // back, and the pointer is never used again.
        if unsafe { ffi::netagg_dpdk_pool_free(self.0.as_ptr()) } == 0 {
            eprintln!("netagg-dpdk: an mbuf pool outlives its port: frames are still held");
        }
    }
}

/// Makes frames from a port's pool, from any thread, without the port.
#[derive(Clone)]
pub struct FrameAllocator {
    pool: Arc<Pool>,
}

impl FrameAllocator {
    pub(crate) fn new(pool: &Arc<Pool>) -> FrameAllocator {
        FrameAllocator { pool: Arc::clone(pool) }
    }

    /// A new frame of `len` bytes, their content unset; `None` when the pool is empty or
    /// `len` does not fit one mbuf.
    pub fn frame(&self, len: usize) -> Option<Frame> {
        self.pool.frame(len)
    }
}

/// One frame in an mbuf of a port's pool, freed (returned to the pool) on drop.
///
/// A transparent pointer to the mbuf, so that a slice of frames is the array of mbuf
/// pointers DPDK's bursts take and fill.
#[repr(transparent)]
pub struct Frame(NonNull<ffi::Mbuf>);

// SAFETY: a frame is the only reference to its mbuf (allocated for it, or handed over by a
// receive burst), so moving it to another thread moves the mbuf's only owner; the pool it
// returns to on drop takes mbufs back from any thread.
unsafe impl Send for Frame {}

impl Frame {
    /// The frame's bytes; empty for a frame in several segments, which netagg never
    /// sends and does not read.
    pub fn bytes(&self) -> &[u8] {
        let mut len = 0;
        // SAFETY: the mbuf is live and this frame's alone; `len` is a valid place for it.
        let data = unsafe { ffi::netagg_dpdk_frame_data(self.0.as_ptr(), &mut len) };
        if data.is_null() {
            return &[];
        }
        // SAFETY: the shim returned the start of the mbuf's one segment and its length: `len`
        // initialised bytes inside the mbuf, which lives and does not change while `self` is
        // borrowed.
        unsafe { std::slice::from_raw_parts(data, usize::from(len)) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let mut len = 0;
        // SAFETY: as in `bytes`.
        let data = unsafe { ffi::netagg_dpdk_frame_data(self.0.as_ptr(), &mut len) };
        if data.is_null() {
            return &mut [];
        }
        // SAFETY: as in `bytes`, and `&mut self` makes this the only view of those bytes.
        // They are initialised: a frame just allocated holds what its mbuf held last, or,
        // never used, the zeros of the pool's memory as the kernel mapped it (DPDK takes
        // its memory zero-filled from mmap, hugepages or not).
        unsafe { std::slice::from_raw_parts_mut(data, usize::from(len)) }
    }

    /// Shortens the frame to `len` bytes (no longer than it is).
    pub fn truncate(&mut self, len: usize) {
        // SAFETY: the mbuf is live and this frame's alone; the shim never lengthens it.
        unsafe { ffi::netagg_dpdk_frame_truncate(self.0.as_ptr(), u16::try_from(len).unwrap_or(u16::MAX)) }
    }
}

impl Drop for Frame {
    fn drop(&mut self) {
        // SAFETY: the frame owns the mbuf, gives it back once, here, and its pointer is
        // never used again (a frame a transmit burst took leaves its vector without a drop).
        unsafe { ffi::netagg_dpdk_frame_free(self.0.as_ptr()) }
    }
}
