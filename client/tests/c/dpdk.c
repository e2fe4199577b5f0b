/* A DPDK backend that cannot start, from C: every failure is a code and a message, and
 * the process lives on to run a job on another backend. Run by tests/c_api.rs; EAL
 * starts here without hugepages or devices (root, as CI). */

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"

/* Starts a context of one worker with backend = dpdk and `key` = `value` (if any);
 * checks the result and that the message holds `needle`. */
static void expect_start(const char *key, const char *value, netagg_result expected, const char *needle, int line) {
  netagg_config *config = NULL;
  netagg_context *context = NULL;
  netagg_result got;
  if (netagg_config_new(&config) != NETAGG_OK || netagg_config_set(config, "general.backend", "dpdk") != NETAGG_OK ||
      netagg_config_set(config, "backend.dpdk.device", "net_null0") != NETAGG_OK ||
      (key != NULL && netagg_config_set(config, key, value) != NETAGG_OK) ||
      netagg_context_new(config, &context) != NETAGG_OK) {
    fprintf(stderr, "line %d: cannot configure: %s\n", line, last_error());
    failures++;
    return;
  }
  got = netagg_context_start(context);
  if (got != expected) {
    fprintf(stderr, "line %d: netagg_context_start gave %u, expected %u (%s)\n", line, (unsigned)got,
            (unsigned)expected, last_error());
    failures++;
  } else if (strstr(last_error(), needle) == NULL) {
    fprintf(stderr, "line %d: last error '%s' lacks '%s'\n", line, last_error(), needle);
    failures++;
  }
  netagg_context_free(context);
  netagg_config_free(config);
}
#define EXPECT_START(key, value, expected, needle) expect_start(key, value, expected, needle, __LINE__)

int main(void) {
  static int32_t data[1000];
  netagg_config *config = NULL;
  netagg_context *context = NULL;
  size_t i;

  EXPECT_START("backend.dpdk.device", "", NETAGG_CONFIG_INVALID, "backend.dpdk.device is empty");
  EXPECT_START("backend.dpdk.eal_args", "--no-huge -h", NETAGG_BACKEND, "would print it and end this process");
  EXPECT_START("backend.dpdk.eal_args", "--no-huge -l 0-1", NETAGG_BACKEND, "names several lcores");
  EXPECT_START("backend.dpdk.device", "net_nosuchdriver0", NETAGG_BACKEND, "cannot probe it");
  /* EAL runs now, with the default arguments: others are refused, not half started. */
  EXPECT_START("backend.dpdk.eal_args", "--no-huge --no-shconf -m 64", NETAGG_BACKEND, "once per process");
  /* 1024 elements make 4144-byte datagrams; a 1500-byte MTU carries 1472. */
  EXPECT_START("general.packet_numel", "1024", NETAGG_CONFIG_INVALID, "the largest packet_numel that fits is 355");

  /* The process lives on and runs a job on another backend. */
  if (netagg_config_new(&config) != NETAGG_OK || netagg_config_set(config, "general.backend", "dummy") != NETAGG_OK ||
      netagg_context_new(config, &context) != NETAGG_OK || netagg_context_start(context) != NETAGG_OK) {
    fprintf(stderr, "the dummy backend did not start: %s\n", last_error());
    return 1;
  }
  for (i = 0; i < 1000; i++) data[i] = (int32_t)i;
  if (netagg_allreduce(context, data, data, 1000, NETAGG_INT32) != NETAGG_OK || data[999] != 999) {
    fprintf(stderr, "the dummy allreduce failed: %s\n", last_error());
    failures++;
  }
  netagg_context_free(context);
  netagg_config_free(config);
  if (failures > 0) {
    fprintf(stderr, "%d checks failed\n", failures);
    return 1;
  }
  printf("all DPDK C API checks passed\n");
  return 0;
}
