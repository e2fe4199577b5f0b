/* Every error path of the C API, and a real run on the dummy backend. Built with
 * -Wall -Werror -pedantic -fsanitize=address,undefined and run by tests/c_api.rs, which
 * passes the path of a config file with an unknown key and a closed TCP port. */

#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

#define EXPECT(call, expected)                                                        \
  do {                                                                                \
    netagg_result got_ = (call);                                                      \
    if (got_ != (expected)) {                                                         \
      fprintf(stderr, "%s:%d: %s gave %u, expected %u (%s)\n", __FILE__, __LINE__,    \
              #call, (unsigned)got_, (unsigned)(expected), last_error());            \
      failures++;                                                                     \
    }                                                                                 \
  } while (0)

#define EXPECT_TRUE(condition)                                                        \
  do {                                                                                \
    if (!(condition)) {                                                               \
      fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #condition);        \
      failures++;                                                                     \
    }                                                                                 \
  } while (0)

static void expect_last_error_contains(const char *needle, int line) {
  const char *message = last_error();
  if (strstr(message, needle) == NULL) {
    fprintf(stderr, "line %d: last error '%s' lacks '%s'\n", line, message, needle);
    failures++;
  }
}
#define EXPECT_MESSAGE(needle) expect_last_error_contains(needle, __LINE__)

static double seconds_since(const struct timespec *start) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (double)(now.tv_sec - start->tv_sec) + (double)(now.tv_nsec - start->tv_nsec) / 1e9;
}

static void messages_and_version(void) {
  char buffer[128];
  size_t length = 0;
  EXPECT_TRUE(strlen(netagg_version()) > 0);
  EXPECT(netagg_result_message(NETAGG_STOPPED, buffer, sizeof buffer, &length), NETAGG_OK);
  EXPECT_TRUE(strcmp(buffer, "the context is stopped") == 0 && length == strlen(buffer));
  EXPECT(netagg_result_message(12345, buffer, sizeof buffer, &length), NETAGG_INVALID_ARGUMENT);
  EXPECT_MESSAGE("12345 is not a netagg_result");
  /* Asking the size with no buffer, then a buffer one byte short. */
  EXPECT(netagg_result_message(NETAGG_OK, NULL, 0, &length), NETAGG_BUFFER_TOO_SMALL);
  EXPECT_TRUE(length == strlen("success"));
  memset(buffer, 'x', sizeof buffer);
  EXPECT(netagg_result_message(NETAGG_OK, buffer, length, &length), NETAGG_BUFFER_TOO_SMALL);
  EXPECT_TRUE(buffer[0] == 'x');
  EXPECT(netagg_result_message(NETAGG_OK, buffer, sizeof buffer, NULL), NETAGG_NULL_ARGUMENT);
}

static void null_arguments(void) {
  netagg_config *config = NULL;
  netagg_context *context = NULL;
  netagg_job job = 0;
  netagg_job_state status;
  netagg_stats stats;
  int32_t data[4] = {0};

  EXPECT(netagg_config_new(NULL), NETAGG_NULL_ARGUMENT);
  EXPECT_MESSAGE("netagg_config_new: argument 'config' is NULL");
  EXPECT(netagg_config_load(NULL, NULL), NETAGG_NULL_ARGUMENT);
  EXPECT(netagg_config_set(NULL, "general.rank", "0"), NETAGG_NULL_ARGUMENT);
  EXPECT(netagg_config_new(&config), NETAGG_OK);
  EXPECT(netagg_config_set(config, NULL, "0"), NETAGG_NULL_ARGUMENT);
  EXPECT_MESSAGE("argument 'key' is NULL");
  EXPECT(netagg_config_set(config, "general.rank", NULL), NETAGG_NULL_ARGUMENT);
  EXPECT(netagg_config_get(NULL, "general.rank", NULL, 0, NULL), NETAGG_NULL_ARGUMENT);
  EXPECT(netagg_context_new(NULL, &context), NETAGG_NULL_ARGUMENT);
  EXPECT(netagg_context_new(config, NULL), NETAGG_NULL_ARGUMENT);
  EXPECT(netagg_context_start(NULL), NETAGG_NULL_ARGUMENT);
  EXPECT(netagg_context_stop(NULL), NETAGG_NULL_ARGUMENT);
  EXPECT(netagg_context_get_state(NULL, NULL), NETAGG_NULL_ARGUMENT);
  EXPECT(netagg_context_config(NULL, &config), NETAGG_NULL_ARGUMENT);
  EXPECT(netagg_allreduce(NULL, data, data, 4, NETAGG_INT32), NETAGG_NULL_ARGUMENT);
  EXPECT(netagg_allreduce_async(NULL, data, data, 4, NETAGG_INT32, &job), NETAGG_NULL_ARGUMENT);
  EXPECT(netagg_wait_all(NULL), NETAGG_NULL_ARGUMENT);
  EXPECT(netagg_context_stats(NULL, &stats, sizeof stats), NETAGG_NULL_ARGUMENT);
  EXPECT(netagg_context_stats_text(NULL, NULL, 0, NULL), NETAGG_NULL_ARGUMENT);
  EXPECT(netagg_context_reset_stats(NULL), NETAGG_NULL_ARGUMENT);
  EXPECT(netagg_job_status(1, NULL), NETAGG_NULL_ARGUMENT);
  EXPECT(netagg_job_id(1, NULL), NETAGG_NULL_ARGUMENT);
  EXPECT(netagg_job_wait(0), NETAGG_INVALID_JOB);
  EXPECT(netagg_job_status(987654321, &status), NETAGG_INVALID_JOB);
  EXPECT_MESSAGE("job handle 987654321 was freed or never issued");
  EXPECT(netagg_job_free(0), NETAGG_OK);
  netagg_config_free(NULL);
  netagg_context_free(NULL);
  netagg_config_free(config);
}

static void bad_configs(const char *unknown_key_file) {
  netagg_config *config = NULL;
  netagg_context *context = NULL;
  char value[64];
  size_t length = 0;

  EXPECT(netagg_config_load("/nonexistent/netagg.cfg", &config), NETAGG_CONFIG_FILE);
  EXPECT_MESSAGE("cannot read config file /nonexistent/netagg.cfg");
  EXPECT_TRUE(config == NULL);
  EXPECT(netagg_config_load(unknown_key_file, &config), NETAGG_CONFIG_UNKNOWN_KEY);
  EXPECT_MESSAGE("unknown key 'general.num_wokers'; known keys: general.rank");

  EXPECT(netagg_config_new(&config), NETAGG_OK);
  EXPECT(netagg_config_set(config, "general.nope", "1"), NETAGG_CONFIG_UNKNOWN_KEY);
  EXPECT_MESSAGE("unknown key 'general.nope'");
  EXPECT(netagg_config_set(config, "general.num_workers", "0"), NETAGG_CONFIG_VALUE);
  EXPECT_MESSAGE("key 'general.num_workers' = '0': expected an integer from 1 to 65535");
  EXPECT(netagg_config_set(config, "general.backend", "tcp"), NETAGG_CONFIG_VALUE);
  EXPECT_MESSAGE("expected 'udp', 'dpdk', 'rdma' or 'dummy'");
  EXPECT(netagg_config_get(config, "general.nope", value, sizeof value, &length), NETAGG_CONFIG_UNKNOWN_KEY);
  EXPECT(netagg_config_set(config, "general.num_workers", "4"), NETAGG_OK);
  EXPECT(netagg_config_set(config, "general.rank", "4"), NETAGG_OK);
  EXPECT(netagg_context_new(config, &context), NETAGG_CONFIG_INVALID);
  EXPECT_MESSAGE("general.rank 4 (set by the program) must be below general.num_workers 4 (set by the program)");
  EXPECT_TRUE(context == NULL);
  EXPECT(netagg_config_get(config, "general.num_workers", value, sizeof value, &length), NETAGG_OK);
  EXPECT_TRUE(strcmp(value, "4") == 0 && length == 1);
  netagg_config_free(config);

  /* RDMA on a host whose kernel has none (this one, and CI's): a clear error at start. */
  if (access("/sys/class/infiniband", F_OK) != 0) {
    EXPECT(netagg_config_new(&config), NETAGG_OK);
    EXPECT(netagg_config_set(config, "general.backend", "rdma"), NETAGG_OK);
    EXPECT(netagg_context_new(config, &context), NETAGG_OK);
    EXPECT(netagg_context_start(context), NETAGG_BACKEND);
    EXPECT_MESSAGE("backend.rdma: no RDMA device: this kernel has no RDMA support");
    EXPECT_MESSAGE("rdma link add rxe0 type rxe netdev eth0");
    EXPECT_MESSAGE("backend = udp needs none");
    netagg_context_free(context);
    netagg_config_free(config);
  }
}

static netagg_context *dummy_context_at(const char *prepostprocessor, const char *bandwidth) {
  netagg_config *config = NULL;
  netagg_context *context = NULL;
  EXPECT(netagg_config_new(&config), NETAGG_OK);
  EXPECT(netagg_config_set(config, "general.backend", "dummy"), NETAGG_OK);
  EXPECT(netagg_config_set(config, "general.num_workers", "3"), NETAGG_OK);
  EXPECT(netagg_config_set(config, "general.packet_numel", "64"), NETAGG_OK);
  EXPECT(netagg_config_set(config, "general.prepostprocessor", prepostprocessor), NETAGG_OK);
  EXPECT(netagg_config_set(config, "backend.dummy.bandwidth", bandwidth), NETAGG_OK);
  EXPECT(netagg_context_new(config, &context), NETAGG_OK);
  netagg_config_free(config); /* the context keeps its own copy */
  return context;
}

static netagg_context *dummy_context(const char *prepostprocessor) {
  return dummy_context_at(prepostprocessor, "0");
}

/* The size argument of netagg_context_stats: a program built with an older header (a
 * shorter struct) gets the counters it names and nothing past them; one built with a
 * newer header reads 0 in counters this library does not keep. */
static void sized_stats(const netagg_context *context) {
  uint64_t words[sizeof(netagg_stats) / 8 + 3];
  size_t i;
  const size_t older = offsetof(netagg_stats, gap_requests);
  memset(words, 0xAB, sizeof words);
  EXPECT(netagg_context_stats(context, (netagg_stats *)words, older), NETAGG_OK);
  EXPECT_TRUE(words[0] == 1); /* jobs_submitted */
  for (i = older / 8; i < sizeof words / 8; i++) {
    EXPECT_TRUE(words[i] == 0xABABABABABABABABull);
  }
  EXPECT(netagg_context_stats(context, (netagg_stats *)words, sizeof words - 8), NETAGG_OK);
  EXPECT_TRUE(words[0] == 1);
  for (i = sizeof(netagg_stats) / 8; i < sizeof words / 8 - 1; i++) {
    EXPECT_TRUE(words[i] == 0);
  }
  EXPECT_TRUE(words[sizeof words / 8 - 1] == 0xABABABABABABABABull);
  EXPECT(netagg_context_stats(context, (netagg_stats *)words, 12), NETAGG_INVALID_ARGUMENT);
  EXPECT_MESSAGE("stats_size 12 is no netagg_stats's size: pass sizeof(netagg_stats)");
  EXPECT(netagg_context_stats(context, (netagg_stats *)words, 0), NETAGG_INVALID_ARGUMENT);
}

static void lifecycle_and_jobs(void) {
  enum { NUMEL = 10000 };
  static int32_t input[NUMEL], output[NUMEL];
  static float floats[NUMEL];
  netagg_context *context = dummy_context("native");
  netagg_context_state state;
  netagg_job job = 0, second = 0;
  netagg_job_state status;
  netagg_stats stats;
  netagg_config *copy = NULL;
  uint64_t id = 0;
  char value[64], text[4096];
  size_t length = 0;
  int i, exact = 1;

  for (i = 0; i < NUMEL; i++) {
    input[i] = i - 5000;
    floats[i] = (float)i * 0.25f;
  }
  /* Misuse before start. */
  EXPECT(netagg_context_get_state(context, &state), NETAGG_OK);
  EXPECT_TRUE(state == NETAGG_CONTEXT_CREATED);
  EXPECT(netagg_allreduce(context, input, output, NUMEL, NETAGG_INT32), NETAGG_NOT_STARTED);
  EXPECT_MESSAGE("netagg_allreduce: call netagg_context_start first");
  EXPECT(netagg_wait_all(context), NETAGG_NOT_STARTED);
  EXPECT(netagg_context_stop(context), NETAGG_NOT_STARTED);
  EXPECT(netagg_context_stats(context, &stats, sizeof stats), NETAGG_NOT_STARTED);

  EXPECT(netagg_context_start(context), NETAGG_OK);
  EXPECT(netagg_context_start(context), NETAGG_ALREADY_STARTED);
  EXPECT(netagg_context_get_state(context, &state), NETAGG_OK);
  EXPECT_TRUE(state == NETAGG_CONTEXT_RUNNING);
  EXPECT(netagg_context_config(context, &copy), NETAGG_OK);
  EXPECT(netagg_config_get(copy, "general.num_workers", value, sizeof value, &length), NETAGG_OK);
  EXPECT_TRUE(strcmp(value, "3") == 0);
  netagg_config_free(copy);

  /* Synchronous, out of place: the dummy switch sums three equal contributions. */
  EXPECT(netagg_allreduce(context, input, output, NUMEL, NETAGG_INT32), NETAGG_OK);
  for (i = 0; i < NUMEL; i++) {
    exact &= output[i] == 3 * input[i] && input[i] == i - 5000;
  }
  EXPECT_TRUE(exact);

  /* Asynchronous, in place, float32. */
  EXPECT(netagg_allreduce_async(context, floats, floats, NUMEL, NETAGG_FLOAT32, &job), NETAGG_OK);
  EXPECT(netagg_allreduce_async(context, input, output, 0, NETAGG_INT32, &second), NETAGG_OK);
  EXPECT(netagg_job_wait(job), NETAGG_OK);
  EXPECT(netagg_job_wait_timeout(second, 1000), NETAGG_OK);
  EXPECT(netagg_job_status(job, &status), NETAGG_OK);
  EXPECT_TRUE(status == NETAGG_JOB_STATE_FINISHED);
  EXPECT(netagg_job_id(job, &id), NETAGG_OK);
  EXPECT_TRUE(id == 2);
  for (i = 0, exact = 1; i < NUMEL; i++) {
    exact &= floats[i] == 3.0f * (float)i * 0.25f;
  }
  EXPECT_TRUE(exact);
  EXPECT(netagg_wait_all(context), NETAGG_OK);

  /* A freed handle is reported, not read. */
  EXPECT(netagg_job_free(job), NETAGG_OK);
  EXPECT(netagg_job_wait(job), NETAGG_INVALID_JOB);
  EXPECT(netagg_job_free(job), NETAGG_INVALID_JOB);
  EXPECT_MESSAGE("was freed already or never issued");
  EXPECT(netagg_job_free(second), NETAGG_OK);

  /* Bad arguments. */
  EXPECT(netagg_allreduce(context, input, output, NUMEL, 7), NETAGG_INVALID_ARGUMENT);
  EXPECT_MESSAGE("data type 7 is none of NETAGG_FLOAT32 (0), NETAGG_INT32 (1), NETAGG_FLOAT16 (2), "
                 "NETAGG_BFLOAT16 (3)");
  EXPECT(netagg_allreduce(context, NULL, output, NUMEL, NETAGG_INT32), NETAGG_NULL_ARGUMENT);
  EXPECT(netagg_allreduce(context, input, input + 1, NUMEL - 1, NETAGG_INT32), NETAGG_INVALID_ARGUMENT);
  EXPECT_MESSAGE("overlap");
  EXPECT(netagg_allreduce(context, input, output, UINT64_MAX / 2, NETAGG_INT32), NETAGG_INVALID_ARGUMENT);
  EXPECT(netagg_allreduce_async(context, input, output, NUMEL, NETAGG_INT32, NULL), NETAGG_NULL_ARGUMENT);

  EXPECT(netagg_context_stats(context, &stats, sizeof stats), NETAGG_OK);
  EXPECT_TRUE(stats.jobs_submitted == 3 && stats.jobs_finished == 3 && stats.jobs_failed == 0);
  EXPECT_TRUE(stats.elements_submitted == 2 * NUMEL && stats.worker_threads == 2);
  EXPECT_TRUE(stats.packets_sent >= 2 * ((NUMEL + 63) / 64));
  EXPECT(netagg_context_stats_text(context, text, sizeof text, &length), NETAGG_OK);
  EXPECT_TRUE(strstr(text, "jobs: 3 submitted, 3 finished, 0 failed") != NULL);
  EXPECT(netagg_context_reset_stats(context), NETAGG_OK);
  EXPECT(netagg_context_stats(context, &stats, sizeof stats), NETAGG_OK);
  EXPECT_TRUE(stats.jobs_submitted == 0 && stats.packets_sent == 0);
  /* After a reset, a job counts only its own packets: 157 of 64 elements. */
  EXPECT(netagg_allreduce(context, input, output, NUMEL, NETAGG_INT32), NETAGG_OK);
  EXPECT(netagg_context_stats(context, &stats, sizeof stats), NETAGG_OK);
  EXPECT_TRUE(stats.jobs_submitted == 1 && stats.packets_sent >= 157 && stats.packets_sent < 2 * 157);
  EXPECT_TRUE(stats.data_sent >= 157 && stats.data_sent <= stats.packets_sent);
  EXPECT_TRUE(stats.data_sent + stats.acks_sent + stats.probes == stats.packets_sent);
  EXPECT_TRUE(stats.corrupt == 0);
  sized_stats(context);

  EXPECT(netagg_context_stop(context), NETAGG_OK);
  EXPECT(netagg_context_stop(context), NETAGG_STOPPED);
  EXPECT_MESSAGE("already stopped");
  EXPECT(netagg_allreduce(context, input, output, NUMEL, NETAGG_INT32), NETAGG_STOPPED);
  EXPECT(netagg_context_stats(context, &stats, sizeof stats), NETAGG_OK);
  /* A stopped context starts again, in a new session. */
  EXPECT(netagg_context_start(context), NETAGG_OK);
  EXPECT(netagg_allreduce(context, input, output, NUMEL, NETAGG_INT32), NETAGG_OK);
  EXPECT_TRUE(output[NUMEL - 1] == 3 * input[NUMEL - 1]);
  netagg_context_free(context);
}

/* Datagrams dropped each way on the dummy backend: exact sums, and the losses that the
 * numbering of packets shows recovered at once, counted apart from the timers. */
static void losses_found_by_their_numbers(void) {
  enum { NUMEL = 20000, JOBS = 3 };
  static int32_t input[NUMEL], output[NUMEL];
  netagg_config *config = NULL;
  netagg_context *context = NULL;
  netagg_stats stats;
  int i, job, exact = 1;

  for (i = 0; i < NUMEL; i++) {
    input[i] = i - 7000;
  }
  EXPECT(netagg_config_new(&config), NETAGG_OK);
  EXPECT(netagg_config_set(config, "general.backend", "dummy"), NETAGG_OK);
  EXPECT(netagg_config_set(config, "general.num_workers", "3"), NETAGG_OK);
  EXPECT(netagg_config_set(config, "general.packet_numel", "64"), NETAGG_OK);
  EXPECT(netagg_config_set(config, "faults.send_drop", "0.02"), NETAGG_OK);
  EXPECT(netagg_config_set(config, "faults.receive_drop", "0.02"), NETAGG_OK);
  EXPECT(netagg_config_set(config, "faults.seed", "5"), NETAGG_OK);
  EXPECT(netagg_context_new(config, &context), NETAGG_OK);
  netagg_config_free(config);
  EXPECT(netagg_context_start(context), NETAGG_OK);
  for (job = 0; job < JOBS; job++) {
    EXPECT(netagg_allreduce(context, input, output, NUMEL, NETAGG_INT32), NETAGG_OK);
    for (i = 0; i < NUMEL; i++) {
      exact &= output[i] == 3 * input[i];
    }
  }
  EXPECT_TRUE(exact);
  EXPECT(netagg_context_stats(context, &stats, sizeof stats), NETAGG_OK);
  EXPECT_TRUE(stats.gap_requests > 0 && stats.lost_notices > 0);
  netagg_context_free(context);
}

/* The float16 bits of a float that float16 holds exactly: zero or a normal number. */
static uint16_t float16_bits(float value) {
  uint32_t bits, exponent;
  memcpy(&bits, &value, sizeof bits);
  exponent = (bits >> 23) & 0xff;
  if (exponent == 0) {
    return (uint16_t)((bits >> 16) & 0x8000);
  }
  return (uint16_t)(((bits >> 16) & 0x8000) | ((exponent - 127 + 15) << 10) | ((bits & 0x7fffff) >> 13));
}

/* The bfloat16 bits of a float that bfloat16 holds exactly: its upper half. */
static uint16_t bfloat16_bits(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  return (uint16_t)(bits >> 16);
}

/* float16 and bfloat16 on the dummy backend's three equal contributions: exact sums of
 * values the types hold, infinity past float16's range, NaN kept, and half the bytes of
 * float32 on the wire. */
static void sixteen_bit_types(void) {
  enum { NUMEL = 10000 };
  static uint16_t halves[NUMEL], brains[NUMEL], expected_halves[NUMEL], expected_brains[NUMEL];
  static float floats[NUMEL];
  netagg_context *context = dummy_context("native");
  netagg_stats stats;
  netagg_job job = 0;
  uint64_t float32_bytes;
  int i, exact = 1;
  for (i = 0; i < NUMEL; i++) {
    float half = (float)(i % 200) * 0.25f - 25.0f, brain = (float)(i % 64) * 0.5f - 16.0f;
    halves[i] = float16_bits(half);
    expected_halves[i] = float16_bits(3.0f * half);
    brains[i] = bfloat16_bits(brain);
    expected_brains[i] = bfloat16_bits(3.0f * brain);
  }
  /* Past float16's largest finite value (65504): 3 x 60000 is infinity, of either sign. */
  halves[7] = float16_bits(60000.0f);
  expected_halves[7] = 0x7c00;
  halves[8] = float16_bits(-60000.0f);
  expected_halves[8] = 0xfc00;
  halves[9] = 0x7e00; /* a quiet NaN */
  EXPECT(netagg_context_start(context), NETAGG_OK);
  EXPECT(netagg_allreduce_async(context, brains, brains, NUMEL, NETAGG_BFLOAT16, &job), NETAGG_OK);
  EXPECT(netagg_allreduce(context, halves, halves, NUMEL, NETAGG_FLOAT16), NETAGG_OK);
  EXPECT(netagg_job_wait(job), NETAGG_OK);
  EXPECT(netagg_job_free(job), NETAGG_OK);
  for (i = 0; i < NUMEL; i++) {
    exact &= (i == 9 || halves[i] == expected_halves[i]) && brains[i] == expected_brains[i];
  }
  EXPECT_TRUE(exact);
  EXPECT_TRUE((halves[9] & 0x7c00) == 0x7c00 && (halves[9] & 0x03ff) != 0);
  /* Odd lengths and misuse as for the 4-byte types. */
  EXPECT(netagg_allreduce(context, halves, halves, 3, NETAGG_FLOAT16), NETAGG_OK);
  EXPECT(netagg_allreduce(context, halves, halves + 1, NUMEL - 1, NETAGG_BFLOAT16), NETAGG_INVALID_ARGUMENT);
  EXPECT_MESSAGE("overlap");
  EXPECT(netagg_allreduce(context, NULL, halves, NUMEL, NETAGG_FLOAT16), NETAGG_NULL_ARGUMENT);
  EXPECT(netagg_allreduce(context, halves, halves, UINT64_MAX / 2, NETAGG_FLOAT16), NETAGG_INVALID_ARGUMENT);

  EXPECT(netagg_context_reset_stats(context), NETAGG_OK);
  EXPECT(netagg_allreduce(context, floats, floats, NUMEL, NETAGG_FLOAT32), NETAGG_OK);
  EXPECT(netagg_context_stats(context, &stats, sizeof stats), NETAGG_OK);
  float32_bytes = stats.bytes_sent;
  EXPECT(netagg_context_reset_stats(context), NETAGG_OK);
  EXPECT(netagg_allreduce(context, brains, brains, NUMEL, NETAGG_BFLOAT16), NETAGG_OK);
  EXPECT(netagg_context_stats(context, &stats, sizeof stats), NETAGG_OK);
  /* Half the payload in half the packets, each as long as a float32 one. */
  EXPECT_TRUE(stats.bytes_sent > float32_bytes * 45 / 100 && stats.bytes_sent < float32_bytes * 55 / 100);
  netagg_context_free(context);
}

/* general.wire_precision: float32 tensors sent as 16 bits, summed, and widened back:
 * exact for values bfloat16 holds, in half the bytes; a value or combination it refuses
 * is an error naming it. */
static void float32_as_16_bits_on_the_wire(void) {
  enum { NUMEL = 4096 };
  static float floats[NUMEL];
  netagg_config *config = NULL;
  netagg_context *narrow = NULL, *wide = dummy_context("native");
  netagg_stats stats;
  uint64_t float32_bytes;
  int i, exact = 1;
  EXPECT(netagg_config_new(&config), NETAGG_OK);
  EXPECT(netagg_config_set(config, "general.wire_precision", "float8"), NETAGG_CONFIG_VALUE);
  EXPECT_MESSAGE("key 'general.wire_precision' = 'float8'");
  EXPECT(netagg_config_set(config, "general.wire_precision", "bfloat16"), NETAGG_OK);
  EXPECT(netagg_config_set(config, "general.prepostprocessor", "cpu_exponent_quantizer"), NETAGG_OK);
  EXPECT(netagg_context_new(config, &narrow), NETAGG_CONFIG_INVALID);
  EXPECT_MESSAGE("general.wire_precision bfloat16 (set by the program) needs general.prepostprocessor native");
  EXPECT(netagg_config_set(config, "general.prepostprocessor", "native"), NETAGG_OK);
  EXPECT(netagg_config_set(config, "general.backend", "dummy"), NETAGG_OK);
  EXPECT(netagg_config_set(config, "general.num_workers", "3"), NETAGG_OK);
  EXPECT(netagg_config_set(config, "general.packet_numel", "64"), NETAGG_OK);
  EXPECT(netagg_config_set(config, "backend.dummy.bandwidth", "0"), NETAGG_OK);
  EXPECT(netagg_context_new(config, &narrow), NETAGG_OK);
  netagg_config_free(config);
  EXPECT(netagg_context_start(narrow), NETAGG_OK);
  EXPECT(netagg_context_start(wide), NETAGG_OK);

  EXPECT(netagg_allreduce(wide, floats, floats, NUMEL, NETAGG_FLOAT32), NETAGG_OK);
  EXPECT(netagg_context_stats(wide, &stats, sizeof stats), NETAGG_OK);
  float32_bytes = stats.bytes_sent;
  for (i = 0; i < NUMEL; i++) {
    floats[i] = (float)(i % 64) * 0.5f - 16.0f;
  }
  EXPECT(netagg_allreduce(narrow, floats, floats, NUMEL, NETAGG_FLOAT32), NETAGG_OK);
  for (i = 0; i < NUMEL; i++) {
    exact &= floats[i] == 3.0f * ((float)(i % 64) * 0.5f - 16.0f);
  }
  EXPECT_TRUE(exact);
  EXPECT(netagg_context_stats(narrow, &stats, sizeof stats), NETAGG_OK);
  EXPECT_TRUE(stats.bytes_sent > float32_bytes * 45 / 100 && stats.bytes_sent < float32_bytes * 55 / 100);
  netagg_context_free(narrow);
  netagg_context_free(wide);
}

/* Block floating point cannot carry a NaN: its whole block comes back NaN, on every
   rank, and the other blocks sum as usual. */
static void nan_with_block_floating_point(void) {
  float values[128];
  int i;
  netagg_context *context = dummy_context("cpu_exponent_quantizer");
  EXPECT(netagg_context_start(context), NETAGG_OK);
  for (i = 0; i < 128; i++) values[i] = 0.5f;
  values[100] = NAN;
  EXPECT(netagg_allreduce(context, values, values, 128, NETAGG_FLOAT32), NETAGG_OK);
  for (i = 0; i < 128; i++) EXPECT_TRUE(i < 64 ? values[i] == 1.5f : isnan(values[i]));
  netagg_context_free(context);
}

static void *stop_soon(void *context) {
  struct timespec pause = {0, 50 * 1000 * 1000};
  nanosleep(&pause, NULL);
  EXPECT(netagg_context_stop(context), NETAGG_OK);
  return NULL;
}

/* A thread stops the context while this one waits for its jobs (SwitchML's benchmarks
 * stop from a signal-handling thread): the wait returns only when no job touches its
 * buffer any more, so the buffers may be freed then. */
static void stop_while_waiting(void) {
  enum { JOBS = 8, NUMEL = 1 << 20 };
  /* 1 Gbit/s: the 32 MiB of jobs take about a quarter of a second. */
  netagg_context *context = dummy_context_at("native", "1000");
  netagg_job jobs[JOBS];
  float *buffers[JOBS];
  pthread_t stopper;
  netagg_job_state state;
  int i, ended = 0;
  EXPECT(netagg_context_start(context), NETAGG_OK);
  for (i = 0; i < JOBS; i++) {
    buffers[i] = calloc(NUMEL, sizeof(float));
    EXPECT(netagg_allreduce_async(context, buffers[i], buffers[i], NUMEL, NETAGG_FLOAT32, &jobs[i]), NETAGG_OK);
  }
  EXPECT_TRUE(pthread_create(&stopper, NULL, stop_soon, context) == 0);
  EXPECT(netagg_wait_all(context), NETAGG_OK);
  for (i = 0; i < JOBS; i++) {
    EXPECT(netagg_job_status(jobs[i], &state), NETAGG_OK);
    ended += state == NETAGG_JOB_STATE_FINISHED || state == NETAGG_JOB_STATE_FAILED;
    free(buffers[i]); /* nothing writes here any more */
  }
  EXPECT_TRUE(ended == JOBS);
  pthread_join(stopper, NULL);
  EXPECT(netagg_job_wait(jobs[JOBS - 1]), NETAGG_STOPPED);
  EXPECT(netagg_context_stop(context), NETAGG_STOPPED);
  for (i = 0; i < JOBS; i++) {
    EXPECT(netagg_job_free(jobs[i]), NETAGG_OK);
  }
  netagg_context_free(context);
}

/* Jobs in flight own their memory: another job that writes it, or reads what one
 * writes, is refused with the job it would race named; the same buffers again run after
 * it, element by element. Sums land in malloc's memory, never written before. */
static void shared_buffers_between_jobs(void) {
  enum { NUMEL = 1 << 20 };
  /* 1 Gbit/s: a job of 4 MiB stays in flight for tens of milliseconds. */
  netagg_context *context = dummy_context_at("native", "1000");
  float *shared = calloc(NUMEL, sizeof(float));
  int32_t *input = malloc(NUMEL * sizeof(int32_t)), *output = malloc(NUMEL * sizeof(int32_t));
  netagg_job first = 0, again = 0;
  uint64_t id = 0;
  int i, exact = 1;
  EXPECT(netagg_context_start(context), NETAGG_OK);
  for (i = 0; i < NUMEL; i++) {
    shared[i] = 1.0f;
    input[i] = i;
  }
  EXPECT(netagg_allreduce_async(context, shared, shared, NUMEL, NETAGG_FLOAT32, &first), NETAGG_OK);
  EXPECT(netagg_allreduce(context, shared + 16, output, 16, NETAGG_FLOAT32), NETAGG_BUFFER_IN_USE);
  EXPECT_MESSAGE("the input of this job (64 bytes at 0x");
  EXPECT_MESSAGE("overlaps the output of job 1, which is still in flight");
  EXPECT(netagg_allreduce(context, input, shared + NUMEL - 1, 1, NETAGG_INT32), NETAGG_BUFFER_IN_USE);
  EXPECT_MESSAGE("the output of this job (4 bytes at 0x");
  EXPECT(netagg_allreduce_async(context, shared, shared, NUMEL, NETAGG_FLOAT32, &again), NETAGG_OK);
  EXPECT(netagg_job_wait(first), NETAGG_OK);
  EXPECT(netagg_job_wait(again), NETAGG_OK);
  /* Jobs refused for buffers in use keep their numbers: another rank may run them. */
  EXPECT(netagg_job_id(again, &id), NETAGG_OK);
  EXPECT_TRUE(id == 4);
  /* Three ranks' ones, summed twice. */
  EXPECT_TRUE(shared[0] == 9.0f && shared[NUMEL - 1] == 9.0f);
  EXPECT(netagg_allreduce(context, input, output, NUMEL, NETAGG_INT32), NETAGG_OK);
  for (i = 0; i < NUMEL; i++) {
    exact &= output[i] == 3 * i;
  }
  EXPECT_TRUE(exact);
  EXPECT(netagg_job_free(first), NETAGG_OK);
  EXPECT(netagg_job_free(again), NETAGG_OK);
  netagg_context_free(context);
  free(shared);
  free(input);
  free(output);
}

/* Runs after main returns, when the thread's locals are gone: a failing call still
 * returns its code rather than aborting the process. */
static void at_exit(void) {
  if (netagg_job_free(424242) != NETAGG_INVALID_JOB) {
    fprintf(stderr, "netagg_job_free at exit did not report the unknown handle\n");
    _Exit(3);
  }
}

static void unreachable_switch(const char *closed_port) {
  netagg_config *config = NULL;
  netagg_context *context = NULL;
  struct timespec start;
  double waited;
  EXPECT(netagg_config_new(&config), NETAGG_OK);
  EXPECT(netagg_config_set(config, "general.controller_port", closed_port), NETAGG_OK);
  EXPECT(netagg_config_set(config, "general.connect_timeout", "1"), NETAGG_OK);
  EXPECT(netagg_context_new(config, &context), NETAGG_OK);
  clock_gettime(CLOCK_MONOTONIC, &start);
  EXPECT(netagg_context_start(context), NETAGG_CONNECT);
  waited = seconds_since(&start);
  EXPECT_MESSAGE("cannot reach the switch at 127.0.0.1:");
  EXPECT_TRUE(waited >= 0.8 && waited < 5.0);
  /* A failed start leaves the context startable and not running. */
  EXPECT(netagg_allreduce(context, NULL, NULL, 0, NETAGG_INT32), NETAGG_NOT_STARTED);
  netagg_context_free(context);
  netagg_config_free(config);
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s UNKNOWN_KEY_CONFIG CLOSED_PORT\n", argv[0]);
    return 2;
  }
  messages_and_version();
  null_arguments();
  bad_configs(argv[1]);
  lifecycle_and_jobs();
  losses_found_by_their_numbers();
  sixteen_bit_types();
  float32_as_16_bits_on_the_wire();
  nan_with_block_floating_point();
  stop_while_waiting();
  shared_buffers_between_jobs();
  unreachable_switch(argv[2]);
  atexit(at_exit);
  if (failures > 0) {
    fprintf(stderr, "%d checks failed\n", failures);
    return 1;
  }
  printf("all C API checks passed\n");
  return 0;
}
