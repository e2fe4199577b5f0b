/* netagg's hello world in C: every rank sums a tensor of int32, one of float32 and one of
 * bfloat16 with every other rank, synchronously and asynchronously, and checks the sums.
 *
 * Run it under the launcher, which starts a switch and tells each rank its number:
 *   netagg-run -n 2 -- ./hello_world_c */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <netagg.h>

enum { NUMEL = 1 << 16 };

static void print_error(const char *what, netagg_result result) {
  char message[1024];
  size_t length = 0;
  if (netagg_last_error_message(message, sizeof message, &length) != NETAGG_OK) {
    message[0] = '\0';
  }
  fprintf(stderr, "%s failed (%u): %s\n", what, (unsigned)result, message);
}

/* bfloat16 is float32's upper half: a float of 8 significant bits converts exactly. */
static uint16_t to_bfloat16(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  return (uint16_t)(bits >> 16);
}

/* Sums the tensors with every other rank; returns how many sums are wrong, or -1. */
static long run(netagg_context *context, long workers, int32_t *integers, float *floats, float *float_sums,
                uint16_t *brains) {
  netagg_job job = 0;
  netagg_result result;
  long i, wrong = 0;

  printf("Starting the context: waiting for %ld workers\n", workers);
  if ((result = netagg_context_start(context)) != NETAGG_OK) {
    print_error("starting", result);
    return -1;
  }
  for (i = 0; i < NUMEL; i++) {
    integers[i] = (int32_t)(i % 1000) - 500;
    floats[i] = (float)(i % 100) * 0.5f;
    brains[i] = to_bfloat16((float)(i % 16) * 0.5f);
  }
  printf("Summing int32 in place, float32 asynchronously\n");
  if ((result = netagg_allreduce_async(context, floats, float_sums, NUMEL, NETAGG_FLOAT32, &job)) != NETAGG_OK) {
    print_error("submitting the float32 job", result);
    return -1;
  }
  if ((result = netagg_allreduce(context, integers, integers, NUMEL, NETAGG_INT32)) != NETAGG_OK ||
      (result = netagg_allreduce(context, brains, brains, NUMEL, NETAGG_BFLOAT16)) != NETAGG_OK) {
    print_error("the int32 or bfloat16 allreduce", result);
    netagg_wait_all(context); /* the float32 job still uses its buffers */
    netagg_job_free(job);
    return -1;
  }
  result = netagg_job_wait(job);
  netagg_job_free(job);
  if (result != NETAGG_OK) {
    print_error("the float32 allreduce", result);
    return -1;
  }
  for (i = 0; i < NUMEL; i++) {
    wrong += integers[i] != (int32_t)(workers * ((i % 1000) - 500));
    wrong += float_sums[i] != (float)workers * ((float)(i % 100) * 0.5f);
    wrong += brains[i] != to_bfloat16((float)workers * ((float)(i % 16) * 0.5f));
  }
  return wrong;
}

int main(void) {
  netagg_config *config = NULL;
  netagg_context *context = NULL;
  netagg_result result;
  char workers_text[16];
  size_t length = 0;
  int32_t *integers = malloc(NUMEL * sizeof *integers);
  float *floats = malloc(NUMEL * sizeof *floats);
  float *float_sums = malloc(NUMEL * sizeof *float_sums);
  uint16_t *brains = malloc(NUMEL * sizeof *brains);
  long wrong = -1;

  printf("Hello from netagg %s\n", netagg_version());
  /* netagg.cfg if there is one, then NETAGG_* and the launcher's variables. */
  if (integers == NULL || floats == NULL || float_sums == NULL || brains == NULL) {
    fprintf(stderr, "out of memory\n");
  } else if ((result = netagg_config_load(NULL, &config)) != NETAGG_OK) {
    print_error("loading the config", result);
  } else if ((result = netagg_config_get(config, "general.num_workers", workers_text, sizeof workers_text,
                                         &length)) != NETAGG_OK) {
    print_error("reading general.num_workers", result);
  } else if ((result = netagg_context_new(config, &context)) != NETAGG_OK) {
    print_error("making the context", result);
  } else {
    wrong = run(context, strtol(workers_text, NULL, 10), integers, floats, float_sums, brains);
  }
  netagg_context_free(context); /* stops it; NULL is fine */
  netagg_config_free(config);
  free(integers);
  free(floats);
  free(float_sums);
  free(brains);
  if (wrong != 0) {
    if (wrong > 0) {
      fprintf(stderr, "%ld sums are wrong\n", wrong);
    }
    return 1;
  }
  printf("All %d int32, %d float32 and %d bfloat16 sums verified\n", NUMEL, NUMEL, NUMEL);
  return 0;
}
