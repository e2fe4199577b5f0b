// netagg's hello world in C++, written against SwitchML's API: the same source builds
// with SwitchML's client library. Every rank sums 8 float tensors with every other rank.
//
//   netagg-run -n 2 -- ./hello_world_cpp

#include <switchml/context.h>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  switchml::Context& ctx = switchml::Context::GetInstance();
  std::printf("Hello from netagg's SwitchML API. Starting the context\n");
  if (!ctx.Start()) {
    return 1;
  }
  const int num_workers = ctx.GetConfig().general_.num_workers;
  const uint64_t numel = 1 << 15;
  const int num_tensors = 8;

  std::vector<std::vector<float>> in(num_tensors, std::vector<float>(numel));
  std::vector<std::vector<float>> out(num_tensors, std::vector<float>(numel));
  for (int t = 0; t < num_tensors; t++) {
    for (uint64_t i = 0; i < numel; i++) {
      in[t][i] = static_cast<float>(t * 1000 + i % 1000);
    }
  }

  std::printf("Submitting %d allreduce jobs\n", num_tensors);
  std::vector<std::shared_ptr<switchml::Job>> jobs;
  for (int t = 0; t < num_tensors; t++) {
    jobs.push_back(ctx.AllReduceAsync(in[t].data(), out[t].data(), numel, switchml::FLOAT32,
                                      switchml::AllReduceOperation::SUM));
  }
  std::printf("Waiting for all jobs\n");
  ctx.WaitForAllJobs();
  for (const auto& job : jobs) {
    if (job->GetJobStatus() != switchml::JobStatus::FINISHED) {
      std::fprintf(stderr, "job %lu failed: %s\n", static_cast<unsigned long>(job->id_),
                   job->GetErrorMessage().c_str());
      return 1;
    }
  }
  ctx.GetStats().LogStats();
  ctx.Stop();

  for (int t = 0; t < num_tensors; t++) {
    for (uint64_t i = 0; i < numel; i++) {
      const float expected = in[t][i] * static_cast<float>(num_workers);
      if (std::fabs(out[t][i] - expected) > 1e-6f * std::fabs(expected)) {
        std::fprintf(stderr, "tensor %d element %lu: %g instead of %g\n", t, static_cast<unsigned long>(i),
                     out[t][i], expected);
        return 1;
      }
    }
  }
  std::printf("Data verified: %d tensors of %lu floats summed over %d workers\n", num_tensors,
              static_cast<unsigned long>(numel), num_workers);
  return 0;
}
