// The SwitchML-compatible API (switchml/context.h) and the C++ API (netagg.hpp) on the
// dummy backend: every member SwitchML's applications use, and the errors netagg
// reports where SwitchML aborts. Built with -Wall -Werror -pedantic and the sanitizers
// by tests/cpp_api.rs, which sets NETAGG_GENERAL__BACKEND=dummy and 3 workers.

#include <switchml/context.h>

#include <cstdio>
#include <cstring>
#include <unistd.h>
#include <thread>
#include <vector>

static int failures = 0;

#define EXPECT(condition)                                                  \
  do {                                                                     \
    if (!(condition)) {                                                    \
      std::fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #condition); \
      failures++;                                                          \
    }                                                                      \
  } while (0)

static void netagg_cpp_api() {
  netagg::Config config;
  config.set("general.backend", "dummy").set("general.num_workers", "2");
  EXPECT(config.get("general.num_workers") == "2");
  try {
    config.set("general.num_workers", "zero");
    EXPECT(false);
  } catch (const netagg::Error& error) {
    EXPECT(error.code() == NETAGG_CONFIG_VALUE);
    EXPECT(std::strstr(error.what(), "expected an integer from 1 to 65535") != nullptr);
  }
  netagg::Context context(config);
  try {
    context.wait_all();
    EXPECT(false);
  } catch (const netagg::Error& error) {
    EXPECT(error.code() == NETAGG_NOT_STARTED);
  }
  context.start();
  std::vector<std::int32_t> data(1000, 7);
  context.allreduce(data.data(), data.data(), data.size());
  EXPECT(data[999] == 14);
  netagg::Job job = context.allreduce_async(data.data(), data.data(), data.size());
  EXPECT(job.wait_for(std::chrono::seconds(10)));
  EXPECT(job.state() == NETAGG_JOB_STATE_FINISHED && job.id() == 2 && data[0] == 28);
  // 16-bit elements name their type: bfloat16 1.5 (0x3fc0) on two ranks is 3.0 (0x4040).
  std::vector<std::uint16_t> brains(1000, 0x3fc0);
  context.allreduce(brains.data(), brains.data(), brains.size(), NETAGG_BFLOAT16);
  EXPECT(brains[0] == 0x4040 && brains[999] == 0x4040);
  EXPECT(context.stats().jobs_finished == 3);
  EXPECT(context.stats_text().find("jobs: 3 submitted, 3 finished") != std::string::npos);
  context.stop();
  EXPECT(context.state() == NETAGG_CONTEXT_STOPPED);
}

static void misuse_before_start(switchml::Context& ctx) {
  std::vector<float> data(100, 1.0f);
  EXPECT(ctx.GetContextState() == switchml::Context::CREATED);
  std::shared_ptr<switchml::Job> job =
      ctx.AllReduceAsync(data.data(), data.data(), data.size(), switchml::FLOAT32, switchml::AllReduceOperation::SUM);
  EXPECT(job != nullptr && job->GetJobStatus() == switchml::JobStatus::FAILED);
  EXPECT(job->GetErrorMessage().find("call Start first") != std::string::npos);
  job->WaitToComplete();  // returns at once
  ctx.WaitForAllJobs();   // nothing to wait for
  ctx.Stop();             // reported, not fatal
  ctx.GetStats().LogStats();

  switchml::Config bad;
  EXPECT(bad.LoadFromFile());
  bad.general_.backend = "tcp";
  std::string why;
  EXPECT(!bad.IsValid(&why) && why.find("expected 'udp', 'dpdk', 'rdma' or 'dummy'") != std::string::npos);
  EXPECT(!ctx.Start(&bad));
  // Valid, but this host has no RDMA device: Start says so rather than abort.
  bad.general_.backend = "rdma";
  EXPECT(bad.IsValid(&why));
  EXPECT(access("/sys/class/infiniband", F_OK) == 0 || !ctx.Start(&bad));
  bad.general_.backend = "dummy";
  bad.general_.scheduler = "lifo";
  EXPECT(!ctx.Start(&bad));
  EXPECT(!switchml::Config().LoadFromFile("/nonexistent/netagg.cfg"));
  EXPECT(ctx.GetContextState() == switchml::Context::CREATED);
}

static void running(switchml::Context& ctx) {
  EXPECT(ctx.Start());
  EXPECT(!ctx.Start());  // already running
  EXPECT(ctx.GetContextState() == switchml::Context::RUNNING);
  const switchml::Config& config = ctx.GetConfig();
  EXPECT(config.general_.num_workers == 3 && config.general_.backend == "dummy");
  EXPECT(config.general_.scheduler == "fifo" && config.general_.controller_port == 50099);

  const std::uint64_t numel = 10000;
  std::vector<std::int32_t> in(numel), out(numel, 123456789);
  for (std::uint64_t i = 0; i < numel; i++) {
    in[i] = static_cast<std::int32_t>(i) * (i % 2 == 0 ? 1 : -1);
  }
  std::shared_ptr<switchml::Job> job =
      ctx.AllReduce(in.data(), out.data(), numel, switchml::DataType::INT32, switchml::AllReduceOperation::SUM);
  EXPECT(job->GetJobStatus() == switchml::FINISHED && job->id_ == 1);
  EXPECT(job->tensor_.numel == numel && job->tensor_.out_ptr == out.data());
  EXPECT(job->tensor_.data_type == switchml::INT32 && job->job_type_ == switchml::ALLREDUCE);
  bool exact = true;
  for (std::uint64_t i = 0; i < numel; i++) {
    exact = exact && out[i] == 3 * in[i];
  }
  EXPECT(exact);

  std::vector<std::shared_ptr<switchml::Job>> jobs;
  std::vector<std::vector<float>> tensors(4, std::vector<float>(5000, 0.5f));
  switchml::clock::time_point begin = switchml::clock::now();
  for (auto& tensor : tensors) {
    jobs.push_back(ctx.AllReduceAsync(tensor.data(), tensor.data(), tensor.size(), switchml::FLOAT32,
                                      switchml::AllReduceOperation::SUM));
  }
  ctx.WaitForAllJobs();
  EXPECT(switchml::clock::now() >= begin);
  for (std::size_t t = 0; t < jobs.size(); t++) {
    EXPECT(jobs[t]->GetJobStatus() == switchml::FINISHED && jobs[t]->id_ == 2 + t);
    EXPECT(tensors[t][4999] == 1.5f);
  }
  std::shared_ptr<switchml::Job> bad = ctx.AllReduceAsync(in.data(), in.data() + 1, numel - 1, switchml::INT32,
                                                          switchml::AllReduceOperation::SUM);
  EXPECT(bad->GetJobStatus() == switchml::FAILED && bad->GetErrorMessage().find("overlap") != std::string::npos);
  EXPECT(switchml::DataTypeSize(switchml::FLOAT32) == 4 && switchml::DataTypeSize(switchml::INT32) == 4);
  EXPECT(switchml::DataTypeSize(switchml::FLOAT16) == 2 && switchml::DataTypeSize(switchml::BFLOAT16) == 2);

  // float16 0.5 (0x3800) and bfloat16 -2.25 (0xc010) from three ranks: 1.5 (0x3e00) and
  // -6.75 (0xc0d8); an odd count, so that the second tensor starts mid-packet.
  std::vector<std::uint16_t> halves(4097, 0x3800), brains(4097, 0xc010);
  std::shared_ptr<switchml::Job> half_job = ctx.AllReduceAsync(halves.data(), halves.data(), halves.size(),
                                                               switchml::FLOAT16, switchml::SUM);
  std::shared_ptr<switchml::Job> brain_job =
      ctx.AllReduce(brains.data(), brains.data(), brains.size(), switchml::DataType::BFLOAT16, switchml::SUM);
  half_job->WaitToComplete();
  EXPECT(half_job->GetJobStatus() == switchml::FINISHED && brain_job->GetJobStatus() == switchml::FINISHED);
  EXPECT(half_job->tensor_.data_type == switchml::FLOAT16);
  bool halves_exact = true;
  for (std::size_t i = 0; i < halves.size(); i++) {
    halves_exact = halves_exact && halves[i] == 0x3e00 && brains[i] == 0xc0d8;
  }
  EXPECT(halves_exact);
  switchml::Tensor tensor = half_job->tensor_;
  tensor.OffsetPtrs(10);
  EXPECT(tensor.in_ptr == static_cast<void*>(halves.data() + 10));
  EXPECT(ctx.GetStats().GetCounters().jobs_finished == 7);
  ctx.GetStats().LogStats();
  ctx.GetStats().ResetStats();
  EXPECT(ctx.GetStats().GetCounters().jobs_submitted == 0);
}

static void stop_from_another_thread(switchml::Context& ctx) {
  // SwitchML's benchmarks stop the context from a signal-handling thread while the main
  // thread waits: the wait ends, the jobs end FINISHED or FAILED, nothing crashes.
  std::vector<float> big(1 << 22, 1.0f);
  std::vector<std::shared_ptr<switchml::Job>> jobs;
  for (int i = 0; i < 8; i++) {
    jobs.push_back(
        ctx.AllReduceAsync(big.data(), big.data(), big.size(), switchml::FLOAT32, switchml::AllReduceOperation::SUM));
  }
  std::thread stopper([&ctx] { ctx.Stop(); });
  ctx.WaitForAllJobs();
  stopper.join();
  for (auto& job : jobs) {
    job->WaitToComplete();
    switchml::JobStatus status = job->GetJobStatus();
    EXPECT(status == switchml::FINISHED || status == switchml::FAILED);
  }
  EXPECT(ctx.GetContextState() == switchml::Context::STOPPED);
  std::shared_ptr<switchml::Job> late =
      ctx.AllReduce(big.data(), big.data(), 10, switchml::FLOAT32, switchml::AllReduceOperation::SUM);
  EXPECT(late->GetJobStatus() == switchml::FAILED);

  // Unlike SwitchML, a stopped context starts again, here from a filled-in Config.
  switchml::Config config;
  EXPECT(config.LoadFromFile());
  config.general_.num_workers = 2;
  config.general_.packet_numel = 64;
  EXPECT(ctx.Start(&config));
  EXPECT(ctx.GetConfig().general_.num_workers == 2 && ctx.GetConfig().general_.packet_numel == 64);
  std::vector<std::int32_t> data(300, 5);
  EXPECT(ctx.AllReduce(data.data(), data.data(), data.size(), switchml::INT32, switchml::SUM)->GetJobStatus() ==
         switchml::FINISHED);
  EXPECT(data[299] == 10);
  ctx.Stop();
}

int main() {
  netagg_cpp_api();
  switchml::Context& ctx = switchml::Context::GetInstance();
  misuse_before_start(ctx);
  running(ctx);
  stop_from_another_thread(ctx);
  if (failures > 0) {
    std::fprintf(stderr, "%d checks failed\n", failures);
    return 1;
  }
  std::printf("all C++ API checks passed\n");
  return 0;
}
