//! An Ethernet port with its pairs of receive and transmit queues and its mbuf pool. The
//! one place that calls DPDK's port functions: the port id they take is held only by a
//! [`Port`] this process probed and started, and a queue's index only by its [`Queue`],
//! so that the safe code above cannot name a port or queue that is not there.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::eal::{self, explain, replay, with_captured_log};
use crate::frame::{Frame, FrameAllocator, Pool};
use crate::headers::{IP_UDP_HEADERS_LEN, UDP_HEADERS_LEN};
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
        let (probed, log) = with_captured_log(|| {
            // SAFETY: both strings are NUL-terminated and outlive the call, `id` is a valid
            // place for a port id, and `control` keeps other threads from changing DPDK's
            // device list meanwhile, which DPDK does not guard.
            unsafe { ffi::netagg_dpdk_probe(devargs.as_ptr(), c_name.as_ptr(), &mut id) }
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
        let frame_room = pool.frame_room();
        let mut port = Port {
            id,
            device: device.clone(),
            pool: Arc::new(pool),
            mac: MacAddr([0; 6]),
            mtu: 0,
            frame_room,
        };
        let mut queues = queues;
        let (started, log) = with_captured_log(|| {
            // SAFETY: `id` is a port probed above and this process's alone (`open_ports`),
            // `control` is held, the pool is live for as long as the port (it holds it), and
            // the other pointers are valid places for what the shim reports.
            unsafe {
                ffi::netagg_dpdk_port_start(
                    id,
                    &mut queues,
                    settings.rx_descriptors,
                    settings.tx_descriptors,
                    port.pool.as_ptr(),
                    &mut port.mac.0,
                    &mut port.mtu,
                )
            }
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
            // SAFETY: the port is probed and started, and stays so while `self` lives; DPDK
            // checks the id besides.
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

    /// The longest UDP payload that leaves in one frame: the MTU less the IPv4 and UDP
    /// headers, and no more than an mbuf holds.
    pub fn max_udp_payload(&self) -> usize {
        (usize::from(self.mtu).saturating_sub(IP_UDP_HEADERS_LEN))
            .min(self.frame_room.saturating_sub(UDP_HEADERS_LEN))
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
        FrameAllocator::new(&self.pool)
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
        // SAFETY: the port is started and stays so while `self` holds it, `index` is one of
        // its queues, and `&mut self` makes this the one thread on that queue, as DPDK
        // requires. The vector has room for `max` more elements past `len` (reserved
        // above), and a `Frame` is a transparent pointer to an mbuf, so that room is an
        // array of `max` mbuf pointers, which the driver fills from the front.
        let received = unsafe {
            let room = frames.as_mut_ptr().add(len).cast::<*mut ffi::Mbuf>();
            ffi::netagg_dpdk_rx(self.port.id, self.index, room, max)
        };
        // SAFETY: the driver wrote `received` (at most `max`) non-null mbuf pointers past
        // `len`, each an mbuf now ours alone: valid frames, within the capacity reserved.
        unsafe { frames.set_len(len + usize::from(received)) };
        usize::from(received)
    }

    /// Hands the frames at the front of `frames` to the transmit queue, as many as it
    /// takes; they leave `frames`, the rest stay. Returns how many it took.
    pub fn transmit(&mut self, frames: &mut Vec<Frame>) -> usize {
        let len = frames.len();
        let count = u16::try_from(len).unwrap_or(u16::MAX);
        let base = frames.as_mut_ptr();
        // SAFETY: port and queue as in `receive`; `base` points to `len` frames, at least
        // `count`, which as transparent mbuf pointers are the array the driver reads.
        let sent = usize::from(unsafe { ffi::netagg_dpdk_tx(self.port.id, self.index, base.cast(), count) });
        // The driver owns the frames it took: they leave the vector without a drop.
        // SAFETY: `sent` <= `count` <= `len`: the copy moves the `len - sent` frames the
        // driver left (an overlapping move, which `copy` allows) to the front, and the
        // length then covers exactly those, so that no frame is dropped or kept twice.
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
    let ((), log) = with_captured_log(|| {
        // SAFETY: the caller holds `control` and this process opened `id`; no queue of it is
        // left (this runs when its `Port` drops, or before any queue was made), so nothing
        // polls it once it is closed.
        unsafe { ffi::netagg_dpdk_port_close(id) }
    });
    replay(&log);
    open_ports().remove(&id);
}
