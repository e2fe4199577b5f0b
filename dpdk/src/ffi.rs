//! The C shim's functions (`shim/shim.c`), over opaque pointers: Rust never sees the
//! layout of a DPDK structure.

use std::ffi::{c_char, c_int, c_uint};

#[repr(C)]
pub(crate) struct Mempool {
    _opaque: [u8; 0],
}

#[repr(C)]
pub(crate) struct Mbuf {
    _opaque: [u8; 0],
}

extern "C" {
    /// rte_eal_init: how many arguments it consumed, or a negative errno.
    pub(crate) fn netagg_dpdk_eal_init(argc: c_int, argv: *mut *mut c_char) -> c_int;
    pub(crate) fn netagg_dpdk_log_install() -> c_int;
    pub(crate) fn netagg_dpdk_log_capture_begin(text: *mut c_char, capacity: usize);
    pub(crate) fn netagg_dpdk_log_capture_end() -> usize;
    pub(crate) fn netagg_dpdk_strerror(error: c_int) -> *const c_char;
    pub(crate) fn netagg_dpdk_probe(devargs: *const c_char, name: *const c_char, port: *mut u16) -> c_int;
    pub(crate) fn netagg_dpdk_pool_create(
        name: *const c_char,
        count: c_uint,
        port: u16,
        error: *mut c_int,
    ) -> *mut Mempool;
    pub(crate) fn netagg_dpdk_pool_frame_room(pool: *mut Mempool) -> u16;
    pub(crate) fn netagg_dpdk_pool_free(pool: *mut Mempool) -> c_int;
    pub(crate) fn netagg_dpdk_port_start(
        port: u16,
        queues: *mut u16,
        rx_descriptors: u16,
        tx_descriptors: u16,
        pool: *mut Mempool,
        mac: *mut [u8; 6],
        mtu: *mut u16,
    ) -> c_int;
    pub(crate) fn netagg_dpdk_port_close(port: u16);
    pub(crate) fn netagg_dpdk_link_up(port: u16) -> c_int;
    pub(crate) fn netagg_dpdk_rx(port: u16, queue: u16, mbufs: *mut *mut Mbuf, count: u16) -> u16;
    pub(crate) fn netagg_dpdk_tx(port: u16, queue: u16, mbufs: *mut *mut Mbuf, count: u16) -> u16;
    pub(crate) fn netagg_dpdk_frame_alloc(pool: *mut Mempool, len: u16, data: *mut *mut u8) -> *mut Mbuf;
    pub(crate) fn netagg_dpdk_frame_truncate(mbuf: *mut Mbuf, len: u16);
    pub(crate) fn netagg_dpdk_frame_data(mbuf: *mut Mbuf, len: *mut u16) -> *mut u8;
    pub(crate) fn netagg_dpdk_frame_free(mbuf: *mut Mbuf);
}
