/* The MPI baseline of scripts/bench-compare: MPI_Allreduce (float sum, in place) of a
 * tensor, timed per job like allreduce_benchmark's jobs.
 *
 * usage: mpirun -n N allreduce_mpi NUMEL JOBS WARMUP
 * Rank 0 prints one line of JSON: the median goodput in Gbit/s (tensor bits / time, as
 * allreduce_benchmark counts them), the median's nanoseconds, and every timed job's
 * nanoseconds in order. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static int compare_doubles(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (argc != 4) {
    if (rank == 0) fprintf(stderr, "usage: allreduce_mpi NUMEL JOBS WARMUP\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  long numel = atol(argv[1]);
  int jobs = atoi(argv[2]), warmup = atoi(argv[3]);
  float *tensor = malloc(sizeof(float) * (size_t)numel);
  double *seconds = malloc(sizeof(double) * (size_t)(jobs > 0 ? jobs : 1));
  if (numel <= 0 || jobs <= 0 || warmup < 0 || !tensor || !seconds) MPI_Abort(MPI_COMM_WORLD, 2);
  for (long i = 0; i < numel; i++) tensor[i] = (float)((i % 1000) - 500) / 1024.0f;
  for (int job = 0; job < warmup + jobs; job++) {
    MPI_Barrier(MPI_COMM_WORLD);
    double started = MPI_Wtime();
    MPI_Allreduce(MPI_IN_PLACE, tensor, (int)numel, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    if (job >= warmup) seconds[job - warmup] = MPI_Wtime() - started;
  }
  if (rank == 0) {
    double *sorted = malloc(sizeof(double) * (size_t)jobs);
    if (!sorted) MPI_Abort(MPI_COMM_WORLD, 2);
    for (int job = 0; job < jobs; job++) sorted[job] = seconds[job];
    qsort(sorted, (size_t)jobs, sizeof(double), compare_doubles);
    double median = jobs % 2 ? sorted[jobs / 2] : (sorted[jobs / 2 - 1] + sorted[jobs / 2]) / 2;
    printf("{\"median_gbps\":%g,\"median_ns\":%.0f,\"jobs_ns\":[", numel * 32.0 / median / 1e9,
           median * 1e9);
    for (int job = 0; job < jobs; job++) printf("%s%.0f", job ? "," : "", seconds[job] * 1e9);
    printf("]}\n");
    free(sorted);
  }
  free(tensor);
  free(seconds);
  MPI_Finalize();
  return 0;
}
