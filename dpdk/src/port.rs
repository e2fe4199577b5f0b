//! An Ethernet port with one receive and one transmit queue, its mbuf pool, and the frames
//! that pass through it.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::eal::{self, explain, replay, with_captured_log};
use crate::{ffi, DpdkError, Eal, MacAddr};

/// What a [`Port`] is opened with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortSettings {
    /// The device: a virtual device's arguments (`net_af_packet0,iface=eth0`,
    /// `net_null0`) or a PCI address (`0000:3b:00.0`).
    pub device: String,
    /// Descriptors of the receive and transmit rings (the driver may round them).
    pub rx_descriptors: u16,
    pub tx_descriptors: u16,
    /// Mbufs in the port's pool, shared by its rings and every frame being built.
    pub pool_size: u32,
    /// Pairs of receive and transmit queues wanted: the port gets as many as the device
    /// has, up to this, at least one.
    pub queues: u16,
}

/// A started port: its device, address and pool. Frames pass through its [`Queue`]s;
/// the port closes when the last of them is dropped.
pub struct Port {
    id: u16,
    device: String,
    pool: Arc<Pool>,
    mac: MacAddr,
    mtu: u16,
    /// The longest frame one of the pool's mbufs holds.
    frame_room: usize,
}

/// How long opening a port waits for its link to come up.
const LINK_WAIT: Duration = Duration::from_secs(5);

/// The ports this process has open, by id.
fn open_ports() -> MutexGuard<'static, BTreeSet<u16>> {
    static OPEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    OPEN.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A port's mbuf pool, freed when the port and every [`FrameAllocator`] are gone.
struct Pool(NonNull<ffi::Mempool>);

// DPDK's default mempool is multi-producer, multi-consumer: any thread may take and give.
unsafe impl Send for Pool {}
unsafe impl Sync for Pool {}

impl Pool {
    /// A new frame of `len` bytes from this pool.
    fn frame(&self, len: usize) -> Option<Frame> {
        let len = u16::try_from(len).ok()?;
        let mut data = std::ptr::null_mut();
        let mbuf = unsafe { ffi::netagg_dpdk_frame_alloc(self.0.as_ptr(), len, &mut data) };
        NonNull::new(mbuf).map(Frame)
    }

    /// A pool of `count` mbufs for port `id`; an error says why not.
    fn create(id: u16, count: u32) -> Result<Pool, String> {
        // Pool names are process-wide, and a pool a port leaked keeps its name.
        static POOLS: AtomicU32 = AtomicU32::new(0);
        let name = format!("netagg-{}", POOLS.fetch_add(1, Ordering::Relaxed));
        let name = CString::new(name).expect("no NUL in a number");
        let mut code = 0;
        let (pool, log) = with_captured_log(|| unsafe {
            ffi::netagg_dpdk_pool_create(name.as_ptr(), count, id, &mut code)
        });
        NonNull::new(pool)
            .map(Pool)
            .ok_or_else(|| format!("cannot create a pool of {count} mbufs: {}", explain(code, &log)))
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // A frame still held somewhere returns to the pool when it drops: the pool then
        // stays, as a leak, rather than be freed under it.
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
    /// A new frame of `len` bytes, their content unset; `None` when the pool is empty or
    /// `len` does not fit one mbuf.
    pub fn frame(&self, len: usize) -> Option<Frame> {
        self.pool.frame(len)
    }
}

impl Port {
    /// Probes `settings.device`, gives it a pool and starts it; returns its queues. A
    /// device this process has open already is refused: a port has one owner.
    pub fn open(_eal: &Eal, settings: &PortSettings) -> Result<Vec<Queue>, DpdkError> {
        let device = settings.device.clone();
        let failed = |reason: String| DpdkError::Device { device: device.clone(), reason };
        // The device's name is its arguments up to the first comma.
        let name = device.split(',').next().unwrap_or_default().trim();
        if name.is_empty() {
            return Err(failed("no device named (e.g. net_af_packet0,iface=eth0 or 0000:3b:00.0)".into()));
        }
        let queues = settings.queues.max(1);
        let rings =
            u32::from(queues) * (u32::from(settings.rx_descriptors) + u32::from(settings.tx_descriptors));
        if settings.pool_size <= rings {
            return Err(failed(format!(
                "a pool of {} mbufs cannot fill its rings ({queues} × {} receive and {} transmit descriptors) \
                 and leave frames to send: raise pool_size or lower the rings",
                settings.pool_size, settings.rx_descriptors, settings.tx_descriptors
            )));
        }
        let devargs = CString::new(device.as_str()).map_err(|_| failed("it holds a NUL byte".into()))?;
        let c_name = CString::new(name).map_err(|_| failed("it holds a NUL byte".into()))?;
        // From probe to start, no other thread changes the device list or the open ports.
        let control = eal::control();
        let mut id = 0u16;
        let (probed, log) = with_captured_log(|| unsafe {
            ffi::netagg_dpdk_probe(devargs.as_ptr(), c_name.as_ptr(), &mut id)
        });
        if probed < 0 {
            return Err(failed(format!("cannot probe it: {}", explain(probed, &log))));
        }
        replay(&log);
        if !open_ports().insert(id) {
            return Err(failed(format!(
                "it is open already in this process, as port {id}: one context or switch per device"
            )));
        }
        let pool = match Pool::create(id, settings.pool_size) {
            Ok(pool) => pool,
            Err(reason) => {
                close(id);
                return Err(failed(reason));
            }
        };
        let frame_room = usize::from(unsafe { ffi::netagg_dpdk_pool_frame_room(pool.0.as_ptr()) });
        let mut port = Port {
            id,
            device: device.clone(),
            pool: Arc::new(pool),
            mac: MacAddr([0; 6]),
            mtu: 0,
            frame_room,
        };
        let mut queues = queues;
        let (started, log) = with_captured_log(|| unsafe {
            ffi::netagg_dpdk_port_start(
                id,
                &mut queues,
                settings.rx_descriptors,
                settings.tx_descriptors,
                port.pool.0.as_ptr(),
                &mut port.mac.0,
                &mut port.mtu,
            )
        });
        // Released before `port` may drop, which takes it to close the device.
        drop(control);
        if started < 0 {
            return Err(failed(format!("cannot start it: {}", explain(started, &log))));
        }
        replay(&log);
        port.wait_for_link();
        let port = Arc::new(port);
        Ok((0..queues).map(|index| Queue { port: Arc::clone(&port), index }).collect())
    }

    /// Waits up to [`LINK_WAIT`] for the link to come up (a NIC negotiating its speed);
    /// a link still down is logged, not refused: frames sent meanwhile are lost and
    /// recovered as any loss is.
    fn wait_for_link(&self) {
        let deadline = Instant::now() + LINK_WAIT;
        loop {
            match unsafe { ffi::netagg_dpdk_link_up(self.id) } {
                1 => return,
                0 if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                0 => {
                    return eprintln!(
                        "netagg-dpdk: the link of {} is still down after {LINK_WAIT:?}",
                        self.device
                    )
                }
                // A driver that cannot tell: nothing to wait for.
                _ => return,
            }
        }
    }

    /// The port's MAC address.
    pub fn mac(&self) -> MacAddr {
        self.mac
    }

    /// The largest IP packet the port carries.
    pub fn mtu(&self) -> u16 {
        self.mtu
    }

    /// The longest frame one of the pool's mbufs holds.
    pub fn frame_room(&self) -> usize {
        self.frame_room
    }

    pub fn device(&self) -> &str {
        &self.device
    }

    /// A new frame of `len` bytes, their content unset; `None` when the pool is empty or
    /// `len` does not fit one mbuf.
    pub fn frame(&self, len: usize) -> Option<Frame> {
        self.pool.frame(len)
    }

    /// Makes frames from this port's pool, for threads that do not hold the port.
    pub fn allocator(&self) -> FrameAllocator {
        FrameAllocator { pool: Arc::clone(&self.pool) }
    }
}

impl Drop for Port {
    fn drop(&mut self) {
        let _control = eal::control();
        close(self.id);
    }
}

/// One pair of a port's receive and transmit queues. Receiving and transmitting need
/// `&mut`: a DPDK queue is used by one thread at a time, its owner's.
pub struct Queue {
    port: Arc<Port>,
    index: u16,
}

impl Queue {
    /// The port the queue belongs to.
    pub fn port(&self) -> &Arc<Port> {
        &self.port
    }

    /// Which of the port's queues this is.
    pub fn index(&self) -> u16 {
        self.index
    }

    /// Appends up to `max` received frames to `frames`; returns how many.
    pub fn receive(&mut self, frames: &mut Vec<Frame>, max: u16) -> usize {
        frames.reserve(usize::from(max));
        let len = frames.len();
        // Frame is a transparent pointer to an mbuf: the spare room is an array of them.
        let received = unsafe {
            let room = frames.as_mut_ptr().add(len).cast::<*mut ffi::Mbuf>();
            ffi::netagg_dpdk_rx(self.port.id, self.index, room, max)
        };
        unsafe { frames.set_len(len + usize::from(received)) };
        usize::from(received)
    }

    /// Hands the frames at the front of `frames` to the transmit queue, as many as it
    /// takes; they leave `frames`, the rest stay. Returns how many it took.
    pub fn transmit(&mut self, frames: &mut Vec<Frame>) -> usize {
        let len = frames.len();
        let count = u16::try_from(len).unwrap_or(u16::MAX);
        let base = frames.as_mut_ptr();
        let sent = usize::from(unsafe { ffi::netagg_dpdk_tx(self.port.id, self.index, base.cast(), count) });
        // The driver owns the frames it took: they leave the vector without a drop.
        unsafe {
            std::ptr::copy(base.add(sent), base, len - sent);
            frames.set_len(len - sent);
        }
        sent
    }
}

/// Stops, closes and removes port `id`, which this process opened; the caller holds
/// [`eal::control`].
fn close(id: u16) {
    let ((), log) = with_captured_log(|| unsafe { ffi::netagg_dpdk_port_close(id) });
    replay(&log);
    open_ports().remove(&id);
}

/// One frame in an mbuf of a port's pool, freed (returned to the pool) on drop.
#[repr(transparent)]
pub struct Frame(NonNull<ffi::Mbuf>);

// An mbuf belongs to one owner at a time, which this type is.
unsafe impl Send for Frame {}

impl Frame {
    /// The frame's bytes; empty for a frame in several segments, which netagg never
    /// sends and does not read.
    pub fn bytes(&self) -> &[u8] {
        let mut len = 0;
        let data = unsafe { ffi::netagg_dpdk_frame_data(self.0.as_ptr(), &mut len) };
        if data.is_null() {
            return &[];
        }
        unsafe { std::slice::from_raw_parts(data, usize::from(len)) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let mut len = 0;
        let data = unsafe { ffi::netagg_dpdk_frame_data(self.0.as_ptr(), &mut len) };
        if data.is_null() {
            return &mut [];
        }
        unsafe { std::slice::from_raw_parts_mut(data, usize::from(len)) }
    }

    /// Shortens the frame to `len` bytes (no longer than it is).
    pub fn truncate(&mut self, len: usize) {
        unsafe { ffi::netagg_dpdk_frame_truncate(self.0.as_ptr(), u16::try_from(len).unwrap_or(u16::MAX)) }
    }
}

impl Drop for Frame {
    fn drop(&mut self) {
        unsafe { ffi::netagg_dpdk_frame_free(self.0.as_ptr()) }
    }
}
