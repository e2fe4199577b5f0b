// The SIGCOMM'21 SwitchML tutorial's exercise, done against netagg: allocate a 64 MiB
// tensor, get and start the context, time a synchronous allreduce, time an asynchronous
// submission and its wait, stop. netagg adds a check of the sums.
//
//   netagg-run -n 2 -- ./tutorial

#include <switchml/context.h>

#include <chrono>
#include <cmath>
#include <cstdio>

typedef std::chrono::steady_clock clk;

static long long nanoseconds(clk::time_point begin, clk::time_point end) {
  return static_cast<long long>(std::chrono::duration_cast<std::chrono::nanoseconds>(end - begin).count());
}

int main() {
  std::chrono::time_point<clk> begin, end;
  switchml::Context& ctx = switchml::Context::GetInstance();
  std::printf("Hello from the netagg tutorial benchmark.\n");
  if (!ctx.Start()) {
    return 1;
  }
  const uint64_t numel = 1 << 24;  // 64 MiB of floats
  std::printf("Allocating a tensor of %lu floats\n", static_cast<unsigned long>(numel));
  float* data = new float[numel];
  for (uint64_t i = 0; i < numel; i++) {
    data[i] = static_cast<float>(i % 64);
  }

  begin = clk::now();
  std::shared_ptr<switchml::Job> sync_job =
      ctx.AllReduce(data, data, numel, switchml::FLOAT32, switchml::AllReduceOperation::SUM);
  end = clk::now();
  std::printf("Synchronous allreduce call took %lld ns.\n", nanoseconds(begin, end));

  begin = clk::now();
  std::shared_ptr<switchml::Job> async_job =
      ctx.AllReduceAsync(data, data, numel, switchml::FLOAT32, switchml::AllReduceOperation::SUM);
  end = clk::now();
  std::printf("Asynchronous allreduce call took %lld ns.\n", nanoseconds(begin, end));

  begin = clk::now();
  async_job->WaitToComplete();
  end = clk::now();
  std::printf("Asynchronous allreduce waiting for the job took %lld ns.\n", nanoseconds(begin, end));

  const bool finished = sync_job->GetJobStatus() == switchml::FINISHED &&
                        async_job->GetJobStatus() == switchml::FINISHED;
  const float workers = ctx.GetConfig().general_.num_workers;
  ctx.Stop();
  if (!finished) {
    std::fprintf(stderr, "a job failed: %s%s\n", sync_job->GetErrorMessage().c_str(),
                 async_job->GetErrorMessage().c_str());
    delete[] data;
    return 1;
  }
  // Summed in place twice: each element is now its input times workers squared.
  uint64_t wrong = 0;
  for (uint64_t i = 0; i < numel; i++) {
    wrong += data[i] != static_cast<float>(i % 64) * workers * workers;
  }
  delete[] data;
  if (wrong > 0) {
    std::fprintf(stderr, "%lu sums are wrong\n", static_cast<unsigned long>(wrong));
    return 1;
  }
  std::printf("Verified %lu sums.\n", static_cast<unsigned long>(numel));
  return 0;
}
