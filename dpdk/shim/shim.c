/* The C side of netagg's DPDK crate: the calls Rust makes into DPDK 22.11, kept to what
 * needs C. Many of DPDK's hot functions (rx/tx bursts, mbuf allocation) are static
 * inline in its headers and exist only where a C compiler sees them; the rest is here so
 * that the Rust side never depends on DPDK's structure layouts. Every function returns
 * an error code (a negative errno) rather than calling rte_panic or exit. */

#define _GNU_SOURCE /* fopencookie */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <rte_dev.h>
#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_ethdev.h>
#include <rte_lcore.h>
#include <rte_mbuf.h>
#include <rte_mempool.h>

int netagg_dpdk_eal_init(int argc, char **argv) {
  int parsed = rte_eal_init(argc, argv);
  /* EAL leaves rte_errno unset on some of its failures. */
  return parsed < 0 ? -(rte_errno != 0 ? rte_errno : EINVAL) : parsed;
}

/* DPDK explains its failures in its log, not in its error codes. Its log goes to one
 * stream, installed before EAL starts and never closed (other threads may log at any
 * time): it writes to standard error, except on a thread that is capturing, where it
 * writes into that thread's buffer, which the caller reads back. */
struct capture {
  char *text;
  size_t len;
  size_t capacity;
};
static __thread struct capture *capturing;

static ssize_t log_write(void *cookie, const char *bytes, size_t len) {
  (void)cookie;
  struct capture *capture = capturing;
  if (capture == NULL) return (ssize_t)fwrite(bytes, 1, len, stderr);
  size_t room = capture->capacity - 1 - capture->len;
  size_t kept = len < room ? len : room;
  memcpy(capture->text + capture->len, bytes, kept);
  capture->len += kept;
  capture->text[capture->len] = 0;
  return (ssize_t)len;
}

int netagg_dpdk_log_install(void) {
  static FILE *stream;
  if (stream != NULL) return 0;
  cookie_io_functions_t functions = {.read = NULL, .write = log_write, .seek = NULL, .close = NULL};
  stream = fopencookie(NULL, "w", functions);
  if (stream == NULL) return -errno;
  /* Each message is flushed as it is written: no line waits in the stream's buffer. */
  setvbuf(stream, NULL, _IONBF, 0);
  return rte_openlog_stream(stream);
}

/* From now until netagg_dpdk_log_capture_end, what this thread logs goes into `text`
 * (of `capacity` bytes, kept NUL-terminated) instead of standard error. */
void netagg_dpdk_log_capture_begin(char *text, size_t capacity) {
  static __thread struct capture capture;
  capture.text = text;
  capture.len = 0;
  capture.capacity = capacity;
  text[0] = 0;
  capturing = &capture;
}

/* Ends this thread's capture; returns how many bytes it kept. */
size_t netagg_dpdk_log_capture_end(void) {
  size_t len = capturing != NULL ? capturing->len : 0;
  capturing = NULL;
  return len;
}

const char *netagg_dpdk_strerror(int error) { return rte_strerror(error); }

/* Finds the port of the device `name`, probing it with `devargs` (a vdev such as
 * "net_af_packet0,iface=eth0", or a PCI address) unless it exists already: EAL probes
 * the PCI devices it is allowed (-a) when it starts. */
int netagg_dpdk_probe(const char *devargs, const char *name, uint16_t *port_id) {
  if (rte_eth_dev_get_port_by_name(name, port_id) == 0) return 0;
  int probed = rte_dev_probe(devargs);
  if (probed < 0) return probed;
  return rte_eth_dev_get_port_by_name(name, port_id);
}

/* A pool of `count` mbufs for `port`, on its NUMA node. No per-lcore cache, since the
 * threads that take and give mbufs are not EAL lcores; and a ring that stays safe and
 * fair when those threads outnumber the cores and are preempted mid-operation (head-tail
 * sync), where the default ring can leave the others spinning for a time slice. */
struct rte_mempool *netagg_dpdk_pool_create(const char *name, unsigned count, uint16_t port, int *error) {
  struct rte_mempool *pool = rte_pktmbuf_pool_create_by_ops(name, count, 0, 0, RTE_MBUF_DEFAULT_BUF_SIZE,
                                                            rte_eth_dev_socket_id(port), "ring_mt_hts");
  if (pool == NULL) *error = -(rte_errno != 0 ? rte_errno : ENOMEM);
  return pool;
}

/* The longest frame one of the pool's mbufs holds. */
uint16_t netagg_dpdk_pool_frame_room(struct rte_mempool *pool) {
  return rte_pktmbuf_data_room_size(pool) - RTE_PKTMBUF_HEADROOM;
}

/* Frees `pool` if every mbuf is back in it, and says whether it did: an mbuf still out
 * would be freed into memory no longer a pool's. */
int netagg_dpdk_pool_free(struct rte_mempool *pool) {
  if (rte_mempool_in_use_count(pool) != 0) return 0;
  rte_mempool_free(pool);
  return 1;
}

/* Configures `port` with up to *queues pairs of receive and transmit queues (as many as
 * the device has, at least one; *queues says how many) of the given sizes, fed from
 * `pool`, and starts it; reports its MAC address and MTU. With several queues, received
 * frames are spread by a hash of their addresses and ports (RSS), where the device can. */
int netagg_dpdk_port_start(uint16_t port, uint16_t *queues, uint16_t rx_descriptors, uint16_t tx_descriptors,
                           struct rte_mempool *pool, uint8_t mac[6], uint16_t *mtu) {
  struct rte_eth_dev_info info;
  int result = rte_eth_dev_info_get(port, &info);
  if (result < 0) return result;
  uint16_t count = *queues;
  if (count > info.max_rx_queues) count = info.max_rx_queues;
  if (count > info.max_tx_queues) count = info.max_tx_queues;
  if (count == 0) count = 1;
  struct rte_eth_conf conf;
  memset(&conf, 0, sizeof conf);
  uint64_t hashed = info.flow_type_rss_offloads & (RTE_ETH_RSS_IP | RTE_ETH_RSS_UDP);
  if (count > 1 && hashed != 0) {
    conf.rxmode.mq_mode = RTE_ETH_MQ_RX_RSS;
    conf.rx_adv_conf.rss_conf.rss_hf = hashed;
  }
  result = rte_eth_dev_configure(port, count, count, &conf);
  if (result < 0) return result;
  result = rte_eth_dev_adjust_nb_rx_tx_desc(port, &rx_descriptors, &tx_descriptors);
  if (result < 0) return result;
  int socket = rte_eth_dev_socket_id(port);
  for (uint16_t queue = 0; queue < count; queue++) {
    result = rte_eth_rx_queue_setup(port, queue, rx_descriptors, socket, NULL, pool);
    if (result < 0) return result;
    result = rte_eth_tx_queue_setup(port, queue, tx_descriptors, socket, NULL);
    if (result < 0) return result;
  }
  *queues = count;
  result = rte_eth_dev_start(port);
  if (result < 0) return result;
  struct rte_ether_addr address;
  result = rte_eth_macaddr_get(port, &address);
  if (result < 0) return result;
  memcpy(mac, address.addr_bytes, 6);
  return rte_eth_dev_get_mtu(port, mtu);
}

/* 1 if `port`'s link is up, 0 if not, a negative errno if it cannot tell. */
int netagg_dpdk_link_up(uint16_t port) {
  struct rte_eth_link link;
  int result = rte_eth_link_get_nowait(port, &link);
  return result < 0 ? result : link.link_status == RTE_ETH_LINK_UP;
}

/* Stops and closes `port` and removes its device, so that the same device can be
 * probed again in this process. */
void netagg_dpdk_port_close(uint16_t port) {
  struct rte_eth_dev_info info;
  int have_info = rte_eth_dev_info_get(port, &info) == 0;
  rte_eth_dev_stop(port);
  rte_eth_dev_close(port);
  if (have_info && info.device != NULL) rte_dev_remove(info.device);
}

uint16_t netagg_dpdk_rx(uint16_t port, uint16_t queue, struct rte_mbuf **mbufs, uint16_t count) {
  return rte_eth_rx_burst(port, queue, mbufs, count);
}

uint16_t netagg_dpdk_tx(uint16_t port, uint16_t queue, struct rte_mbuf **mbufs, uint16_t count) {
  return rte_eth_tx_burst(port, queue, mbufs, count);
}

/* A frame of `len` bytes from `pool`, its bytes at *data; NULL if the pool is empty or
 * the frame does not fit one mbuf. */
struct rte_mbuf *netagg_dpdk_frame_alloc(struct rte_mempool *pool, uint16_t len, uint8_t **data) {
  struct rte_mbuf *mbuf = rte_pktmbuf_alloc(pool);
  if (mbuf == NULL) return NULL;
  char *bytes = rte_pktmbuf_append(mbuf, len);
  if (bytes == NULL) {
    rte_pktmbuf_free(mbuf);
    return NULL;
  }
  *data = (uint8_t *)bytes;
  return mbuf;
}

/* Shortens a frame to `len` bytes (at most its length). */
void netagg_dpdk_frame_truncate(struct rte_mbuf *mbuf, uint16_t len) {
  if (len < rte_pktmbuf_data_len(mbuf)) rte_pktmbuf_trim(mbuf, rte_pktmbuf_data_len(mbuf) - len);
}

/* The bytes of a received frame; NULL for a frame in several segments, which netagg's
 * frames never are. */
uint8_t *netagg_dpdk_frame_data(struct rte_mbuf *mbuf, uint16_t *len) {
  if (mbuf->nb_segs != 1) return NULL;
  *len = rte_pktmbuf_data_len(mbuf);
  return rte_pktmbuf_mtod(mbuf, uint8_t *);
}

void netagg_dpdk_frame_free(struct rte_mbuf *mbuf) { rte_pktmbuf_free(mbuf); }
