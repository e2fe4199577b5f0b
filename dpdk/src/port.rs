//! An Ethernet port with one receive and one transmit queue, its mbuf pool, and the frames
//! that pass through it.

use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::eal::{explain, replay, with_captured_log};
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
}

/// A started port. Receiving and transmitting need `&mut`: the port has one queue each
/// way, and a DPDK queue is used by one thread at a time.
pub struct Port {
    id: u16,
    device: String,
    pool: Arc<Pool>,
    mac: MacAddr,
    mtu: u16,
}

/// A port's mbuf pool, freed when the port and every [`FrameAllocator`] are gone.
struct Pool(NonNull<ffi::Mempool>);

// DPDK's default mempool is multi-producer, multi-consumer: any thread may take and give.
unsafe impl Send for Pool {}
unsafe impl Sync for Pool {}

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
        let len = u16::try_from(len).ok()?;
        let mut data = std::ptr::null_mut();
        let mbuf = unsafe { ffi::netagg_dpdk_frame_alloc(self.pool.0.as_ptr(), len, &mut data) };
        NonNull::new(mbuf).map(Frame)
    }
}

impl Port {
    /// Probes `settings.device`, gives it a pool and starts it.
    pub fn open(_eal: &Eal, settings: &PortSettings) -> Result<Port, DpdkError> {
        let device = settings.device.clone();
        let failed = |reason: String| DpdkError::Device { device: device.clone(), reason };
        // The device's name is its arguments up to the first comma.
        let name = device.split(',').next().unwrap_or_default().trim();
        if name.is_empty() {
            return Err(failed("no device named (e.g. net_af_packet0,iface=eth0 or 0000:3b:00.0)".into()));
        }
        let devargs = CString::new(device.as_str()).map_err(|_| failed("it holds a NUL byte".into()))?;
        let c_name = CString::new(name).map_err(|_| failed("it holds a NUL byte".into()))?;
        let mut id = 0u16;
        let (probed, log) = with_captured_log(|| unsafe {
            ffi::netagg_dpdk_probe(devargs.as_ptr(), c_name.as_ptr(), &mut id)
        });
        if probed < 0 {
            return Err(failed(format!("cannot probe it: {}", explain(probed, &log))));
        }
        replay(&log);

        // Pool names are process-wide, and a pool a port leaked keeps its name.
        static POOLS: AtomicU32 = AtomicU32::new(0);
        let pool_name = format!("netagg-{}", POOLS.fetch_add(1, Ordering::Relaxed));
        let pool_name = CString::new(pool_name).expect("no NUL in a number");
        let mut code = 0;
        let (pool, log) = with_captured_log(|| unsafe {
            ffi::netagg_dpdk_pool_create(pool_name.as_ptr(), settings.pool_size, &mut code)
        });
        let Some(pool) = NonNull::new(pool).map(|pool| Arc::new(Pool(pool))) else {
            close(id);
            return Err(failed(format!(
                "cannot create a pool of {} mbufs: {}",
                settings.pool_size,
                explain(code, &log)
            )));
        };
        let mut port =
            Port { id, device: device.clone(), pool: Arc::clone(&pool), mac: MacAddr([0; 6]), mtu: 0 };
        let (started, log) = with_captured_log(|| unsafe {
            ffi::netagg_dpdk_port_start(
                id,
                settings.rx_descriptors,
                settings.tx_descriptors,
                pool.0.as_ptr(),
                &mut port.mac.0,
                &mut port.mtu,
            )
        });
        if started < 0 {
            // Dropping the port closes the device and frees the pool.
            return Err(failed(format!("cannot start it: {}", explain(started, &log))));
        }
        replay(&log);
        Ok(port)
    }

    /// The port's MAC address.
    pub fn mac(&self) -> MacAddr {
        self.mac
    }

    /// The largest IP packet the port carries.
    pub fn mtu(&self) -> u16 {
        self.mtu
    }

    pub fn device(&self) -> &str {
        &self.device
    }

    /// A new frame of `len` bytes, their content unset; `None` when the pool is empty or
    /// `len` does not fit one mbuf.
    pub fn frame(&self, len: usize) -> Option<Frame> {
        self.allocator().frame(len)
    }

    /// Makes frames from this port's pool, for threads that do not hold the port.
    pub fn allocator(&self) -> FrameAllocator {
        FrameAllocator { pool: Arc::clone(&self.pool) }
    }

    /// Appends up to `max` received frames to `frames`; returns how many.
    pub fn receive(&mut self, frames: &mut Vec<Frame>, max: u16) -> usize {
        frames.reserve(usize::from(max));
        let len = frames.len();
        // Frame is a transparent pointer to an mbuf: the spare room is an array of them.
        let received = unsafe {
            let room = frames.as_mut_ptr().add(len).cast::<*mut ffi::Mbuf>();
            ffi::netagg_dpdk_rx(self.id, room, max)
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
        let sent = usize::from(unsafe { ffi::netagg_dpdk_tx(self.id, base.cast(), count) });
        // The driver owns the frames it took: they leave the vector without a drop.
        unsafe {
            std::ptr::copy(base.add(sent), base, len - sent);
            frames.set_len(len - sent);
        }
        sent
    }
}

impl Drop for Port {
    fn drop(&mut self) {
        close(self.id);
    }
}

fn close(id: u16) {
    let ((), log) = with_captured_log(|| unsafe { ffi::netagg_dpdk_port_close(id) });
    replay(&log);
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
