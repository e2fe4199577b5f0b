/* netagg's hello world in C: every rank sums a tensor of int32 and one of float32 with
 * every other rank, synchronously and asynchronously, and checks the sums.
 *
 * Run it under the launcher, which starts a switch and tells each rank its number:
 *   netagg-run -n 2 -- ./hello_world_c */

#include <stdio.h>
#include <stdlib.h>

#include <netagg.h>

enum { NUMEL = 1 << 16 };

static int fail(const char *what, netagg_result result) {
  char message[1024];
  size_t length = 0;
  if (netagg_last_error_message(message, sizeof message, &length) != NETAGG_OK) {
    message[0] = '\0';
  }
  fprintf(stderr, "%s failed (%u): %s\n", what, (unsigned)result, message);
  return 1;
}

int main(void) {
  netagg_config *config = NULL;
  netagg_context *context = NULL;
  netagg_job job = 0;
  netagg_result result;
  char workers_text[16];
  size_t length = 0;
  int32_t *integers = malloc(NUMEL * sizeof *integers);
  float *floats = malloc(NUMEL * sizeof *floats);
  float *float_sums = malloc(NUMEL * sizeof *float_sums);
  long workers, i, wrong = 0;

  if (integers == NULL || floats == NULL || float_sums == NULL) {
    fprintf(stderr, "out of memory\n");
    return 1;
  }
  printf("Hello from netagg %s\n", netagg_version());
  /* netagg.cfg if there is one, then NETAGG_* and the launcher's variables. */
  if ((result = netagg_config_load(NULL, &config)) != NETAGG_OK) return fail("loading the config", result);
  if ((result = netagg_context_new(config, &context)) != NETAGG_OK) return fail("making the context", result);
  netagg_config_get(config, "general.num_workers", workers_text, sizeof workers_text, &length);
  workers = strtol(workers_text, NULL, 10);
  netagg_config_free(config);

  printf("Starting the context: waiting for %ld workers\n", workers);
  if ((result = netagg_context_start(context)) != NETAGG_OK) return fail("starting", result);

  for (i = 0; i < NUMEL; i++) {
    integers[i] = (int32_t)(i % 1000) - 500;
    floats[i] = (float)(i % 100) * 0.5f;
  }
  printf("Summing int32 in place, float32 asynchronously\n");
  if ((result = netagg_allreduce_async(context, floats, float_sums, NUMEL, NETAGG_FLOAT32, &job)) != NETAGG_OK) {
    return fail("submitting the float32 job", result);
  }
  if ((result = netagg_allreduce(context, integers, integers, NUMEL, NETAGG_INT32)) != NETAGG_OK) {
    return fail("the int32 allreduce", result);
  }
  if ((result = netagg_job_wait(job)) != NETAGG_OK) return fail("the float32 allreduce", result);
  netagg_job_free(job);

  for (i = 0; i < NUMEL; i++) {
    wrong += integers[i] != (int32_t)(workers * ((i % 1000) - 500));
    wrong += float_sums[i] != (float)workers * ((float)(i % 100) * 0.5f);
  }
  netagg_context_free(context);
  free(integers);
  free(floats);
  free(float_sums);
  if (wrong > 0) {
    fprintf(stderr, "%ld sums are wrong\n", wrong);
    return 1;
  }
  printf("All %d int32 and %d float32 sums verified\n", NUMEL, NUMEL);
  return 0;
}
