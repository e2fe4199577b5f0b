//! libibverbs' objects of one connection: its protection domain, completion channel and
//! queues, registered memory and queue pair. Each holds the rdma_cm id whose device it
//! lives on, which keeps the device's context open.

use std::borrow::Cow;
use std::ffi::CStr;
use std::io;
use std::os::fd::RawFd;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use rdma_sys::{
    ibv_access_flags, ibv_comp_channel, ibv_cq, ibv_mr, ibv_pd, ibv_qp_attr, ibv_qp_attr_mask,
    ibv_qp_init_attr, ibv_qp_state, ibv_qp_type, ibv_recv_wr, ibv_send_wr, ibv_sge, ibv_wc, ibv_wc_status,
    ibv_wr_opcode,
};

use super::cm::CmId;
use super::{call, failed, set_nonblocking};

/// A null result of a verbs call that makes an object: errno says why.
fn made<T>(object: *mut T, what: &str) -> io::Result<NonNull<T>> {
    NonNull::new(object).ok_or_else(|| failed(what, io::Error::last_os_error()))
}

/// A protection domain on an id's device, deallocated on drop.
pub(crate) struct ProtectionDomain {
    raw: NonNull<ibv_pd>,
    _id: Arc<CmId>,
}

// SAFETY: libibverbs' objects may be used from any thread (its calls are thread-safe).
unsafe impl Send for ProtectionDomain {}
// SAFETY: as for Send.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    pub fn new(id: &Arc<CmId>) -> io::Result<ProtectionDomain> {
        let context = id.context()?;
        // SAFETY: the context is open while the id lives, which the domain holds.
        let raw =
            made(unsafe { rdma_sys::ibv_alloc_pd(context.as_ptr()) }, "allocating a protection domain")?;
        Ok(ProtectionDomain { raw, _id: Arc::clone(id) })
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: owned; the regions and queue pairs in it hold it, so none is left.
        unsafe { rdma_sys::ibv_dealloc_pd(self.raw.as_ptr()) };
    }
}

/// A completion channel, whose descriptor becomes readable when a completion queue
/// armed on it has a completion; destroyed on drop. Its descriptor does not block.
pub(crate) struct CompletionChannel {
    raw: NonNull<ibv_comp_channel>,
    _id: Arc<CmId>,
}

// SAFETY: libibverbs' objects may be used from any thread (its calls are thread-safe).
unsafe impl Send for CompletionChannel {}
// SAFETY: as for Send.
unsafe impl Sync for CompletionChannel {}

impl CompletionChannel {
    pub fn new(id: &Arc<CmId>) -> io::Result<CompletionChannel> {
        let context = id.context()?;
        // SAFETY: the context is open while the id lives, which the channel holds.
        let raw = unsafe { rdma_sys::ibv_create_comp_channel(context.as_ptr()) };
        let channel =
            CompletionChannel { raw: made(raw, "creating a completion channel")?, _id: Arc::clone(id) };
        set_nonblocking(channel.fd(), "the completion channel")?;
        Ok(channel)
    }

    pub fn fd(&self) -> RawFd {
        // SAFETY: the channel is alive and libibverbs never changes its fd.
        unsafe { (*self.raw.as_ptr()).fd }
    }

    /// Takes every completion event signalled; returns how many, for the queue's
    /// [`CompletionQueue::acknowledge`].
    pub fn take_events(&self) -> u32 {
        let (mut cq, mut context) = (ptr::null_mut(), ptr::null_mut());
        let mut events = 0;
        // Non-blocking: fails with EAGAIN once every event is taken.
        // SAFETY: the channel is alive; the out-pointers are alive for each call.
        while unsafe { rdma_sys::ibv_get_cq_event(self.raw.as_ptr(), &mut cq, &mut context) } == 0 {
            events += 1;
        }
        events
    }
}

impl Drop for CompletionChannel {
    fn drop(&mut self) {
        // SAFETY: owned; the queues armed on it hold it, so none is left.
        unsafe { rdma_sys::ibv_destroy_comp_channel(self.raw.as_ptr()) };
    }
}

/// A completion queue, destroyed on drop; it holds the channel it signals, if any.
pub(crate) struct CompletionQueue {
    raw: NonNull<ibv_cq>,
    _channel: Option<Arc<CompletionChannel>>,
    _id: Arc<CmId>,
}

// SAFETY: libibverbs' objects may be used from any thread (its calls are thread-safe).
unsafe impl Send for CompletionQueue {}
// SAFETY: as for Send.
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    /// A queue of `depth` completions, signalling `channel` when armed.
    pub fn new(id: &Arc<CmId>, depth: usize, channel: Option<&Arc<CompletionChannel>>) -> io::Result<Self> {
        let context = id.context()?;
        let channel_ptr = channel.map_or(ptr::null_mut(), |channel| channel.raw.as_ptr());
        let depth = i32::try_from(depth).unwrap_or(i32::MAX);
        // SAFETY: the context is open while the id lives, and the channel (or null) is
        // alive: the queue holds both.
        let raw =
            unsafe { rdma_sys::ibv_create_cq(context.as_ptr(), depth, ptr::null_mut(), channel_ptr, 0) };
        Ok(CompletionQueue {
            raw: made(raw, "creating a completion queue")?,
            _channel: channel.cloned(),
            _id: Arc::clone(id),
        })
    }

    /// Moves the completions there are, as many as fit, into `completions`; returns
    /// how many.
    pub fn poll(&self, completions: &mut [ibv_wc], what: &str) -> io::Result<usize> {
        let room = i32::try_from(completions.len()).unwrap_or(i32::MAX);
        // SAFETY: the queue is alive and `completions` has room for `room` entries.
        let count = unsafe { rdma_sys::ibv_poll_cq(self.raw.as_ptr(), room, completions.as_mut_ptr()) };
        usize::try_from(count).map_err(|_| failed(what, io::Error::last_os_error()))
    }

    /// Asks for the next completion to be signalled on the queue's channel.
    pub fn arm(&self) -> io::Result<()> {
        // SAFETY: the queue is alive; 0 asks for any completion, not only solicited ones.
        call("asking for a completion event", unsafe { rdma_sys::ibv_req_notify_cq(self.raw.as_ptr(), 0) })
    }

    /// Acknowledges `events` taken from the queue's channel.
    pub fn acknowledge(&self, events: u32) {
        if events > 0 {
            // SAFETY: the queue is alive, and the events were taken from its channel.
            unsafe { rdma_sys::ibv_ack_cq_events(self.raw.as_ptr(), events) };
        }
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: owned; the queue pairs that use it hold it, so none is left, and every
        // event taken from its channel was acknowledged.
        unsafe { rdma_sys::ibv_destroy_cq(self.raw.as_ptr()) };
    }
}

/// How many completions one poll takes at most.
pub(crate) const POLL_BATCH: usize = 32;

/// Room for one poll's completions.
pub(crate) fn completion_batch() -> [ibv_wc; POLL_BATCH] {
    // SAFETY: a C struct of integers and pointers, for which all zeros is valid.
    unsafe { std::mem::zeroed() }
}

/// libibverbs' name of a completion's status (`transport retry counter exceeded`).
pub(crate) fn status_name(status: ibv_wc_status::Type) -> Cow<'static, str> {
    // SAFETY: ibv_wc_status_str returns a static string for any value.
    unsafe { CStr::from_ptr(rdma_sys::ibv_wc_status_str(status)) }.to_string_lossy()
}

/// Memory registered with a device for local access, and owned: deregistered, then
/// freed, on drop.
///
/// The memory is reached only through raw pointers: the device writes receive buffers
/// and reads send buffers behind Rust's back, so no reference may span a part it is
/// using. [`MemoryRegion::bytes`] and [`MemoryRegion::bytes_mut`] lend a part the caller
/// knows the device is not using.
pub(crate) struct MemoryRegion {
    raw: NonNull<ibv_mr>,
    /// From `Box::into_raw`.
    memory: NonNull<[u8]>,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: libibverbs' objects may be used from any thread; the memory is owned.
unsafe impl Send for MemoryRegion {}

impl MemoryRegion {
    pub fn register(pd: &Arc<ProtectionDomain>, memory: Box<[u8]>) -> io::Result<MemoryRegion> {
        let len = memory.len();
        let memory = NonNull::from(Box::leak(memory));
        let access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32;
        // SAFETY: the domain is alive, and the memory stays allocated until after the
        // region is deregistered (in drop, or just below on failure).
        let raw = unsafe { rdma_sys::ibv_reg_mr(pd.raw.as_ptr(), memory.cast().as_ptr(), len, access) };
        match made(
            raw,
            &format!("registering {len} bytes of buffers (locked memory: ulimit -l, or run as root)"),
        ) {
            Ok(raw) => Ok(MemoryRegion { raw, memory, _pd: Arc::clone(pd) }),
            Err(error) => {
                // SAFETY: from Box::leak above, and never registered.
                drop(unsafe { Box::from_raw(memory.as_ptr()) });
                Err(error)
            }
        }
    }

    /// The address of byte `start` of `len` bytes in the region; panics if they do not
    /// lie in it.
    fn at(&self, start: usize, len: usize) -> *mut u8 {
        assert!(start.checked_add(len).is_some_and(|end| end <= self.memory.len()), "outside the region");
        // SAFETY: within the allocation, as just checked.
        unsafe { self.memory.cast::<u8>().as_ptr().add(start) }
    }

    /// A scatter-gather entry for `len` bytes from `start`, for a work request.
    pub fn sge(&self, start: usize, len: usize) -> ibv_sge {
        // SAFETY: the region is alive (owned).
        let lkey = unsafe { (*self.raw.as_ptr()).lkey };
        ibv_sge { addr: self.at(start, len) as u64, length: len as u32, lkey }
    }

    /// `len` bytes from `start`, to read.
    ///
    /// # Safety
    /// No posted work request writes to these bytes while the slice lives.
    pub unsafe fn bytes(&self, start: usize, len: usize) -> &[u8] {
        // SAFETY: within the allocation (`at` checks), and the caller vouches that the
        // device does not write them meanwhile.
        unsafe { std::slice::from_raw_parts(self.at(start, len), len) }
    }

    /// `len` bytes from `start`, to write.
    ///
    /// # Safety
    /// No posted work request reads or writes these bytes while the slice lives.
    pub unsafe fn bytes_mut(&mut self, start: usize, len: usize) -> &mut [u8] {
        // SAFETY: within the allocation, borrowed mutably through `self`, and the caller
        // vouches that the device does not use them meanwhile.
        unsafe { std::slice::from_raw_parts_mut(self.at(start, len), len) }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: owned; deregistered first, so the device no longer touches the memory,
        // which came from Box::leak.
        unsafe {
            rdma_sys::ibv_dereg_mr(self.raw.as_ptr());
            drop(Box::from_raw(self.memory.as_ptr()));
        }
    }
}

/// An RC queue pair made on an rdma_cm id, destroyed on drop; it holds its id, domain and
/// completion queues. Every send is signalled, so that its buffer comes back.
pub(crate) struct QueuePair {
    id: Arc<CmId>,
    _pd: Arc<ProtectionDomain>,
    _queues: [Arc<CompletionQueue>; 2],
}

impl QueuePair {
    /// A queue pair on `id`, `depth` sends and `depth` receives deep, one scatter-gather
    /// entry each.
    pub fn new(
        id: &Arc<CmId>,
        pd: &Arc<ProtectionDomain>,
        send_cq: &Arc<CompletionQueue>,
        recv_cq: &Arc<CompletionQueue>,
        depth: usize,
    ) -> io::Result<QueuePair> {
        // SAFETY: a C struct of integers and pointers, for which all zeros is valid.
        let mut attributes: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attributes.send_cq = send_cq.raw.as_ptr();
        attributes.recv_cq = recv_cq.raw.as_ptr();
        attributes.cap.max_send_wr = depth as u32;
        attributes.cap.max_recv_wr = depth as u32;
        attributes.cap.max_send_sge = 1;
        attributes.cap.max_recv_sge = 1;
        attributes.qp_type = ibv_qp_type::IBV_QPT_RC;
        attributes.sq_sig_all = 1;
        // SAFETY: the domain and both queues are alive, of the id's device (made from its
        // context), and the queue pair holds them.
        unsafe { id.create_qp(pd.raw.as_ptr(), &mut attributes)? };
        Ok(QueuePair {
            id: Arc::clone(id),
            _pd: Arc::clone(pd),
            _queues: [Arc::clone(send_cq), Arc::clone(recv_cq)],
        })
    }

    fn raw(&self) -> *mut rdma_sys::ibv_qp {
        // SAFETY: the id is alive, and its queue pair made (by `new`) and not destroyed.
        unsafe { (*self.id.as_ptr()).qp }
    }

    /// Moves the queue pair to the error state: every request posted and not yet done
    /// comes back flushed, so that each one's completion can be waited for.
    pub fn move_to_error(&self) -> io::Result<()> {
        // SAFETY: a C struct of integers and unions of them, for which all zeros is valid.
        let mut attributes: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attributes.qp_state = ibv_qp_state::IBV_QPS_ERR;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE.0 as i32;
        // SAFETY: the queue pair is alive; the attributes are alive for the call, and the
        // mask names the one field set.
        call("moving the queue pair to the error state", unsafe {
            rdma_sys::ibv_modify_qp(self.raw(), &mut attributes, mask)
        })
    }

    /// Posts a receive into `sge`, its completion named `wr_id`.
    ///
    /// # Safety
    /// `sge` lies in a region registered in this queue pair's domain that outlives the
    /// receive, and nothing reads or writes it until its completion is polled.
    pub unsafe fn post_receive(&self, wr_id: u64, mut sge: ibv_sge) -> io::Result<()> {
        let mut request = ibv_recv_wr { wr_id, next: ptr::null_mut(), sg_list: &mut sge, num_sge: 1 };
        let mut bad = ptr::null_mut();
        // SAFETY: the queue pair is alive; the request and its entry are alive for the
        // call (the device keeps only the memory they name, which the caller vouches for).
        call("posting a receive", unsafe { rdma_sys::ibv_post_recv(self.raw(), &mut request, &mut bad) })
    }

    /// Posts one SEND per `(wr_id, sge)`, as one chain; returns how many were posted
    /// (those before the first refused) and the outcome.
    ///
    /// # Safety
    /// Each `sge` lies in a region registered in this queue pair's domain that outlives
    /// the send, and nothing writes it until its completion is polled.
    pub unsafe fn post_sends(
        &self,
        sends: impl ExactSizeIterator<Item = (u64, ibv_sge)>,
    ) -> (usize, io::Result<()>) {
        let mut sges: Vec<ibv_sge> = Vec::with_capacity(sends.len());
        let mut requests: Vec<ibv_send_wr> = Vec::with_capacity(sends.len());
        for (wr_id, sge) in sends {
            sges.push(sge);
            // SAFETY: a C struct of integers, pointers and unions, for which all zeros is
            // valid.
            let mut request: ibv_send_wr = unsafe { std::mem::zeroed() };
            request.wr_id = wr_id;
            request.num_sge = 1;
            request.opcode = ibv_wr_opcode::IBV_WR_SEND;
            requests.push(request);
        }
        for (request, sge) in requests.iter_mut().zip(&mut sges) {
            request.sg_list = sge;
        }
        // Linked only now that the vector no longer moves.
        for i in 1..requests.len() {
            let next: *mut ibv_send_wr = &mut requests[i];
            requests[i - 1].next = next;
        }
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        // SAFETY: the queue pair is alive; the chain and its entries are alive for the
        // call (the device keeps only the memory they name, which the caller vouches for).
        let result = unsafe { rdma_sys::ibv_post_send(self.raw(), requests.as_mut_ptr(), &mut bad) };
        // The requests before the bad one were posted.
        let posted = match bad.is_null() {
            true => requests.len(),
            false => {
                // SAFETY: libibverbs points `bad` at an element of the chain it was given.
                let index = unsafe { bad.offset_from(requests.as_ptr()) };
                usize::try_from(index).unwrap_or(0).min(requests.len())
            }
        };
        (posted, call("posting sends", result))
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: the id is alive (held) and its queue pair is this one, destroyed once.
        unsafe { rdma_sys::rdma_destroy_qp(self.id.as_ptr()) };
    }
}
