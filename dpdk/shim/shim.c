/* The C side of netagg's DPDK crate: the calls Rust makes into DPDK 22.11, kept to what
 * needs C. Many of DPDK's hot functions (rx/tx bursts, mbuf allocation) are static
 * inline in its headers and exist only where a C compiler sees them; the rest is here so
 * that the Rust side never depends on DPDK's structure layouts. Every function returns
 * an error code (a negative errno) rather than calling rte_panic or exit. */

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
  return parsed < 0 ? -rte_errno : parsed;
}

/* DPDK explains its failures in its log, not in its error codes: while an operation that
 * may fail runs, the log goes to a buffer the caller reads back. */
static FILE *captured_stream;
static char *captured_text;
static size_t captured_len;

int netagg_dpdk_log_capture_begin(void) {
  captured_stream = open_memstream(&captured_text, &captured_len);
  if (captured_stream == NULL) return -errno;
  return rte_openlog_stream(captured_stream);
}

/* Ends the capture and copies what was logged, as a C string, into `text`; returns its
 * length. */
size_t netagg_dpdk_log_capture_end(char *text, size_t capacity) {
  rte_openlog_stream(NULL);
  if (captured_stream == NULL) return 0;
  fclose(captured_stream);
  captured_stream = NULL;
  size_t len = captured_len < capacity - 1 ? captured_len : capacity - 1;
  memcpy(text, captured_text, len);
  text[len] = 0;
  free(captured_text);
  captured_text = NULL;
  return len;
}

const char *netagg_dpdk_strerror(int error) { return rte_strerror(error); }

/* Probes the device `devargs` names (a vdev such as "net_af_packet0,iface=eth0", or a PCI
 * address) and finds its port; a device EAL probed already at start is found too. */
int netagg_dpdk_probe(const char *devargs, const char *name, uint16_t *port_id) {
  int probed = rte_dev_probe(devargs);
  if (probed < 0 && probed != -EEXIST) return probed;
  return rte_eth_dev_get_port_by_name(name, port_id);
}

struct rte_mempool *netagg_dpdk_pool_create(const char *name, unsigned count, int *error) {
  /* No per-lcore cache: the threads that allocate are not EAL lcores. */
  struct rte_mempool *pool =
      rte_pktmbuf_pool_create(name, count, 0, 0, RTE_MBUF_DEFAULT_BUF_SIZE, SOCKET_ID_ANY);
  if (pool == NULL) *error = -rte_errno;
  return pool;
}

/* Frees `pool` if every mbuf is back in it, and says whether it did: an mbuf still out
 * would be freed into memory no longer a pool's. */
int netagg_dpdk_pool_free(struct rte_mempool *pool) {
  if (rte_mempool_in_use_count(pool) != 0) return 0;
  rte_mempool_free(pool);
  return 1;
}

/* Configures `port` with one receive and one transmit queue of the given sizes, fed from
 * `pool`, and starts it; reports its MAC address and MTU. */
int netagg_dpdk_port_start(uint16_t port, uint16_t rx_descriptors, uint16_t tx_descriptors,
                           struct rte_mempool *pool, uint8_t mac[6], uint16_t *mtu) {
  struct rte_eth_conf conf;
  memset(&conf, 0, sizeof conf);
  int result = rte_eth_dev_configure(port, 1, 1, &conf);
  if (result < 0) return result;
  result = rte_eth_dev_adjust_nb_rx_tx_desc(port, &rx_descriptors, &tx_descriptors);
  if (result < 0) return result;
  int socket = rte_eth_dev_socket_id(port);
  result = rte_eth_rx_queue_setup(port, 0, rx_descriptors, socket, NULL, pool);
  if (result < 0) return result;
  result = rte_eth_tx_queue_setup(port, 0, tx_descriptors, socket, NULL);
  if (result < 0) return result;
  result = rte_eth_dev_start(port);
  if (result < 0) return result;
  struct rte_ether_addr address;
  result = rte_eth_macaddr_get(port, &address);
  if (result < 0) return result;
  memcpy(mac, address.addr_bytes, 6);
  return rte_eth_dev_get_mtu(port, mtu);
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

uint16_t netagg_dpdk_rx(uint16_t port, struct rte_mbuf **mbufs, uint16_t count) {
  return rte_eth_rx_burst(port, 0, mbufs, count);
}

uint16_t netagg_dpdk_tx(uint16_t port, struct rte_mbuf **mbufs, uint16_t count) {
  return rte_eth_tx_burst(port, 0, mbufs, count);
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
